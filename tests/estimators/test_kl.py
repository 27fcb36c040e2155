"""KL to a reference: estimator values, and the exact gradient of each placement on a
categorical policy (one state, every token enumerated, probability weights)."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators import (
    MAX_LOG_RATIO,
    Aggregation,
    Estimator,
    KLPenalty,
    Reinforce,
    RewardAsAdvantage,
    kl_k1,
    kl_k2,
    kl_k3,
    loss,
    prepare,
)

EXACT = 1e-12  # float64 closed forms and autograd over 5 tokens
V = 5
COEF = 0.3


def test_hand_worked_estimator_values():
    # log π = log 0.5, log π_ref = log 0.25: log r = log(0.25/0.5) = -0.693147
    lp = torch.tensor([math.log(0.5)], dtype=torch.float64)
    ref = torch.tensor([math.log(0.25)], dtype=torch.float64)
    assert kl_k1(lp, ref).item() == pytest.approx(math.log(2), abs=EXACT)  # -log r
    assert kl_k2(lp, ref).item() == pytest.approx(0.5 * math.log(2) ** 2, abs=EXACT)  # 0.240227
    assert kl_k3(lp, ref).item() == pytest.approx(0.5 - 1 + math.log(2), abs=EXACT)  # 0.193147


def _world(seed=0):
    gen = torch.Generator().manual_seed(seed)
    theta = torch.randn(V, generator=gen, dtype=torch.float64).requires_grad_(True)
    ref_logits = torch.randn(V, generator=gen, dtype=torch.float64)
    mu_logits = torch.randn(V, generator=gen, dtype=torch.float64)
    rewards = torch.rand(V, generator=gen, dtype=torch.float64)
    # every token v as its own sequence: prompt [0], response [v]
    batch = TokenBatch.from_sequences([[0]] * V, [[v] for v in range(V)],
                                      rewards=rewards.tolist(), dtype=torch.float64)
    return theta, torch.log_softmax(ref_logits, 0), torch.log_softmax(mu_logits, 0), rewards, batch


def _column(batch, values_V):
    """Put per-token values at the response position (column 1) of each row."""
    out = torch.zeros(batch.tokens.shape, dtype=torch.float64)
    return out.index_put((torch.arange(V), torch.ones(V, dtype=torch.long)), values_V)


def _loss_gradient(theta, batch, est, sample_logprobs):
    """Gradient of the loss with every token weighted by its probability under the sampler."""
    logp = torch.log_softmax(theta, 0)
    lp_RC = _column(batch, logp)
    step = prepare(batch, est)
    step = step.replace(loss_weight=_column(batch, sample_logprobs.exp().detach()))
    (g,) = torch.autograd.grad(loss(lp_RC, step, est)[0], theta)
    return g


def _grad(fn, theta):
    (g,) = torch.autograd.grad(fn(torch.log_softmax(theta, 0)), theta)
    return g


def _reverse_kl(logp, ref):  # KL(π ‖ π_ref)
    return (logp.exp() * (logp - ref)).sum()


def _forward_kl(logp, ref):  # KL(π_ref ‖ π)
    return (ref.exp() * (ref - logp)).sum()


def _no_reward(batch):
    return batch.replace(reward=torch.zeros(V, dtype=torch.float64))


def _in_loss(batch, ref, estimator, **kw):
    batch = batch.replace(ref_logprob=_column(batch, ref))
    est = Estimator(surrogate=Reinforce(), advantage=RewardAsAdvantage(),
                    aggregation=Aggregation.TOKEN_SUM,
                    kl=KLPenalty(coef=COEF, in_reward=False, estimator=estimator, **kw))
    return batch, est


def test_k1_in_the_loss_has_zero_expected_gradient():
    theta, ref, _, _, batch = _world()
    batch, est = _in_loss(_no_reward(batch), ref, kl_k1)
    g = _loss_gradient(theta, batch, est, torch.log_softmax(theta, 0))
    assert g.abs().max() < EXACT
    # and the k2 placement is not zero on the same world (the test can tell them apart)
    batch, est = _in_loss(_no_reward(batch), ref, kl_k2)
    assert _loss_gradient(theta, batch, est, torch.log_softmax(theta, 0)).abs().max() > 1e-3


def test_k2_in_the_loss_gives_the_reverse_kl_gradient():
    theta, ref, _, _, batch = _world(1)
    batch, est = _in_loss(_no_reward(batch), ref, kl_k2)
    g = _loss_gradient(theta, batch, est, torch.log_softmax(theta, 0))
    expected = COEF * _grad(lambda lp: _reverse_kl(lp, ref), theta)
    assert torch.allclose(g, expected, atol=EXACT, rtol=0)


def test_k3_in_the_loss_gives_the_forward_kl_gradient():
    theta, ref, _, _, batch = _world(2)
    batch, est = _in_loss(_no_reward(batch), ref, kl_k3)
    g = _loss_gradient(theta, batch, est, torch.log_softmax(theta, 0))
    expected = COEF * _grad(lambda lp: _forward_kl(lp, ref), theta)
    assert torch.allclose(g, expected, atol=EXACT, rtol=0)
    assert not torch.allclose(g, COEF * _grad(lambda lp: _reverse_kl(lp, ref), theta),
                              atol=1e-4, rtol=0)


def test_k1_in_the_reward_gives_the_regularized_objective_gradient():
    # R_v - β k1_v (k1 at π_old = π, detached) as the advantage: the loss gradient is
    # -∇(J - β KL(π ‖ π_ref)), with J = Σ π R.
    theta, ref, _, rewards, batch = _world(3)
    logp = torch.log_softmax(theta, 0).detach()
    batch = batch.replace(ref_logprob=_column(batch, ref), old_logprob=_column(batch, logp))
    est = Estimator(surrogate=Reinforce(), advantage=RewardAsAdvantage(),
                    aggregation=Aggregation.TOKEN_SUM,
                    kl=KLPenalty(coef=COEF, in_reward=True, estimator=kl_k1))
    g = _loss_gradient(theta, batch, est, logp)
    expected = -_grad(lambda lp: (lp.exp() * rewards).sum() - COEF * _reverse_kl(lp, ref), theta)
    assert torch.allclose(g, expected, atol=EXACT, rtol=0)


def test_importance_weighted_kl_in_the_loss_is_unbiased_off_policy():
    # Sampled from μ (weights μ(v)) with sg(π/μ) on the term: the same gradient as on-policy k2.
    theta, ref, mu, _, batch = _world(4)
    batch = _no_reward(batch).replace(behavior_logprob=_column(batch, mu))
    batch, est = _in_loss(batch, ref, kl_k2, importance_weighted=True)
    g = _loss_gradient(theta, batch, est, mu)
    expected = COEF * _grad(lambda lp: _reverse_kl(lp, ref), theta)
    assert torch.allclose(g, expected, atol=EXACT, rtol=0)


def test_bad_kl_configuration():
    with pytest.raises(ValueError, match="coef"):
        KLPenalty(coef=-0.1, in_reward=False)
    with pytest.raises(ValueError, match="importance_weighted"):
        KLPenalty(coef=0.1, in_reward=True, importance_weighted=True)
    with pytest.raises(TypeError, match="estimator"):
        KLPenalty(coef=0.1, in_reward=False, estimator="k3")
    _, _, _, _, batch = _world()
    est = Estimator(surrogate=Reinforce(), kl=KLPenalty(coef=0.1, in_reward=False))
    with pytest.raises(ValueError, match="ref_logprob"):
        loss(torch.zeros(batch.tokens.shape, dtype=torch.float64), batch, est)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_k3_value_and_gradient_equal_the_formula_under_autograd(dtype):
    # kl_k3 attaches its derivative 1 - r by hand; a second implementation, plain tensor ops
    # differentiated by autograd, must give the same value and gradient, also beyond the cap.
    gen = torch.Generator().manual_seed(3)
    log_r = torch.cat([torch.randn(997, generator=gen, dtype=torch.float64) * 2,
                       torch.tensor([25.0, -40.0, 0.0], dtype=torch.float64)])
    ref = (-torch.rand(1000, generator=gen, dtype=torch.float64) * 4).to(dtype)
    lp = (ref.double() - log_r).to(dtype)
    a, b = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    weights = torch.rand(1000, generator=gen, dtype=torch.float64).to(dtype)
    fused = kl_k3(a, ref)
    lr = ref - b
    formula = torch.expm1(lr.clamp(max=MAX_LOG_RATIO)) - lr   # r - 1 as expm1: no cancellation
    torch.testing.assert_close(fused, formula, rtol=0, atol=0)
    (g_a,) = torch.autograd.grad((weights * fused).sum(), a)
    (g_b,) = torch.autograd.grad((weights * formula).sum(), b)
    # w (1 - r) against autograd's w - w r: the same up to rounding where r is near 1
    tol = (1e-12 if dtype == torch.float64 else 1e-6) * float(g_b.abs().max())
    torch.testing.assert_close(g_a, g_b, rtol=0, atol=tol)
