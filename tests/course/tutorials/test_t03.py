"""Tutorial 3's helpers: each table's rows against a direct computation, the estimators and
measurements against independent ones, and every figure titled with labelled axes."""

from __future__ import annotations

import math
from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from tokenmdp.course.setups import copy_task, ppo_clip_fraction, step_along  # noqa: E402
from tokenmdp.course.tutorials import t03, t03_figures, t03_tables  # noqa: E402
from tokenmdp.estimators import (  # noqa: E402
    ImportanceSampling,
    Level,
    PPOClip,
    Reinforce,
    SequenceRatio,
    TokenRatio,
)
from tokenmdp.exact import (  # noqa: E402
    first_order_path,
    gradient,
    moments,
    sequence_kl,
    sequence_logprobs,
    sequence_probs,
    stale_copy,
    state_logprobs,
)
from tokenmdp.exact.world.chi_square import chi_square  # noqa: E402

EXACT_TOL = 1e-12   # two exact float64 computations of the same quantity
Z_TOL = 4.0         # |Monte Carlo estimate - exact| in standard errors


@pytest.fixture(scope="module")
def world():
    mdp, pi = copy_task()
    return mdp, pi, stale_copy(mdp, pi, distance=1.0)


def fake_moments(mean, bias, variance, *, cosine=0.5, relative_bias=0.1):
    mean, bias = torch.tensor(mean, dtype=torch.float64), torch.tensor(bias, dtype=torch.float64)
    return SimpleNamespace(mean=mean, bias=bias, total_variance=variance, cosine=cosine,
                           relative_bias=relative_bias)


# --- estimators and measurements ------------------------------------------------------------

def test_rloo_and_one_sample_are_unbiased_on_policy(world):
    mdp, pi, _ = world
    grad_J = gradient(mdp, pi)
    for estimator, G in [(t03.rloo(Reinforce()), 2), (t03.one_sample(Reinforce()), 1)]:
        m = moments(mdp, pi, estimator, group_size=G, method="enumeration")
        assert (m.mean - grad_J).abs().max() < EXACT_TOL


def test_response_scores_match_one_backward_pass_per_response(world):
    mdp, pi, _ = world
    scores = t03.response_scores(mdp, pi)
    logprobs = sequence_logprobs(mdp, pi)
    for i in [0, 7, mdp.num_sequences - 1]:
        grads = torch.autograd.grad(logprobs[i], list(pi.parameters()), retain_graph=True)
        assert torch.allclose(scores[i], torch.cat([g.reshape(-1) for g in grads]), rtol=0,
                              atol=EXACT_TOL)


def test_fixed_length_pair_has_responses_of_exactly_T_tokens():
    T, delta = 3, 1.5
    mdp, pi, mu = t03.fixed_length_pair(T, delta=delta, no_eos=-40.0)
    full = mdp.enumerate().length == T
    with torch.no_grad():
        assert abs(float(sequence_probs(mdp, mu)[full].sum()) - 1.0) < 1e-14
        assert abs(float(sequence_probs(mdp, pi)[full].sum()) - 1.0) < 1e-14
        # per token, π's odds of token 0 against 1 are e^δ; μ is uniform on {0, 1}
        (lp_pi, *_), (lp_mu, *_) = state_logprobs(mdp, pi), state_logprobs(mdp, mu)
    assert abs(float(lp_pi.reshape(-1, 3)[0, 0] - lp_pi.reshape(-1, 3)[0, 1]) - delta) < EXACT_TOL
    assert abs(float(lp_mu.reshape(-1, 3)[0, 0] - math.log(0.5))) < 1e-14


def test_path_kls_against_step_along_and_categorical_kl(world):
    mdp, pi, _ = world
    direction = gradient(mdp, pi)
    steps = [0.1, 1.0]
    seq_kl, max_state_kl = t03.path_kls(mdp, pi, direction, steps)
    for s, kl, kl_state in zip(steps, seq_kl, max_state_kl):
        moved = step_along(pi, direction, s)
        with torch.no_grad():
            assert abs(kl - float(sequence_kl(mdp, moved, pi))) < EXACT_TOL
            per_state = torch.cat([
                torch.distributions.kl_divergence(torch.distributions.Categorical(logits=a),
                                                  torch.distributions.Categorical(logits=b))
                .reshape(-1) for a, b in zip(state_logprobs(mdp, pi), state_logprobs(mdp, moved))])
        assert abs(kl_state - float(per_state.max())) < EXACT_TOL


