"""Counts of a whole optimizer step over data-parallel ranks, and DDP's loss scale.

Aggregation is a per-token weight decided once per optimizer step (docs: Concepts › Aggregation):
a token-mean divides by the loss tokens of *every* rank, a sequence-mean by the sequences of
every rank. Each rank holds only its share of the step, so it all-reduces its counts first::

    counts = global_counts(rank_batch)                     # collective: every rank calls it
    rank_batch = estimators.prepare(rank_batch, est, num_tokens=counts.num_loss_tokens,
                                    num_sequences=counts.num_sequences)
    for mb in split_micro_batches(rank_batch, k):          # any split, any layout
        value, _ = estimators.loss(ddp_model(mb.batch), mb.batch, est)
        (value * data_parallel_loss_scale()).backward()    # undo DDP's mean over ranks

The rank losses then sum to the loss of the global batch, and after DDP's all-reduce every rank
holds exactly the single-process gradient of that batch (``tests/test_distributed.py`` checks
it with two gloo processes). Without the global counts each rank normalizes by its own tokens
(a mean of rank means: a different estimator whenever ranks hold unequal counts); without the
scale the gradient is ``W`` times too small.

This module sits at the bottom layer next to :mod:`tokenmdp.batch`: it imports no estimator.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from tokenmdp.batch import TokenBatch

__all__ = ["StepCounts", "all_gather_objects", "all_reduce_counts", "all_reduce_floats",
           "data_parallel_loss_scale", "global_counts", "rank_and_world_size"]


class StepCounts(NamedTuple):
    """Counts of a whole optimizer step: loss tokens, and the sequences ``S`` counts.

    These are ``N_tokens`` and ``S`` of the aggregation table (docs: Concepts › Aggregation),
    the ``num_tokens`` and ``num_sequences`` arguments of ``estimators.prepare``.

    Parameters
    ----------
    num_loss_tokens : int
        Tokens of the step where the loss mask is set (``N_tokens``).
    num_sequences : int
        ``S``: every sequence of the step, or (``sequences="with-loss-tokens"`` in
        :func:`global_counts`) those with at least one loss token.
    """

    num_loss_tokens: int
    num_sequences: int


def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_counts(counts: tuple[int, int], *, device: torch.device | str = "cpu",
                      group: dist.ProcessGroup | None = None) -> StepCounts:
    """Sum local ``(num_loss_tokens, num_sequences)`` over the ranks of ``group``.

    Use it with counts computed elsewhere, e.g. ``estimators.step_counts(batch, est)`` for an
    estimator whose masked-IS rejects leave the normalizer. Without an initialized process group
    the counts are returned as they are. This is a collective: every rank of ``group`` must call
    it; with NCCL pass a CUDA ``device``.

    Parameters
    ----------
    counts : pair of int
        This rank's loss tokens and sequences, both ``>= 0``.
    device : torch.device or str
        Where the small count tensor lives for the all-reduce.
    group : ProcessGroup, optional
        Default: the world.

    Returns
    -------
    StepCounts
    """
    try:
        tokens, sequences = counts
    except (TypeError, ValueError):
        raise TypeError(f"counts: expected a pair of ints, got {counts!r}") from None
    values = []
    for name, value in (("num_loss_tokens", tokens), ("num_sequences", sequences)):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"counts: {name} must be an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"counts: {name}={value} is negative")
        values.append(value)
    if not _is_distributed():
        return StepCounts(*values)
    summed = torch.tensor(values, dtype=torch.long, device=device)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
    return StepCounts(int(summed[0]), int(summed[1]))


def global_counts(batch: TokenBatch, *, mask: torch.Tensor | None = None,
                  group: dist.ProcessGroup | None = None,
                  sequences: str = "sampled") -> StepCounts:
    """Loss tokens and counted sequences of the step, summed over data-parallel ranks.

    Counts the tokens where ``mask`` (default ``batch.loss_mask``) is set and the sequences
    ``S`` counts, exactly as ``estimators.count_step`` does: every sequence of the batch
    (``sequences="sampled"``, the default and the peers' convention) or only those with at
    least one counted token (``"with-loss-tokens"``), then all-reduces them (:func:`all_reduce_counts`). Call
    it on the rank's whole step (all its micro-batches) before computing ``loss_weight``; then
    ``1 / num_loss_tokens`` and ``1 / num_sequences`` are the same on every rank and every
    micro-batch. A collective: every rank of ``group`` must call it (with NCCL, on a GPU batch).

    Parameters
    ----------
    batch : TokenBatch
        This rank's share of the optimizer step, any layout.
    mask : BoolTensor ``[R, C]``, optional
        The tokens that count, inside ``batch.loss_mask``.
    group : ProcessGroup, optional
        Default: the world.
    sequences : {"sampled", "with-loss-tokens"}, default "sampled"
        What ``num_sequences`` counts (the values of ``estimators.SequenceCount``).

    Returns
    -------
    StepCounts
    """
    if not isinstance(batch, TokenBatch):
        raise TypeError(f"batch: expected a TokenBatch, got {type(batch).__name__}")
    if mask is None:
        mask = batch.loss_mask
    elif not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or (
            mask.shape != batch.loss_mask.shape):
        raise ValueError(f"mask: expected a bool tensor of shape {tuple(batch.loss_mask.shape)}")
    elif bool((mask & ~batch.loss_mask).any()):
        raise ValueError("mask: set on tokens outside batch.loss_mask")
    if sequences not in ("sampled", "with-loss-tokens"):
        raise ValueError(f"sequences: expected 'sampled' or 'with-loss-tokens', got {sequences!r}")
    if sequences == "sampled":
        return all_reduce_counts((int(mask.sum()), batch.num_sequences), device=batch.device,
                                 group=group)
    real = batch.sequence_id >= 0
    per_sequence = torch.zeros(batch.num_sequences, dtype=torch.long, device=batch.device)
    per_sequence.index_add_(0, batch.sequence_id[real].long(), mask[real].long())
    return all_reduce_counts((int(mask.sum()), int((per_sequence > 0).sum())),
                             device=batch.device, group=group)


def data_parallel_loss_scale(*, group: dist.ProcessGroup | None = None) -> int:
    """Factor that undoes DDP's gradient averaging: the world size (1 when not distributed).

    DDP (and FSDP by default) all-reduces gradients with a *mean* over the ``W`` ranks:
    ``g = (1/W) sum_r grad L_r``. With loss weights normalized by the global counts of
    :func:`global_counts`, the rank losses already sum to the step's loss,
    ``L = sum_r L_r``, so the wanted gradient is ``sum_r grad L_r = W g``. Multiply each rank's
    loss by this factor (``W``) before ``backward()`` to get exactly ``grad L``; without it the
    gradient is ``W`` times too small (Adam mostly hides that, up to ``eps`` and gradient
    clipping; SGD does not).

    Parameters
    ----------
    group : ProcessGroup, optional
        The data-parallel group (default: the world).

    Returns
    -------
    int
        ``W``, the number of ranks of ``group`` (1 without an initialized process group).
    """
    if _is_distributed():
        return dist.get_world_size(group)
    return 1


def rank_and_world_size(*, group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(rank, world size)`` of ``group``; ``(0, 1)`` without an initialized process group.

    Parameters
    ----------
    group : ProcessGroup, optional
        Default: the world.

    Returns
    -------
    (int, int)
        This process's rank in ``group`` and the number of ranks.
    """
    if _is_distributed():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def all_reduce_floats(values: list[float], *, op: str = "sum", device: torch.device | str = "cpu",
                      group: dist.ProcessGroup | None = None) -> list[float]:
    """Reduce a list of numbers over the ranks in one collective (float64); the list itself
    without a process group.

    A metric that is a ratio is reduced as its numerator and denominator (``op="sum"``) and
    divided afterwards, so the result is the ratio over the whole step, not a mean of rank
    ratios. Every rank of ``group`` must call it with a list of the same length.

    Parameters
    ----------
    values : list of float
        This rank's numbers (converted with ``float``).
    op : {"sum", "min", "max"}
        The reduction, element by element.
    device : torch.device or str
        Where the tensor lives for the collective (a CUDA device with NCCL).
    group : ProcessGroup, optional
        Default: the world.

    Returns
    -------
    list of float
        The reduced numbers, the same on every rank (``values`` as floats when not distributed
        or empty).
    """
    if op not in _REDUCE_OPS:
        raise ValueError(f"op: expected one of {', '.join(_REDUCE_OPS)}, got {op!r}")
    values = [float(v) for v in values]
    if not _is_distributed() or not values:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=_REDUCE_OPS[op], group=group)
    return t.tolist()


def all_gather_objects(obj, *, group: dist.ProcessGroup | None = None) -> list:
    """``[obj of rank 0, obj of rank 1, ...]`` (picklable objects); ``[obj]`` without a process
    group. A collective: every rank of ``group`` must call it.

    Parameters
    ----------
    obj : object
        This rank's object (anything ``pickle`` can send).
    group : ProcessGroup, optional
        Default: the world.

    Returns
    -------
    list
        One object per rank of ``group``, in rank order.
    """
    if not _is_distributed():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
