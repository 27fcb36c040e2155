"""The fused loss path of :func:`~tokenmdp.estimators.loss` (not part of the public API).

Every part of an estimator is an elementwise (or per-sequence) function of ``x = log π_θ`` and
of the step's detached data, so the loss ``Σ_t w_t term_t(x_t)`` and its gradient
``∂loss/∂x_t = w_t term_t'(x_t)`` can be computed together in one pass without autograd: a
*kernel* returns the loss's value and the per-token gradient coefficient, and
:class:`FusedLoss` attaches that coefficient to ``x`` (the backward pass is one product). The
autograd path (the parts' ``__call__``) keeps each intermediate of its chains (sub, clamp, exp,
where, ...) for the backward pass; on a large step both paths are bound by memory traffic, so
the fused one does less: it reads each input once or twice, computes masks as 0/1 floats (a
comparison into a float tensor costs what a product costs, a boolean mask several times more on
CPU) and folds every product of step constants (loss weight, correction factor, advantage, the
clip bounds) into tensors computed once per step.

A kernel is registered for a part's exact type (:func:`register`): ``constants(part, batch,
weight_RC)`` builds the part's step constants from its signed loss weight (the loss is
``Σ weight · term``), once per (batch, estimator); ``kernel(part, x_RC, batch, constants,
request)`` returns :class:`FusedTerms`. A part without a kernel (a subclass, a user's part, a
custom KL estimator) makes the whole estimator take the autograd path. The kernels live in
:mod:`~tokenmdp.estimators.fused.surrogates`, :mod:`~tokenmdp.estimators.fused.kl` and
:mod:`~tokenmdp.estimators.fused.sequence`;
``tests/estimators/fused/test_fused_loss.py`` compares each with the autograd path and with an
independent formula.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.autograd.function import once_differentiable

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators._common import MAX_LOG_RATIO


class Request(NamedTuple):
    """What a kernel call must return besides the loss value: the gradient coefficient
    (``grad``), the metrics' per-token tensors (``metrics``), and an optional per-call factor
    ``scale_RC`` (0/1 float) multiplying the part's weight (a mask computed from ``x``);
    ``accumulate``: a fresh coefficient tensor the kernel may add its own into (and return)."""

    grad: bool
    metrics: bool
    scale_RC: torch.Tensor | None = None
    accumulate: torch.Tensor | None = None


class FusedTerms(NamedTuple):
    """A kernel's output (all detached).

    ``total``: ``Σ weight · term`` (0-dim); ``coef_RC``: ``weight · ∂term/∂x`` (None unless
    ``request.grad``; it may be a step constant itself, so never modify it in place);
    ``clipped_RC``, ``ratio_RC``, ``values_RC``: the metrics' clipped tokens, the capped ratio
    ``π_θ/π_old`` and the per-token term (None when not computed; ``ratio_RC`` is returned
    whenever the kernel computed it, so a wrapping kernel can reuse it); ``owned``: whether
    ``coef_RC`` is a fresh tensor the caller may overwrite (False when it is a step constant).
    Kernels write their temporaries in place where they can: on a large step a fresh
    ``[R, C]`` tensor costs several times an in-place pass (it leaves the cache).
    """

    total: torch.Tensor
    coef_RC: torch.Tensor | None
    clipped_RC: torch.Tensor | None = None
    ratio_RC: torch.Tensor | None = None
    values_RC: torch.Tensor | None = None
    owned: bool = True


class FusedLoss(torch.autograd.Function):
    """``total`` (computed without autograd) as a function of ``x`` whose gradient is
    ``coef_RC``: the backward pass is one product. First-order only (nothing in tokenmdp takes
    a second derivative of a loss; a double backward raises). The value is returned as a new
    tensor, not ``total`` itself, so a caller may add to it in place (verl's actor loss adds its
    KL and entropy terms with ``+=``)."""

    @staticmethod
    def forward(ctx, x, total, coef_RC):  # numpydoc ignore=GL08
        ctx.save_for_backward(coef_RC)
        return total.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # numpydoc ignore=GL08
        (coef_RC,) = ctx.saved_tensors
        return grad * coef_RC, None, None


class Kernel(NamedTuple):
    """A registered pair: ``constants(part, batch, weight_RC)`` and ``kernel(part, x_RC, batch,
    constants, request) -> FusedTerms``."""

    constants: Callable[..., Any]
    kernel: Callable[..., FusedTerms]


_KERNELS: dict[type, Kernel] = {}


def register(part_type: type, constants: Callable[..., Any],
             kernel: Callable[..., FusedTerms]) -> None:
    """Register the fused kernel of ``part_type`` (exact type; subclasses are not matched)."""
    _KERNELS[part_type] = Kernel(constants, kernel)


def lookup(part) -> Kernel | None:
    """The kernel of ``part``'s exact type, or None."""
    return _KERNELS.get(type(part))


