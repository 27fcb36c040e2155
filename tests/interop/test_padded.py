"""Tests of tokenmdp.interop.padded: the Hugging Face round trip is lossless, left padding reads like
right padding, token lists build the same batch as ``TokenBatch.from_sequences``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmdp import TokenBatch
from tokenmdp.interop.padded import IGNORE_INDEX, from_hf, from_token_lists, to_hf
from tokenmdp.packing import pack_in_order, padded_layout

PAD = 99                  # a pad token id that is also a real token id of the fixtures


@st.composite
def batches(draw):
    """Random (prompt, response) lists with random optional fields, a random loss mask inside
    the responses and routing extras, laid out padded or packed in order."""
    num_seq = draw(st.integers(0, 6))
    prompts = draw(st.lists(st.lists(st.integers(0, 120), max_size=4), min_size=num_seq,
                            max_size=num_seq))
    responses = [draw(st.lists(st.integers(0, 120), min_size=0 if p else 1, max_size=4))
                 for p in prompts]
    batch = TokenBatch.from_sequences(prompts, responses,
                                      rewards=draw(st.lists(st.floats(-2, 2), min_size=num_seq,
                                                            max_size=num_seq)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shape = tuple(batch.tokens.shape)
    real = batch.sequence_id >= 0
    changes = {name: torch.from_numpy(rng.normal(size=shape)) * real
               for name in ("advantage", "loss_weight", "behavior_logprob", "old_logprob",
                            "ref_logprob") if draw(st.booleans())}
    changes["loss_mask"] = batch.loss_mask & torch.from_numpy(rng.random(shape) < 0.7)
    changes["token_extras"] = {"routing": torch.from_numpy(rng.integers(0, 8, (*shape, 2, 2)))}
    batch = batch.replace(**changes)
    if num_seq and draw(st.booleans()):
        batch = pack_in_order(batch, batch.capacity + draw(st.integers(0, 5)))
    return batch


def assert_batches_equal(a: TokenBatch, b: TokenBatch) -> None:
    """Every field equal in shape and value (float fields also in dtype)."""
    for f in dataclasses.fields(TokenBatch):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "token_extras":
            assert x.keys() == y.keys()
            pairs = [(x[k], y[k]) for k in x]
        elif x is None or y is None:
            assert x is None and y is None, f.name
            pairs = []
        else:
            pairs = [(x, y)]
        for u, v in pairs:
            assert u.shape == v.shape, f.name
            assert bool((u == v).all()), f.name
            assert u.dtype.is_floating_point == v.dtype.is_floating_point, f.name
            if u.dtype.is_floating_point:
                assert u.dtype == v.dtype, f.name


@settings(deadline=None)
@given(batches(), st.sampled_from([0, PAD]))
def test_hf_round_trip_is_lossless(batch, pad):
    hf, fields = to_hf(batch, pad_token_id=pad)
    back = from_hf(**hf, **fields)
    assert_batches_equal(back, padded_layout(batch))
    assert back.sequences() == batch.sequences()


@settings(deadline=None)
@given(batches())
def test_hf_tensors_hold_the_sequences_right_padded(batch):
    hf, _ = to_hf(batch, pad_token_id=PAD)
    seqs = batch.sequences()
    width = max((len(p) + len(r) for p, r in seqs), default=1)
    assert hf["input_ids"].shape == (len(seqs), width)
    for s, (prompt, response) in enumerate(seqs):     # independent: built from the lists
        n = len(prompt) + len(response)
        assert hf["input_ids"][s].tolist() == prompt + response + [PAD] * (width - n)
        assert hf["attention_mask"][s].tolist() == [1] * n + [0] * (width - n)
    labels = hf["labels"]
    assert int((labels != IGNORE_INDEX).sum()) == batch.num_loss_tokens


@settings(deadline=None)
@given(batches())
def test_left_padding_reads_like_right_padding(batch):
    hf, fields = to_hf(batch, pad_token_id=PAD)
    shift = (hf["attention_mask"] == 0).sum(1).tolist()     # right -> left: roll each row

    def left(t):
        if isinstance(t, dict):
            return {k: left(v) for k, v in t.items()}
        if t.dim() < 2:
            return t
        return torch.stack([torch.roll(row, k, 0) for row, k in zip(t, shift, strict=True)]) \
            if len(shift) else t

    left_hf = {k: left(v) for k, v in hf.items()}
    left_fields = {k: left(v) for k, v in fields.items()}
    assert_batches_equal(from_hf(**left_hf, **left_fields), from_hf(**hf, **fields))


def test_from_hf_hand_example_with_left_padding_and_defaults():
    # Row 0 is left-padded: tokens 5 6 7, labels on 6 7 -> prompt [5], response [6, 7].
    # Row 1: labels on 9, 11, 12 -> the response starts at the first label: [9, 10, 11, 12]
    # (10 is a response token without loss, e.g. a tool output).
    batch = from_hf(input_ids=[[PAD, PAD, 5, 6, 7], [8, 9, 10, 11, 12]],
                    attention_mask=[[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]],
                    labels=[[-100, -100, -100, 6, 7], [-100, 9, -100, 11, 12]])
    assert batch.sequences() == [([5], [6, 7]), ([8], [9, 10, 11, 12])]
    assert batch.tokens.tolist() == [[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]]
    assert batch.loss_mask.tolist() == [[False, True, True, False, False],
                                        [False, True, False, True, True]]
    assert batch.advantage.tolist() == batch.loss_mask.double().tolist()   # default weights 1
    assert batch.reward.tolist() == [0.0, 0.0] and batch.group.tolist() == [0, 1]
    assert batch.dtype == torch.float64
    # Back to Hugging Face: right padding now, the same labels.
    hf, _ = to_hf(batch, pad_token_id=PAD)
    assert hf["input_ids"].tolist() == [[5, 6, 7, PAD, PAD], [8, 9, 10, 11, 12]]
    assert hf["labels"].tolist() == [[-100, 6, 7, -100, -100], [-100, 9, -100, 11, 12]]


def test_hf_dict_survives_tokenmdp_and_back():
    hf = {"input_ids": torch.tensor([[3, 4, 5, PAD], [6, 7, PAD, PAD]]),
          "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]),
          "labels": torch.tensor([[-100, 4, 5, -100], [-100, 7, -100, -100]])}
    again, _ = to_hf(from_hf(**hf), pad_token_id=PAD, capacity=4)
    assert all(torch.equal(again[k], hf[k]) for k in hf)


def test_from_token_lists_matches_from_sequences():
    # [1, 2, 3] with a 2-token response, [4, 5] with a 1-token response.
    lists = from_token_lists([[1, 2, 3], [4, 5]], response_lengths=[2, 1], rewards=[1.0, 0.5],
                             groups=[0, 0])
    reference = TokenBatch.from_sequences([[1], [4]], [[2, 3], [5]], rewards=[1.0, 0.5],
                                          groups=[0, 0])
    assert_batches_equal(lists, reference)


def test_from_token_lists_defaults():
    # Pretraining: every token but the first is predicted.
    batch = from_token_lists([[1, 2, 3], [4]])
    assert batch.length.tolist() == [2, 0]
    assert batch.loss_mask.tolist() == [[False, True, True], [False, False, False]]
    # A loss mask with a hole: the response starts at its first loss token.
    batch = from_token_lists([[1, 2, 3, 4], [5, 6]], loss_masks=[[0, 1, 0, 1], [0, 0]],
                             capacity=6)
    assert batch.length.tolist() == [3, 0] and batch.capacity == 6
    assert batch.loss_mask[0, :4].tolist() == [False, True, False, True]


@pytest.mark.parametrize(("call", "argument"), [
    (lambda: from_hf([1, 2, 3]), "input_ids"),
    (lambda: from_hf([[1, 2]], attention_mask=[[1, 1, 1]]), "attention_mask"),
    (lambda: from_hf([[1, 2, 3]], attention_mask=[[1, 0, 1]]), "attention_mask"),
    (lambda: from_hf([[1, 2]], attention_mask=[[0, 0]]), "attention_mask"),
    (lambda: from_hf([[1, 2]], labels=[[-100, 3]]), "labels"),
    (lambda: from_hf([[1, 2]], attention_mask=[[1, 0]], labels=[[-100, 2]]), "labels"),
    (lambda: from_hf([[1, 2]], length=[1, 1]), "length"),
    (lambda: from_hf([[1, 2]], advantage=[[1.0]]), "advantage"),
    (lambda: from_token_lists([[1], []]), "token_lists"),
    (lambda: from_token_lists([[1, 2]], loss_masks=[[1]]), "loss_masks"),
    (lambda: from_token_lists([[1, 2]], response_lengths=[3]), "response_lengths"),
    (lambda: from_token_lists([[1, 2]], capacity=1), "capacity"),
])
def test_bad_input_raises_value_error_naming_the_argument(call, argument):
    with pytest.raises(ValueError, match=argument):
        call()


def test_from_hf_float_dtype_follows_given_tensors_and_never_casts():
    # Lists take the default float64; a float32 tensor sets the dtype of the defaults.
    assert from_hf([[1, 2]], reward=[0.5], advantage=[[0.0, 1.0]]).dtype == torch.float64
    batch = from_hf([[1, 2]], reward=torch.tensor([0.5], dtype=torch.float32))
    assert batch.dtype == torch.float32 and batch.loss_weight.dtype == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        from_hf([[1, 2]], reward=torch.tensor([0.5], dtype=torch.float32),
                advantage=torch.zeros(1, 2, dtype=torch.float64))
