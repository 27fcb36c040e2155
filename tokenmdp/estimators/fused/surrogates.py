"""Fused kernels of the per-token surrogates (not public API).

Each kernel computes, from ``x = log π_θ`` (sanitized, detached) and its part's step constants,
the loss ``Σ weight · term`` and the gradient coefficient ``weight · ∂term/∂x`` that the part's
autograd path (its ``__call__``, :mod:`~tokenmdp.estimators.surrogates.token` and the other surrogate
modules) gives, with the same ratios, masks and caps (see :mod:`~tokenmdp.estimators.fused.core`).
Notation: ``r = exp(min(x - log π_old, 20))``, ``ok = 1{x - log π_old <= 20}`` (a ratio at the
cap has no gradient), ``wA = weight · Â`` a step constant.

The PPO mask ``M`` as a clamp: ``min(r Â, clip(r) Â)`` (with dual clip ``c``:
``max(min(...), c Â)`` for ``Â < 0``) is ``Â · clamp(r, lo, hi)`` with per-token bounds
``(lo, hi) = (-∞, 1+ε_high)`` where ``Â > 0``, ``(1-ε_low, c or ∞)`` where ``Â < 0`` and
``(-∞, ∞)`` where ``Â = 0``; ``M = 1{clamp(r, lo, hi) = r}``, and the gradient is ``M r Â``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tokenmdp.estimators._common import MAX_LOG_RATIO
from tokenmdp.estimators.fused.core import (
    FusedTerms,
    below_cap,
    bind,
    capped_anywhere,
    capped_ratio,
    dot,
    indicator,
    ratio_only,
    register,
    scaled,
)
from tokenmdp.estimators.surrogates.clipped import CISPO, MiniRL, PPOClip
from tokenmdp.estimators.surrogates.covariance import CLIP_COV_SCALE, KL_COV_SELECTED, ClipCov, KLCov
from tokenmdp.estimators.surrogates.soft import SAPO, EntropyBonus
from tokenmdp.estimators.surrogates.token import Reinforce, TokenRatio
from tokenmdp.estimators.surrogates.trust_region_masks import DPPO, _binary_kl_constant, _binary_kl_sum

INF = float("inf")


class Weighted(NamedTuple):
    """Step constants of the simplest kernels: ``wA = weight · Â`` and ``log π_old`` (or
    None)."""

    wA: torch.Tensor
    old: torch.Tensor | None


class Clipped(NamedTuple):
    """Step constants of a clamp-form mask: ``wA``, ``log π_old`` and the bounds ``lo``, ``hi``."""

    wA: torch.Tensor
    old: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor


def ppo_bounds(advantage_RC: torch.Tensor, eps_low: float, eps_high: float,
               dual_clip: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token ``(lo, hi)`` of the PPO mask as a clamp (module docstring), in the
    advantage's dtype (the bounds the autograd path compares with)."""
    scalar = advantage_RC.new_tensor
    pos, neg = advantage_RC > 0, advantage_RC < 0
    hi = torch.where(pos, scalar(1 + eps_high), scalar(INF))
    if dual_clip is not None:
        hi = torch.where(neg, scalar(dual_clip), hi)
    lo = torch.where(neg, scalar(1 - eps_low), scalar(-INF))
    return lo, hi


def _keep(ratio, lo, hi):
    """``M = 1{clamp(r, lo, hi) = r}`` as 0/1 floats (one fresh tensor)."""
    clamped = torch.clamp(ratio, lo, hi)
    return indicator(torch.eq, clamped, ratio, out=clamped)


def _clipped_bool(keep_f):
    return keep_f == 0


# ---------------------------------------------------------------------- REINFORCE, r Â
def _weighted_constants(part, batch, weight_RC):
    old = batch.old_logprob if "old_logprob" in part.requires else None
    return Weighted(weight_RC * batch.advantage, old)


def _reinforce(part, x, batch, c, request):
    """``Â x``: value ``Σ wA x``, coefficient ``wA``."""
    wA = scaled(c.wA, request)
    return FusedTerms(dot(wA, x), wA if request.grad else None, owned=request.scale_RC is not None)


