"""Fused kernel of the KL-in-loss penalty (not public API).

``β Σ_t w_t k(x_t, log π_ref)`` for the five estimators of :mod:`~tokenmdp.estimators.kl`, each
as its value and its derivative ``∂k/∂x`` (the ones the estimators attach with
``with_derivative``, or k1's and k2's autograd derivatives ``1`` and ``x - log π_ref``), with the
same ``e^20`` cap; a custom estimator callable has no fused form (the autograd path runs).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tokenmdp.estimators._common import MAX_LOG_RATIO
from tokenmdp.estimators.fused.core import FusedTerms, below_cap, capped_anywhere, dot, register
from tokenmdp.estimators.kl import KLPenalty, kl_abs, kl_k1, kl_k2, kl_k3, kl_k3_plus


class Penalty(NamedTuple):
    """A KL-in-loss penalty's step constants: the weight ``w``, ``β w`` (None when
    importance-weighted: the weight then changes with ``x``), ``log π_ref``, ``log μ``."""

    weight: torch.Tensor
    coef_weight: torch.Tensor | None
    ref: torch.Tensor
    behavior: torch.Tensor | None


#: The estimators with a fused form: ``(value, derivative, sign) = form(x, ref, grad)``, the
#: derivative ``∂k/∂x`` being ``sign · derivative`` (None: 1).
def _k1(x, ref, grad):
    return x - ref, None, 1.0


def _k2(x, ref, grad):
    u = ref - x
    return u.square().mul_(0.5), (x - ref) if grad else None, 1.0


def _k3(x, ref, grad):
    log_r = ref - x
    if not capped_anywhere(log_r):   # no clamp; the value written over log r; ∂k/∂x = -(r - 1)
        r_minus_1 = torch.expm1(log_r)
        return torch.sub(r_minus_1, log_r, out=log_r), r_minus_1 if grad else None, -1.0
    r_minus_1 = log_r.clamp(max=MAX_LOG_RATIO).expm1_()
    return r_minus_1 - log_r, _k3_derivative(log_r, r_minus_1) if grad else None, 1.0


def _k3_derivative(log_r, r_minus_1):
    """``∂k3/∂x``: ``-(r - 1)`` below the cap, 1 above it (written over both arguments)."""
    ok = below_cap(log_r, reuse=True)
    r_minus_1.mul_(ok)
    return ok.sub_(1).neg_().sub_(r_minus_1)


def _k3_plus(x, ref, grad):
    log_r = ref - x
    value = log_r.clamp(max=MAX_LOG_RATIO).expm1_().sub_(log_r)
    return value, log_r if grad else None, -1.0


def _abs(x, ref, grad):
    minus_log_r = x - ref
    return minus_log_r.abs(), torch.sign(minus_log_r) if grad else None, 1.0


_KL_FORMS = {kl_k1: _k1, kl_k2: _k2, kl_k3: _k3, kl_k3_plus: _k3_plus, kl_abs: _abs}


def _kl_constants(part, batch, weight_RC):
    if part.estimator not in _KL_FORMS:
        return None
    behavior = batch.behavior_logprob if part.importance_weighted else None
    coef_weight = None if behavior is not None else part.coef * weight_RC
    return Penalty(weight_RC, coef_weight, batch.ref_logprob, behavior)


def _kl(part, x, batch, c, request):
    """``β Σ w k`` (``w`` times ``sg(π_θ/μ)`` when importance-weighted) and ``β w ∂k/∂x``."""
    value, derivative, sign = _KL_FORMS[part.estimator](x, c.ref, request.grad)
    weight, coef_weight = c.weight, c.coef_weight
    if c.behavior is not None:
        weight = weight * (x - c.behavior).clamp_(max=MAX_LOG_RATIO).exp_()
    total = part.coef * dot(weight, value)
    coef, owned = None, True
    if request.grad:
        if coef_weight is None:
            coef_weight = part.coef * weight
        into = request.accumulate
        if into is not None:       # one pass: into + sign · derivative · β w
            coef = into.add_(coef_weight) if derivative is None else \
                into.addcmul_(derivative, coef_weight, value=sign)
        elif derivative is None:   # k1: β w, a step constant unless importance-weighted
            coef, owned = coef_weight, c.coef_weight is None
        else:
            coef = derivative.mul_(coef_weight)
            if sign < 0:
                coef.neg_()
    return FusedTerms(total, coef, values_RC=value if request.metrics else None, owned=owned)


register(KLPenalty, _kl_constants, _kl)

