"""``loss`` per micro-batch: the weighted per-token loss of a prepared batch, and its metrics.

:func:`loss` runs on any micro-batch, on any rank: it reads ``advantage`` and ``loss_weight``
(filled once per step by :func:`~tokenmdp.estimators.prepare`) and never recomputes
them, so the micro-batch losses sum to the full-step loss::

    loss = -Σ_{loss tokens} loss_weight · (c · surrogate - β k)

(``c`` the detached correction factor ``π_old/μ``, ``β k`` a KL-in-loss penalty).
:func:`per_micro_batch_token_mean_loss` is the counter-example that renormalizes per micro-batch.

When every part of the estimator has a fused kernel (every registry estimator's parts have
one), the loss and its gradient are computed in one pass without autograd
(``tokenmdp/estimators/fused/core.py``): the same numbers as the parts' autograd terms up to the
order of floating-point products, at a fraction of the memory traffic.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

import tokenmdp.estimators.fused.kl  # noqa: F401  (the kernels register on import)
import tokenmdp.estimators.fused.sequence  # noqa: F401
import tokenmdp.estimators.fused.surrogates  # noqa: F401
from tokenmdp.batch import TokenBatch
from tokenmdp.estimators._common import MAX_LOG_RATIO, check_like_tokens
from tokenmdp.estimators.aggregation import Aggregation, loss_weights
from tokenmdp.estimators.corrections.diagnostics import correction_diagnostics
from tokenmdp.estimators.corrections.factor import CorrectionFactor, Level
from tokenmdp.estimators.estimator import Estimator
from tokenmdp.estimators.fused.core import Bound, FusedLoss, Request, bind, sanitized
from tokenmdp.estimators.registry.lookup import resolve
from tokenmdp.estimators.surrogates.token import SurrogateTerms

__all__ = ["loss", "per_micro_batch_token_mean_loss"]


def loss(logprobs_RC: torch.Tensor, batch: TokenBatch, estimator: Estimator, *,
         metrics: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``loss = -Σ_{loss tokens} loss_weight · (c · surrogate - β k)`` and metrics.

    Parameters
    ----------
    logprobs_RC : Tensor ``[R, C]``
        ``log π_θ`` of each token given its prefix (differentiable), aligned with
        ``batch.tokens``; values off ``loss_mask`` are ignored (replaced by 0 before use).
    batch : TokenBatch
        A prepared batch (:func:`prepare`) or a part of one; ``advantage`` and ``loss_weight``
        are read as they are.
    estimator : Estimator
    metrics : bool, default True
        Compute the metrics below. ``False`` returns an empty dict and skips them: for inner
        loops (the exact lab's thousands of stacked steps, a micro-batch whose metrics are not
        logged), where they cost more than the loss itself.

    Returns
    -------
    loss : scalar tensor
    metrics : dict of detached scalar tensors, computed under ``no_grad`` (empty with
        ``metrics=False``)
        ``tokens`` (loss tokens of this batch); ``clip_fraction`` (where the surrogate's clip or
        mask was active) and ``masked_fraction`` (rejected by masked IS); when ``old_logprob`` is
        present ``r_min/r_mean/r_max`` (``r = π_θ/π_old``), when ``behavior_logprob`` is present
        ``rho_min/rho_mean/rho_max`` (``ρ = π_θ/μ``), with both ``train_infer_kl_k1/k3``
        (``KL(μ ‖ π_old)`` per token, k1 and k3 forms) and ``is_ess``/``is_chi2`` (the
        normalized effective sample size and χ² estimate of the token weights ``π_old/μ``;
        ``is_seq_ess``/``is_seq_chi2`` of the sequence weights too when the correction acts per
        sequence or geometric mean; :mod:`~tokenmdp.estimators.corrections.diagnostics`), and with
        a KL-in-loss penalty ``kl_ref`` (mean of its estimator ``k(π_θ, π_ref)``). Over zero
        loss tokens fractions, KLs and χ² are 0 and ratio statistics and ESS 1 (neutral
        values, no NaN); an empty batch (no sequences) gives loss 0, these neutral metrics and
        a zero gradient.

    ``estimator`` may also be a registry name (``"grpo"``). Half-precision batches are refused
    (``TypeError``): the ratio cap ``e^20`` and the metrics overflow in float16.
    """
    return _loss(logprobs_RC, batch, estimator, metrics=metrics, fused=True)