def _token_ratio(part, x, batch, c, request):
    """``r Â``: value ``Σ wA r``, coefficient ``wA r ok``."""
    wA = scaled(c.wA, request)
    log_ratio, ratio, capped = capped_ratio(x, c.old)
    coef = None
    if request.grad:
        coef = (below_cap(log_ratio, reuse=True).mul_(ratio).mul_(wA) if capped
                else ratio * wA)
    return FusedTerms(dot(wA, ratio), coef, None, ratio)


register(Reinforce, _weighted_constants, _reinforce)
register(TokenRatio, _weighted_constants, _token_ratio)


# ---------------------------------------------------------------------- PPO clip, Clip-Cov
def _ppo_constants(part, batch, weight_RC, scale_RC=None):
    weight = weight_RC if scale_RC is None else weight_RC * scale_RC
    lo, hi = ppo_bounds(batch.advantage, part.eps_low, part.eps_high,
                        getattr(part, "dual_clip", None))
    return Clipped(weight * batch.advantage, batch.old_logprob, lo, hi)


def _ppo(part, x, batch, c, request):
    """``Â clamp(r, lo, hi)``: value ``Σ wA clamp(r)``, coefficient ``wA M r ok``."""
    wA = scaled(c.wA, request)
    log_ratio, ratio, capped = capped_ratio(x, c.old)
    clamped = torch.clamp(ratio, c.lo, c.hi)
    total = dot(wA, clamped)
    keep = indicator(torch.eq, clamped, ratio, out=clamped)
    clipped = _clipped_bool(keep) if request.metrics else None
    coef = None
    if request.grad:
        if capped:
            keep.mul_(below_cap(log_ratio, reuse=True))
        coef = keep.mul_(ratio).mul_(wA)
    return FusedTerms(total, coef, clipped, ratio)


def _clip_cov_constants(part, batch, weight_RC):
    scale = batch.token_extras.get(CLIP_COV_SCALE)
    if scale is None:  # not prepared: the autograd path raises its own error
        return None
    return _ppo_constants(part, batch, weight_RC, scale)


def _clip_cov(part, x, batch, c, request):
    """Clip-Cov: PPO with the step's scale ``s_t`` folded into ``wA``."""
    terms = _ppo(part, x, batch, c, request)
    if request.metrics:
        scale = batch.token_extras[CLIP_COV_SCALE]
        terms = terms._replace(clipped_RC=terms.clipped_RC | (scale < 1))
    return terms


register(PPOClip, _ppo_constants, _ppo)
register(ClipCov, _clip_cov_constants, _clip_cov)


# ---------------------------------------------------------------------- CISPO, MiniRL
class Masked(NamedTuple):
    """Step constants of CISPO and MiniRL: ``wA``, ``log π_old``, the mask's bounds (None
    without a mask)."""

    wA: torch.Tensor
    old: torch.Tensor
    lo: torch.Tensor | None
    hi: torch.Tensor | None


def _cispo_constants(part, batch, weight_RC):
    lo = hi = None
    if part.mask_eps_low is not None:
        lo, hi = ppo_bounds(batch.advantage, part.mask_eps_low, part.mask_eps_high)
    return Masked(weight_RC * batch.advantage, batch.old_logprob, lo, hi)


def _cispo(part, x, batch, c, request):
    """``sg(clip(r) [M]) Â x``: coefficient ``wA clip(r) [M]``, value ``Σ coefficient · x``."""
    wA = scaled(c.wA, request)
    ratio = ratio_only(x, c.old)
    weight = ratio.clamp(1 - part.eps_low, 1 + part.eps_high)
    clipped = (weight != ratio) if request.metrics else None
    if c.lo is not None:
        keep = _keep(ratio, c.lo, c.hi)
        if request.metrics:
            clipped |= _clipped_bool(keep)
        weight = weight.mul_(keep)
    coef = weight.mul_(wA)
    return FusedTerms(dot(coef, x), coef if request.grad else None, clipped, ratio)


def _minirl_constants(part, batch, weight_RC):
    lo, hi = ppo_bounds(batch.advantage, part.eps_low, part.eps_high)
    return Masked(weight_RC * batch.advantage, batch.old_logprob, lo, hi)


def _minirl(part, x, batch, c, request):
    """``M sg(r) Â x``: coefficient ``wA M r``, value ``Σ coefficient · x``."""
    wA = scaled(c.wA, request)
    ratio = ratio_only(x, c.old)
    keep = _keep(ratio, c.lo, c.hi)
    clipped = _clipped_bool(keep) if request.metrics else None
    coef = keep.mul_(ratio).mul_(wA)
    return FusedTerms(dot(coef, x), coef if request.grad else None, clipped, ratio)


