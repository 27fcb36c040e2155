"""tokenmdp.course.tutorials.t01, tutorial 1's helpers: each table's rows against a direct computation (the
reward callable, ``len(responses())``, ``objective`` per prompt, ``state_index``, the tabular
score ``e_a − π(·|s)`` in closed form), ``flat_grad_retained`` against ``flat_grad``, the ids of
sampled responses against their token tuples, the text layout of :class:`Table`, and both
figures with titles and labelled axes."""

import math

import matplotlib.pyplot as plt
import pytest
import torch

from tokenmdp.course.setups import copy_task
from tokenmdp.course.tutorials import t01, t01_figures
from tokenmdp.exact import (
    NeuralPolicy,
    TabularPolicy,
    TokenMDP,
    flat_grad,
    gradient,
    objective,
    sample,
    sequence_probs,
    state_logprobs,
    values,
)

EXACT_TOL = 1e-12  # two float64 computations of the same quantity


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_table_text_layout_and_row_check():
    table = t01.Table([("name", 6, ""), ("x", 7, "+.2f"), ("n", 3, "")], [("a", 1.5, 2)])
    assert str(table) == "  name       x   n\n     a   +1.50   2"
    assert repr(table) == str(table)
    assert table.rows == [("a", 1.5, 2)]
    with pytest.raises(ValueError, match="rows: row 0 has 2 values for 3 columns"):
        t01.Table([("a", 1, ""), ("b", 1, ""), ("c", 1, "")], [(1, 2)])


def test_response_table_rows_follow_the_reward_callable():
    mdp, _ = copy_task()
    table = t01.response_table(mdp, first=20)
    assert len(table.rows) == 20
    for (x, y), (prompt, shown, length, reward) in zip(mdp.responses(), table.rows, strict=False):
        assert prompt == str(x) and length == len(y)
        assert shown.split() == ["EOS" if t == mdp.eos else str(t) for t in y]
        copies = sum(t == x[0] for t in y)                   # the course's copy reward, by hand
        assert reward == copies - (y[-1] != mdp.eos)


def test_count_table_rows_against_the_enumerated_responses():
    cases = [(2, 3), (3, 2), (4, 2)]

    def closed_form(v, l):
        return sum((v - 1) ** k for k in range(l + 1))

    def wrong(v, l):                                         # off by one: must show up
        return closed_form(v, l) + 1

    for (v, l), row in zip(cases, t01.count_table(cases, closed_form, wrong).rows, strict=True):
        n = len(TokenMDP(v, l, lambda x, y: 0.0).responses())
        assert row == (v, l, n, n + 1, n, 0)


