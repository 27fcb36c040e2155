"""``global_counts`` (one process, no process group) counts what ``count_step`` counts: loss
tokens, and every sampled sequence by default; with ``sequences="with-loss-tokens"`` only the
sequences with a loss token (an empty response, a wholly loss-masked one, or one whose tokens
``mask`` drops is not a sequence of the mean). Hand-counted."""

from __future__ import annotations

import pytest

from tokenmdp.batch import TokenBatch
from tokenmdp.distributed import global_counts
from tokenmdp.estimators import count_step

# responses: 2 tokens, empty, 3 tokens (loss mask cleared), 1 token, empty
RESPONSES = [[3, 3], [], [4, 4, 4], [5], []]


def _batch() -> TokenBatch:
    batch = TokenBatch.from_sequences([[1, 2]] * len(RESPONSES), RESPONSES)
    return batch.replace(loss_mask=batch.loss_mask & (batch.sequence_id != 2))


WITH = "with-loss-tokens"


def test_global_counts_skip_sequences_without_loss_tokens():
    batch = _batch()
    counts = global_counts(batch, sequences=WITH)
    assert (counts.num_loss_tokens, counts.num_sequences) == (3, 2)
    assert (counts.num_loss_tokens, counts.num_sequences) == count_step(batch, sequences=WITH)


def test_global_counts_count_every_sampled_sequence_by_default():
    batch = _batch()
    counts = global_counts(batch)
    assert (counts.num_loss_tokens, counts.num_sequences) == (3, 5)
    assert (counts.num_loss_tokens, counts.num_sequences) == count_step(batch)


def test_global_counts_skip_sequences_whose_tokens_the_mask_drops():
    batch = _batch()
    mask = batch.loss_mask & (batch.sequence_id != 3)
    counts = global_counts(batch, mask=mask, sequences=WITH)
    assert (counts.num_loss_tokens, counts.num_sequences) == (2, 1)
    assert (counts.num_loss_tokens, counts.num_sequences) == count_step(batch, mask,
                                                                        sequences=WITH)
    assert tuple(global_counts(batch, mask=mask)) == count_step(batch, mask) == (2, 5)


def test_global_counts_of_a_batch_of_empty_responses():
    batch = TokenBatch.from_sequences([[1], [2, 2]], [[], []])
    assert tuple(global_counts(batch, sequences=WITH)) == (0, 0)
    assert tuple(global_counts(batch)) == (0, 2)
    packed = TokenBatch.from_sequences([[1], [2, 2]], [[3], []])
    assert tuple(global_counts(packed, sequences=WITH)) == (1, 1)
    assert tuple(global_counts(packed)) == (1, 2)


def test_a_bad_sequence_count_is_refused():
    with pytest.raises(ValueError, match="sequences"):
        global_counts(_batch(), sequences="all")
