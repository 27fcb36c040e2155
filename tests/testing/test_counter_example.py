"""The counter-example: per-micro-batch normalization fails the micro-batch check, and
Hypothesis finds it and shrinks it to a small step.

:func:`tokenmdp.testing.per_micro_batch_token_mean` normalizes each micro-batch by its own loss
tokens. Accumulated as frameworks did (the mean of the micro-batch losses) it equals the step's
token mean only when every micro-batch holds the same number of loss tokens, so the smallest
failing step is two sequences whose responses differ in length, one per micro-batch.
"""

from __future__ import annotations

from hypothesis import HealthCheck, find, settings
from hypothesis import strategies as st

from tokenmdp import estimators as est_lib
from tokenmdp import testing
from tokenmdp.batch import TokenBatch

#: a shrunk failing step has at most this many sequences (the minimum is 2, one group)
MAX_SHRUNK_SEQUENCES = 3
FIND_SETTINGS = settings(max_examples=200, database=None, deadline=None, derandomize=True,
                         suppress_health_check=[HealthCheck.too_slow])
# REINFORCE with a group-mean baseline and the step's token mean: needs no old log-probs.
ESTIMATOR = est_lib.Estimator(surrogate=est_lib.Reinforce(), advantage=est_lib.GroupMean(),
                              aggregation=est_lib.Aggregation.TOKEN_MEAN)
PREPARE = testing.estimator_prepare(ESTIMATOR)
COUNTER_EXAMPLE = testing.per_micro_batch_token_mean(ESTIMATOR)


@st.composite
def cases(draw):
    batch = draw(testing.token_batches(with_logprobs=False, max_groups=2, max_response_len=3))
    return batch, draw(testing.micro_batch_splits(max_micro_batches=3))


def _check(loss_fn, batch, split) -> testing.InvarianceReport:
    return testing.check_micro_batch_invariance(loss_fn, batch, [split], prepare=PREPARE,
                                                average_micro_batches=True)


def test_hypothesis_finds_and_shrinks_the_per_micro_batch_normalization_bug():
    batch, split = find(cases(), lambda case: not _check(COUNTER_EXAMPLE, *case).ok,
                        settings=FIND_SETTINGS)
    parts = split(PREPARE(batch))
    assert 2 <= batch.num_sequences <= MAX_SHRUNK_SEQUENCES
    assert len(parts) == 2
    # Why it fails: the micro-batches hold different numbers of loss tokens.
    assert len({p.num_loss_tokens for p in parts}) == 2
    # One micro-batch (the whole step): the counter-example is the token-mean loss.
    assert _check(COUNTER_EXAMPLE, batch, lambda b: [b]).ok


def test_the_counter_example_passes_when_micro_batches_hold_equal_token_counts():
    # Responses of 2 and 2 tokens, one per micro-batch: the mean of means is the token mean.
    batch = TokenBatch.from_sequences([[1], [1]], [[2, 3], [3, 2]], rewards=[1.0, 0.0],
                                      groups=[0, 0])
    assert _check(COUNTER_EXAMPLE, batch, testing.MicroBatchSplit(2)).ok


def test_the_counter_example_fails_on_unequal_token_counts_and_the_step_weights_pass():
    # Responses of 1 and 3 tokens, advantages +-1/2, one micro-batch each. Token mean over the
    # step: weight 1/4 per token; mean of micro-batch means: 1/2 and 1/6. Different gradients.
    batch = TokenBatch.from_sequences([[1], [1]], [[2], [3, 3, 2]], rewards=[1.0, 0.0],
                                      groups=[0, 0])
    split = testing.MicroBatchSplit(2)
    report = _check(COUNTER_EXAMPLE, batch, split)
    assert report.gradient_difference > report.gradient_tolerance
    # Summed instead of averaged it fails too (twice the token mean here).
    summed = testing.check_micro_batch_invariance(COUNTER_EXAMPLE, batch, [split], prepare=PREPARE)
    assert not summed.ok
    # The estimator's own loss, reading the step's weights, passes when summed.
    testing.check_micro_batch_invariance(testing.estimator_loss(ESTIMATOR), batch, [split],
                                         prepare=PREPARE, raise_on_failure=True)
