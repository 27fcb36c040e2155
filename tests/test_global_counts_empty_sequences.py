"""``global_counts`` (one process, no process group) counts what ``count_step`` counts: loss
tokens, and only the sequences with one — an empty response, a wholly loss-masked one, or one
whose tokens ``mask`` drops is not a sequence of the mean. Hand-counted."""

from __future__ import annotations

from tokenmdp.batch import TokenBatch
from tokenmdp.distributed import global_counts
from tokenmdp.estimators import count_step

# responses: 2 tokens, empty, 3 tokens (loss mask cleared), 1 token, empty
RESPONSES = [[3, 3], [], [4, 4, 4], [5], []]


def _batch() -> TokenBatch:
    batch = TokenBatch.from_sequences([[1, 2]] * len(RESPONSES), RESPONSES)
    return batch.replace(loss_mask=batch.loss_mask & (batch.sequence_id != 2))


def test_global_counts_skip_sequences_without_loss_tokens():
    batch = _batch()
    counts = global_counts(batch)
    assert (counts.num_loss_tokens, counts.num_sequences) == (3, 2)
    assert (counts.num_loss_tokens, counts.num_sequences) == count_step(batch)


def test_global_counts_skip_sequences_whose_tokens_the_mask_drops():
    batch = _batch()
    mask = batch.loss_mask & (batch.sequence_id != 3)
    counts = global_counts(batch, mask=mask)
    assert (counts.num_loss_tokens, counts.num_sequences) == (2, 1)
    assert (counts.num_loss_tokens, counts.num_sequences) == count_step(batch, mask)


def test_global_counts_of_a_batch_of_empty_responses_are_zero():
    batch = TokenBatch.from_sequences([[1], [2, 2]], [[], []])
    counts = global_counts(batch)
    assert (counts.num_loss_tokens, counts.num_sequences) == (0, 0)
    packed = TokenBatch.from_sequences([[1], [2, 2]], [[3], []])
    assert (global_counts(packed).num_loss_tokens, global_counts(packed).num_sequences) == (1, 1)