def _loss(logprobs_RC, batch, estimator, *, metrics: bool, fused: bool):
    """:func:`loss`; ``fused=False`` forces the autograd path (the parts' ``__call__``), which
    the fused one replaces whenever every part has a fused kernel (:mod:`._fused`): the same
    value and gradient, up to the order of floating-point products."""
    estimator = resolve(estimator)
    estimator._check(batch, "loss")
    check_like_tokens("logprobs_RC", logprobs_RC, batch.advantage)
    constants = _step_constants(batch, estimator)
    if fused and constants.plan is not None:
        return _fused_loss(logprobs_RC, batch, estimator, constants, metrics)
    mask = batch.loss_mask
    logprobs_RC = torch.where(mask, logprobs_RC, 0.0)
    terms = estimator.surrogate(logprobs_RC, batch)
    # Detached per-token weights, 0 off the loss tokens: loss_weight, times the correction factor
    # for the surrogate. Folding the constant factor into the weight keeps it off the autograd
    # graph; the terms are finite off the loss tokens (log-probs 0 there, ratios capped), so
    # their zero weight removes them. They are constants of the step: computed once per
    # (batch, estimator) and reused by later calls (_step_constants).
    weight_RC, surrogate_weight_RC = constants.weight_RC, constants.surrogate_weight_RC
    total = -_weighted_sum(surrogate_weight_RC, terms.term_RC)
    k_RC = None
    if estimator.kl is not None and not estimator.kl.in_reward:
        k_RC, is_weight_RC = estimator.kl.loss_penalty(logprobs_RC, batch)
        kl_weight_RC = weight_RC if is_weight_RC is None else weight_RC * is_weight_RC
        total = total + estimator.kl.coef * _weighted_sum(kl_weight_RC, k_RC)
    if logprobs_RC.requires_grad and not total.requires_grad:  # an empty batch: a zero
        total = total + logprobs_RC.sum()                      # gradient, not a graph error
    if not metrics:
        return total, {}
    return total, _all_metrics(logprobs_RC, batch, estimator, terms, constants, k_RC)


def _fused_loss(logprobs_RC, batch, estimator, constants, metrics):
    """The fused path: the kernels' loss value and gradient coefficient, joined to
    ``logprobs_RC`` by :class:`~tokenmdp.estimators.fused.core.FusedLoss` (a one-product backward
    pass)."""
    plan = constants.plan
    grad = logprobs_RC.requires_grad and torch.is_grad_enabled()
    with torch.no_grad():
        # the metrics read x everywhere: they need the zeros off the loss tokens
        x = sanitized(logprobs_RC, batch.loss_mask, plan.mask_f_RC, raw_ok=not metrics)
        request = Request(grad, metrics)
        terms = plan.surrogate(x, batch, request)
        total, coef = terms.total, terms.coef_RC
        k_RC = None
        if plan.kl is not None:
            into = coef if grad and terms.owned else None   # the penalty adds itself in
            penalty = plan.kl(x, batch, request._replace(accumulate=into))
            total = total + penalty.total
            if grad and into is None:
                coef = penalty.coef_RC.add_(coef) if penalty.owned else coef + penalty.coef_RC
            k_RC = penalty.values_RC
    if grad:
        total = FusedLoss.apply(logprobs_RC, total, coef)
    if not metrics:
        return total, {}
    surrogate_terms = SurrogateTerms(None, terms.clipped_RC, terms.ratio_RC)
    return total, _all_metrics(x, batch, estimator, surrogate_terms, constants, k_RC)