def test_monte_carlo_clip_fraction_agrees_with_the_exact_one(world):
    mdp, pi, _ = world
    old = stale_copy(mdp, pi, distance=0.5)
    estimator = t03.rloo(PPOClip(eps_low=0.1, eps_high=0.1))
    fractions = t03.monte_carlo_clip_fraction(mdp, pi, old, estimator, batches=6, size=1000,
                                              group_size=2, generator=torch.Generator().manual_seed(0))
    exact = ppo_clip_fraction(mdp, pi, old, eps_low=0.1, eps_high=0.1)
    se = float(fractions.std() / len(fractions) ** 0.5)
    assert fractions.shape == (6,) and exact > 0.01
    assert abs(float(fractions.mean()) - exact) < Z_TOL * se
    # nothing moved: nothing is clipped
    none = t03.monte_carlo_clip_fraction(mdp, pi, pi, estimator, batches=2, size=200, group_size=2,
                                         generator=torch.Generator().manual_seed(1))
    assert float(none.abs().max()) == 0.0


def test_mse_is_squared_bias_plus_variance_over_groups():
    m = fake_moments([1.0, 2.0], [0.3, -0.4], 2.0)
    assert abs(t03.mse(m, 1) - (0.25 + 2.0)) < EXACT_TOL
    assert abs(t03.mse(m, 64) - (0.25 + 2.0 / 64)) < EXACT_TOL


# --- tables ---------------------------------------------------------------------------------

def test_table_prints_the_notebooks_fixed_width_layout():
    table = t03_tables.Table([("a", 5, ".2f"), "|", ("b", 7, "+.3f"), ("c", 3, "s")], [(1.5, -0.25, "x")])
    assert str(table) == f"{'a':>5} | {'b':>7} {'c':>3}\n{1.5:>5.2f} | {-0.25:>+7.3f} {'x':>3}"
    assert table.rows == [(1.5, -0.25, "x")]


def test_composition_table_rows(world):
    mdp, pi, pi_old = world
    kw = dict(group_size=2, behavior=pi_old, method="enumeration")
    by_s = moments(mdp, pi, t03.rloo(SequenceRatio()), **kw)
    by_c = moments(mdp, pi, t03.rloo(Reinforce(), ImportanceSampling(level=Level.SEQUENCE)),
                   old=pi, **kw)
    (row,) = t03_tables.composition_table({"sequence IS": (by_s, by_c)}).rows
    assert row[0] == "sequence IS"
    assert abs(row[1] - float(by_s.mean.norm())) < EXACT_TOL
    assert abs(row[2] - float(by_c.mean.norm())) < EXACT_TOL
    assert row[3] < EXACT_TOL and abs(row[4]) < EXACT_TOL


def test_sweep_table_rows_against_the_library_chi_square(world):
    mdp, pi, stale = world
    with torch.no_grad():
        kl = float(sequence_kl(mdp, pi, stale))
    # the notebook's χ² of π against μ, here from tokenmdp.exact.world.chi_square (another implementation)
    chi2 = float(chi_square(mdp, pi, stale))
    seq = moments(mdp, pi, t03.rloo(SequenceRatio()), group_size=2, behavior=stale,
                  method="enumeration")
    tok = moments(mdp, pi, t03.rloo(TokenRatio()), group_size=2, behavior=stale,
                  method="enumeration")
    (row,) = t03_tables.sweep_table([dict(distance=1.0, kl=kl, chi2=chi2, seq=seq, tok=tok)]).rows
    assert row[:4] == (1.0, kl, math.exp(kl), 1 + chi2)
    assert row[4] < EXACT_TOL and row[5] == seq.total_variance
    assert row[6] == tok.relative_bias and row[7] == tok.total_variance
    assert row[2] <= row[3]                            # e^KL <= 1 + χ²


def test_length_tables_rows():
    (row,) = t03_tables.length_identity_table([(2, 1.5, 1.25, 3.0, 2.0)]).rows
    assert row == (2, 1.5, 1.25, 0.25, 3.0, 2.0, 1.0)
    # sequence-IS variance = on-policy variance × (1 + χ)^T: every successive ratio is 1 + χ
    chi2_tok, on = 0.4, [0.1, 0.3, 0.5]
    by_length = [dict(T=T, on=fake_moments([0.0], [0.0], v),
                      seq=fake_moments([0.0], [0.0], v * (1 + chi2_tok) ** T, relative_bias=1e-13),
                      tok=fake_moments([0.0], [0.0], 1.0, relative_bias=0.01 * T))
                 for T, v in zip([1, 2, 3], on)]
    rows = t03_tables.length_ratio_table(by_length, chi2_tok).rows
    assert [r[0] for r in rows] == [2, 3]
    for r in rows:
        assert abs(r[1] - (1 + chi2_tok)) < EXACT_TOL and abs(r[3]) < EXACT_TOL
        assert r[4] == 0.01 * r[0] and r[5] == 1e-13