class Bound(NamedTuple):
    """A part, its kernel and its step constants: ``bound(x_RC, batch, request)`` runs it."""

    part: Any
    kernel: Kernel
    constants: Any

    def __call__(self, x_RC: torch.Tensor, batch: TokenBatch, request: Request) -> FusedTerms:
        return self.kernel.kernel(self.part, x_RC, batch, self.constants, request)


def bind(part, batch: TokenBatch, weight_RC: torch.Tensor) -> Bound | None:
    """``part`` with its step constants for the signed weight ``weight_RC``, or None when the
    part has no kernel (or declines one for this configuration: its ``constants`` returns
    None)."""
    kernel = lookup(part)
    if kernel is None:
        return None
    constants = kernel.constants(part, batch, weight_RC)
    return None if constants is None else Bound(part, kernel, constants)


# ---------------------------------------------------------------------- elementwise helpers
#: Bound on ``|log π|`` under which the per-token kernels may read the raw log-probs: every
#: kernel's arithmetic stays finite (``r |x| <= e^20 · 1e15``, ``(x - log π_ref)² <= 1e31``), so
#: the zero weight off the loss tokens removes them exactly, as it removes ``where``'s zeros.
TAME = 1e15


def sanitized(logprobs_RC: torch.Tensor, mask_RC: torch.Tensor, mask_f_RC: torch.Tensor, *,
              raw_ok: bool = False) -> torch.Tensor:
    """``where(mask, logprobs, 0)``, detached. On CPU, where a boolean ``where`` costs several
    float passes, one reduction first checks that every value is finite with ``|x| <= TAME``;
    then the input itself is returned when ``raw_ok`` (the kernels read it where the weights
    are 0, and the products vanish), else it is multiplied by the 0/1 float mask (the same
    values: ``v · 1 = v``, ``v · 0 = ±0``)."""
    x = logprobs_RC.detach()
    if x.device.type == "cpu" and x.numel():
        lo, hi = torch.aminmax(x)
        if bool(lo >= -TAME) and bool(hi <= TAME):
            return x if raw_ok else x * mask_f_RC
    return torch.where(mask_RC, x, 0.0)


def indicator(condition: Callable[..., torch.Tensor], a: torch.Tensor, b,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``condition(a, b)`` (``torch.eq``, ``torch.le``, ...) as a 0/1 tensor of ``a``'s dtype,
    written into ``out`` (a fresh tensor by default; ``a`` itself is allowed)."""
    if out is None:
        out = torch.empty_like(a)
    return condition(a, b, out=out)


def capped_anywhere(log_ratio_RC: torch.Tensor) -> bool:
    """Whether some ``log r`` may exceed ``MAX_LOG_RATIO``: False on CPU when one reduction
    shows that none does (then ``min(log r, MAX_LOG_RATIO) = log r`` and :func:`below_cap` is
    1 everywhere: a kernel skips the clamp and the product by it, bit for bit the same); True
    elsewhere (a device would have to synchronize)."""
    if log_ratio_RC.device.type != "cpu" or not log_ratio_RC.numel():
        return True
    return not bool(log_ratio_RC.max() <= MAX_LOG_RATIO)


def capped_ratio(x_RC: torch.Tensor, ref_RC: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(log r, r, capped)`` with ``log r = x - ref``, ``r = exp(min(log r, MAX_LOG_RATIO))``
    (the values of :func:`~tokenmdp.estimators._common.capped_exp`) and ``capped`` from
    :func:`capped_anywhere`."""
    log_ratio = x_RC - ref_RC
    capped = capped_anywhere(log_ratio)
    ratio = log_ratio.clamp(max=MAX_LOG_RATIO).exp_() if capped else torch.exp(log_ratio)
    return log_ratio, ratio, capped


def ratio_only(x_RC: torch.Tensor, ref_RC: torch.Tensor) -> torch.Tensor:
    """``r`` of :func:`capped_ratio` alone, in one fresh tensor."""
    log_ratio = torch.sub(x_RC, ref_RC)
    if capped_anywhere(log_ratio):
        log_ratio.clamp_(max=MAX_LOG_RATIO)
    return log_ratio.exp_()


def below_cap(log_ratio_RC: torch.Tensor, *, reuse: bool = False) -> torch.Tensor:
    """``1{log r <= MAX_LOG_RATIO}`` as 0/1 floats (a ratio held at the cap has no gradient);
    with ``reuse`` written over ``log_ratio_RC``."""
    return indicator(torch.le, log_ratio_RC, MAX_LOG_RATIO,
                     out=log_ratio_RC if reuse else None)


def dot(a_RC: torch.Tensor, b_RC: torch.Tensor) -> torch.Tensor:
    """``Σ a · b`` as one dot product (no ``[R, C]`` temporary)."""
    return torch.dot(a_RC.reshape(-1), b_RC.reshape(-1))


def scaled(weight_RC: torch.Tensor, request: Request) -> torch.Tensor:
    """``weight_RC``, times the request's per-call ``scale_RC`` when there is one."""
    return weight_RC if request.scale_RC is None else weight_RC * request.scale_RC
