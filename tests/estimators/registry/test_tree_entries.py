"""The tree entries of the registry (issue 28): listed apart, documented, their cards render, and
prepare + loss are invariant under layouts and micro-batch splits of a tree batch."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.estimators.advantages.test_tree_advantages import forests
from tests.reports.test_card_math import check_latex
from tests.testing.cases import MAX_RESPONSE_LEN, aligned_logprobs
from tokenmdp import estimators as E
from tokenmdp import testing
from tokenmdp.reports.card_math import loss_latex
from tokenmdp.reports.cards import card_markdown, card_text, reference_rows
from tokenmdp.reports.latex_terms import width
from tokenmdp.trees import batch_from_trees

TREE_ENTRIES = ("tree_grpo", "tree_rloo", "tree_value_diff", "tree_return_minus_value", "treerl",
                "vineppo_tree")
PER_ENTRY = settings(max_examples=12, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.too_slow])


def test_the_tree_entries_are_listed_apart():
    assert E.names(trees=True) == TREE_ENTRIES
    everything = E.names(trees=None)
    assert set(E.names()) | set(TREE_ENTRIES) == set(everything)
    assert not set(E.names()) & set(TREE_ENTRIES)
    assert everything[-len(TREE_ENTRIES):] == TREE_ENTRIES          # registered last
    with pytest.raises(TypeError, match="trees"):
        E.names(trees="yes")


@pytest.mark.parametrize("name", TREE_ENTRIES)
def test_each_entry_states_its_formula_paper_and_shared_token_weight(name):
    doc = E.describe(name)
    assert "Formula: " in doc and "Paper: " in doc and "arXiv" in doc
    assert "shared token" in doc               # what a shared-prefix token's weight is
    assert E.get(name).name == name
    text, md = card_text(name), card_markdown(name)
    assert text.startswith(f"{name}\n") and "tree batch" in text
    assert md.startswith(f"# {name}\n")
    tex = loss_latex(E.get(name))
    assert tex.known, name                     # every tree part has its LaTeX form
    check_latex(tex.tex)
    assert all(width(line.removesuffix(" \\\\")) <= 64 for line in tex.tex.split("\n")[2:-1])


def test_a_tree_entry_has_no_reference_row():
    assert reference_rows(TREE_ENTRIES) == {}


@st.composite
def tree_steps(draw):
    # two leaves a tree at least: GRPO's sample std and RLOO need them (a clear refusal otherwise)
    forest = draw(forests.filter(lambda f: all(len(t.leaves) >= 2 for t in f)))
    batch = batch_from_trees(forest)
    model = testing.TokenTable.for_batch(batch, seed=draw(st.integers(0, 2**16)))
    batch = aligned_logprobs(batch, model, old_noise=draw(st.sampled_from((0.0, 0.1))),
                             other_noise=0.0, seed=draw(st.integers(0, 2**16)))
    return batch, model


@pytest.mark.parametrize("name", TREE_ENTRIES)
def test_each_entry_is_layout_and_micro_batch_invariant_on_trees(name):
    est = E.get(name)
    loss_fn = testing.estimator_loss(est)
    prepare = testing.estimator_prepare(est, max_len=MAX_RESPONSE_LEN)
    scales = []

    @PER_ENTRY
    @given(tree_steps(), st.lists(testing.layouts(), min_size=3, max_size=3),
           st.lists(testing.micro_batch_splits(max_micro_batches=4), min_size=2, max_size=2))
    def prop(step, layouts, splits):
        batch, model = step
        by_layout = testing.check_layout_invariance(loss_fn, batch, layouts, prepare=prepare,
                                                    model=model)
        by_split = testing.check_micro_batch_invariance(loss_fn, batch, splits, prepare=prepare,
                                                        model=model)
        by_layout.assert_ok()
        by_split.assert_ok()
        scales.append(min(by_layout.gradient_scale, by_split.gradient_scale))
    prop()
    assert any(s > 0 for s in scales), "every reference gradient was zero"
