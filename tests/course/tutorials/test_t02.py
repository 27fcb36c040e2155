"""Tutorial 2's helpers: each table's rows against a direct computation, the moment cache
against ``moments`` itself, and each figure's title and axis labels."""

from __future__ import annotations

import re

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from tokenmdp.course.tutorials import t02, t02_figures  # noqa: E402
from tokenmdp.estimators import get  # noqa: E402
from tokenmdp.exact import TabularPolicy, TokenMDP, moments, sample, sequence_probs  # noqa: E402

EXACT_TOL = 1e-12  # two float64 computations of the same O(1) number


def _reward(prompt, response):
    return float(prompt[0] in response)


@pytest.fixture(scope="module")
def world():
    mdp = TokenMDP(3, 2, _reward, prompts=[(0,), (1,)], prompt_probs=[0.5, 0.5])
    policy = TabularPolicy(mdp, generator=torch.Generator().manual_seed(33), init_std=1.5)
    estimators = {"REINFORCE": get("reinforce"), "RLOO": get("rloo")}
    return mdp, policy, estimators, t02.ExactCache(mdp, policy, estimators)


def test_aligned_table_formats_each_column_and_keeps_the_rows():
    out = t02.aligned_table([("a", 1.23456, -2.0), ("bb", None, 3.5)],
                            [("name", 4, ""), ("x", 8, ".3f"), ("d", 9, "+.1e")], title="T")
    assert str(out).splitlines() == ["T", "name        x         d", "   a    1.235  -2.0e+00",
                                     "  bb" + " " * 11 + "+3.5e+00"]
    assert out.rows == [("a", 1.23456, -2.0), ("bb", None, 3.5)] and out.headers == ["name", "x", "d"]
    assert re.search(r"<th[^>]*>name</th>", out._repr_html_())
    with pytest.raises(ValueError, match="rows"):
        t02.aligned_table([(1,)], [("a", 2, ""), ("b", 2, "")])


def test_exact_cache_is_moments_computed_once(world):
    mdp, policy, estimators, exact = world
    m = exact("RLOO", 2)
    direct = moments(mdp, policy, estimators["RLOO"], group_size=2, method="exact")
    assert exact("RLOO", 2) is m
    assert torch.allclose(m.mean, direct.mean, rtol=0, atol=EXACT_TOL)
    assert abs(m.total_variance - direct.total_variance) < EXACT_TOL
    estimators["late"] = get("reinforce")                  # read at call time
    assert torch.allclose(exact("late", 2).mean, exact("REINFORCE", 2).mean, rtol=0, atol=0)
    with pytest.raises(ValueError, match="name"):
        exact("missing", 2)


def test_response_table_lists_every_response_and_the_prompt_values(world):
    mdp, policy, _, _ = world
    probs = sequence_probs(mdp, policy).detach()
    J_P = torch.stack([(probs * mdp.rewards)[mdp.terminal_prompt_index == x].sum() for x in range(2)])
    out = t02.response_table(mdp, probs, J_P, 0.5 * float(J_P.sum()))
    assert len(out.rows) == mdp.num_sequences
    for (prompt, shown, q, r), (x, y), p, want in zip(out.rows, mdp.responses(), probs, mdp.rewards,
                                                      strict=True):
        assert prompt == str(x) and shown.split()[-1] == ("EOS" if y[-1] == 2 else str(y[-1]))
        assert q == float(p) and r == float(want)
    assert str(out).splitlines()[-1] == f"J = {0.5 * float(J_P.sum()):.6f}"


def test_score_report_rows_are_the_norm_and_the_largest_entry_off_the_block():
    g_P = torch.tensor([[3.0, 4.0, 1e-20], [0.0, -2e-18, 1.0]], dtype=torch.float64)
    owner = torch.tensor([0, 0, 1])
    out = t02.score_report({"r": torch.tensor([1e-17, -3e-17])}, g_P, owner, [(0,), (1,)])
    assert out.rows == [("(0,)", 5.0, 1e-20), ("(1,)", 1.0, 2e-18)]
    assert str(out).splitlines()[0] == f"{'max |r|':<33}= 3.0e-17"


def test_variance_table_appends_exact_minus_closed():
    out = t02.variance_table([(1, 1e-17, 0.5, 0.25), (2, 0.0, 0.125, 0.25)], label="G",
                             label_width=2)
    assert [row[-1] for row in out.rows] == [0.25, -0.125]
    assert str(out).splitlines()[1].split() == ["1", "1.0e-17", "0.50000000", "0.25000000", "+2.5e-01"]