def _all_metrics(logprobs_RC, batch, estimator, terms, constants, k_RC):
    """:func:`_metrics` and, with both old and behavior log-probs, the correction's
    diagnostics; the metrics of the step's data alone (the training–inference KL, the
    correction's diagnostics) are computed once per step and cached with its constants."""
    cache = constants.step_metrics
    with torch.no_grad():
        out = _metrics(logprobs_RC, batch, terms, constants.factor.keep_RC, k_RC, cache)
        if batch.old_logprob is not None and batch.behavior_logprob is not None:
            level = getattr(estimator.correction, "level", Level.TOKEN)
            out.update(_cached(cache, "correction", lambda: correction_diagnostics(
                batch, sequence=level is not Level.TOKEN)))
    return out


def _cached(cache: dict | None, key: str, compute) -> dict[str, torch.Tensor]:
    """``compute()`` (a dict of 0-dim tensors), kept in ``cache`` under ``key`` after its first
    call; copies are returned (a caller may change its metrics in place)."""
    if cache is None:
        return compute()
    if key not in cache:
        cache[key] = compute()
    return {name: value.clone() for name, value in cache[key].items()}


class _Plan(NamedTuple):
    """The fused path of one (batch, estimator): the bound surrogate and KL penalty, the 0/1
    float loss mask."""

    surrogate: Bound
    kl: Bound | None
    mask_f_RC: torch.Tensor


class _Constants(NamedTuple):
    """A step's constants under one estimator (:func:`_step_constants`)."""

    factor: CorrectionFactor
    weight_RC: torch.Tensor
    surrogate_weight_RC: torch.Tensor
    plan: _Plan | None
    step_metrics: dict


#: The fields a step constant is computed from (their in-place changes invalidate it).
_CONSTANT_INPUTS = ("loss_mask", "loss_weight", "old_logprob", "behavior_logprob", "advantage",
                    "ref_logprob")
_constants: dict[int, tuple] = {}


def _step_constants(batch: TokenBatch, estimator: Estimator):
    """:class:`_Constants` of ``batch`` under ``estimator`` (the correction factor, the masked
    loss weight, the surrogate's weight and the fused plan, None when a part has no fused
    kernel), cached while ``batch`` lives and its inputs keep their tensor versions (an in-place
    change recomputes them), for the last estimator used on it; gradient mode is irrelevant
    (they carry no graph)."""
    versions = tuple(None if getattr(batch, f) is None else
                     (id(getattr(batch, f)), getattr(batch, f)._version) for f in _CONSTANT_INPUTS)
    hit = _constants.get(id(batch))
    if hit is not None and hit[0]() is batch and hit[1] is estimator and hit[2] == versions:
        return hit[3]
    with torch.no_grad():
        factor = estimator.correction(batch)
        weight_RC = torch.where(batch.loss_mask, batch.loss_weight, 0.0)
        surrogate_weight_RC = (weight_RC if factor.factor_RC is None
                               else weight_RC * factor.factor_RC)
        value = _Constants(factor, weight_RC, surrogate_weight_RC,
                           _plan(batch, estimator, weight_RC, surrogate_weight_RC), {})
    key = id(batch)
    _constants[key] = (weakref.ref(batch, lambda _, key=key: _constants.pop(key, None)),
                       estimator, versions, value)
    return value


def _plan(batch, estimator, weight_RC, surrogate_weight_RC) -> _Plan | None:
    """The fused path's parts bound to their step constants (the surrogate's signed weight is
    ``-surrogate_weight``: the loss is ``Σ weight · term``), or None."""
    surrogate = bind(estimator.surrogate, batch, -surrogate_weight_RC)
    if surrogate is None:
        return None
    kl = None
    if estimator.kl is not None and not estimator.kl.in_reward:
        kl = bind(estimator.kl, batch, weight_RC)
        if kl is None:
            return None
    return _Plan(surrogate, kl, batch.loss_mask.to(batch.dtype))


def _weighted_sum(weight_RC: torch.Tensor, values_RC: torch.Tensor) -> torch.Tensor:
    """``Σ weight · values`` as one dot product: no ``[R, C]`` temporary, and a backward pass of
    one product (``weight`` is detached)."""
    return torch.dot(weight_RC.reshape(-1), values_RC.reshape(-1))


