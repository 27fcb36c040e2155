"""Per-token log-probabilities and entropies from any model's logits, aligned with a TokenBatch.

A causal language model's output at column ``c - 1`` is the distribution of the token at
column ``c`` (the convention of :meth:`tokenmdp.model.MoETransformer.token_logprobs` and of
Hugging Face's shifted labels). So, for logits ``[R, C, V]`` on a batch's grid,

* :func:`token_logprobs_from_logits` gives ``log π(y_c | prefix) = z_{c-1}[y_c] − logsumexp z_{c-1}``
  at each selected column, 0 elsewhere;
* :func:`entropy_from_logits` gives ``H_c = −Σ_v π(v | prefix) log π(v | prefix)`` of the
  distribution the token at column ``c`` was drawn from (terms with ``π(v) = 0`` count 0), 0
  elsewhere.

With a :class:`~tokenmdp.batch.TokenBatch` the selected columns are its response tokens (0 on
prompt tokens and padding, as the policy protocol wants); in packed rows the output just before a
sequence's first token belongs to the previous sequence, which is why a response token needs a
prompt token before it. With a plain ``[R, C]`` token tensor, every column ``c ≥ 1`` (or those
of ``mask_RC``) is selected.

Numerics. Half-precision logits (float16, bfloat16) are normalized in float32 and the results are
float32; float32 and float64 logits keep their dtype. The work is chunked over positions: at most
``chunk_size`` selected positions are upcast and normalized at a time, in the forward pass and
again in the backward pass (a custom autograd function that keeps only the logits and one
log-normalizer per position), so a large vocabulary never has a second full ``[R, C, V]`` copy
(an upcast one, or a saved softmax) next to the logits. Prompt and padding positions are never
touched. The gradient with respect to the logits is in the logits' dtype.
"""

from __future__ import annotations

import torch

from tokenmdp.batch import TokenBatch

__all__ = ["DEFAULT_CHUNK_SIZE", "token_logprobs_from_logits", "entropy_from_logits"]

DEFAULT_CHUNK_SIZE = 1024
"""Positions normalized at a time (``chunk_size · V`` float32 values live at once)."""

_HALF = (torch.float16, torch.bfloat16)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _HALF else dtype


def _chunks(total: int, chunk_size: int):
    for start in range(0, total, chunk_size):
        yield slice(start, min(start + chunk_size, total))


class _TokenLogprob(torch.autograd.Function):
    """``z[src, target] − logsumexp(z[src])`` per selected position, chunked; saves ``lse``."""

    @staticmethod
    def forward(ctx, logits_NV, src_M, target_M, chunk_size):
        dtype = _compute_dtype(logits_NV.dtype)
        out = torch.empty(src_M.numel(), dtype=dtype, device=logits_NV.device)
        lse = torch.empty_like(out)
        for sl in _chunks(src_M.numel(), chunk_size):
            z = logits_NV[src_M[sl]].to(dtype)
            lse[sl] = torch.logsumexp(z, dim=-1)
            out[sl] = z.gather(-1, target_M[sl, None]).squeeze(-1) - lse[sl]
        ctx.save_for_backward(logits_NV, src_M, target_M, lse)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_M):
        logits_NV, src_M, target_M, lse = ctx.saved_tensors
        grad_NV = torch.zeros_like(logits_NV)
        for sl in _chunks(src_M.numel(), ctx.chunk_size):
            p = (logits_NV[src_M[sl]].to(lse.dtype) - lse[sl, None]).exp_()
            g = p.mul_(-grad_M[sl, None])                       # −g · softmax
            g.scatter_add_(-1, target_M[sl, None], grad_M[sl, None])  # + g · onehot(target)
            grad_NV.index_add_(0, src_M[sl], g.to(logits_NV.dtype))
        return grad_NV, None, None, None