def test_advantage_table_scales_and_compares(world):
    mdp, policy, estimators, _ = world
    batch = sample(mdp, policy, 4, generator=torch.Generator().manual_seed(0), group_size=2)
    a = torch.tensor([0.5, -0.5, 1.0, 0.0], dtype=torch.float64)
    b = torch.tensor([1.0, -1.0, 3.0, 0.0], dtype=torch.float64)
    out = t02.advantage_table(batch, {"a": a, "b": b}, scaled="b", scale=0.5, header="b/2",
                              compare="a")
    for s, row in enumerate(out.rows):
        assert row[:2] == (int(batch.group[s]), float(batch.reward[s]))
        assert row[4] == 0.5 * float(b[s]) and row[5] == float(a[s]) - 0.5 * float(b[s])
    with pytest.raises(ValueError, match="scaled"):
        t02.advantage_table(batch, {"a": a}, scaled="z", scale=1.0, header="z")
    with pytest.raises(ValueError, match="fmt"):
        t02.advantage_table(batch, {"a": a}, scaled="a", scale=1.0, header="z", fmt=[".1f", ".2f"])


def test_moment_tables_against_direct_computations(world):
    _, _, _, exact = world
    m2, m3 = exact("RLOO", 2), exact("REINFORCE", 3)
    g = m2.true_gradient
    out = t02.scaled_mean_table([("RLOO", 0.5, m2)], g)
    assert out.rows[0] == ("RLOO", float((m2.mean - 0.5 * g).abs().max()), 0.5, m2.total_variance)
    out = t02.effective_reward_table([("RLOO", 2, m2, 2 * g)])
    assert out.rows[0] == ("RLOO", 2, float((m2.mean - 2 * g).abs().max()), m2.cosine)
    out = t02.peeking_bias_table([("RLOO", 2, "0", m2, -g)])
    assert out.rows[0] == ("RLOO", 2, "0", float((m2.bias + g).abs().max()), m2.relative_bias,
                           m2.cosine)
    out = t02.group_size_table({"RLOO": [m2], "REINFORCE": [m3]}, [2])
    assert [r[:2] for r in out.rows] == [("RLOO", 2), ("REINFORCE", 2)]
    assert out.rows[1][-1] == m3.scale ** 2 * m3.total_variance and out.rows[1][2] == m3.relative_bias


def test_grpo_scale_table_adds_the_difference_and_the_angle():
    out = t02.grpo_scale_table([("g", 4, "(0,)", 0.1, 2.0, 1.5, 0.5), ("g", 4, "(1,)", 0.5, 1.0, 1.0, None)])
    assert out.rows[0][6] == 0.5 and out.rows[0][8] == f"{60.0:>5.2f}°"
    assert out.rows[1][6] == 0.0 and out.rows[1][7] is None and out.rows[1][8] is None
    assert t02.grpo_scale_table([("g", 2, "x", 0.5, 1.0, 1.0, 1.0 + 1e-15)]).rows[0][8] == " 0.00°"


def _labelled(fig):
    axes = [ax for ax in fig.axes if ax.get_title()]
    assert axes and all(ax.get_xlabel() and ax.get_ylabel() for ax in axes)
    plt.close(fig)


def test_figures_have_titles_and_labelled_axes(world):
    _, _, _, exact = world
    _labelled(t02_figures.baseline_parabola_figure([0.0, 1.0], [2.0, 1.0], {"b = 0": (0.0, 2.0)}, 1.5, 4))
    p = [0.2, 0.5, 0.8]
    fig = t02_figures.grpo_scale_figure(p, {2: [1.0] * 3, 4: [2.0] * 3}, {"prompt (0,)": (0.5, {4: 2.0})})
    assert "G = 4" in fig.axes[0].get_title()
    _labelled(fig)
    ms = {"RLOO": [exact("RLOO", 2), exact("RLOO", 3)], "REINFORCE": [exact("REINFORCE", 2),
                                                                      exact("REINFORCE", 3)]}
    fig = t02_figures.bias_variance_figure(ms, [2, 3], {"RLOO": [0.0, 0.0]}, [1.0, 0.5])
    assert len(fig.axes) == 3 and all(ax.get_title() for ax in fig.axes)
    _labelled(fig)