def _metrics(logprobs_RC, batch, terms, keep_RC, k_RC, cache=None) -> dict[str, torch.Tensor]:
    """The diagnostics of :func:`loss` (under ``no_grad``). Sums over the loss tokens are dot
    products with the 0/1 mask (every tensor summed is finite off the loss tokens) and
    temporaries are updated in place: on a large step these passes are bound by memory."""
    mask = batch.loss_mask
    mask_f = mask.to(batch.dtype)
    count = mask_f.sum()
    has = count > 0
    denominator = count.clamp(min=1)

    def mean(values_RC, empty: float):
        return torch.where(has, _weighted_sum(mask_f, values_RC) / denominator, empty)

    out = {"tokens": count}
    zero = count.new_zeros(())
    clipped_RC = terms.clipped_RC
    out["clip_fraction"] = zero if clipped_RC is None else (clipped_RC & mask).sum() / denominator
    out["masked_fraction"] = zero if keep_RC is None else (mask & ~keep_RC).sum() / denominator
    # Off the loss tokens, ratios are filled with the value at the first loss token (one of the
    # values over the loss tokens), so one aminmax gives their min and max.
    ratios = [(key, ref) for key, ref in (("r", batch.old_logprob), ("rho", batch.behavior_logprob))
              if ref is not None]
    if ratios and mask.numel() == 0:  # an empty batch: neutral ratio statistics
        one = count.new_ones(())
        for key, _ in ratios:
            out.update({f"{key}_min": one, f"{key}_mean": one, f"{key}_max": one})
        ratios = []
    if ratios:
        off = ~mask
        first = mask.reshape(-1).to(torch.uint8).argmax()
    for key, ref in ratios:
        if key == "r" and terms.ratio_RC is not None:
            ratio = terms.ratio_RC.clone()  # the surrogate's capped r
        else:
            ratio = (logprobs_RC - ref).clamp_(max=MAX_LOG_RATIO).exp_()
        ratio.masked_fill_(off, ratio.reshape(-1)[first])
        lo, hi = torch.aminmax(ratio)
        out[f"{key}_min"] = torch.where(has, lo, 1.0)
        out[f"{key}_mean"] = mean(ratio, 1.0)
        out[f"{key}_max"] = torch.where(has, hi, 1.0)
    if batch.old_logprob is not None and batch.behavior_logprob is not None:
        def train_infer_kl():
            log_q = batch.old_logprob - batch.behavior_logprob  # log(π_old/μ), drawn from μ
            k3 = log_q.clamp(max=MAX_LOG_RATIO).expm1_().sub_(log_q)  # expm1: k3 >= 0 near 1
            return {"train_infer_kl_k1": 0.0 - mean(log_q, 0.0),
                    "train_infer_kl_k3": mean(k3, 0.0)}
        out.update(_cached(cache, "train_infer_kl", train_infer_kl))
    if k_RC is not None:  # the estimate k of KL(π_θ ‖ π_ref) of a KL-in-loss penalty
        out["kl_ref"] = mean(k_RC, 0.0)
    return out


def per_micro_batch_token_mean_loss(logprobs_RC: torch.Tensor, batch: TokenBatch,
                                    estimator: Estimator
                                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """COUNTER-EXAMPLE, do not train with it: :func:`loss` with token-mean weights recomputed from
    this micro-batch's own token count, ignoring ``batch.loss_weight``.

    This is the per-micro-batch normalization many frameworks shipped (TRL's ``bnpo``; gradient
    accumulation over micro-batch means): the estimator then depends on how the step is split, so
    it fails the layout and micro-batch invariance checks that :func:`loss` passes.

    Parameters
    ----------
    logprobs_RC : Tensor ``[R, C]``
        ``log π_θ`` of each token (differentiable), as for :func:`loss`.
    batch : TokenBatch
        A prepared micro-batch; its ``loss_weight`` is replaced.
    estimator : Estimator or str
        The estimator, or a registry name; its aggregation is ignored.

    Returns
    -------
    loss : scalar tensor
        The micro-batch token-mean loss.
    metrics : dict of detached scalar tensors
        As :func:`loss` returns them.
    """
    own = loss_weights(batch, Aggregation.TOKEN_MEAN)
    return loss(logprobs_RC, batch.replace(loss_weight=own), estimator)
