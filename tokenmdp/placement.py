"""Placements: where each sequence of a batch goes, as pure functions of the sequence lengths.

A :class:`Placement` gives every sequence a row and a first column of a ``num_rows x capacity``
grid; it moves nothing. :func:`tokenmdp.packing.relayout` applies one to a
:class:`~tokenmdp.batch.TokenBatch` (``relayout(batch, *placement)``), and the layouts of
:mod:`tokenmdp.packing` are a placement followed by that relayout.

* :func:`place_first_fit_decreasing` — longest first, each into the first row with room
  (vectorized over the rows, one numpy pass per distinct length);
* :func:`place_in_order` — next fit: sequences in index order, a new row when one does not fit;
* :func:`place_padded` — one sequence per row (right padding);
* :func:`place_flat` — every sequence in one row, back to back.

Every name here is re-exported by :mod:`tokenmdp.packing`.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import numpy as np
import torch

__all__ = ["Placement", "place_first_fit_decreasing", "place_flat", "place_in_order",
           "place_padded"]


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an integer, got a bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__}") from None
    if value < minimum:
        raise ValueError(f"{name}={value}: must be at least {minimum}")
    return value


class Placement(NamedTuple):
    """Where each sequence goes: row ``row_S[s]``, columns ``offset_S[s]`` onwards.

    ``relayout(batch, *placement)`` applies it; ``num_rows`` x ``capacity`` is the new grid.

    Parameters
    ----------
    row_S : LongTensor ``[S]``
        Row of each sequence, in ``[0, num_rows)``.
    offset_S : LongTensor ``[S]``
        Column of each sequence's first token.
    num_rows : int
        ``R'``, the number of rows of the new grid.
    capacity : int
        ``C'``, the row capacity of the new grid.
    """

    row_S: torch.Tensor
    offset_S: torch.Tensor
    num_rows: int
    capacity: int


def _as_lengths(lengths_S: object) -> np.ndarray:
    if isinstance(lengths_S, torch.Tensor):
        lengths_S = lengths_S.detach().cpu().numpy()
    lengths = np.asarray(lengths_S)
    if lengths.ndim != 1 or not (lengths.size == 0 or np.issubdtype(lengths.dtype, np.integer)):
        raise ValueError(f"lengths_S: expected a 1-d array of integers, got shape "
                         f"{lengths.shape} and dtype {lengths.dtype}")
    lengths = lengths.astype(np.int64)
    if lengths.size and int(lengths.min()) < 1:
        raise ValueError("lengths_S: every sequence needs at least one token")
    return lengths


def _check_capacity(capacity: object, lengths: np.ndarray) -> int:
    capacity = _check_int("capacity", capacity, 1)
    longest = int(lengths.max()) if lengths.size else 0
    if capacity < longest:
        raise ValueError(f"capacity={capacity} is smaller than the longest sequence "
                         f"({longest} tokens)")
    return capacity


def _placement(row: np.ndarray, offset: np.ndarray, num_rows: int, capacity: int) -> Placement:
    return Placement(torch.from_numpy(np.ascontiguousarray(row, dtype=np.int64)),
                     torch.from_numpy(np.ascontiguousarray(offset, dtype=np.int64)),
                     int(num_rows), int(capacity))


def place_first_fit_decreasing(lengths_S: object, capacity: int) -> Placement:
    """First-fit decreasing: longest sequence first, each into the first row with room.

    Sequences of equal length are taken in index order. Sequences of one length are placed
    together, vectorized over the rows: a row with ``free`` columns takes ``free // n`` of the
    sequences of length ``n``, rows in order, and the rest open new rows. This is exactly
    item-by-item first fit; the cost is one numpy pass over the rows per distinct length (at
    most ``capacity`` of them), not a Python step per sequence (10^5 sequences: ~0.2 s).

    Parameters
    ----------
    lengths_S : integer array-like ``[S]``
        Number of tokens (prompt and response) of each sequence, each at least 1.
    capacity : int
        Row capacity ``C``; at least the longest sequence.

    Returns
    -------
    Placement
        Rows ``0 .. num_rows-1``; within a row, sequences sit side by side from column 0.
    """
    lengths = _as_lengths(lengths_S)
    capacity = _check_capacity(capacity, lengths)
    num_seq = lengths.size
    order = np.argsort(-lengths, kind="stable")
    sorted_len = lengths[order]
    group_start = np.flatnonzero(np.r_[True, sorted_len[1:] != sorted_len[:-1]]) if num_seq else []
    group_end = np.r_[group_start[1:], num_seq] if num_seq else []
    used = np.zeros(num_seq, dtype=np.int64)          # columns used in each (potential) row
    row_sorted = np.empty(num_seq, dtype=np.int64)    # row of the i-th longest sequence
    offset_sorted = np.empty(num_seq, dtype=np.int64)
    num_rows = 0
    for a, b in zip(group_start, group_end, strict=True):
        n, count = int(sorted_len[a]), int(b - a)
        # Open rows with room, in order: row i takes min(free_i // n, what is left) sequences.
        rows = np.flatnonzero(used[:num_rows] <= capacity - n)[:count]  # each takes >= 1
        fits = (capacity - used[rows]) // n
        take = np.clip(count - (np.cumsum(fits) - fits), 0, fits)
        rows, k = rows[take > 0], take[take > 0]
        placed = int(k.sum())
        slot = np.arange(placed) - np.repeat(np.cumsum(k) - k, k)   # index inside its row's take
        row_sorted[a:a + placed] = np.repeat(rows, k)
        offset_sorted[a:a + placed] = np.repeat(used[rows], k) + slot * n
        used[rows] += k * n
        # The rest open new rows of capacity // n sequences each.
        rest, per_row = count - placed, capacity // n
        j = np.arange(rest)
        row_sorted[a + placed:b] = num_rows + j // per_row
        offset_sorted[a + placed:b] = (j % per_row) * n
        new_rows = -(-rest // per_row)
        used[num_rows:num_rows + new_rows] = np.bincount(j // per_row, minlength=new_rows) * n
        num_rows += new_rows
    row, offset = np.empty_like(row_sorted), np.empty_like(offset_sorted)
    row[order], offset[order] = row_sorted, offset_sorted
    return _placement(row, offset, num_rows, capacity)


def place_in_order(lengths_S: object, capacity: int) -> Placement:
    """In-order greedy (next fit): sequences in index order, a new row when the next one does
    not fit in the current row; the rows keep the sequence order.

    Parameters
    ----------
    lengths_S : integer array-like ``[S]``
        Number of tokens (prompt and response) of each sequence, each at least 1.
    capacity : int
        Row capacity ``C``; at least the longest sequence.

    Returns
    -------
    Placement
        Consecutive sequences share a row, from column 0, until the next one does not fit.
    """
    lengths = _as_lengths(lengths_S)
    capacity = _check_capacity(capacity, lengths)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    row = np.empty(lengths.size, dtype=np.int64)
    offset = np.empty(lengths.size, dtype=np.int64)
    i, num_rows = 0, 0
    while i < lengths.size:                           # one iteration per row
        j = int(np.searchsorted(ends, starts[i] + capacity, side="right"))
        row[i:j], offset[i:j] = num_rows, starts[i:j] - starts[i]
        i, num_rows = j, num_rows + 1
    return _placement(row, offset, num_rows, capacity)


def place_padded(lengths_S: object, capacity: int | None = None) -> Placement:
    """One sequence per row, sequence ``s`` in row ``s`` from column 0 (right padding).

    Parameters
    ----------
    lengths_S : integer array-like ``[S]``
        Number of tokens (prompt and response) of each sequence, each at least 1.
    capacity : int, optional
        Row capacity ``C``, at least the longest sequence (default: the longest sequence; 1 for
        no sequences).

    Returns
    -------
    Placement
        ``S`` rows; row ``s`` holds sequence ``s`` at offset 0.
    """
    lengths = _as_lengths(lengths_S)
    if capacity is None:
        capacity = max(int(lengths.max()) if lengths.size else 0, 1)
    capacity = _check_capacity(capacity, lengths)
    return _placement(np.arange(lengths.size), np.zeros(lengths.size), lengths.size, capacity)


def place_flat(lengths_S: object, capacity: int | None = None) -> Placement:
    """Every sequence in one row, in index order, back to back.

    Parameters
    ----------
    lengths_S : integer array-like ``[S]``
        Number of tokens (prompt and response) of each sequence, each at least 1.
    capacity : int, optional
        Length of the row, at least the total number of tokens (default: that total; 1 for no
        sequences); a larger one pads the end of the row.

    Returns
    -------
    Placement
        One row; sequence ``s`` starts where sequence ``s - 1`` ends.
    """
    lengths = _as_lengths(lengths_S)
    total = int(lengths.sum())
    capacity = max(total, 1) if capacity is None else _check_int("capacity", capacity, 1)
    if capacity < total:
        raise ValueError(f"capacity={capacity} is smaller than the total number of tokens "
                         f"({total}) of the flat layout")
    return _placement(np.zeros(lengths.size), np.cumsum(lengths) - lengths, 1, capacity)