def test_path_table_rows(world):
    mdp, pi, _ = world
    path = first_order_path(mdp, pi, gradient(mdp, pi), [0.1, 0.5])
    kls = [0.2, 0.4]
    rows = t03_tables.path_table(path, kls).rows
    for row, p, kl in zip(rows, path, kls):
        assert row[:7] == (p.step, p.true_improvement, p.token_surrogate_improvement,
                           p.sequence_is_improvement, p.gap, p.bound, p.gradient_error)
        assert row[7] == kl and row[8] == p.gap / kl


def test_ppo_cap_and_mse_tables_rows():
    grad_J = torch.tensor([3.0, 4.0], dtype=torch.float64)
    m = fake_moments([1.0, 1.0], [-2.0, -3.0], 0.7, cosine=0.9)
    grad_L = {0.5: torch.tensor([1.0, 0.0], dtype=torch.float64)}
    (row,) = t03_tables.ppo_table({(0.5, 0.1): dict(m=m, clip=0.2)}, grad_L, grad_J).rows
    assert row[:4] == (0.5, 0.1, 0.2, 0.9)
    assert abs(row[4] - 1.0 / 5.0) < EXACT_TOL and abs(row[5] - math.sqrt(2) / 5) < EXACT_TOL
    assert row[6] == 0.7

    ref = fake_moments([1.0, 2.0], [0.0, 0.0], 1.0, relative_bias=0.0)
    capped = fake_moments([1.0, 2.5], [0.0, 0.5], 0.5, relative_bias=0.2)
    (row,) = t03_tables.cap_table({"TIS": (capped, ref)}).rows
    assert row == ("TIS", 0.2, 0.0, 0.5, 0.5, 1.0)

    rows = t03_tables.mse_table({"IS": ref}, {"TIS": [capped, ref]}, [2.0, 1.5], 4).rows
    assert rows == [("IS", "-", 0.0, 1.0, 1.0, 0.25), ("TIS", 2.0, 0.25, 0.5, 0.75, 0.375),
                    ("TIS", 1.5, 0.0, 1.0, 1.0, 0.25)]
    assert "MSE_4" in str(t03_tables.mse_table({"IS": ref}, {}, [], 4)).splitlines()[0]


# --- figures --------------------------------------------------------------------------------

def _assert_labelled(fig, panels):
    assert isinstance(fig, Figure) and len(fig.axes) == panels
    for ax in fig.axes:
        assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
    plt.close(fig)


def test_every_figure_has_titled_labelled_panels(world):
    mdp, pi, _ = world
    m = fake_moments([1.0, 2.0], [0.1, 0.2], 0.5)
    sweep = [dict(distance=d, kl=0.1 * (i + 1), chi2=0.2 * (i + 1), seq=m, tok=m)
             for i, d in enumerate([0.0, 0.5, 1.0, 2.0, 4.0])]
    _assert_labelled(t03_figures.plot_sweep_variance(sweep, 0.3, group_size=2), 2)
    by_length = [dict(T=T, seq=m, tok=m, on=m) for T in [1, 2, 3]]
    _assert_labelled(t03_figures.plot_length_variance(by_length, 0.4), 2)
    path = first_order_path(mdp, pi, gradient(mdp, pi), [0.01, 0.1, 1.0])
    kls = [1e-4, 1e-2, 1.0]
    _assert_labelled(t03_figures.plot_gap_orders(path, kls, [2 * p.bound for p in path], path[0]), 2)
    ppo = {(d, eps): dict(m=m, clip=0.1) for d in [0.1, 0.5] for eps in [0.1, math.inf]}
    _assert_labelled(t03_figures.plot_ppo(ppo, [0.1, 0.5], [0.1, math.inf]), 2)
    _assert_labelled(t03_figures.plot_cap_tradeoff({"TIS": [m, m]}, {"IS": m}, [2.0, 1.5], 64,
                                           tol=EXACT_TOL), 3)