register(CISPO, _cispo_constants, _cispo)
register(MiniRL, _minirl_constants, _minirl)


# ---------------------------------------------------------------------- SAPO
class Gated(NamedTuple):
    """SAPO's step constants: ``τ``, ``(4/τ) wA`` and ``4 wA``, ``log π_old``."""

    tau: torch.Tensor
    value_weight: torch.Tensor
    grad_weight: torch.Tensor
    old: torch.Tensor


def _sapo_constants(part, batch, weight_RC):
    A = batch.advantage
    tau = torch.where(A > 0, A.new_tensor(part.tau_pos), A.new_tensor(part.tau_neg))
    wA = weight_RC * A
    return Gated(tau, (4 / tau) * wA, 4 * wA, batch.old_logprob)


def _sapo(part, x, batch, c, request):
    """``(4/τ) σ(τ(r-1)) Â``: coefficient ``4 σ (1-σ) r Â ok`` times the weight."""
    log_ratio, ratio, capped = capped_ratio(x, c.old)
    gate = (ratio - 1).mul_(c.tau).sigmoid_()
    scale = request.scale_RC
    value_weight = c.value_weight if scale is None else c.value_weight * scale
    total = dot(value_weight, gate)
    coef = None
    if request.grad:
        grad_weight = c.grad_weight if scale is None else c.grad_weight * scale
        coef = torch.rsub(gate, 1).mul_(gate).mul_(ratio)
        if capped:
            coef.mul_(below_cap(log_ratio, reuse=True))
        coef = coef.mul_(grad_weight)
    return FusedTerms(total, coef, None, ratio)


register(SAPO, _sapo_constants, _sapo)


# ---------------------------------------------------------------------- DPPO
class Divergence(NamedTuple):
    """DPPO's step constants: ``wA``, ``log π_old``, ``p_old`` and the bounds of its mask
    (``tv``: the clamp bounds of ``p - p_old``; ``kl``: the threshold, the direction sign
    ``b = ±1``, ``q_old = 1 - p_old``, ``1{q_old = 0}`` and the binary KL's constant part minus
    the threshold)."""

    wA: torch.Tensor
    old: torch.Tensor
    p_old: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    q_old: torch.Tensor | None = None
    q_old_zero: torch.Tensor | None = None
    kl_constant: torch.Tensor | None = None


def _dppo_constants(part, batch, weight_RC):
    A, old = batch.advantage, batch.old_logprob
    scalar = A.new_tensor
    pos = A > 0
    p_old = old.exp()
    if part.divergence == "tv":   # keep iff p - p_old <= δ_high (Â > 0), >= -δ_low (Â <= 0)
        a = torch.where(pos, scalar(-INF), -scalar(part.delta_low))
        b = torch.where(pos, scalar(part.delta_high), scalar(INF))
        return Divergence(weight_RC * A, old, p_old, a, b)
    # drop iff D > δ and p moved the advantage's way: b (x - log π_old) > 0, b = ±1
    a = torch.where(pos, scalar(part.delta_high), scalar(part.delta_low))
    b = torch.where(pos, scalar(1.0), scalar(-1.0))
    q_old = -torch.expm1(old)
    constant = _binary_kl_constant(p_old, old, q_old)
    high = constant - scalar(part.delta_high)
    return Divergence(weight_RC * A, old, p_old, a, b, q_old, (q_old == 0).to(q_old.dtype),
                      torch.where(pos, high, constant - scalar(part.delta_low)))