def test_leaf_table_rows_against_objective_per_prompt():
    mdp, policy = copy_task()
    with torch.no_grad():
        table = t01.leaf_table(mdp, sequence_probs(mdp, policy), values(mdp, policy).V)
    for p, (prompt, total, j_x, root_value, difference) in enumerate(table.rows):
        # the same prompt alone (probability 1) and the same logits at its states
        alone = TokenMDP(3, 3, lambda x, y: float(mdp.rewards[mdp.responses().index((x, y))]),
                         prompts=[mdp.prompts[p]])
        own = TabularPolicy(alone, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            own.table.copy_(torch.cat([policy.table[off + p * alone.level_size(k):
                                                    off + (p + 1) * alone.level_size(k)]
                                       for k, off in enumerate(mdp.level_offsets[:-1])]))
        assert prompt == str(mdp.prompts[p])
        assert abs(total - 1) < EXACT_TOL
        assert abs(j_x - float(objective(alone, own).detach())) < EXACT_TOL
        assert abs(root_value - j_x) < EXACT_TOL and difference == j_x - root_value


def test_state_names_follow_state_index():
    mdp, _ = copy_task()
    names = t01.state_names(mdp)
    assert len(names) == mdp.num_states and names[0] == "(0,) | ·"
    for name in names:
        prompt, prefix = name.split(" | ")
        p = [str(x) for x in mdp.prompts].index(prompt)
        tokens = [] if prefix == "·" else [int(t) for t in prefix.split()]
        index = mdp.state_index(torch.tensor([p]), torch.tensor([tokens], dtype=torch.long))
        assert int(index) == names.index(name)


def test_route_and_monte_carlo_tables_name_each_coordinate():
    mdp, policy = copy_task()
    g = gradient(mdp, policy)
    shifted = g + torch.arange(g.numel(), dtype=torch.float64) * 1e-3
    routes = t01.route_table(mdp, g, g, shifted, coords=[0, 5, 40])
    names = t01.state_names(mdp)
    for j, row in zip([0, 5, 40], routes.rows, strict=True):
        token = "EOS" if j % 3 == mdp.eos else str(j % 3)
        assert row[:3] == (j, names[j // 3], token)
        assert row[3:] == (float(g[j]), float(g[j]), float(shifted[j]), 0.0,
                           float(g[j] - shifted[j]))
    se = torch.full_like(g, 0.5)
    mc = t01.monte_carlo_table(mdp, [5], shifted, se, 2 * se, g, (shifted - g) / se)
    assert mc.rows == [(5, names[1], "EOS", float(shifted[5]), 0.5, 1.0, float(g[5]),
                        float(shifted[5] - g[5]), float((shifted[5] - g[5]) / 0.5))]


def test_route_agreement_table_measures_each_route():
    mdp, policy = copy_task()
    neural = NeuralPolicy(mdp, generator=torch.Generator().manual_seed(2), hidden=4)

    def off_by(delta):
        return lambda m, pol: gradient(m, pol) + delta

    table = t01.route_agreement_table(mdp, {"tab": policy, "mlp": neural}, gradient,
                                      off_by(1e-3), off_by(-2e-2))
    for (name, pol), row in zip([("tab", policy), ("mlp", neural)], table.rows, strict=True):
        n = sum(p.numel() for p in pol.parameters())
        assert row[:2] == (name, n)
        assert abs(row[2] - float(objective(mdp, pol).detach())) < EXACT_TOL
        assert abs(row[3] - row[2]) < EXACT_TOL
        assert math.isclose(row[4], 1e-3, rel_tol=1e-9) and math.isclose(row[5], 2e-2, rel_tol=1e-9)


def test_flat_grad_retained_equals_flat_grad_and_keeps_the_graph():
    mdp, policy = copy_task()
    policy.unused = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))   # gets zeros
    j = objective(mdp, policy)
    first = t01.flat_grad_retained(j, policy)
    second = t01.flat_grad_retained(j, policy)                # the graph is still there
    assert torch.equal(first, second)
    assert torch.allclose(first, flat_grad(objective(mdp, policy), policy), rtol=0, atol=EXACT_TOL)
    assert torch.equal(first[-2:], torch.zeros(2, dtype=torch.float64))


def test_lemma_table_rows_against_the_tabular_score_in_closed_form():
    # A tabular policy's score at state s is ∇_θs log π(a|s) = e_a − π(·|s): zero elsewhere.
    mdp, policy = copy_task()
    probs_SA = torch.cat([lp.exp().reshape(-1, 3) for lp in state_logprobs(mdp, policy)]).detach()
    eye = torch.eye(3, dtype=torch.float64)
    norms_S = torch.stack([(eye - q).norm(dim=1).max() for q in probs_SA])

    def closed_form(m, pol):
        expectation = torch.stack([(q[:, None] * (eye - q)).sum(0) for q in probs_SA])
        return expectation, norms_S

    (row,) = t01.lemma_table(mdp, {"tab": policy}, closed_form).rows
    assert row[0] == "tab" and row[1] == row[3] and row[1] < EXACT_TOL and row[2] == 0
    assert row[4] == float(norms_S.min())
    broken = t01.lemma_table(mdp, {"tab": policy}, lambda m, p: (torch.ones(1, 1), norms_S))
    assert broken.rows[0][1] == 1.0


def test_response_ids_point_at_the_sampled_responses():
    mdp, policy = copy_task()
    batch = sample(mdp, policy, 300, generator=torch.Generator().manual_seed(5))
    ids = t01.response_ids(mdp, batch)
    assert [mdp.responses()[i] for i in ids.tolist()] == [
        (tuple(x), tuple(y)) for x, y in batch.sequences()]
    assert torch.equal(t01.response_ids(mdp, mdp.enumerate()), torch.arange(mdp.num_sequences))


def test_calibration_table_rows_against_direct_means():
    z_squared = torch.tensor([0.25, 1.0, 9.0, 4.0], dtype=torch.float64)
    cov = torch.diag(torch.tensor([2.0, 6.0], dtype=torch.float64))
    rows = t01.calibration_table(z_squared, [0.1, 0.3], cov, n_samples=4).rows
    assert rows[0] == ("mean z_j^2", 3.5625, 1.0, 2.5625)
    assert rows[1][0] == "mean ||ĝ - ∇J||^2" and rows[1][2] == 2.0
    assert math.isclose(rows[1][1], 0.2, rel_tol=1e-15)
    assert rows[2] == ("fraction |z_j| <= 2", 0.75, 0.9545, 0.75 - 0.9545)


def test_prefix_tree_figure_has_a_title_and_labelled_axes():
    mdp, policy = copy_task()
    fig = t01_figures.prefix_tree_figure(mdp, policy)
    assert len(fig.get_axes()) == mdp.num_prompts and fig._suptitle is not None
    for ax in fig.get_axes():
        assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
    assert fig.get_axes()[0].get_legend() is not None


def test_monte_carlo_figure_has_titles_and_labelled_axes():
    mdp, policy = copy_task()
    g = gradient(mdp, policy)
    se = torch.full_like(g, 0.01)
    fig = t01_figures.monte_carlo_figure(mdp, g + se, se, g, torch.ones_like(g), n_samples=10)
    top, bottom = fig.get_axes()
    assert top.get_title() and top.get_ylabel() and top.get_legend() is not None
    assert bottom.get_title() and bottom.get_xlabel() and bottom.get_ylabel()
    assert [t.get_text() for t in bottom.get_xticklabels()] == t01.state_names(mdp)
