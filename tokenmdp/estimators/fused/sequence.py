"""Fused kernels of the sequence-coupled surrogates: sequence IS, GSPO, GMPO, OPSM, per-decision
IS, CTPO (not public API).

A token's gradient under these depends on the other tokens of its sequence (a geometric mean,
a sequence mask, a prefix product), so each kernel reduces over sequences. The reductions are
the autograd path's, computed faster from step constants of the layout (:class:`Segments`):

* a per-sequence sum adds each *run* (maximal stretch of one sequence's tokens, contiguous in
  memory; a packed row holds each sequence in one run) with ``segment_reduce``, then the runs
  of a sequence with one ``index_add`` over the runs: the same sequential sum in token order when
  a sequence is one run, several times faster than ``index_add`` over every token;
* a gather to the tokens is one ``index_select`` (the padding reads an appended 0);
* per-decision IS's prefix sums use the dense ``[S, max position + 1]`` view of
  :func:`~tokenmdp.estimators.cumulative_log_ratio` with the flat cell of each token computed
  once (``index_copy`` instead of an accumulating ``index_put``).

The gradients follow from the chain rule by hand (module docstrings of
:mod:`~tokenmdp.estimators.fused.core` and ``tests/estimators/fused/test_fused_loss.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators._common import MAX_LOG_RATIO, require
from tokenmdp.estimators.fused.core import (
    FusedTerms,
    below_cap,
    bind,
    capped_anywhere,
    dot,
    indicator,
    register,
    scaled,
)
from tokenmdp.estimators.fused.surrogates import ppo_bounds
from tokenmdp.estimators.surrogates.ctpo import CTPOClip, ctpo_bounds
from tokenmdp.estimators.surrogates.per_decision import PerDecisionRatio
from tokenmdp.estimators.surrogates.sequence import GSPO, GSPOToken, SequenceRatio
from tokenmdp.estimators.surrogates.soft import GMPO
from tokenmdp.estimators.surrogates.trust_region_masks import OffPolicySequenceMask

INF = float("inf")


class Segments(NamedTuple):
    """The layout's runs: ``slot`` ``[N]`` (each token's sequence, ``S`` for padding),
    ``run_slot`` and ``run_length`` (each run's sequence and length), ``S``, the 0/1 float loss
    mask ``[N]`` and each sequence's loss-token count (``>= 1``)."""

    slot: torch.Tensor
    run_slot: torch.Tensor
    run_length: torch.Tensor
    num_sequences: int
    mask_f: torch.Tensor
    count_S: torch.Tensor

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Float ``[S]``: the sum of ``values`` (flat ``[N]``) over each sequence's tokens."""
        runs = torch.segment_reduce(values, "sum", lengths=self.run_length)
        out = values.new_zeros(self.num_sequences + 1)
        return out.index_add_(0, self.run_slot, runs)[:self.num_sequences]

    def to_tokens(self, values_S: torch.Tensor) -> torch.Tensor:
        """Flat ``[N]``: each token's sequence value (0 on padding)."""
        return torch.cat([values_S, values_S.new_zeros(1)]).index_select(0, self.slot)


def segments(batch: TokenBatch) -> Segments:
    """The :class:`Segments` of ``batch``'s layout."""
    sid = batch.sequence_id.reshape(-1)
    S = batch.num_sequences
    slot = torch.where(sid >= 0, sid, S)
    start = torch.ones_like(slot, dtype=torch.bool)
    start[1:] = slot[1:] != slot[:-1]
    first = start.nonzero().squeeze(1)
    length = torch.diff(first, append=first.new_tensor([slot.numel()]))
    mask_f = batch.loss_mask.reshape(-1).to(batch.dtype)
    count = mask_f.new_zeros(S + 1).index_add_(0, slot, mask_f)[:S].clamp_(min=1)
    return Segments(slot, slot[first], length, S, mask_f, count)


# ---------------------------------------------------------------------- GMPO
class Geometric(NamedTuple):
    """GMPO's step constants: the segments, ``log π_old``, the clamp bounds of ``log r`` and
    ``WA_S = Σ_{t∈s} weight Â`` per sequence."""

    seg: Segments
    old: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    weight_A: torch.Tensor
    wA_S: torch.Tensor


def _gmpo_constants(part, batch, weight_RC):
    if batch.loss_mask.numel() == 0:  # an empty layout: the autograd path
        return None
    seg = segments(batch)
    A = batch.advantage.reshape(-1)
    on = batch.loss_mask.reshape(-1)
    scalar = A.new_tensor
    lo = torch.where(on & (A < 0), scalar(-part.eps_low), scalar(-INF))
    hi = torch.where(on & (A > 0), scalar(part.eps_high), scalar(INF))
    weight_A = weight_RC.reshape(-1) * A
    return Geometric(seg, batch.old_logprob.reshape(-1), lo, hi, weight_A, seg.sum(weight_A))


def _gmpo(part, x, batch, c, request):
    """``g_s Â``, ``log g_s = mean_{t∈s} clamp(log r_t, lo, hi)``: value ``Σ_s g_s WA_s``,
    coefficient ``1{unclipped} g_s WA_s / |y_s|`` (0 where ``log g_s`` is above the cap)."""
    seg = c.seg
    log_ratio = torch.sub(x.reshape(-1), c.old).mul_(seg.mask_f)
    clamped = torch.clamp(log_ratio, c.lo, c.hi)
    log_g = seg.sum(clamped).div_(seg.count_S)
    g = log_g.clamp(max=MAX_LOG_RATIO).exp_()
    wA_S = c.wA_S if request.scale_RC is None else \
        seg.sum(c.weight_A * request.scale_RC.reshape(-1))
    total = torch.dot(g, wA_S)
    clipped = None
    if request.metrics:
        clipped = ((clamped != log_ratio) & (seg.mask_f > 0)).view_as(x)
    coef = None
    if request.grad:
        coef_S = g.mul_(wA_S).div_(seg.count_S).mul_(below_cap(log_g, reuse=True))
        coef = indicator(torch.eq, clamped, log_ratio, out=clamped).mul_(seg.mask_f)
        coef = coef.mul_(seg.to_tokens(coef_S)).view_as(x)
    return FusedTerms(total, coef, clipped)


register(GMPO, _gmpo_constants, _gmpo)


# ---------------------------------------------------------------------- OPSM
class SequenceMasked(NamedTuple):
    """OPSM's step constants: the bound base part, the segments, the sampling log-probs and
    ``1{Â < 0}`` as 0/1 floats."""

    base: object
    seg: Segments
    sampling: torch.Tensor
    negative: torch.Tensor


def _opsm_constants(part, batch, weight_RC):
    base = bind(part.base, batch, weight_RC)
    if base is None or batch.loss_mask.numel() == 0:
        return None
    field = "behavior_logprob" if part.against == "behavior" else "old_logprob"
    sampling = require(batch, field, f"surrogate {part.describe()}")
    negative = (batch.advantage < 0).to(batch.dtype).reshape(-1)
    return SequenceMasked(base, segments(batch), sampling.reshape(-1), negative)


def _opsm(part, x, batch, c, request):
    """The base kernel with its weight times the sequence mask ``1 - far_s 1{Â < 0}``,
    ``far_s = 1{mean_{t∈s} log(μ/π_θ) > δ}``."""
    seg = c.seg
    log_q = torch.rsub(x.reshape(-1), c.sampling).mul_(seg.mask_f)
    far_S = indicator(torch.gt, seg.sum(log_q).div_(seg.count_S), part.delta)
    keep = seg.to_tokens(far_S).mul_(c.negative).neg_().add_(1).view_as(x)
    scale = keep if request.scale_RC is None else keep * request.scale_RC
    terms = c.base(x, batch, request._replace(scale_RC=scale))
    if request.metrics:
        dropped = keep == 0
        clipped = dropped if terms.clipped_RC is None else terms.clipped_RC | dropped
        terms = terms._replace(clipped_RC=clipped)
    return terms


register(OffPolicySequenceMask, _opsm_constants, _opsm)


# ---------------------------------------------------------------------- per-decision IS
class Prefix(NamedTuple):
    """Per-decision IS's step constants: each token's flat cell of the dense
    ``[S + 1, max position + 1]`` view (padding: the extra row's first cell), its shape,
    ``wA``, the sampling log-probs and the 0/1 float loss mask."""

    cell: torch.Tensor
    shape: tuple[int, int]
    wA: torch.Tensor
    sampling: torch.Tensor
    mask_f: torch.Tensor


def _prefix_constants(part, batch, weight_RC):
    if batch.loss_mask.numel() == 0:
        return None
    sampling = require(batch, part.requires[0], f"surrogate {part.describe()}")
    S = batch.num_sequences
    width = int(batch.position.max()) + 1
    sid = batch.sequence_id
    cell = torch.where(sid >= 0, sid * width + batch.position, S * width).reshape(-1)
    return Prefix(cell, (S + 1, width), weight_RC * batch.advantage, sampling,
                  batch.loss_mask.to(batch.dtype))


def _prefix_sum(values_RC, c):
    """Each loss token's sum of ``values_RC`` over its sequence's loss tokens up to it (the
    values must be 0 off the loss tokens), 0 elsewhere: the dense ``[S + 1, width]`` view."""
    values = values_RC.reshape(-1)
    dense = values.new_zeros(c.shape[0] * c.shape[1])
    dense.index_copy_(0, c.cell, values)
    cum = dense.view(c.shape).cumsum(1).view(-1).index_select(0, c.cell)
    return cum.mul_(c.mask_f.reshape(-1)).view_as(values_RC)


def _per_decision(part, x, batch, c, request):
    """``ρ_{1:t} Â``: value ``Σ wA exp(min(cum, 20))``, coefficient ``wA ρ_{1:t} 1{cum <= 20}``
    with ``cum`` the prefix sum of ``log ρ`` over the sequence's loss tokens."""
    wA = scaled(c.wA, request)
    cum = _prefix_sum(torch.sub(x, c.sampling).mul_(c.mask_f), c)
    capped = capped_anywhere(cum)
    ratio = cum.clamp(max=MAX_LOG_RATIO).exp_() if capped else torch.exp(cum)
    total = dot(wA, ratio)
    clipped = ((cum > MAX_LOG_RATIO) & batch.loss_mask) if request.metrics else None
    coef = None
    if request.grad:
        coef = (below_cap(cum, reuse=True).mul_(ratio) if capped else ratio).mul_(wA)
    return FusedTerms(total, coef, clipped)


register(PerDecisionRatio, _prefix_constants, _per_decision)


# ---------------------------------------------------------------------- GSPO, GSPO-token
class SequenceClipped(NamedTuple):
    """GSPO's step constants: the segments, ``log π_old``, ``wA`` and the PPO clamp bounds of
    the sequence ratio at each token (flat ``[N]``)."""

    seg: Segments
    old: torch.Tensor
    wA: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor


def _gspo_constants(part, batch, weight_RC):
    if batch.loss_mask.numel() == 0:
        return None
    lo, hi = ppo_bounds(batch.advantage, part.eps_low, part.eps_high)
    return SequenceClipped(segments(batch), batch.old_logprob.reshape(-1),
                           (weight_RC * batch.advantage).reshape(-1), lo.reshape(-1),
                           hi.reshape(-1))


def _gspo(part, x, batch, c, request):
    """``Â clamp(s_i, lo, hi)`` with ``s_i = exp(min(mean_t log r_t, 20))``: value
    ``Σ wA clamp(s_i)``; GSPO's coefficient ``(s_i / |y_i|) 1{log s_i <= 20} Σ_{t'∈i} wA M``
    on each loss token (``M = 1{clamp(s_i) = s_i}``), GSPO-token's ``wA M s_i`` (its ``s_i``
    detached)."""
    seg = c.seg
    wA = c.wA if request.scale_RC is None else c.wA * request.scale_RC.reshape(-1)
    log_ratio = torch.sub(x.reshape(-1), c.old).mul_(seg.mask_f)
    log_s = seg.sum(log_ratio).div_(seg.count_S)
    s = log_s.clamp(max=MAX_LOG_RATIO).exp_()
    s_t = seg.to_tokens(s)
    clamped = torch.clamp(s_t, c.lo, c.hi)
    total = torch.dot(wA, clamped)
    keep = indicator(torch.eq, clamped, s_t, out=clamped)
    clipped = (keep == 0).view_as(x) if request.metrics else None
    coef = None
    if request.grad:
        if isinstance(part, GSPOToken):
            coef = keep.mul_(s_t).mul_(wA)
        else:
            coef_S = seg.sum(keep.mul_(wA)).mul_(s).div_(seg.count_S)
            coef = seg.to_tokens(coef_S.mul_(below_cap(log_s, reuse=True))).mul_(seg.mask_f)
        coef = coef.view_as(x)
    return FusedTerms(total, coef, clipped)


register(GSPO, _gspo_constants, _gspo)
register(GSPOToken, _gspo_constants, _gspo)


# ---------------------------------------------------------------------- sequence IS
class Summed(NamedTuple):
    """Sequence IS's step constants: the segments, ``log π_old`` and ``WA_s / |y_s|`` with
    ``WA_s = Σ_{t∈s} weight Â``."""

    seg: Segments
    old: torch.Tensor
    weight_A: torch.Tensor
    wA_per_token_S: torch.Tensor


def _sequence_ratio_constants(part, batch, weight_RC):
    if batch.loss_mask.numel() == 0:
        return None
    seg = segments(batch)
    weight_A = (weight_RC * batch.advantage).reshape(-1)
    return Summed(seg, batch.old_logprob.reshape(-1), weight_A,
                  seg.sum(weight_A).div_(seg.count_S))


def _sequence_ratio(part, x, batch, c, request):
    """``ρ(y) Â / |y|``, ``ρ = exp(min(Σ_t log r_t, 20))``: value ``Σ_s ρ_s WA_s / |y_s|``,
    coefficient ``ρ_s 1{log ρ_s <= 20} WA_s / |y_s|`` on each loss token."""
    seg = c.seg
    per_token_S = c.wA_per_token_S if request.scale_RC is None else \
        seg.sum(c.weight_A * request.scale_RC.reshape(-1)).div_(seg.count_S)
    log_rho = seg.sum(torch.sub(x.reshape(-1), c.old).mul_(seg.mask_f))
    rho = log_rho.clamp(max=MAX_LOG_RATIO).exp_()
    total = torch.dot(rho, per_token_S)
    clipped = None
    if request.metrics:
        clipped = (seg.to_tokens((log_rho > MAX_LOG_RATIO).to(x.dtype)).view_as(x) > 0) \
            & batch.loss_mask
    coef = None
    if request.grad:
        coef_S = rho.mul_(per_token_S).mul_(below_cap(log_rho, reuse=True))
        coef = seg.to_tokens(coef_S).mul_(seg.mask_f).view_as(x)
    return FusedTerms(total, coef, clipped)


register(SequenceRatio, _sequence_ratio_constants, _sequence_ratio)


# ---------------------------------------------------------------------- CTPO
class Windowed(NamedTuple):
    """CTPO's step constants: the prefix layout (:class:`Prefix`) and the log-space clamp
    bounds of the held cumulative log-ratio: ``(-∞, hi_t)`` where ``Â > 0``, ``(lo_t, c_t)``
    elsewhere (:func:`~tokenmdp.estimators.ctpo_bounds`)."""

    prefix: Prefix
    lo: torch.Tensor
    hi: torch.Tensor


def _ctpo_constants(part, batch, weight_RC):
    prefix = _prefix_constants(part, batch, weight_RC)
    if prefix is None:
        return None
    lo, hi, c = ctpo_bounds(batch, clip_low=part.clip_low, clip_high=part.clip_high,
                            dual_clip=part.dual_clip, power=part.power)
    positive = batch.advantage > 0
    return Windowed(prefix, torch.where(positive, lo.new_tensor(-INF), lo),
                    torch.where(positive, hi, c))


def _ctpo(part, x, batch, c, request):
    """CTPO's ``exp(clamp(min(L_t, m), lo, hi)) Â``, ``L_t`` the prefix sum of the log-ratios
    held to ``[-20, 20]``: coefficient ``wA exp(min(L_t, m)) 1{unclipped} 1{L_t <= m}``."""
    p = c.prefix
    wA = scaled(p.wA, request)
    log_r = torch.sub(x, p.sampling).clamp_(-MAX_LOG_RATIO, MAX_LOG_RATIO).mul_(p.mask_f)
    cum = _prefix_sum(log_r, p)
    held = cum.clamp(max=part.max_log_ratio)
    window = torch.clamp(held, c.lo, c.hi)
    free = indicator(torch.eq, window, held, out=held)
    free.mul_(indicator(torch.le, cum, part.max_log_ratio, out=cum))
    value = window.exp_()
    total = dot(wA, value)
    clipped = None
    if request.metrics:
        clipped = (free == 0) & batch.loss_mask & (batch.advantage != 0)
    coef = free.mul_(value).mul_(wA) if request.grad else None
    return FusedTerms(total, coef, clipped)


register(CTPOClip, _ctpo_constants, _ctpo)
