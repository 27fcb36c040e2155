"""Issue 17: the fused loss path (``tokenmdp.estimators.fused.core*``) gives the loss, gradient and
metrics of the autograd path it replaces (the parts' ``__call__``), for every registry estimator
and for configurations the registry does not use, on fixtures and on hypothesis batches; and it
agrees with an independent formula (PPO clip + k3, DPPO's binary-KL mask) written here."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmdp import estimators as E
from tokenmdp.batch import TokenBatch
from tokenmdp.estimators import token_loss
from tokenmdp.testing.strategies import token_batches

#: float64; the two paths differ only in the order of floating-point products
RTOL = 1e-12
#: the hand-written formulas differ from the fused path in more roundings (exp vs expm1 + 1)
REFERENCE_RTOL = 1e-10

K_ESTIMATORS = (E.kl_k1, E.kl_k2, E.kl_k3, E.kl_k3_plus, E.kl_abs)


def _extra_estimators():
    """Configurations of every fused kernel that no registry entry has."""
    base = E.get("grpo")
    out = {
        "cispo_unified": dataclasses.replace(base, kl=None, surrogate=E.CISPO(
            mask_eps_low=0.2, mask_eps_high=0.28)),
        "dppo_kl_cap": dataclasses.replace(base, kl=None, surrogate=E.DPPO(divergence="kl",
                                                                           cap=1.5)),
        "dppo_tv_cap": dataclasses.replace(base, kl=None, surrogate=E.DPPO(cap=1.2)),
        "entropy_on_policy": dataclasses.replace(base, kl=None,
                                                 surrogate=E.EntropyBonus(E.Reinforce(), 0.1)),
        "entropy_sapo": dataclasses.replace(base, kl=None, surrogate=E.EntropyBonus(E.SAPO())),
        "entropy_cispo": dataclasses.replace(base, kl=None, surrogate=E.EntropyBonus(E.CISPO())),
        "clip_cov_expected": dataclasses.replace(E.get("clip_cov"), surrogate=E.ClipCov(
            selection="expected")),
        "token_ratio_tis": dataclasses.replace(E.get("token_is"), correction=E.TruncatedIS(2.0)),
    }
    for k in K_ESTIMATORS:
        for weighted in (False, True):
            for surrogate in (E.PPOClip(dual_clip=3.0), E.Reinforce()):
                kl = E.KLPenalty(coef=0.3, in_reward=False, estimator=k,
                                 importance_weighted=weighted)
                name = f"{type(surrogate).__name__}_{k.__name__}{'_is' if weighted else ''}"
                out[name] = dataclasses.replace(base, surrogate=surrogate, kl=kl)
    return out


EXTRA = _extra_estimators()
FUSED = [n for n in E.names()] + list(EXTRA)


def _estimator(name):
    return EXTRA[name] if name in EXTRA else E.get(name)


def _run(step, est, lp, *, fused, metrics=True):
    lp = lp.clone().requires_grad_(True)
    value, out = token_loss._loss(lp, step, est, metrics=metrics, fused=fused)
    (grad,) = torch.autograd.grad(value, lp)
    return value.detach(), grad, out


def _has_plan(step, est):
    return token_loss._step_constants(step, est).plan is not None


def assert_paths_agree(step, est, lp, label):
    """Fused and autograd paths: loss and gradient within RTOL (the fused path with and without
    metrics: some kernels take shortcuts without them), metrics bit for bit."""
    v1, g1, m1 = _run(step, est, lp, fused=True)
    v0, g0, m0 = _run(step, est, lp, fused=False)
    v2, g2, _ = _run(step, est, lp, fused=True, metrics=False)
    scale = max(1.0, float(g0.abs().max()) if g0.numel() else 0.0)
    for value, grad in ((v1, g1), (v2, g2)):
        torch.testing.assert_close(value, v0, rtol=RTOL, atol=RTOL * scale, msg=label)
        torch.testing.assert_close(grad, g0, rtol=RTOL, atol=RTOL * scale, msg=label)
    assert m1.keys() == m0.keys(), label
    for key in m0:
        assert torch.equal(m1[key], m0[key]), (label, key, m1[key], m0[key])


def fixture(seed=0):
    """Six sequences in three groups, one response token left out of the loss, random
    log-probs (old, behavior and reference) and advantages."""
    gen = torch.Generator().manual_seed(seed)
    batch = TokenBatch.from_sequences(
        [[1, 2], [1, 2], [3], [3], [4, 5, 6], [4, 5, 6]],
        [[1, 2, 3, 4, 5], [2, 3], [4, 4, 4, 1], [1], [2, 2, 2, 2, 2, 2], [3, 1, 2]],
        rewards=[1.0, 0.0, 0.5, 2.0, -1.0, 0.3], groups=[0, 0, 1, 1, 2, 2],
        prompt_index=[0, 0, 1, 1, 2, 2], dtype=torch.float64)
    shape, response = batch.tokens.shape, batch.response_mask
    mask = batch.loss_mask.clone()
    mask[0, 3] = False

    def field(values):
        return torch.where(response, values, 0.0)
    old = field(-2 * torch.rand(shape, generator=gen, dtype=torch.float64))
    noise = [0.2 * torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3)]
    return batch.replace(loss_mask=mask, advantage=torch.where(mask, noise[0] * 5, 0.0),
                         loss_weight=mask.to(torch.float64), old_logprob=old,
                         behavior_logprob=field((old + noise[1]).clamp(max=0.0)),
                         ref_logprob=field((old + noise[2]).clamp(max=0.0)))


def _noisy(step, scale, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return step.old_logprob + scale * torch.randn(step.tokens.shape, generator=gen,
                                                  dtype=step.dtype)


def test_every_estimator_has_a_fused_path():
    batch = fixture()
    unfused = []
    for name in FUSED:
        est = _estimator(name)
        if not _has_plan(E.prepare(batch, est, max_len=8), est):
            unfused.append(name)
    assert unfused == [], unfused


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("scale", [0.05, 0.5, 3.0])
def test_fused_path_matches_autograd_path_on_a_fixture(name, scale):
    gen = torch.Generator().manual_seed(1)
    batch = fixture()
    est = _estimator(name)
    step = E.prepare(batch, est, max_len=8)
    lp = _noisy(step, scale)
    # garbage off the loss tokens is ignored (replaced by 0) by both paths
    lp = torch.where(step.loss_mask, lp, 50 * torch.randn(lp.shape, generator=gen,
                                                          dtype=lp.dtype))
    assert_paths_agree(step, est, lp, name)


@settings(max_examples=60, deadline=None)
@given(token_batches(with_logprobs=True), st.data())
def test_fused_path_matches_autograd_path_on_hypothesis_batches(batch, data):
    names = data.draw(st.lists(st.sampled_from(FUSED), min_size=1, max_size=3, unique=True))
    scale = data.draw(st.sampled_from([0.01, 0.3, 2.0]))
    shift = data.draw(st.sampled_from([0.0, 25.0, -25.0]))  # ±25: ratios beyond the e^20 cap
    off = data.draw(st.sampled_from([0.0, 1e3, -1e14, 1e14, float("inf"), float("nan")]))
    for name in names:
        est = _estimator(name)
        step = E.prepare(batch, est, max_len=8)
        lp = _noisy(step, scale, seed=data.draw(st.integers(0, 2**16)))
        shifted = torch.rand(lp.shape, generator=torch.Generator().manual_seed(3)) < 0.2
        lp = torch.where(shifted, lp + shift, lp)
        lp = torch.where(step.loss_mask, lp, torch.full_like(lp, off))
        assert_paths_agree(step, est, lp, (name, scale, shift, off))


@pytest.mark.parametrize("name", FUSED)
def test_fused_path_without_the_cpu_shortcuts(name, monkeypatch):
    """The path a GPU takes: no reduction decides that no ratio reaches the cap or that the
    log-probs can be read raw (each would synchronize the device)."""
    from tokenmdp.estimators.fused import core as _fused
    from tokenmdp.estimators.fused import kl as _fused_kl
    from tokenmdp.estimators.fused import sequence as _fused_sequence
    from tokenmdp.estimators.fused import surrogates as _fused_surrogates
    for module in (_fused, _fused_kl, _fused_sequence, _fused_surrogates):
        if hasattr(module, "capped_anywhere"):
            monkeypatch.setattr(module, "capped_anywhere", lambda log_ratio: True)
    monkeypatch.setattr(_fused, "TAME", -1.0)
    est = _estimator(name)
    step = E.prepare(fixture(2), est, max_len=8)
    assert_paths_agree(step, est, _noisy(step, 0.5, seed=2), name)


def test_fused_path_without_gradient_and_on_an_empty_batch():
    batch = fixture()
    est = E.get("grpo")
    step = E.prepare(batch, est, max_len=8)
    lp = _noisy(step, 0.3)
    with torch.no_grad():
        v1 = token_loss._loss(lp, step, est, metrics=False, fused=True)[0]
        v0 = token_loss._loss(lp, step, est, metrics=False, fused=False)[0]
    torch.testing.assert_close(v1, v0, rtol=RTOL, atol=RTOL)
    empty = step.replace(loss_mask=torch.zeros_like(step.loss_mask))
    value, grad, _ = _run(empty, est, lp, fused=True)
    assert float(value) == 0.0 and torch.equal(grad, torch.zeros_like(grad))


def test_fused_loss_refuses_a_second_derivative():
    batch = fixture()
    est = E.get("ppo")
    step = E.prepare(batch, est, max_len=8)
    lp = _noisy(step, 0.3).requires_grad_(True)
    value = E.loss(lp, step, est, metrics=False)[0]
    (grad,) = torch.autograd.grad(value, lp, create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(grad.sum(), lp)


# ---------------------------------------------------------------------- independent formulas
def reference_ppo_k3(lp, step, *, eps_low, eps_high, dual_clip, beta):
    """``-Σ w min(r Â, clip(r) Â) [dual clip] + β Σ w k3`` under autograd, from the papers'
    formulas (PPO arXiv 1707.06347 Eq. 7, dual clip arXiv 1912.09729, k3 Schulman 2020); the
    ratio and ``π_ref/π_θ`` held at ``e^20``."""
    mask = step.loss_mask
    x = torch.where(mask, lp, 0.0)
    w = torch.where(mask, step.loss_weight, 0.0)
    A = step.advantage
    r = torch.exp(torch.clamp(x - step.old_logprob, max=20.0))
    surrogate = torch.minimum(r * A, torch.clamp(r, 1 - eps_low, 1 + eps_high) * A)
    if dual_clip is not None:
        surrogate = torch.where(A < 0, torch.maximum(surrogate, dual_clip * A), surrogate)
    log_r = step.ref_logprob - x
    k3 = torch.exp(torch.clamp(log_r, max=20.0)) - 1 - log_r
    return -(w * surrogate).sum() + beta * (w * k3).sum()


def reference_dppo_kl_keep(lp, old, A, delta_low, delta_high):
    """DPPO's binary-KL mask from its definition (arXiv 2602.04879), with ``torch.xlogy``."""
    p, p_old = lp.exp(), old.exp()
    d = torch.xlogy(p_old, p_old) - torch.xlogy(p_old, p) \
        + torch.xlogy(1 - p_old, 1 - p_old) - torch.xlogy(1 - p_old, 1 - p)
    drop = torch.where(A > 0, (d > delta_high) & (p > p_old), (d > delta_low) & (p < p_old))
    return ~drop


