"""Tests of tokenmdp.packing: layouts move whole sequences with every field, exactly.

The reference for "nothing changed" is :func:`records`, a plain Python walk over the grid that
collects each sequence's tokens and fields by position (independent of the gather / scatter
code under test), together with ``batch.sequences()`` and per-sequence sums.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmdp import TokenBatch
from tokenmdp import distributed as dd
from tokenmdp import packing as pk

SUM_RTOL = 1e-12          # per-sequence sums in float64 may differ by summation order only
FFD_MIN_FILL = 0.97       # the target fill for first-fit decreasing
TOKEN_FIELDS = ("tokens", "loss_mask", "advantage", "loss_weight", "behavior_logprob",
                "old_logprob", "ref_logprob")
SEQUENCE_FIELDS = ("reward", "group", "length", "prompt_index")


# ------------------------------------------------------------------ strategies and references
@st.composite
def placements(draw, totals, capacity=None):
    """Rows and offsets for sequences of ``totals`` tokens: a random order, random gaps, random
    row breaks and empty rows. Returns (row, offset, num_rows, capacity) as Python lists."""
    longest = max(totals, default=1)
    cap = capacity if capacity is not None else draw(st.integers(longest, longest + 3))
    row, offset = [0] * len(totals), [0] * len(totals)
    r, used = 0, 0
    for s in draw(st.permutations(range(len(totals)))):
        gap = draw(st.integers(0, 2))
        if used + gap + totals[s] > cap or draw(st.booleans()):
            r, used = r + 1 + draw(st.integers(0, 1)), 0
            gap = min(gap, cap - totals[s])
        row[s], offset[s], used = r, used + gap, used + gap + totals[s]
    return row, offset, r + 1 + draw(st.integers(0, 1)), cap


@st.composite
def batches(draw, max_sequences=7, max_tokens=9):
    """A TokenBatch built by hand in a random layout, with every optional field sometimes set
    and two token extras: integer routing records ``[R, C, 2, 3]`` and float gates ``[R, C, 2]``."""
    totals = draw(st.lists(st.integers(1, max_tokens), max_size=max_sequences))
    rows, offsets, num_rows, cap = draw(placements(totals))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shape = (num_rows, cap)
    tokens, sid, pos = np.zeros(shape, np.int64), np.full(shape, -1), np.zeros(shape, np.int64)
    mask = np.zeros(shape, bool)
    floats = {name: rng.normal(size=shape) for name in TOKEN_FIELDS[2:]}   # padding too
    response = [int(rng.integers(0, n + 1)) for n in totals]
    for s, n in enumerate(totals):
        for p in range(n):
            r, c = rows[s], offsets[s] + p
            tokens[r, c], sid[r, c], pos[r, c] = rng.integers(0, 50), s, p
            mask[r, c] = p >= n - response[s] and rng.random() < 0.7
    optional = {name: torch.from_numpy(floats[name]) if draw(st.booleans()) else None
                for name in TOKEN_FIELDS[4:]}
    return TokenBatch(
        tokens=torch.from_numpy(tokens), sequence_id=torch.from_numpy(sid),
        position=torch.from_numpy(pos), loss_mask=torch.from_numpy(mask),
        advantage=torch.from_numpy(floats["advantage"]),
        loss_weight=torch.from_numpy(floats["loss_weight"]), **optional,
        reward=torch.from_numpy(rng.normal(size=len(totals))),
        group=torch.from_numpy(rng.integers(0, 3, len(totals))),
        length=torch.tensor(response, dtype=torch.long),
        prompt_index=torch.from_numpy(rng.integers(0, 5, len(totals))),
        token_extras={"routing": torch.from_numpy(rng.integers(0, 8, (*shape, 2, 3))),
                      "gate": torch.from_numpy(rng.random((*shape, 2), dtype=np.float32))})


def records(batch: TokenBatch) -> list[tuple]:
    """Per sequence: its tokens with every per-token field, in position order, and its
    sequence fields. A plain loop over the grid."""
    per_token = [(name, getattr(batch, name)) for name in TOKEN_FIELDS
                 if getattr(batch, name) is not None]
    per_token += [(f"extra:{k}", v) for k, v in sorted(batch.token_extras.items())]
    values = {name: t.tolist() for name, t in per_token}
    seqs: list[list] = [[] for _ in range(batch.num_sequences)]
    sid, pos = batch.sequence_id.tolist(), batch.position.tolist()
    for r in range(batch.num_rows):
        for c in range(batch.capacity):
            if sid[r][c] >= 0:
                seqs[sid[r][c]].append((pos[r][c],) + tuple(
                    (name, values[name][r][c]) for name, _ in per_token))
    return [(tuple(sorted(tok)),) + tuple(getattr(batch, f)[s].item() for f in SEQUENCE_FIELDS)
            for s, tok in enumerate(seqs)]


def assert_same_sequences(new: TokenBatch, old: TokenBatch, index=None) -> None:
    """New sequence k is old sequence index[k] (default: k), by three routes."""
    index = list(range(old.num_sequences)) if index is None else [int(i) for i in index]
    old_records, old_seqs = records(old), old.sequences()
    assert records(new) == [old_records[i] for i in index]
    assert new.sequences() == [old_seqs[i] for i in index]
    for name in ("advantage", "loss_weight", "behavior_logprob"):
        if getattr(old, name) is not None:
            torch.testing.assert_close(new.sequence_sum(getattr(new, name)),
                                       old.sequence_sum(getattr(old, name))[index],
                                       rtol=SUM_RTOL, atol=0)
    assert (new.token_extras.keys() == old.token_extras.keys())


def reference_first_fit_decreasing(lengths, capacity):
    """Item by item: longest first (ties by index), into the first row with room."""
    row, offset, free = [0] * len(lengths), [0] * len(lengths), []
    for s in sorted(range(len(lengths)), key=lambda s: (-lengths[s], s)):
        r = next((r for r, f in enumerate(free) if f >= lengths[s]), len(free))
        if r == len(free):
            free.append(capacity)
        row[s], offset[s] = r, capacity - free[r]
        free[r] -= lengths[s]
    return row, offset, len(free)


def reference_in_order(lengths, capacity):
    row, offset, r, used = [], [], -1, capacity
    for n in lengths:
        if used + n > capacity:
            r, used = r + 1, 0
        row.append(r)
        offset.append(used)
        used += n
    return row, offset, r + 1


def lengths_of(batch):
    return batch.sequence_lengths_total()


# ------------------------------------------------------------------ relayout and layouts
def test_every_tokenbatch_field_is_moved():
    names = {f.name for f in dataclasses.fields(TokenBatch)}
    handled = set(pk._MOVED_TOKEN_FIELDS) | set(pk._SEQUENCE_FIELDS)
    assert names == handled | {"sequence_id", "position", "token_extras"}


@settings(deadline=None)
@given(st.data())
def test_relayout_to_any_placement_preserves_every_sequence(data):
    batch = data.draw(batches())
    row, offset, num_rows, cap = data.draw(placements(lengths_of(batch).tolist()))
    new = pk.relayout(batch, row, offset, num_rows, cap)
    assert (new.num_rows, new.capacity) == (num_rows, cap)
    assert_same_sequences(new, batch)
    spans = pk.sequence_spans(new)
    assert spans.row_S.tolist() == row and spans.start_S.tolist() == offset


@settings(deadline=None)
@given(batches(), st.integers(0, 4))
def test_packed_padded_flat_layouts_preserve_every_sequence(batch, extra_capacity):
    longest = int(lengths_of(batch).max()) if batch.num_sequences else 1
    total = batch.num_real_tokens
    for new in (pk.pack_first_fit_decreasing(batch, longest + extra_capacity),
                pk.pack_in_order(batch, longest + extra_capacity),
                pk.padded_layout(batch), pk.flat_layout(batch)):
        assert_same_sequences(new, batch)
    padded, flat = pk.padded_layout(batch), pk.flat_layout(batch)
    assert padded.num_rows == batch.num_sequences and padded.capacity == longest
    assert flat.num_rows == 1 and flat.capacity == max(total, 1)
    # Padded and flat keep the sequence order: ids are non-decreasing along the rows.
    for layout in (padded, flat):
        ids = layout.sequence_id[layout.sequence_id >= 0]
        assert bool((ids[1:] >= ids[:-1]).all())


@settings(deadline=None)
@given(batches(), st.integers(0, 3), st.integers(0, 6))
def test_changing_the_row_capacity_preserves_every_sequence(batch, extra_a, extra_b):
    longest = int(lengths_of(batch).max()) if batch.num_sequences else 1
    first = pk.pack_first_fit_decreasing(batch, longest + extra_a)
    second = pk.pack_in_order(first, longest + extra_b)
    assert second.capacity == longest + extra_b
    assert_same_sequences(second, batch)


@settings(deadline=None)
@given(st.data())
def test_select_and_permute_sequences(data):
    batch = data.draw(batches())
    perm = data.draw(st.permutations(range(batch.num_sequences)))
    permuted = pk.select_sequences(batch, perm)
    assert_same_sequences(permuted, batch, perm)
    assert torch.equal(permuted.sequence_id >= 0, batch.sequence_id[
        (batch.sequence_id >= 0).any(1)] >= 0)          # same slots, only the ids change
    subset = data.draw(st.lists(st.sampled_from(range(batch.num_sequences)), unique=True)
                       if batch.num_sequences else st.just([]))
    assert_same_sequences(pk.select_sequences(batch, subset), batch, subset)
    # relayout can copy a sequence (resampling): twice sequence 0 in a flat row.
    if batch.num_sequences:
        n = int(lengths_of(batch)[0])
        twice = pk.relayout(batch, [0, 0], [0, n], 1, 2 * n, sequence_index=[0, 0])
        assert_same_sequences(twice, batch, [0, 0])


def test_routing_records_travel_with_their_tokens():
    # Two sequences of 3 and 2 tokens, padded; routing[r, c] = [[10r + c] * K] * layers.
    batch = TokenBatch.from_sequences([[1], [2]], [[3, 4], [5]])
    r, c = torch.meshgrid(torch.arange(2), torch.arange(3), indexing="ij")
    routing = (10 * r + c)[:, :, None, None].expand(2, 3, 4, 2).clone()
    flat = pk.flat_layout(batch.replace(token_extras={"routing": routing}))
    # Flat row: seq 0 (from row 0, columns 0..2), then seq 1 (row 1, columns 0..1).
    assert flat.token_extras["routing"][0, :, 0, 0].tolist() == [0, 1, 2, 10, 11]
    assert flat.token_extras["routing"].shape == (1, 5, 4, 2)


# ------------------------------------------------------------------ placements
@given(st.integers(1, 20).flatmap(lambda cap: st.tuples(
    st.lists(st.integers(1, cap), max_size=40), st.just(cap))))
def test_first_fit_decreasing_matches_item_by_item_reference(case):
    lengths, cap = case
    placement = pk.place_first_fit_decreasing(lengths, cap)
    row, offset, num_rows = reference_first_fit_decreasing(lengths, cap)
    assert placement.row_S.tolist() == row and placement.offset_S.tolist() == offset
    assert placement.num_rows == num_rows and placement.capacity == cap


@given(st.integers(1, 20).flatmap(lambda cap: st.tuples(
    st.lists(st.integers(1, cap), max_size=40), st.just(cap))))
def test_in_order_matches_next_fit_reference(case):
    lengths, cap = case
    placement = pk.place_in_order(lengths, cap)
    assert (placement.row_S.tolist(), placement.offset_S.tolist(), placement.num_rows) == \
        reference_in_order(lengths, cap)


def test_first_fit_decreasing_hand_example():
    # Lengths 5 4 3 3 2 1, capacity 6: 5 -> row 0, 4 -> row 1, 3 -> row 2, 3 -> row 2 (col 3),
    # 2 -> row 1 (col 4), 1 -> row 0 (col 5): three full rows. In order: 5 | 4 | 3 3 | 2 1.
    ffd = pk.place_first_fit_decreasing([5, 4, 3, 3, 2, 1], 6)
    assert ffd.row_S.tolist() == [0, 1, 2, 2, 1, 0]
    assert ffd.offset_S.tolist() == [0, 0, 0, 3, 4, 5]
    assert ffd.num_rows == 3
    in_order = pk.place_in_order([5, 4, 3, 3, 2, 1], 6)
    assert in_order.row_S.tolist() == [0, 1, 2, 2, 3, 3] and in_order.num_rows == 4


def test_first_fit_decreasing_fills_rows_of_log_normal_lengths():
    rng = np.random.default_rng(0)
    lengths = np.clip(np.rint(rng.lognormal(np.log(200), 1.0, 5000)), 1, 4096).astype(np.int64)
    placement = pk.place_first_fit_decreasing(lengths, 4096)
    fill = lengths.sum() / (placement.num_rows * 4096)
    assert fill >= FFD_MIN_FILL


def test_fill_fraction_hand_example():
    # Padded: rows of 3 and 2 tokens with capacity 3 -> 5 / 6; flat: 5 / 5.
    batch = TokenBatch.from_sequences([[1], [2]], [[3, 4], [5]])
    assert pk.fill_fraction(batch) == pytest.approx(5 / 6)
    assert pk.fill_fraction(pk.flat_layout(batch)) == 1.0


# ------------------------------------------------------------------ micro-batches
def check_micro_batches(parts, batch):
    index = torch.cat([p.sequence_index for p in parts])
    assert sorted(index.tolist()) == list(range(batch.num_sequences))   # every sequence once
    assert torch.cat([p.row_index for p in parts]).tolist() == list(range(batch.num_rows))
    old = records(batch)
    for p in parts:
        assert records(p.batch) == [old[i] for i in p.sequence_index.tolist()]
        assert torch.equal(p.batch.tokens, batch.tokens[p.row_index])
    loss = sum(float((p.batch.loss_weight * p.batch.advantage)[p.batch.loss_mask].sum())
               for p in parts)
    full = float((batch.loss_weight * batch.advantage)[batch.loss_mask].sum())
    assert loss == pytest.approx(full, rel=SUM_RTOL, abs=SUM_RTOL)


@settings(deadline=None)
@given(st.data())
def test_micro_batches_cover_every_sequence_once(data):
    batch = data.draw(batches())
    num = data.draw(st.integers(1, batch.num_rows))
    parts = pk.split_micro_batches(batch, num)
    assert len(parts) == num
    sizes = [p.batch.num_rows for p in parts]
    assert max(sizes) - min(sizes) <= 1
    check_micro_batches(parts, batch)
    max_tokens = data.draw(st.integers(batch.capacity, 4 * batch.capacity))
    parts = pk.split_micro_batches(batch, max_tokens=max_tokens)
    assert all(p.batch.num_rows * batch.capacity <= max_tokens for p in parts)
    assert all(p.batch.num_rows == max_tokens // batch.capacity for p in parts[:-1])
    check_micro_batches(parts, batch)


# ------------------------------------------------------------------ bad input
def _batch():
    return TokenBatch.from_sequences([[1, 2], [3]], [[4], [5, 6, 7]])   # 3 and 4 tokens


@pytest.mark.parametrize(("call", "argument"), [
    (lambda b: pk.pack_first_fit_decreasing(b, 3), "capacity"),
    (lambda b: pk.pack_in_order(b, 3), "capacity"),
    (lambda b: pk.padded_layout(b, 3), "capacity"),
    (lambda b: pk.flat_layout(b, 6), "capacity"),
    (lambda b: pk.pack_first_fit_decreasing(b, 0), "capacity"),
    (lambda b: pk.place_first_fit_decreasing([3, 0], 4), "lengths_S"),
    (lambda b: pk.place_in_order([[3]], 4), "lengths_S"),
    (lambda b: pk.split_micro_batches(b, 0), "num_micro_batches"),
    (lambda b: pk.split_micro_batches(b, 3), "num_micro_batches"),
    (lambda b: pk.split_micro_batches(b), "num_micro_batches, max_tokens"),
    (lambda b: pk.split_micro_batches(b, 1, max_tokens=8), "num_micro_batches, max_tokens"),
    (lambda b: pk.split_micro_batches(b, max_tokens=3), "max_tokens"),
    (lambda b: pk.relayout(b, [0, 0], [0, 2], 1, 8), "overlap"),
    (lambda b: pk.relayout(b, [0, 1], [0, 0], 1, 8), "row_S"),
    (lambda b: pk.relayout(b, [0], [0], 2, 8), "row_S"),
    (lambda b: pk.relayout(b, [0, 1], [-1, 0], 2, 8), "offset_S"),
    (lambda b: pk.relayout(b, [0, 0], [0, 3], 1, 6), "capacity"),
    (lambda b: pk.relayout(b, [0], [0], 1, 8, sequence_index=[2]), "sequence_index"),
    (lambda b: pk.select_sequences(b, [1, 1]), "sequence_index"),
])
def test_bad_input_raises_value_error_naming_the_argument(call, argument):
    with pytest.raises(ValueError, match=argument):
        call(_batch())


# ------------------------------------------------------------------ step counts
def test_counts_without_distributed_are_local():
    batch = _batch()
    assert dd.global_counts(batch) == (4, 2)
    assert dd.data_parallel_loss_scale() == 1


def _counts_worker(rank, world_size, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    # Rank r holds r + 1 sequences of one prompt and two response tokens each.
    batch = TokenBatch.from_sequences([[1]] * (rank + 1), [[2, 3]] * (rank + 1))
    torch.save((tuple(dd.global_counts(batch)), dd.data_parallel_loss_scale()),
               f"{out_dir}/{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_counts_are_summed_over_ranks(tmp_path):
    # Ranks hold 1 and 2 sequences: 3 sequences and 6 loss tokens in all, world size 2.
    mp.start_processes(_counts_worker, args=(2, str(tmp_path / "init"), str(tmp_path)),
                       nprocs=2, start_method="fork")
    for rank in range(2):
        assert torch.load(tmp_path / f"{rank}.pt") == ((6, 3), 2)