class _Entropy(torch.autograd.Function):
    """``H = −Σ_v p_v log p_v`` per selected position, chunked; ``∂H/∂z_k = −p_k (log p_k + H)``."""

    @staticmethod
    def forward(ctx, logits_NV, src_M, chunk_size):
        dtype = _compute_dtype(logits_NV.dtype)
        out = torch.empty(src_M.numel(), dtype=dtype, device=logits_NV.device)
        for sl in _chunks(src_M.numel(), chunk_size):
            logp = torch.log_softmax(logits_NV[src_M[sl]].to(dtype), dim=-1)
            p = logp.exp()
            out[sl] = -torch.where(p > 0, p * logp, 0.0).sum(-1)
        ctx.save_for_backward(logits_NV, src_M, out)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_M):
        logits_NV, src_M, entropy_M = ctx.saved_tensors
        grad_NV = torch.zeros_like(logits_NV)
        for sl in _chunks(src_M.numel(), ctx.chunk_size):
            logp = torch.log_softmax(logits_NV[src_M[sl]].to(entropy_M.dtype), dim=-1)
            p = logp.exp()
            g = torch.where(p > 0, -p * (logp + entropy_M[sl, None]), 0.0) * grad_M[sl, None]
            grad_NV.index_add_(0, src_M[sl], g.to(logits_NV.dtype))
        return grad_NV, None, None


def _selection(logits_RCV, target, mask_RC, chunk_size, who: str):
    """Validate; return the selected ``[R, C]`` mask and the token ids ``[R, C]`` (or None)."""
    if not isinstance(logits_RCV, torch.Tensor) or logits_RCV.dim() != 3 \
            or not logits_RCV.is_floating_point():
        raise TypeError(f"logits_RCV: expected a floating-point tensor [R, C, V], got "
                        f"{getattr(logits_RCV, 'shape', type(logits_RCV).__name__)}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected an int >= 1, got {chunk_size!r}")
    grid = tuple(logits_RCV.shape[:2])
    if isinstance(target, TokenBatch):
        if mask_RC is not None:
            raise ValueError("mask_RC: not with a TokenBatch (its response tokens are selected)")
        tokens, selected = target.tokens, target.response_mask
        if bool((selected & (target.position == 0)).any()):
            raise ValueError(f"{who}: a response token is the first token of its sequence; its "
                             "distribution needs a prompt token before it")
    elif (isinstance(target, torch.Tensor) and who == "tokens") or (target is None
                                                                     and who == "batch"):
        tokens = target
        if tokens is not None and (tokens.dtype not in (torch.int32, torch.int64)
                                   or tuple(tokens.shape) != grid):
            raise TypeError(f"{who}: expected a TokenBatch or integer token ids of shape {grid}, "
                            f"got {tokens.dtype} {tuple(tokens.shape)}")
        if mask_RC is None:
            selected = torch.ones(grid, dtype=torch.bool, device=logits_RCV.device)
            selected[:, :1] = False
        else:
            if not isinstance(mask_RC, torch.Tensor) or mask_RC.dtype != torch.bool \
                    or tuple(mask_RC.shape) != grid:
                raise TypeError(f"mask_RC: expected a bool tensor of shape {grid}")
            if bool(mask_RC[:, :1].any()):
                raise ValueError("mask_RC: column 0 has no preceding output to predict it")
            selected = mask_RC
    else:
        kinds = "a TokenBatch or a LongTensor [R, C]" if who == "tokens" else "a TokenBatch or None"
        raise TypeError(f"{who}: expected {kinds}, got {type(target).__name__}")
    if tokens is not None and tuple(tokens.shape) != grid:
        raise ValueError(f"{who}: its grid {tuple(tokens.shape)} differs from the logits' {grid}")
    if selected.device != logits_RCV.device:
        raise ValueError(f"{who}: on {selected.device}, the logits on {logits_RCV.device}")
    return selected, tokens


def _sources(selected_RC: torch.Tensor):
    """Flat indices of the selected columns and of the outputs that predict them (``c − 1``)."""
    dst = selected_RC.reshape(-1).nonzero().squeeze(-1)
    return dst, dst - 1                      # c ≥ 1 on every selected column: same row