def _dppo(part, x, batch, c, request):
    """``M sg(min(r, C)) Â x``, ``M`` the divergence mask of
    :func:`~tokenmdp.estimators.dppo_keep_mask`: coefficient ``wA M min(r, C)``."""
    wA = scaled(c.wA, request)
    if part.divergence == "tv":
        p = x.exp()
        diff = p.sub_(c.p_old)
        keep = indicator(torch.eq, torch.clamp(diff, c.a, c.b), diff)
        # the exact ratio whether or not metrics are asked for: metrics=False is the same loss
        # and gradient bit for bit
        ratio = ratio_only(x, c.old)
    else:
        # q = -expm1(x), + 1 where q_old = 0 (q_old log q is 0 there either way): off the loss
        # tokens x = 0 makes q = 0, and a log over a vector holding 0 is slow for all of it;
        # then no log is -inf where its product counts, and no clamp is needed
        e = torch.expm1(x)
        q_old_log_q = torch.sub(c.q_old_zero, e, out=e).log_().mul_(c.q_old)
        t = _binary_kl_sum(c.p_old, x, q_old_log_q)
        over = indicator(torch.lt, t, c.kl_constant, out=t)   # D > δ: t < constant - δ
        # keep = 1 - over · moved, moved = 1{b (x - log π_old) > 0}: over · b log r <= 0
        log_ratio = x - c.old
        keep = indicator(torch.le, over.mul_(log_ratio).mul_(c.b), 0.0, out=over)
        if capped_anywhere(log_ratio):
            log_ratio.clamp_(max=MAX_LOG_RATIO)
        ratio = log_ratio.exp_()
    weight = ratio if part.cap is None else ratio.clamp(max=part.cap)
    clipped = _clipped_bool(keep) if request.metrics else None
    coef = keep.mul_(weight).mul_(wA)
    return FusedTerms(dot(coef, x), coef if request.grad else None, clipped, ratio)


register(DPPO, _dppo_constants, _dppo)


# ---------------------------------------------------------------------- KL-Cov, entropy bonus
class Penalized(NamedTuple):
    """KL-Cov's step constants: ``wA``, ``log π_old`` and ``-weight β m_t``."""

    wA: torch.Tensor
    old: torch.Tensor
    penalty_weight: torch.Tensor


def _kl_cov_constants(part, batch, weight_RC):
    selected = batch.token_extras.get(KL_COV_SELECTED)
    if selected is None:
        return None
    return Penalized(weight_RC * batch.advantage, batch.old_logprob,
                     -(weight_RC * (part.coef * selected)))


def _kl_cov(part, x, batch, c, request):
    """``r Â - β m |log r|``: coefficient ``wA r ok - weight β m sign(log r)``."""
    wA = scaled(c.wA, request)
    penalty_weight = scaled(c.penalty_weight, request)
    log_ratio, ratio, capped = capped_ratio(x, c.old)
    total = dot(wA, ratio) + dot(penalty_weight, log_ratio.abs())
    coef = None
    if request.grad:
        coef = torch.sign(log_ratio).mul_(penalty_weight)
        if capped:
            coef += below_cap(log_ratio, reuse=True).mul_(ratio).mul_(wA)
        else:
            coef += ratio * wA
    clipped = batch.token_extras[KL_COV_SELECTED] > 0 if request.metrics else None
    return FusedTerms(total, coef, clipped, ratio)


register(KLCov, _kl_cov_constants, _kl_cov)


class WithBonus(NamedTuple):
    """The entropy bonus's step constants: the bound base part, ``c · weight``, ``log π_old``
    (None for an on-policy bonus)."""

    base: object
    bonus_weight: torch.Tensor
    old: torch.Tensor | None


def _entropy_constants(part, batch, weight_RC):
    base = bind(part.base, batch, weight_RC)
    if base is None:
        return None
    old = batch.old_logprob if "old_logprob" in part.base.requires else None
    return WithBonus(base, part.coef * weight_RC, old)


def _entropy(part, x, batch, c, request):
    """``base + c ĥ``, ``ĥ = -r x`` (``-x`` on-policy) with the coefficient ``ĥ ok``; the ratio
    is the base's when it computed one."""
    terms = c.base(x, batch, request)
    bonus_weight = scaled(c.bonus_weight, request)
    if c.old is None:
        value = torch.neg(x)
        total = terms.total + dot(bonus_weight, value)
        coef = (terms.coef_RC + value.mul_(bonus_weight)) if request.grad else None
        return terms._replace(total=total, coef_RC=coef)
    log_ratio = x - c.old
    ratio = terms.ratio_RC if terms.ratio_RC is not None else log_ratio.clamp(max=MAX_LOG_RATIO).exp()
    value = torch.mul(ratio, x).neg_()
    total = terms.total + dot(bonus_weight, value)
    coef = None
    if request.grad:
        if capped_anywhere(log_ratio):
            value.mul_(below_cap(log_ratio, reuse=True))
        coef = value.mul_(bonus_weight).add_(terms.coef_RC)
    return terms._replace(total=total, coef_RC=coef)


register(EntropyBonus, _entropy_constants, _entropy)
