"""Issue 33, gap 1: the bands and budgets the registry's fixtures never hold.

* **Asymmetric DPPO bands** (``delta_low != delta_high``): every registry entry uses one
  threshold both ways, so a mask that swapped them would pass every other test. Here the
  gradient of DPPO-TV and DPPO-KL, on its fused and autograd paths, is checked against the
  definition written out (Qi et al., arXiv 2602.04879): the token keeps ``-w r Â`` unless
  ``Â > 0`` and ``p`` rose past ``δ_high`` or ``Â <= 0`` and ``p`` fell past ``δ_low`` (TV:
  ``p - p_old``; KL: the binary KL ``D(p_old ‖ p)``), with a hand-worked case where only the
  order of the thresholds decides.
* **Clip-Cov budgets larger than the candidate set** (``⌊r N⌋ >= #candidates``): every
  candidate is detached, by the random draw and by the expected selection (scale 0, never
  negative), and the gradient is PPO's on the other tokens only; below the budget, exactly
  ``max(⌊r N⌋, 1)`` candidates are detached.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.estimators.estimator_helpers import make_batch, response_values
from tests.estimators.fused.test_fused_loss import reference_dppo_kl_keep
from tokenmdp import estimators as E
from tokenmdp.estimators import token_loss
from tokenmdp.estimators.surrogates.covariance import CLIP_COV_SCALE
from tokenmdp.testing import token_batches

#: float64, the same products in another order
EXACT = 1e-12
BANDS = [(0.05, 0.3), (0.3, 0.05), (0.02, 0.2)]


def _dppo(divergence, low, high):
    return E.Estimator(surrogate=E.DPPO(divergence=divergence, delta_low=low, delta_high=high),
                       advantage=E.GroupMean(), aggregation=E.Aggregation.TOKEN_SUM)


def _grad(step, est, lp, fused):
    lp = lp.clone().requires_grad_(True)
    value, _ = token_loss._loss(lp, step, est, metrics=False, fused=fused)
    return value.detach(), torch.autograd.grad(value, lp)[0]


def reference_dppo_keep(x, old, A, divergence, low, high):
    """The keep mask from its definition; TV here, KL through the fused tests' transcription."""
    if divergence == "kl":
        return reference_dppo_kl_keep(x, old, A, low, high)
    diff = x.exp() - old.exp()
    return ~torch.where(A > 0, diff > high, diff < -low)


def _check(step, est, lp, label):
    part = est.surrogate
    mask = step.loss_mask
    x = torch.where(mask, lp, 0.0)
    keep = reference_dppo_keep(x, step.old_logprob, step.advantage, part.divergence,
                               part.delta_low, part.delta_high)
    coef = torch.where(keep & mask, -step.loss_weight * torch.exp(x - step.old_logprob)
                       * step.advantage, 0.0)
    for fused in (True, False):
        value, grad = _grad(step, est, lp, fused)
        torch.testing.assert_close(grad, coef, rtol=EXACT, atol=EXACT, msg=str(label))
        torch.testing.assert_close(value, (coef * x).sum(), rtol=EXACT, atol=EXACT,
                                   msg=str(label))
    return keep


@pytest.mark.parametrize("divergence", ["tv", "kl"])
def test_only_the_order_of_the_thresholds_decides_these_tokens(divergence):
    # sequence 0 (Â > 0): p rises 0.30 -> 0.45; sequence 1 (Â < 0): p falls 0.30 -> 0.15
    old = [[math.log(0.3)], [math.log(0.3)]]
    batch = make_batch([[1], [1]], [[2], [3]], rewards=[1.0, -1.0], groups=[0, 0], old=old,
                       behavior=old, ref=old)
    # |Δp| = 0.15 (TV); binary KL 0.047 rising, 0.072 falling: between the thresholds below
    small, large = (0.1, 0.2) if divergence == "tv" else (0.03, 0.09)
    lp = response_values(batch, [[math.log(0.45)], [math.log(0.15)]])
    kept = {}
    for low, high in ((small, large), (large, small)):
        est = _dppo(divergence, low, high)
        step = E.prepare(batch, est)
        keep = _check(step, est, lp, (divergence, low, high))
        kept[(low, high)] = [bool(keep[(batch.sequence_id == s) & batch.loss_mask][0])
                             for s in range(2)]
    # δ_low small: the falling negative-advantage token is dropped, the rising one kept
    assert kept[(small, large)] == [True, False]
    assert kept[(large, small)] == [False, True]


@settings(max_examples=40, deadline=None)
@given(token_batches(with_logprobs=True, edge_masks=True, max_response_len=6),
       st.sampled_from(["tv", "kl"]), st.sampled_from(BANDS), st.sampled_from([0.3, 1.0]),
       st.integers(0, 2**16))