@settings(max_examples=40, deadline=None)
@given(token_batches(with_logprobs=True, max_response_len=6, edge_masks=True),
       st.sampled_from(["grpo", "grpo_verl"]), st.sampled_from([0.05, 0.4, 1.5]),
       st.integers(0, 2**16))
def test_fused_grpo_matches_the_written_out_formula(batch, name, scale, seed):
    est = E.get(name)
    step = E.prepare(batch, est, max_len=8)
    lp = _noisy(step, scale, seed).requires_grad_(True)
    surrogate = est.surrogate
    value = E.loss(lp, step, est, metrics=False)[0]
    (grad,) = torch.autograd.grad(value, lp)
    expected = reference_ppo_k3(lp, step, eps_low=surrogate.eps_low, eps_high=surrogate.eps_high,
                                dual_clip=surrogate.dual_clip, beta=est.kl.coef)
    (expected_grad,) = torch.autograd.grad(expected, lp)
    torch.testing.assert_close(value, expected.detach(), rtol=REFERENCE_RTOL,
                               atol=REFERENCE_RTOL)
    torch.testing.assert_close(grad, expected_grad, rtol=REFERENCE_RTOL, atol=REFERENCE_RTOL)


@settings(max_examples=40, deadline=None)
@given(token_batches(with_logprobs=True, max_response_len=6, edge_masks=True),
       st.sampled_from([0.05, 0.4, 1.5]), st.integers(0, 2**16))
def test_fused_dppo_kl_matches_the_written_out_formula(batch, scale, seed):
    est = E.get("dppo_kl")
    step = E.prepare(batch, est, max_len=8)
    lp = torch.clamp(_noisy(step, scale, seed), max=-1e-3).requires_grad_(True)
    part = est.surrogate
    value = E.loss(lp, step, est, metrics=False)[0]
    (grad,) = torch.autograd.grad(value, lp)
    mask, x = step.loss_mask, torch.where(step.loss_mask, lp.detach(), 0.0)
    keep = reference_dppo_kl_keep(x, step.old_logprob, step.advantage, part.delta_low,
                                  part.delta_high)
    r = torch.exp(x - step.old_logprob)
    w = torch.where(mask, step.loss_weight, 0.0)
    coef = torch.where(keep, -w * r * step.advantage, 0.0)
    torch.testing.assert_close(grad, coef, rtol=REFERENCE_RTOL, atol=REFERENCE_RTOL)
    torch.testing.assert_close(value, (coef * x).sum(), rtol=REFERENCE_RTOL, atol=REFERENCE_RTOL)
