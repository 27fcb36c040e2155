"""tokenmdp.course.tutorials.t11 and t11_figures: the score matrix against ∇J, the leaf weights
of a tree (1/n and slots), leaf-level REINFORCE's exact moments against the library's tree
moments and against Monte Carlo, the prompt-state mask, the tree drawing, the budget table
against the library's comparison, and the figure laid out for the page."""

from __future__ import annotations

import functools

import matplotlib
import pytest
import torch

from tokenmdp.course.setups import copy_task
from tokenmdp.course.tutorials import t11, t11_figures
from tokenmdp.exact import gradient, sequence_probs
from tokenmdp.exact.branching import TreeWorkspace, at_budget, sample_trees
from tokenmdp.reports.comparison import summary_row
from tokenmdp.tree_schedules import EntropyForks, FixedForks
from tokenmdp.trees import ResponseTree

matplotlib.use("Agg")

EXACT_TOL = 1e-12
TWO_LEVEL = FixedForks((0, 1), (2, 2))


@functools.cache
def _world():
    mdp, pi = copy_task()
    return mdp, pi, TreeWorkspace(mdp, pi), t11.score_matrix(mdp, pi), gradient(mdp, pi)


def test_the_score_matrix_gives_the_policy_gradient():
    mdp, pi, _, scores, grad = _world()
    with torch.no_grad():
        weight = sequence_probs(mdp, pi) * mdp.prompt_probs[mdp.terminal_prompt_index]
    assert scores.shape == (mdp.num_sequences, sum(p.numel() for p in pi.parameters()))
    assert float(((weight * mdp.rewards) @ scores - grad).abs().max()) < EXACT_TOL
    assert float((weight @ scores).abs().max()) < EXACT_TOL          # E[σ] = 0


def test_leaf_weights_are_one_over_n_or_the_slots():
    mdp, _, ws, _, _ = _world()
    law = ws.law(TWO_LEVEL)
    sizes = set()
    for tree in law.trees:
        plain = t11.leaf_weights(TWO_LEVEL, tree, "leaves")
        split = t11.leaf_weights(TWO_LEVEL, tree, "slots")
        n = len(tree.leaves())
        sizes.add(n)
        assert all(w == pytest.approx(1 / n) for _, w in plain)
        assert sum(w for _, w in split) == pytest.approx(1.0)       # the slots fill the tree
        # a leaf whose response ended before the second fork stands for its two branches
        assert sorted(w for _, w in split) == sorted(
            0.5 if mdp.responses()[row][1][0] == mdp.eos else 0.25 for row, _ in split)
    assert sizes == {2, 3, 4}
    with pytest.raises(ValueError, match="weights"):
        t11.leaf_weights(TWO_LEVEL, law.trees[0], "nodes")


def test_exact_leaf_moments_are_the_library_reinforce_and_slots_are_unbiased():
    mdp, _, ws, scores, grad = _world()
    law = ws.law(TWO_LEVEL)
    plain = t11.exact_leaf_moments(law, scores, mdp.rewards, grad, "leaves")
    library = ws.moments("reinforce", TWO_LEVEL, method="exact")
    assert float((plain.mean - library.mean).abs().max()) < EXACT_TOL
    assert plain.total_variance == pytest.approx(library.total_variance, abs=1e-10)
    assert plain.relative_bias == pytest.approx(library.relative_bias, abs=1e-10)
    assert plain.relative_bias > 0.01
    split = t11.exact_leaf_moments(law, scores, mdp.rewards, grad, "slots")
    assert split.relative_bias < 1e-10 and split.mean_se is None


def test_sampled_leaf_moments_agree_with_the_exact_ones_within_their_errors():
    mdp, pi, ws, scores, grad = _world()
    sample = sample_trees(mdp, pi, TWO_LEVEL, 2000, generator=torch.Generator().manual_seed(0))
    mc = t11.sampled_leaf_moments(sample, scores, mdp.rewards, grad, "slots")
    exact = t11.exact_leaf_moments(ws.law(TWO_LEVEL), scores, mdp.rewards, grad, "slots")
    assert float(((mc.mean - exact.mean).abs() / mc.mean_se.clamp_min(1e-15)).max()) < 5.0
    W = t11.leaf_weight_matrix(sample.grown, TWO_LEVEL, mdp.num_sequences, "leaves")
    assert torch.allclose(W.sum(1), torch.ones(2000, dtype=torch.float64))


def test_the_prompt_state_mask_selects_the_first_token_logits():
    mdp, pi, _, scores, _ = _world()
    mask = t11.prompt_state_mask(mdp, pi)
    assert int(mask.sum()) == mdp.num_prompts * mdp.vocab_size
    # the score of a response's first token lives only in the logits of its prompt's state
    eos_rows = [i for i, (_, y) in enumerate(mdp.responses()) if y == (mdp.eos,)]
    assert eos_rows and all(float(scores[i][~mask].abs().max()) == 0.0 for i in eos_rows)


def test_tree_text_draws_every_node_with_its_leaf_count():
    tree = ResponseTree([0], [1, 2, 0, 2], [-1, 0, 0, 2], reward=[0.0, 1.0])
    text = t11.tree_text(tree, eos=2)
    assert text.splitlines() == ["prompt [0]", "  └ 1  (2 leaves)", "    └ EOS  R = 0",
                                 "    └ 0", "      └ EOS  R = 1"]


def test_the_budget_table_is_the_library_comparison():
    mdp, pi, _, _, _ = _world()
    ws = TreeWorkspace(mdp, pi)
    draws = (4, FixedForks((1,), (4,)), EntropyForks((3,), (1,)))
    out = t11.budget_table(ws, ["reinforce", "rloo"], draws, multiples=(1, 16))
    assert [r[:2] for r in out.rows] == [(n, d) for n in ("reinforce", "rloo")
                                          for d in ("iid:4", "fixed:1x4", "entropy:3x1")]
    row = out.rows[1]
    step = ws.moments("reinforce", FixedForks((1,), (4,)))
    big = summary_row("reinforce", at_budget(step, 16 * 4 * ws.mean_length))["mse_c_star"]
    assert row[8] == pytest.approx(big, rel=1e-12)
    assert row[5] == pytest.approx(step.generated_tokens) and row[2] == pytest.approx(0, abs=1e-10)
    assert out.rows[0][9] == out.rows[0][10] == 1.0                  # the group against itself
    assert "vs iid@16B" in str(out) and len(out.headers) == len(row)


def test_the_leaf_law_figure_has_one_labelled_panel_per_schedule():
    mu = torch.full((4,), 0.25, dtype=torch.float64)
    panels = {"a": (mu + 0.01, mu, mu * 0.1), "b": (mu, mu, mu * 0.1)}
    fig = t11_figures.leaf_law_figure(mu, panels, labels=["w", "x", "y", "z"])
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["a", "b"]
    assert [t.get_text() for t in axes[-1].get_xticklabels()] == ["w", "x", "y", "z"]
    assert axes[0].get_legend() is not None
    matplotlib.pyplot.close(fig)
