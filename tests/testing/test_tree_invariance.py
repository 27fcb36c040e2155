"""Tree layout is memory, never meaning: for every registry estimator (the tree entries
included), the loss and gradient through packed trees equal those of the expanded paths, over
expanded layouts, packings and micro-batches of whole trees, with the MoE transformer in
float64, to 1e-12.

Each estimator also runs on one fixed tree step whose reference gradient must not be zero, so
the gradient half of the check is never vacuous for any of them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.testing.tree_cases import MAX_LEN, aligned_tree_logprobs, tree_steps
from tokenmdp import estimators as est_lib
from tokenmdp import testing
from tokenmdp.testing.strategies import Layout
from tokenmdp.testing.tree_strategies import TreePacking, TreeSplit
from tokenmdp.trees import ResponseTree, batch_from_trees

PER_ESTIMATOR = settings(max_examples=2, deadline=None, database=None,
                         suppress_health_check=[HealthCheck.too_slow])
TOL = {"rtol": 1e-12, "atol": 1e-12}
PACKINGS = st.lists(testing.tree_packings(), min_size=2, max_size=2)
#: |log r| (KL-Cov's penalty) has a kink at r = 1: exactly on policy its gradient is sign(0) = 0
#: through the packed tree and ±1 through expanded paths whose log-probs differ by 1e-16, a
#: property of the estimator, not of the layout; it is checked off policy.
OFF_POLICY_ONLY = {"kl_cov": (1e-3, 0.1)}


def _fixed_step():
    trees = [ResponseTree([1, 2], [3, 4, 0, 1, 2, 3], [-1, 0, 1, 1, 0, 4], reward=[1.0, 0.0, 0.5]),
             ResponseTree([4], [1, 2, 3, 0], [-1, -1, 1, 1], reward=[0.0, 1.0, 1.0])]
    batch = batch_from_trees(trees)
    model = testing.tree_check_model(batch, seed=3)
    return aligned_tree_logprobs(batch, model, noise=0.05, seed=1), model


def test_every_estimator_is_offered_tree_batches():
    batch, _ = _fixed_step()
    accepted = testing.estimators_accepting(batch)
    assert set(accepted) == set(est_lib.names(trees=None))
    plain = dataclasses.replace(batch, token_extras={})
    assert not set(est_lib.names(trees=True)) & set(testing.estimators_accepting(plain))


@pytest.mark.parametrize("name", est_lib.names(trees=None))
def test_every_registry_estimator_is_tree_layout_invariant(name):
    est = est_lib.get(name)
    batch, model = _fixed_step()
    fixed = testing.check_tree_layout_invariance(
        est, batch, [TreePacking(Layout("flat")), TreePacking(extra_capacity=20)],
        [TreeSplit(2)], max_len=MAX_LEN, model=model, **TOL).assert_ok()
    assert fixed.gradient_scale > 0, f"{name}: zero reference gradient on the fixed step"

    @PER_ESTIMATOR
    @given(tree_steps(noise_scales=OFF_POLICY_ONLY.get(name, (0.0, 1e-3, 0.1))), PACKINGS,
           testing.tree_splits())
    def prop(step, packings, split):
        batch, model = step
        testing.check_tree_layout_invariance(est, batch, packings, [split], max_len=MAX_LEN,
                                             model=model, raise_on_failure=True, **TOL)
    prop()


def test_a_model_that_ignores_the_tree_mask_fails_the_check():
    # the check is not vacuous: a packed pass where tokens also see their siblings' subtrees
    batch, model = _fixed_step()

    class Leaky(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def token_logprobs(self, b):
            return self.inner.token_logprobs(b)

        def tree_token_outputs(self, tokens, position, tree_end, parent, valid, **kw):
            full = torch.full_like(tree_end, tree_end.shape[1])   # every later column: leaks
            return self.inner.tree_token_outputs(tokens, position, full, parent, valid, **kw)

    report = testing.check_tree_layout_invariance(est_lib.get("grpo"), batch, [TreePacking()],
                                                  max_len=MAX_LEN, model=Leaky(), **TOL)
    assert not report.ok


def test_the_check_names_bad_arguments():
    batch, model = _fixed_step()
    est = est_lib.get("grpo")
    with pytest.raises(ValueError, match="packings, splits"):
        testing.check_tree_layout_invariance(est, batch, max_len=MAX_LEN, model=model)
    with pytest.raises(TypeError, match="packings: .* must return"):
        testing.check_tree_layout_invariance(est, batch, [lambda b: b], max_len=MAX_LEN,
                                             model=model)
    with pytest.raises(TypeError, match="model: needs a tree_token_outputs"):
        testing.check_tree_layout_invariance(est, batch, [TreePacking()], max_len=MAX_LEN,
                                             model=testing.TokenTable.for_batch(batch))
    with pytest.raises(TypeError, match="splits: .* must return a non-empty list"):
        testing.check_tree_layout_invariance(est, batch, splits=[lambda b: []],
                                             max_len=MAX_LEN, model=model)


@settings(max_examples=20, deadline=None, database=None)
@given(testing.tree_batches(max_trees=3), testing.tree_splits(max_micro_batches=3))
def test_drawn_trees_have_groups_of_two_leaves_and_splits_keep_whole_trees(batch, split):
    counts = torch.bincount(batch.group)
    assert bool((counts[counts > 0] >= 2).all())
    parts = split(batch)
    assert sum(p.num_sequences for p, _ in parts) == batch.num_sequences
    for part, packed in parts:   # a group (a tree) is whole in its part
        for g in part.group.unique().tolist():
            assert int((part.group == g).sum()) == int(counts[g])
        assert packed.num_expanded_tokens == part.num_real_tokens
