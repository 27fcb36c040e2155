"""Property tests: every registered estimator and every aggregation mode is invariant under
layouts (permutation, padded / flat / packed, row capacity) and micro-batch splits (prepared
once, losses summed), in value and in gradient, with a tabular model.

Each test runs its Hypothesis property inside the test and then asserts that the gradient half
of the checks was not vacuous: a non-zero reference gradient in at least one example. (Zero
gradients are legitimate in many single examples: tied rewards, every ratio clipped or masked;
the fraction of non-zero ones is 0.6 to 0.9 per estimator, so a fixed fraction would be flaky.)
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.testing.cases import MAX_RESPONSE_LEN, aligned_logprobs, steps
from tokenmdp import estimators as est_lib
from tokenmdp import testing
from tokenmdp.exact import TabularPolicy, sample

PER_ESTIMATOR = settings(max_examples=10, deadline=None, database=None,
                         suppress_health_check=[HealthCheck.too_slow])
PER_MODE = settings(max_examples=25, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
LAYOUTS = st.lists(testing.layouts(), min_size=3, max_size=3)
SPLITS = st.lists(testing.micro_batch_splits(max_micro_batches=4), min_size=2, max_size=2)


def _check_both(batch, est, model, layouts, splits, **tolerances):
    """Both checks for one step; returns the smaller of the two reference gradient scales."""
    loss_fn = testing.estimator_loss(est)
    prepare = testing.estimator_prepare(est, max_len=MAX_RESPONSE_LEN)
    by_layout = testing.check_layout_invariance(loss_fn, batch, layouts, prepare=prepare,
                                                model=model, **tolerances)
    by_split = testing.check_micro_batch_invariance(loss_fn, batch, splits, prepare=prepare,
                                                    model=model, **tolerances)
    by_layout.assert_ok()
    by_split.assert_ok()
    return min(by_layout.gradient_scale, by_split.gradient_scale)


def _run(prop) -> None:
    scales: list[float] = []
    prop(scales)
    assert any(s > 0 for s in scales), f"all {len(scales)} reference gradients were zero"


@pytest.mark.parametrize("name", est_lib.names())
def test_every_registered_estimator_is_layout_and_micro_batch_invariant(name):
    @PER_ESTIMATOR
    @given(steps(estimators=testing.estimators(names=(name,))), LAYOUTS, SPLITS)
    def prop(scales, step, layouts, splits):
        scales.append(_check_both(*step, layouts, splits))
    _run(prop)


@pytest.mark.parametrize("mode", list(est_lib.Aggregation), ids=lambda m: m.value)
def test_every_aggregation_mode_is_layout_and_micro_batch_invariant(mode):
    @PER_MODE
    @given(steps(estimators=testing.estimators(aggregations=(mode,))), LAYOUTS, SPLITS)
    def prop(scales, step, layouts, splits):
        scales.append(_check_both(*step, layouts, splits))
    _run(prop)


def test_float32_is_invariant_within_the_float32_tolerances():
    # Stated tolerance: rtol FLOAT32_RTOL = 1e-5, atol FLOAT32_ATOL = 5e-6 of the reference
    # loss / largest gradient entry (the checks' float32 defaults).
    @PER_MODE
    @given(steps(dtype=torch.float32), LAYOUTS, SPLITS)
    def prop(scales, step, layouts, splits):
        assert step[0].dtype == torch.float32
        scales.append(_check_both(*step, layouts, splits, rtol=testing.FLOAT32_RTOL,
                                  atol=testing.FLOAT32_ATOL))
    _run(prop)


def test_exact_tabular_policy_as_the_model():
    # The MDP's own TabularPolicy differentiates the loss; batches are sampled from it.
    @PER_MODE
    @given(testing.mdps(), testing.estimators(), LAYOUTS, SPLITS,
           st.integers(1, 3), st.integers(2, 3), st.integers(0, 2**16))
    def prop(scales, mdp, est, layouts, splits, groups, group_size, seed):
        gen = torch.Generator().manual_seed(seed)
        policy = TabularPolicy(mdp, generator=gen)
        batch = sample(mdp, policy, groups * group_size, generator=gen, group_size=group_size)
        batch = aligned_logprobs(batch, policy.token_logprobs, old_noise=0.1, other_noise=0.1,
                                 seed=seed)
        loss_fn = testing.estimator_loss(est)
        prepare = testing.estimator_prepare(est, max_len=mdp.max_len)
        seed_kw = {"mdp": mdp, "seed": seed}
        reports = [testing.check_layout_invariance(loss_fn, batch, layouts, prepare=prepare,
                                                   **seed_kw),
                   testing.check_micro_batch_invariance(loss_fn, batch, splits, prepare=prepare,
                                                        **seed_kw)]
        for report in reports:
            report.assert_ok()
        scales.append(min(r.gradient_scale for r in reports))
    _run(prop)
