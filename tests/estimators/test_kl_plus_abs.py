"""The KL estimators k3+ (value of k3, gradient of k2) and abs (|log r|): values against their
closed forms, gradients against k2 / finite differences, float32 at large |log r|, and each
placed in a KLPenalty through ``estimators.loss``."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators import (
    Aggregation,
    Estimator,
    KLPenalty,
    Reinforce,
    RewardAsAdvantage,
    kl_abs,
    kl_k2,
    kl_k3,
    kl_k3_plus,
    loss,
    prepare,
)

EXACT = 1e-12  # float64 closed forms and autograd
FD_STEP = 1e-6  # central finite differences of |log r| (linear away from 0: error ~ rounding)
FD_TOL = 1e-8
V = 5
COEF = 0.3


def _log_ratio_sample(seed=0, n=200):
    """Pairs (log π_θ, log π_ref) in float64, log r = ref - lp of both signs, with exact 0s."""
    gen = torch.Generator().manual_seed(seed)
    ref = -torch.rand(n, generator=gen, dtype=torch.float64) * 4
    log_r = torch.randn(n, generator=gen, dtype=torch.float64) * 1.5
    log_r[:3] = 0.0
    return ref - log_r, ref


def _grad(fn, lp, ref, weights):
    x = lp.clone().requires_grad_(True)
    (g,) = torch.autograd.grad((weights * fn(x, ref)).sum(), x)
    return g


def test_hand_worked_values():
    # log π = log 0.5, log π_ref = log 0.25: log r = -log 2, r = 1/2
    lp = torch.tensor([math.log(0.5)], dtype=torch.float64)
    ref = torch.tensor([math.log(0.25)], dtype=torch.float64)
    assert kl_k3_plus(lp, ref).item() == pytest.approx(0.5 - 1 + math.log(2), abs=EXACT)
    assert kl_abs(lp, ref).item() == pytest.approx(math.log(2), abs=EXACT)
    assert kl_abs(ref, lp).item() == pytest.approx(math.log(2), abs=EXACT)  # symmetric


def test_values_equal_the_closed_forms():
    lp, ref = _log_ratio_sample(1)
    log_r = ref - lp
    torch.testing.assert_close(kl_k3_plus(lp, ref), torch.exp(log_r) - 1 - log_r,
                               rtol=0, atol=EXACT)
    torch.testing.assert_close(kl_k3_plus(lp, ref), kl_k3(lp, ref), rtol=0, atol=0)
    torch.testing.assert_close(kl_abs(lp, ref), log_r.abs(), rtol=0, atol=0)


def test_k3_plus_has_the_gradient_of_k2_and_not_of_k3():
    lp, ref = _log_ratio_sample(2)
    weights = torch.rand(lp.shape, generator=torch.Generator().manual_seed(9),
                         dtype=torch.float64)
    g_plus = _grad(kl_k3_plus, lp, ref, weights)
    torch.testing.assert_close(g_plus, _grad(kl_k2, lp, ref, weights), rtol=0, atol=EXACT)
    # and by its closed form w (log π_θ - log π_ref), distinct from k3's w (1 - r)
    torch.testing.assert_close(g_plus, weights * (lp - ref), rtol=0, atol=EXACT)
    assert (g_plus - _grad(kl_k3, lp, ref, weights)).abs().max() > 1e-2


def test_abs_gradient_by_finite_differences_and_zero_at_zero():
    lp, ref = _log_ratio_sample(3)
    weights = torch.ones_like(lp)
    g = _grad(kl_abs, lp, ref, weights)
    away = (lp - ref).abs() > 10 * FD_STEP
    fd = (kl_abs(lp + FD_STEP, ref) - kl_abs(lp - FD_STEP, ref)) / (2 * FD_STEP)
    torch.testing.assert_close(g[away], fd[away], rtol=0, atol=FD_TOL)
    at_zero = lp == ref
    assert int(at_zero.sum()) == 3
    assert torch.equal(g[at_zero], torch.zeros(3, dtype=torch.float64))
    assert set(g[away].tolist()) == {-1.0, 1.0}


@pytest.mark.parametrize("estimator", [kl_k3_plus, kl_abs])
def test_finite_in_float32_up_to_large_log_ratios(estimator):
    log_r = torch.linspace(-30.0, 30.0, 601, dtype=torch.float32)
    ref = torch.full_like(log_r, -2.0)
    lp = (ref - log_r).requires_grad_(True)
    value = estimator(lp, ref)
    (g,) = torch.autograd.grad(value.sum(), lp)
    assert value.dtype == torch.float32 and torch.isfinite(value).all() and (value >= 0).all()
    assert torch.isfinite(g).all()
    if estimator is kl_k3_plus:  # k2's derivative stays -log r even beyond k3's cap
        torch.testing.assert_close(g, lp.detach() - ref, rtol=0, atol=0)


def _one_state_batch(seed=0):
    """Every token v of a vocabulary of V as its own sequence (prompt [0], response [v])."""
    gen = torch.Generator().manual_seed(seed)
    theta = torch.randn(V, generator=gen, dtype=torch.float64).requires_grad_(True)
    ref = torch.log_softmax(torch.randn(V, generator=gen, dtype=torch.float64), 0)
    batch = TokenBatch.from_sequences([[0]] * V, [[v] for v in range(V)],
                                      rewards=[0.0] * V, dtype=torch.float64)
    return theta, ref, batch


def _column(batch, values_V):
    out = torch.zeros(batch.tokens.shape, dtype=torch.float64)
    return out.index_put((torch.arange(V), torch.ones(V, dtype=torch.long)), values_V)


@pytest.mark.parametrize("estimator", [kl_k3_plus, kl_abs])
def test_kl_penalty_in_the_loss_runs_through_loss(estimator):
    # Reward 0, token-sum weights: loss = β Σ_v k_v, its gradient β Σ_v ∂k_v; k3+ must give
    # the k2 penalty's gradient (the reverse-KL one), abs the value and sign by hand.
    theta, ref, batch = _one_state_batch(4)
    batch = batch.replace(ref_logprob=_column(batch, ref))

    def run(est_fn):
        est = Estimator(surrogate=Reinforce(), advantage=RewardAsAdvantage(),
                        aggregation=Aggregation.TOKEN_SUM,
                        kl=KLPenalty(coef=COEF, in_reward=False, estimator=est_fn))
        logp = torch.log_softmax(theta, 0)
        value, _ = loss(_column(batch, logp), prepare(batch, est), est)
        (g,) = torch.autograd.grad(value, theta)
        return value, g, logp.detach()

    value, g, logp = run(estimator)
    if estimator is kl_k3_plus:
        log_r = ref - logp
        expected_value = COEF * (torch.exp(log_r) - 1 - log_r).sum()
        _, expected_g, _ = run(kl_k2)
    else:
        expected_value = COEF * (logp - ref).abs().sum()
        lp = torch.log_softmax(theta, 0)
        (expected_g,) = torch.autograd.grad(COEF * (torch.sign(logp - ref) * lp).sum(), theta)
    assert value.item() == pytest.approx(expected_value.item(), abs=EXACT)
    torch.testing.assert_close(g, expected_g, rtol=0, atol=EXACT)


@pytest.mark.parametrize(("estimator", "label"), [(kl_k3_plus, "k3+"), (kl_abs, "abs")])
def test_kl_penalty_in_the_reward_and_its_label(estimator, label):
    theta, ref, batch = _one_state_batch(5)
    logp = torch.log_softmax(theta, 0).detach()
    batch = batch.replace(ref_logprob=_column(batch, ref), old_logprob=_column(batch, logp))
    kl = KLPenalty(coef=COEF, in_reward=True, estimator=estimator)
    assert kl.describe() == f"{label} in reward, coef={COEF:g}"
    expected = COEF * estimator(logp, ref)  # one loss token per sequence
    torch.testing.assert_close(kl.reward_penalty(batch), expected, rtol=0, atol=EXACT)