def test_asymmetric_dppo_bands_against_the_definition(batch, divergence, band, scale, seed):
    est = _dppo(divergence, *band)
    step = E.prepare(batch, est)
    gen = torch.Generator().manual_seed(seed)
    lp = step.old_logprob + scale * torch.randn(step.tokens.shape, generator=gen,
                                                dtype=step.dtype)
    lp = torch.clamp(lp, max=-1e-3)
    _check(step, est, lp, (divergence, band))


# ---------------------------------------------------------------------- Clip-Cov budgets
def _cov_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 2, 4, 1, 3]
    old = [(-3 * torch.rand(n, generator=g, dtype=torch.float64)).tolist() for n in lengths]
    return make_batch([[1]] * 5, [[2] * n for n in lengths], rewards=[1.0, -0.5, 2.0, 0.0, -1.0],
                      groups=[0, 0, 1, 1, 1], old=old, behavior=old, ref=old), lengths


def _loop_covariance(step):
    """``(Â_t - mean Â)(log π_old,t - mean log π_old)`` over the loss tokens, written out."""
    mask = step.loss_mask
    a, lo = step.advantage[mask].tolist(), step.old_logprob[mask].tolist()
    ma, ml = sum(a) / len(a), sum(lo) / len(lo)
    return [(x - ma) * (y - ml) for x, y in zip(a, lo, strict=True)]


@pytest.mark.parametrize("selection", ["random", "expected"])
@pytest.mark.parametrize("ratio", [0.1, 0.3, 0.6, 1.0])
def test_clip_cov_budget_above_and_below_the_candidates(ratio, selection):
    batch, _ = _cov_batch()
    part = E.ClipCov(ratio=ratio, cov_low=0.0, cov_high=50.0, selection=selection)
    est = E.Estimator(surrogate=part, advantage=E.GroupNormalized(),
                      aggregation=E.Aggregation.TOKEN_SUM)
    step = E.prepare(batch, est)
    mask = step.loss_mask
    cov = _loop_covariance(step)
    candidates = [0.0 < c < 50.0 for c in cov]
    n, n_cand = len(cov), sum(candidates)
    assert 0 < n_cand < n
    budget = max(math.floor(ratio * n), 1)
    scale = step.token_extras[CLIP_COV_SCALE][mask].tolist()
    assert all(s == 1.0 for s, c in zip(scale, candidates, strict=True) if not c)
    kept = [s for s, c in zip(scale, candidates, strict=True) if c]
    if selection == "expected":
        want = 1 - min(budget, n_cand) / n_cand
        assert kept == pytest.approx([want] * n_cand, abs=EXACT)
    else:
        assert sorted(kept) == [0.0] * min(budget, n_cand) + [1.0] * max(n_cand - budget, 0)
    if budget >= n_cand:
        assert kept == [0.0] * n_cand
    # the gradient: PPO's clipped term times the scale, written out
    gen = torch.Generator().manual_seed(1)
    lp = step.old_logprob + 0.3 * torch.randn(step.tokens.shape, generator=gen,
                                              dtype=step.dtype)
    x = torch.where(mask, lp, 0.0).requires_grad_(True)
    r = torch.exp(x - step.old_logprob)
    A = step.advantage
    term = torch.minimum(r * A, torch.clamp(r, 1 - part.eps_low, 1 + part.eps_high) * A)
    reference = -(step.token_extras[CLIP_COV_SCALE] * step.loss_weight * term)[mask].sum()
    (want_grad,) = torch.autograd.grad(reference, x)
    for fused in (True, False):
        value, grad = _grad(step, est, lp, fused)
        torch.testing.assert_close(grad, want_grad, rtol=EXACT, atol=EXACT)
        torch.testing.assert_close(value, reference.detach(), rtol=EXACT, atol=EXACT)


def test_clip_cov_registry_entry_with_every_candidate_detached():
    """The registry's ``clip_cov`` with a budget over its candidates and every token a
    candidate: every term is detached (scale 0), so no token keeps a gradient."""
    batch, _ = _cov_batch(3)
    base = E.get("clip_cov")
    est = dataclasses.replace(base, surrogate=dataclasses.replace(
        base.surrogate, ratio=1.0, cov_low=-50.0, cov_high=50.0))
    step = E.prepare(batch, est)
    assert bool((step.token_extras[CLIP_COV_SCALE][step.loss_mask] == 0).all())
    lp = step.old_logprob + 0.2
    for fused in (True, False):
        _, grad = _grad(step, est, lp, fused)
        assert bool((grad == 0).all())
