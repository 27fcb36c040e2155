"""Small tensor helpers shared by the estimator modules (not part of the public API).

Per-sequence reductions here are layout-free: one ``index_add`` or one gather through
``sequence_id``, never a Python loop over sequences. Unlike :meth:`TokenBatch.sequence_sum`
they avoid boolean indexing (a device sync), so the caller must pass values that are already
zero on every token that should not count (padding included).
"""

from __future__ import annotations

import math

import torch

from tokenmdp.batch import TokenBatch

#: Upper bound on a log-ratio before it is exponentiated: ratios above ``e^20`` (about 4.9e8)
#: are held at ``e^20``. Above the bound the ratio is constant, so such a token (or sequence)
#: carries no gradient through it. Keeps float32 and float64 finite (``exp(4096)`` is not).
MAX_LOG_RATIO = 20.0


def capped_exp(log_x: torch.Tensor, *, bound: float = MAX_LOG_RATIO) -> torch.Tensor:
    """``exp(min(log_x, bound))``: a ratio from its log, held at ``e^bound`` above the bound."""
    return torch.exp(log_x.clamp(max=bound))


class _KnownDerivative(torch.autograd.Function):
    """``value`` (computed without autograd) as a function of ``x`` whose elementwise derivative
    is ``derivative``: the backward pass is one product, and nothing but ``derivative`` is kept
    for it. Used for the per-token terms whose autograd chains (sub, clamp, exp, min, ...) would
    each keep and re-read ``[R, C]`` intermediates: on a large step the loss is bound by memory
    traffic."""

    @staticmethod
    def forward(ctx, x, value, derivative):
        ctx.save_for_backward(derivative)
        return value

    @staticmethod
    def backward(ctx, grad):
        (derivative,) = ctx.saved_tensors
        return grad * derivative, None, None


def with_derivative(x: torch.Tensor, value: torch.Tensor, derivative: torch.Tensor) -> torch.Tensor:
    """``value`` carrying the gradient ``derivative ⊙ ∂/∂x`` back to ``x`` (``value`` and
    ``derivative`` detached, elementwise functions of ``x``); ``value`` itself when ``x`` needs no
    gradient. Tests compare each use with the same formula differentiated by autograd."""
    if not (x.requires_grad and torch.is_grad_enabled()):
        return value
    return _KnownDerivative.apply(x, value.detach(), derivative.detach())


def check_nonnegative(name: str, value: float | None, *, allow_none: bool = False) -> None:
    """Raise ``TypeError``/``ValueError`` naming ``name`` unless ``value`` is finite and >= 0."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}: must be a finite number >= 0, got {value}")


def check_positive(name: str, value: float) -> None:
    """Raise ``TypeError``/``ValueError`` naming ``name`` unless ``value`` is a finite float > 0."""
    check_nonnegative(name, value)
    if value <= 0:
        raise ValueError(f"{name}: must be > 0, got {value}")


def check_like_tokens(name: str, values: torch.Tensor, like: torch.Tensor) -> None:
    """Raise unless ``values`` is a tensor with the shape, dtype and device of ``like``."""
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(values).__name__}")
    if values.shape != like.shape:
        raise ValueError(f"{name}: shape {tuple(values.shape)} differs from the batch's "
                         f"[R, C] = {tuple(like.shape)}")
    if values.dtype != like.dtype:
        raise TypeError(f"{name}: dtype {values.dtype} differs from the batch's {like.dtype} "
                        "(no silent casts)")
    if values.device != like.device:
        raise ValueError(f"{name}: on {values.device}, the batch on {like.device}")


def require(batch: TokenBatch, field: str, who: str) -> torch.Tensor:
    """``batch.<field>``, or ``ValueError`` saying that ``who`` needs it."""
    value = getattr(batch, field)
    if value is None:
        raise ValueError(f"batch.{field} is None, but {who} needs it")
    return value


def sequence_sum(values_RC: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    """``out[s] = sum of values over the tokens of s`` (values must be 0 where they don't count)."""
    sid = batch.sequence_id.clamp(min=0).reshape(-1)
    out = values_RC.new_zeros(batch.num_sequences)
    return out.index_add(0, sid, values_RC.reshape(-1))


def take(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[index]`` for an integer ``index`` of any shape, by ``index_select`` (the same
    gather, about twice as fast as advanced indexing on CPU)."""
    return values.index_select(0, index.reshape(-1)).view(index.shape + values.shape[1:])


def to_tokens(values_S: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    """Each token gets its sequence's value (one gather; padding gets sequence 0's, mask it)."""
    if batch.num_sequences == 0:
        return values_S.new_zeros(batch.tokens.shape)
    return take(values_S, batch.sequence_id.clamp(min=0))


def loss_token_counts(batch: TokenBatch, mask_RC: torch.Tensor | None = None) -> torch.Tensor:
    """Float ``[S]``: number of tokens of each sequence where ``mask_RC`` (default loss_mask)."""
    mask = batch.loss_mask if mask_RC is None else mask_RC
    return sequence_sum(mask.to(batch.dtype), batch)


def masked_mean(values_RC: torch.Tensor, mask_RC: torch.Tensor, count: torch.Tensor,
                *, empty: float) -> torch.Tensor:
    """Mean of ``values`` over ``mask`` (``count`` tokens), or ``empty`` when there are none."""
    total = torch.where(mask_RC, values_RC, 0.0).sum()
    return torch.where(count > 0, total / count.clamp(min=1), total.new_tensor(empty))