def token_logprobs_from_logits(logits_RCV: torch.Tensor, tokens: TokenBatch | torch.Tensor, *,
                               mask_RC: torch.Tensor | None = None,
                               chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """``log π(y_c | prefix)`` of each selected token from the logits that predict it.

    Parameters
    ----------
    logits_RCV : float Tensor ``[R, C, V]``
        A causal model's outputs on the batch's grid: column ``c − 1`` predicts token ``c``.
        Differentiable.
    tokens : TokenBatch or LongTensor ``[R, C]``
        A batch (its response tokens are selected, 0 on prompt tokens and padding), or the
        token ids on the same grid (every column ``c ≥ 1`` selected, or those of ``mask_RC``).
    mask_RC : BoolTensor ``[R, C]``, optional
        With token ids only: the columns to compute (never column 0).
    chunk_size : int, default ``DEFAULT_CHUNK_SIZE``
        Selected positions normalized at a time.

    Returns
    -------
    Tensor ``[R, C]``
        The log-probs (float32 for half-precision logits, else the logits' dtype), 0 on columns
        not selected; differentiable in ``logits_RCV``.

    Raises
    ------
    TypeError
        ``logits_RCV``, ``tokens`` or ``mask_RC`` of the wrong kind.
    ValueError
        A bad ``chunk_size``; a grid that differs from the logits'; a token id outside
        ``[0, V)`` at a selected column; a response token without a prompt token before it.
    """
    selected, ids = _selection(logits_RCV, tokens, mask_RC, chunk_size, "tokens")
    R, C, V = logits_RCV.shape
    dst, src = _sources(selected)
    target = ids.reshape(-1)[dst].long()
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= V):
        raise ValueError(f"tokens: ids at the selected columns must be in [0, V={V})")
    values = _TokenLogprob.apply(logits_RCV.reshape(R * C, V), src, target, chunk_size)
    out = values.new_zeros(R * C).index_put((dst,), values)
    return out.view(R, C)


def entropy_from_logits(logits_RCV: torch.Tensor, batch: TokenBatch | None = None, *,
                        mask_RC: torch.Tensor | None = None,
                        chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """Entropy of the distribution each selected token was drawn from.

    ``H_c = −Σ_v π(v | prefix) log π(v | prefix)`` with ``π(· | prefix) = softmax(z_{c−1})``;
    vocabulary entries of probability 0 (logit ``−inf``) count 0.

    Parameters
    ----------
    logits_RCV : float Tensor ``[R, C, V]``
        A causal model's outputs on the batch's grid (column ``c − 1`` predicts token ``c``).
    batch : TokenBatch, optional
        Its response tokens are selected (0 on prompt tokens and padding); without it every
        column ``c ≥ 1``, or those of ``mask_RC``.
    mask_RC : BoolTensor ``[R, C]``, optional
        Without a batch only: the columns to compute (never column 0).
    chunk_size : int, default ``DEFAULT_CHUNK_SIZE``
        Selected positions normalized at a time.

    Returns
    -------
    Tensor ``[R, C]``
        The entropies in nats (float32 for half-precision logits, else the logits' dtype), 0 on
        columns not selected; differentiable in ``logits_RCV``.

    Raises
    ------
    TypeError
        ``logits_RCV``, ``batch`` or ``mask_RC`` of the wrong kind.
    ValueError
        A bad ``chunk_size``; a grid that differs from the logits'; a response token without a
        prompt token before it.
    """
    selected, _ = _selection(logits_RCV, batch, mask_RC, chunk_size, "batch")
    R, C, V = logits_RCV.shape
    dst, src = _sources(selected)
    values = _Entropy.apply(logits_RCV.reshape(R * C, V), src, chunk_size)
    out = values.new_zeros(R * C).index_put((dst,), values)
    return out.view(R, C)
