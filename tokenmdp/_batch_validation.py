"""The invariants of a :class:`~tokenmdp.batch.TokenBatch`, checked (not part of the public API).

:func:`validate` checks every invariant listed in :mod:`tokenmdp.batch` (field types, shapes,
devices, one float dtype, finiteness, ``sequence_id`` and ``position`` describing contiguous
sequences, the response and loss mask) and runs when a batch is built;
:func:`validate_float_changes` checks only what :meth:`TokenBatch.replace
<tokenmdp.batch.TokenBatch.replace>` changes when it changes only float fields, whose layout was
validated already. A violation raises ``ValueError`` (``TypeError`` for a value that is not a
tensor) naming the field as ``TokenBatch.<field>``. The checks read the batch's attributes;
this module stands a floor below :mod:`tokenmdp.batch` and does not import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

TOKEN_FLOAT_FIELDS = ("advantage", "behavior_logprob", "old_logprob", "ref_logprob", "loss_weight")
SEQ_FLOAT_FIELDS = ("reward",)
SEQ_INT_FIELDS = ("group", "length", "prompt_index")


def _fail(field: str, what: str) -> None:
    raise ValueError(f"TokenBatch.{field}: {what}")


def validate(batch) -> None:
    """Raise unless ``batch`` satisfies every invariant of :mod:`tokenmdp.batch`."""
    for name in ("tokens", "sequence_id", "position", "loss_mask", "advantage", "loss_weight",
                 "reward", "group", "length", "prompt_index"):
        if not isinstance(getattr(batch, name), torch.Tensor):
            raise TypeError(f"TokenBatch.{name}: expected a torch.Tensor, got "
                            f"{type(getattr(batch, name)).__name__}")
    if batch.tokens.dim() != 2:
        _fail("tokens", f"expected shape [R, C], got {tuple(batch.tokens.shape)}")
    shape = batch.tokens.shape
    device = batch.tokens.device
    for name in ("tokens", "sequence_id", "position"):
        t = getattr(batch, name)
        if t.dtype not in (torch.int64, torch.int32):
            _fail(name, f"expected an integer tensor, got {t.dtype}")
    if batch.loss_mask.dtype != torch.bool:
        _fail("loss_mask", f"expected a bool tensor, got {batch.loss_mask.dtype}")
    float_dtype = batch.advantage.dtype
    if not float_dtype.is_floating_point:
        _fail("advantage", f"expected a floating-point tensor, got {float_dtype}")
    for name in ("sequence_id", "position", "loss_mask", *TOKEN_FLOAT_FIELDS):
        t = getattr(batch, name)
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"TokenBatch.{name}: expected a torch.Tensor or None, got "
                            f"{type(t).__name__}")
        if t.shape != shape:
            _fail(name, f"shape {tuple(t.shape)} differs from tokens' {tuple(shape)}")
        if t.device != device:
            _fail(name, f"on {t.device}, tokens on {device}")
    for name in TOKEN_FLOAT_FIELDS + SEQ_FLOAT_FIELDS:
        t = getattr(batch, name)
        if t is None:
            continue
        if t.dtype != float_dtype:
            _fail(name, f"dtype {t.dtype} differs from advantage's {float_dtype}; "
                        "all floating-point fields share one dtype")
        if not bool(torch.isfinite(t).all()):
            _fail(name, "contains non-finite values")
    for name, t in batch.token_extras.items():
        if not isinstance(t, torch.Tensor) or tuple(t.shape[:2]) != tuple(shape):
            _fail(f"token_extras[{name!r}]", f"expected a tensor of shape [R, C, ...] = "
                  f"{tuple(shape)}+..., got {getattr(t, 'shape', type(t).__name__)}")

    if batch.reward.dim() != 1:
        _fail("reward", f"expected shape [S], got {tuple(batch.reward.shape)}")
    num_seq = batch.reward.shape[0]
    for name in SEQ_INT_FIELDS:
        t = getattr(batch, name)
        if t.dtype not in (torch.int64, torch.int32):
            _fail(name, f"expected an integer tensor, got {t.dtype}")
        if t.shape != (num_seq,):
            _fail(name, f"expected shape [S] = ({num_seq},), got {tuple(t.shape)}")
        if t.device != device:
            _fail(name, f"on {t.device}, tokens on {device}")
        if num_seq and int(t.min()) < 0:
            _fail(name, "contains negative values")
    if batch.reward.device != device:
        _fail("reward", f"on {batch.reward.device}, tokens on {device}")

    sid = batch.sequence_id
    real = sid >= 0
    if bool((sid < -1).any()) or (num_seq and int(sid.max()) >= num_seq):
        _fail("sequence_id", f"values must be -1 (padding) or in [0, {num_seq})")
    if num_seq == 0 and bool(real.any()):
        _fail("sequence_id", "tokens belong to sequences but the batch has no sequences (S = 0)")
    if bool((batch.loss_mask & ~real).any()):
        _fail("loss_mask", "set on padding tokens")
    if bool((batch.tokens < 0).any()):
        _fail("tokens", "contains negative token ids")
    if bool((batch.position < 0).any()):
        _fail("position", "contains negative positions")
    if num_seq == 0:
        return
    # Contiguity: a token at position p > 0 follows, in the same row, the token of the same
    # sequence at position p - 1; each sequence starts exactly once (position 0).
    pos = batch.position
    starts = real & (pos == 0)
    cont = real & (pos > 0)
    prev_ok = torch.zeros_like(real)
    prev_ok[:, 1:] = (sid[:, 1:] == sid[:, :-1]) & (pos[:, 1:] == pos[:, :-1] + 1)
    if bool((cont & ~prev_ok).any()):
        _fail("position", "each sequence must occupy a contiguous span of one row with "
                          "positions 0, 1, 2, ... in order")
    n_starts = torch.zeros(num_seq, dtype=torch.long, device=device).index_add_(
        0, sid[starts].long(), torch.ones_like(sid[starts], dtype=torch.long))
    if bool((n_starts != 1).any()):
        missing = int((n_starts == 0).sum())
        _fail("sequence_id", f"every sequence id in [0, S) must start exactly once "
                             f"({missing} never occur, {int((n_starts > 1).sum())} repeat)")
    total = batch.sequence_lengths_total()
    if bool((batch.length > total).any()):
        _fail("length", "response length exceeds the number of tokens of the sequence")
    if bool((batch.loss_mask & ~batch.response_mask).any()):
        _fail("loss_mask", "set on prompt tokens; only response tokens can be actions")


def validate_float_changes(batch, changes: Mapping[str, Any]) -> None:
    """Raise unless each of ``changes`` (float fields only) fits ``batch``: a tensor of the
    field's shape on the batch's device, in its float dtype, finite (``None`` for an optional
    log-prob)."""
    for name, value in changes.items():
        expected = batch.reward.shape if name in SEQ_FLOAT_FIELDS else batch.tokens.shape
        if value is None and name not in ("advantage", "loss_weight", "reward"):
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"TokenBatch.{name}: expected a torch.Tensor, got "
                            f"{type(value).__name__}")
        if value.shape != expected:
            _fail(name, f"shape {tuple(value.shape)} differs from the expected "
                        f"{tuple(expected)}")
        if value.device != batch.device:
            _fail(name, f"on {value.device}, tokens on {batch.device}")
        if value.dtype != batch.dtype:
            _fail(name, f"dtype {value.dtype} differs from the batch's {batch.dtype}; "
                        "all floating-point fields share one dtype")
        if not bool(torch.isfinite(value).all()):
            _fail(name, "contains non-finite values")
