"""Layouts of a :class:`~tokenmdp.batch.TokenBatch`: packing and micro-batches.

A layout places each sequence of a batch at one row and one column offset of an ``[R, C]``
grid. Layout is memory, never meaning: every function here moves whole sequences together with
every per-token field (tokens, loss mask, advantage, loss weight, behaviour / old / reference
log-probs, every ``token_extras`` tensor such as MoE routing records ``[R, C, layers, K]``) and
every per-sequence field (reward, group, length, prompt index), so a loss reduced through
``sequence_id`` is the same in every layout.

Reading order:

1. placements, pure functions of the sequence lengths, in :mod:`tokenmdp.placement` (re-exported
   here): :func:`place_first_fit_decreasing`, :func:`place_in_order`, :func:`place_padded`,
   :func:`place_flat`;
2. :func:`relayout`, the one primitive that moves tokens (one gather and one scatter per field);
3. batch layouts built on it: :func:`pack_first_fit_decreasing`, :func:`pack_in_order`,
   :func:`padded_layout`, :func:`flat_layout`, :func:`select_sequences`, :func:`fill_fraction`;
4. :func:`split_micro_batches`, rows into micro-batches that remember their original sequences.

Step counts over data-parallel ranks (:func:`~tokenmdp.distributed.global_counts`,
:func:`~tokenmdp.distributed.data_parallel_loss_scale`) live in :mod:`tokenmdp.distributed`.

Padding positions of a re-laid-out batch hold 0 in every field (``False`` in ``loss_mask``),
except ``sequence_id``, which is -1.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.placement import (
    _check_int,
    place_first_fit_decreasing,
    place_flat,
    place_in_order,
    place_padded,
)

__all__ = ["MicroBatch", "SequenceSpans", "fill_fraction", "flat_layout", "pack_first_fit_decreasing",
           "pack_in_order", "padded_layout", "relayout", "select_sequences", "sequence_spans",
           "split_micro_batches"]

# Per-token fields moved as they are (``sequence_id`` and ``position`` are rebuilt from the
# placement, ``token_extras`` is moved entry by entry) and per-sequence fields, gathered.
_MOVED_TOKEN_FIELDS = ("tokens", "loss_mask", "advantage", "loss_weight", "behavior_logprob",
                       "old_logprob", "ref_logprob")
_SEQUENCE_FIELDS = ("reward", "group", "length", "prompt_index")


# ---------------------------------------------------------------------------------- relayout
class SequenceSpans(NamedTuple):
    """Where each sequence of a batch sits: row ``row_S``, first column ``start_S``, and its
    number of tokens ``total_S`` (prompt and response).

    Parameters
    ----------
    row_S : LongTensor ``[S]``
        Row of each sequence.
    start_S : LongTensor ``[S]``
        Column of each sequence's first token (its position 0).
    total_S : LongTensor ``[S]``
        Number of tokens of each sequence, prompt and response.
    """

    row_S: torch.Tensor
    start_S: torch.Tensor
    total_S: torch.Tensor


def sequence_spans(batch: TokenBatch) -> SequenceSpans:
    """Row, first column and number of tokens of every sequence (vectorized, no loop).

    Parameters
    ----------
    batch : TokenBatch
        Any layout.

    Returns
    -------
    SequenceSpans
        Indexed by sequence id.
    """
    starts = (batch.sequence_id >= 0) & (batch.position == 0)
    r, c = starts.nonzero(as_tuple=True)
    sid = batch.sequence_id[r, c].long()
    row = torch.empty(batch.num_sequences, dtype=torch.long, device=batch.device)
    start = torch.empty_like(row)
    row[sid], start[sid] = r, c
    return SequenceSpans(row, start, batch.sequence_lengths_total())


def _as_index(name: str, values: object, device: torch.device, *, size: int | None = None,
              upper: int | None = None) -> torch.Tensor:
    t = torch.as_tensor(values, device=device)
    if t.dim() != 1 or (t.numel() and (t.dtype.is_floating_point or t.dtype == torch.bool)):
        raise ValueError(f"{name}: expected a 1-d integer tensor, got shape {tuple(t.shape)} "
                         f"and dtype {t.dtype}")
    if size is not None and t.shape[0] != size:
        raise ValueError(f"{name}: expected {size} entries, got {t.shape[0]}")
    if upper is not None and t.numel() and (int(t.min()) < 0 or int(t.max()) >= upper):
        raise ValueError(f"{name}: values must lie in [0, {upper})")
    return t.long()


def relayout(batch: TokenBatch, row_S: object, offset_S: object, num_rows: int, capacity: int,
             *, sequence_index: object = None) -> TokenBatch:
    """Move sequences to new rows and columns of a ``num_rows x capacity`` grid.

    New sequence ``k`` is old sequence ``sequence_index[k]`` (default: all sequences, in order)
    and occupies row ``row_S[k]``, columns ``offset_S[k] ..offset_S[k] + n_k - 1``. Each field
    moves with one gather and one scatter over the moved tokens; no per-token Python loop.

    Parameters
    ----------
    batch : TokenBatch
    row_S, offset_S : integer ``[S']``
        Row and first column of each new sequence. Spans must fit the grid and not overlap.
    num_rows, capacity : int
        Shape ``[R', C']`` of the new grid.
    sequence_index : integer ``[S']``, optional
        Old sequence id of each new sequence. A subset drops sequences, a permutation renumbers
        them; repeats copy a sequence (as in resampling). Sequence fields are gathered with it.

    Returns
    -------
    TokenBatch
        Padding holds 0 in every field (``False`` in ``loss_mask``, -1 in ``sequence_id``).
    """
    return _relayout(batch, sequence_spans(batch), row_S, offset_S, num_rows, capacity,
                     sequence_index)


def _relayout(batch: TokenBatch, spans: SequenceSpans, row_S: object, offset_S: object,
              num_rows: int, capacity: int, sequence_index: object) -> TokenBatch:
    device = batch.device
    num_rows = _check_int("num_rows", num_rows, 0)
    capacity = _check_int("capacity", capacity, 1)
    index = (torch.arange(batch.num_sequences, device=device) if sequence_index is None else
             _as_index("sequence_index", sequence_index, device, upper=batch.num_sequences))
    num_new = index.shape[0]
    row = _as_index("row_S", row_S, device, size=num_new, upper=num_rows)
    offset = _as_index("offset_S", offset_S, device, size=num_new, upper=capacity)
    total = spans.total_S[index]
    if num_new and int((offset + total).max()) > capacity:
        k = int(torch.argmax(offset + total))
        raise ValueError(f"capacity={capacity}: new sequence {k} ({int(total[k])} tokens at "
                         f"offset {int(offset[k])}) does not fit in its row")
    # Spans never cross a row, so they overlap iff they overlap on the flattened grid.
    first = row * capacity + offset
    sorted_first, order = torch.sort(first)
    if bool((sorted_first[1:] < (sorted_first + total[order])[:-1]).any()):
        raise ValueError("row_S, offset_S: two sequences overlap in the new layout")

    # Every moved token: its new sequence, its position, where it comes from and goes to.
    seq_first = torch.cumsum(total, 0) - total          # index of each new sequence's first token
    new_seq = torch.zeros(int(total.sum()), dtype=torch.long, device=device)
    new_seq[seq_first[1:]] = 1                          # every sequence has at least one token
    new_seq = torch.cumsum(new_seq, 0)
    position = torch.arange(new_seq.shape[0], device=device) - seq_first[new_seq]
    src = (spans.row_S * batch.capacity + spans.start_S)[index][new_seq] + position
    dst = first[new_seq] + position

    def move(t_RC: torch.Tensor | None, fill: float | bool = 0) -> torch.Tensor | None:
        if t_RC is None:
            return None
        rest = tuple(t_RC.shape[2:])
        out = t_RC.new_full((num_rows * capacity, *rest), fill)
        out[dst] = t_RC.reshape(-1, *rest)[src]
        return out.view(num_rows, capacity, *rest)

    sequence_id = batch.sequence_id.new_full((num_rows * capacity,), -1)
    sequence_id[dst] = new_seq.to(sequence_id.dtype)
    new_position = batch.position.new_zeros(num_rows * capacity)
    new_position[dst] = position.to(new_position.dtype)
    fields = {name: move(getattr(batch, name)) for name in _MOVED_TOKEN_FIELDS}
    fields.update({name: getattr(batch, name)[index] for name in _SEQUENCE_FIELDS})
    return TokenBatch(sequence_id=sequence_id.view(num_rows, capacity),
                      position=new_position.view(num_rows, capacity),
                      token_extras={k: move(v) for k, v in batch.token_extras.items()}, **fields)


# ---------------------------------------------------------------------------------- layouts
def pack_first_fit_decreasing(batch: TokenBatch, capacity: int) -> TokenBatch:
    """Pack the sequences into rows of ``capacity`` tokens by first-fit decreasing
    (:func:`place_first_fit_decreasing`). Sequence ids are unchanged.

    Parameters
    ----------
    batch : TokenBatch
        Any layout.
    capacity : int
        Row capacity ``C``; at least the longest sequence.

    Returns
    -------
    TokenBatch
        The same sequences in as few rows as first fit finds (longest first).
    """
    return relayout(batch, *place_first_fit_decreasing(batch.sequence_lengths_total(), capacity))


def pack_in_order(batch: TokenBatch, capacity: int) -> TokenBatch:
    """Pack the sequences into rows of ``capacity`` tokens in sequence-id order, a new row when
    the next one does not fit (:func:`place_in_order`). Sequence ids are unchanged.

    Parameters
    ----------
    batch : TokenBatch
        Any layout.
    capacity : int
        Row capacity ``C``; at least the longest sequence.

    Returns
    -------
    TokenBatch
        The same sequences, rows in sequence-id order.
    """
    return relayout(batch, *place_in_order(batch.sequence_lengths_total(), capacity))


def padded_layout(batch: TokenBatch, capacity: int | None = None) -> TokenBatch:
    """One sequence per row, sequence ``s`` in row ``s``, right padding to ``capacity``
    (default: the longest sequence).

    Parameters
    ----------
    batch : TokenBatch
        Any layout.
    capacity : int, optional
        Row capacity ``C``, at least the longest sequence (default: the longest sequence).

    Returns
    -------
    TokenBatch
        ``S`` rows (:func:`place_padded`).
    """
    return relayout(batch, *place_padded(batch.sequence_lengths_total(), capacity))


def flat_layout(batch: TokenBatch, capacity: int | None = None) -> TokenBatch:
    """All sequences in one row in sequence-id order.

    Parameters
    ----------
    batch : TokenBatch
        Any layout.
    capacity : int, optional
        Length of the row, at least the number of real tokens (default: that number).

    Returns
    -------
    TokenBatch
        One row (:func:`place_flat`).
    """
    return relayout(batch, *place_flat(batch.sequence_lengths_total(), capacity))


def select_sequences(batch: TokenBatch, sequence_index: object) -> TokenBatch:
    """Keep the sequences ``sequence_index`` (new sequence ``k`` is old ``sequence_index[k]``).

    Each kept sequence stays at its row and columns; rows left without sequences are dropped
    and the capacity is unchanged. A permutation only renumbers the sequences. Re-lay the result
    out (for example :func:`pack_first_fit_decreasing`) to reclaim the room of dropped ones.

    Parameters
    ----------
    batch : TokenBatch
        Any layout.
    sequence_index : integer ``[S']``
        The old ids of the kept sequences, each at most once, in their new order.

    Returns
    -------
    TokenBatch
        ``S'`` sequences, renumbered ``0 .. S'-1``; the rows that still hold one.

    Raises
    ------
    ValueError
        If ``sequence_index`` repeats a sequence (use :func:`relayout` to copy sequences) or is
        out of range.
    """
    spans = sequence_spans(batch)
    index = _as_index("sequence_index", sequence_index, batch.device, upper=batch.num_sequences)
    if torch.unique(index).numel() != index.numel():
        raise ValueError("sequence_index: repeats a sequence")
    kept_rows, new_row = torch.unique(spans.row_S[index], return_inverse=True)
    return _relayout(batch, spans, new_row, spans.start_S[index], kept_rows.numel(),
                     batch.capacity, index)


def fill_fraction(batch: TokenBatch) -> float:
    """Fraction of the ``R x C`` grid that holds real tokens (0.0 for an empty grid).

    Parameters
    ----------
    batch : TokenBatch
        Any layout.

    Returns
    -------
    float
        Real tokens over ``R * C``, in ``[0, 1]``.
    """
    slots = batch.num_rows * batch.capacity
    return batch.num_real_tokens / slots if slots else 0.0


# ---------------------------------------------------------------------------------- micro-batches
class MicroBatch(NamedTuple):
    """One micro-batch of a step and where it came from.

    ``batch`` holds rows ``row_index`` of the step's batch (same columns, same capacity) with
    sequence ids renumbered ``0 .. S'-1``; its sequence ``k`` is the step's sequence
    ``sequence_index[k]``. Results scatter back with ``full_S[mb.sequence_index] = part_S`` and
    ``full_RC[mb.row_index] = part_RC``.

    Parameters
    ----------
    batch : TokenBatch
        The micro-batch itself: whole rows of the step, sequences renumbered.
    sequence_index : LongTensor ``[S']``
        The step's id of each of its sequences.
    row_index : LongTensor ``[R']``
        The step's row of each of its rows.
    """

    batch: TokenBatch
    sequence_index: torch.Tensor
    row_index: torch.Tensor


def split_micro_batches(batch: TokenBatch, num_micro_batches: int | None = None, *,
                        max_tokens: int | None = None) -> list[MicroBatch]:
    """Split a step's batch into micro-batches of whole rows, hence of whole sequences.

    Rows are the unit: a sequence never spans two rows, and the packing of each row is kept.
    Re-lay the batch out first to choose it (e.g. :func:`pack_first_fit_decreasing` with
    ``capacity = max_tokens`` gives one packed row per micro-batch). Compute ``loss_weight`` for
    the whole step before splitting: the micro-batch losses then sum to the step's loss.

    Parameters
    ----------
    batch : TokenBatch
    num_micro_batches : int, optional
        Split the rows, in order, into this many micro-batches whose row counts differ by at most
        one. At least 1 and at most the number of rows.
    max_tokens : int, optional (keyword)
        Instead, the largest grid ``rows x capacity`` (padding included, the size of the forward
        pass) of a micro-batch; rows are taken in order, ``max_tokens // capacity`` per
        micro-batch. At least the capacity. Give exactly one of the two.

    Returns
    -------
    list of MicroBatch
        Together they hold every row and every sequence of ``batch`` exactly once.
    """
    if (num_micro_batches is None) == (max_tokens is None):
        raise ValueError("num_micro_batches, max_tokens: give exactly one of them")
    num_rows = batch.num_rows
    if num_micro_batches is not None:
        num_micro_batches = _check_int("num_micro_batches", num_micro_batches, 1)
        if num_micro_batches > num_rows:
            raise ValueError(f"num_micro_batches={num_micro_batches} exceeds the number of rows "
                             f"({num_rows}); re-lay the batch out with more rows first")
        sizes = np.full(num_micro_batches, num_rows // num_micro_batches)
        sizes[: num_rows % num_micro_batches] += 1
    else:
        max_tokens = _check_int("max_tokens", max_tokens, 1)
        rows_per = max_tokens // batch.capacity
        if rows_per < 1:
            raise ValueError(f"max_tokens={max_tokens} is smaller than one row "
                             f"(capacity {batch.capacity})")
        sizes = np.full(-(-num_rows // rows_per), rows_per)
        if num_rows % rows_per:
            sizes[-1] = num_rows % rows_per
    bounds = np.r_[0, np.cumsum(sizes)]

    # Sequences grouped by micro-batch, by ascending id inside each one (a stable sort).
    spans = sequence_spans(batch)
    part_S = torch.bucketize(spans.row_S, torch.as_tensor(bounds[1:], device=batch.device),
                             right=True)
    part_S, by_part = torch.sort(part_S, stable=True)
    part_start = torch.searchsorted(part_S, torch.arange(len(sizes) + 1, device=batch.device))
    out = []
    for p, (a, b) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)):
        index = by_part[int(part_start[p]):int(part_start[p + 1])]
        part = _relayout(batch, spans, spans.row_S[index] - a, spans.start_S[index], b - a,
                         batch.capacity, index)
        out.append(MicroBatch(part, index, torch.arange(a, b, device=batch.device)))
    return out
