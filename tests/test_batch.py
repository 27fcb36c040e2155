"""TokenBatch: construction, validation naming the field, per-sequence reductions, conversions."""

import pytest
import torch

from tokenmdp import TokenBatch


def small_batch(**kw):
    # sequence 0: prompt [5], response [6, 7]; sequence 1: prompt [1, 2], response [3]
    return TokenBatch.from_sequences([[5], [1, 2]], [[6, 7], [3]], rewards=[1.0, -1.0],
                                     groups=[0, 0], **kw)


def packed_copy(batch):
    """The same two sequences packed into one row of capacity 7 (one padding slot at the end),
    in the opposite order, built by hand."""
    return TokenBatch(
        tokens=torch.tensor([[1, 2, 3, 5, 6, 7, 0]]),
        sequence_id=torch.tensor([[1, 1, 1, 0, 0, 0, -1]]),
        position=torch.tensor([[0, 1, 2, 0, 1, 2, 0]]),
        loss_mask=torch.tensor([[False, False, True, False, True, True, False]]),
        advantage=torch.tensor([[0, 0, 1.0, 0, 1.0, 1.0, 0]], dtype=torch.float64),
        loss_weight=torch.tensor([[0, 0, 1.0, 0, 1.0, 1.0, 0]], dtype=torch.float64),
        reward=batch.reward, group=batch.group, length=batch.length,
        prompt_index=batch.prompt_index)


def test_from_sequences_lays_out_one_sequence_per_row():
    b = small_batch()
    assert (b.num_rows, b.capacity, b.num_sequences, b.num_loss_tokens) == (2, 3, 2, 3)
    assert b.tokens.tolist() == [[5, 6, 7], [1, 2, 3]]
    assert b.loss_mask.tolist() == [[False, True, True], [False, False, True]]
    assert b.length.tolist() == [2, 1]
    assert b.sequences() == [([5], [6, 7]), ([1, 2], [3])]
    assert b.dtype == torch.float64


def test_sequence_sum_and_response_position_do_not_depend_on_layout():
    padded = small_batch()
    packed = packed_copy(padded)
    values = torch.arange(1.0, 8.0, dtype=torch.float64)
    # per-token values keyed by (sequence, position), written into each layout
    def fill(batch):
        out = torch.zeros(batch.tokens.shape, dtype=torch.float64)
        real = batch.sequence_id >= 0
        out[real] = values[batch.sequence_id[real] * 3 + batch.position[real]]
        return out
    assert padded.sequence_sum(fill(padded)).tolist() == packed.sequence_sum(fill(packed)).tolist()
    assert packed.sequence_sum(fill(packed)).tolist() == [1 + 2 + 3, 4 + 5 + 6]
    assert packed.response_position.tolist() == [[-1, -1, 0, -1, 0, 1, -1]]
    assert packed.sequences() == padded.sequences()
    torch.testing.assert_close(packed.to_tokens(packed.reward),
                               torch.tensor([[-1.0, -1, -1, 1, 1, 1, 0]], dtype=torch.float64))


def test_sequence_sum_is_differentiable():
    b = small_batch()
    x = torch.ones(b.tokens.shape, dtype=torch.float64, requires_grad=True)
    (b.sequence_sum(x * b.loss_mask) * torch.tensor([2.0, 3.0], dtype=torch.float64)).sum()\
        .backward()
    assert x.grad.tolist() == [[0, 2, 2], [0, 0, 3]]


def test_to_casts_only_floats_and_keeps_values():
    b = small_batch(behavior_logprobs=[[-0.5, -1.0], [-2.0]])
    c = b.to(dtype=torch.float32)
    assert c.advantage.dtype == c.reward.dtype == c.behavior_logprob.dtype == torch.float32
    assert c.tokens.dtype == torch.long
    assert c.behavior_logprob.tolist() == [[0, -0.5, -1.0], [0, 0, -2.0]]
    with pytest.raises(TypeError, match="dtype"):
        b.to(dtype=torch.long)


def test_replace_revalidates():
    b = small_batch()
    assert b.replace(advantage=b.advantage * 2).advantage.sum() == 6
    with pytest.raises(ValueError, match="TokenBatch.advantage"):
        b.replace(advantage=b.advantage[:, :2])


@pytest.mark.parametrize("field, value, match", [
    ("tokens", torch.zeros(2, 3, 1, dtype=torch.long), "tokens: expected shape"),
    ("tokens", torch.tensor([[5, 6, 7], [1, 2, -3]]), "tokens: contains negative"),
    ("sequence_id", torch.tensor([[0, 0, 0], [1, 1, 2]]), "sequence_id: values"),
    ("sequence_id", torch.tensor([[0, 0, 0], [0, 0, 0]]), "sequence_id: every sequence id"),
    ("position", torch.tensor([[0, 2, 1], [0, 1, 2]]), "position: each sequence"),
    ("loss_mask", torch.tensor([[True, True, True], [False, False, True]]), "loss_mask: set on "
     "prompt"),
    ("advantage", torch.tensor([[0, 1.0, float("nan")], [0, 0, 1.0]], dtype=torch.float64),
     "advantage: contains non-finite"),
    ("loss_weight", torch.ones(2, 3, dtype=torch.float32), "loss_weight: dtype"),
    ("reward", torch.zeros(3, dtype=torch.float64), "reward: shape"),
    ("reward", torch.zeros(2, dtype=torch.float32), "reward: dtype"),
    ("advantage", torch.zeros(2, 3), "advantage: dtype"),
    ("length", torch.tensor([4, 1]), "length: response length exceeds"),
    ("group", torch.tensor([0, -1]), "group: contains negative"),
    ("old_logprob", torch.zeros(2, 2, dtype=torch.float64), "old_logprob: shape"),
    ("tokens", [[1]], "tokens: expected a torch.Tensor"),
])
def test_malformed_batches_raise_naming_the_field(field, value, match):
    with pytest.raises((ValueError, TypeError), match=f"TokenBatch.{match}"):
        small_batch().replace(**{field: value})


def test_loss_mask_on_padding_is_rejected():
    b = TokenBatch.from_sequences([[1]], [[2]], capacity=3)
    with pytest.raises(ValueError, match="TokenBatch.loss_mask: set on padding"):
        b.replace(loss_mask=torch.tensor([[False, True, True]]))


def test_missing_sequence_is_rejected():
    b = small_batch()
    with pytest.raises(ValueError, match="sequence_id: every sequence id"):
        b.replace(sequence_id=torch.tensor([[0, 0, 0], [-1, -1, -1]]),
                  loss_mask=torch.tensor([[False, True, True], [False, False, False]]))


def test_empty_batch_is_allowed_and_counts_zero():
    b = TokenBatch.from_sequences([], [])
    assert b.num_sequences == 0 and b.num_loss_tokens == 0
    assert b.sequence_sum(b.advantage).shape == (0,)


def test_from_sequences_rejects_bad_arguments():
    with pytest.raises(ValueError, match="prompts and responses"):
        TokenBatch.from_sequences([[1]], [])
    with pytest.raises(ValueError, match="capacity"):
        TokenBatch.from_sequences([[1]], [[2, 3]], capacity=2)
    with pytest.raises(ValueError, match="behavior_logprobs\\[0\\]"):
        TokenBatch.from_sequences([[1]], [[2, 3]], behavior_logprobs=[[-1.0]])
    with pytest.raises(ValueError, match="sequence 0 is empty"):
        TokenBatch.from_sequences([[]], [[]])
