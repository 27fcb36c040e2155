"""What the strategies generate, not only that it is valid: over a fixed (derandomized) run of
examples, every case a property test relies on is drawn — partial loss masks, empty responses,
binary and Gaussian rewards, each log-prob field present and absent, every layout kind with and
without a permutation and extra capacity, both kinds of micro-batch split, every aggregation,
every reward kind of the MDPs — and a case switched off is never drawn.

A strategy that silently stopped drawing one of these (say, never clearing a loss-mask token)
would leave every property test green while no longer exercising that case. The runs are
derandomized and the thresholds keep a wide margin: the counts still move with Hypothesis'
internal state (they differ a little when other Hypothesis tests ran first in the process), but
a case the strategy still draws is seen many times over, and one it stopped drawing never.
"""

from __future__ import annotations

import collections

import torch
from hypothesis import HealthCheck, given, settings

from tokenmdp import estimators as est_lib
from tokenmdp import testing
from tokenmdp.exact.world import rewards

#: examples per run; the common cases below come with probability >= 1/5 per example (seen
#: >= 30 times in 200 runs of other orders), the rare ones (a response whose every token is
#: cleared, unequal binary rewards) >= 1/40 (seen >= 6 times in 200).
EXAMPLES = 300
RARE = ("response without loss tokens", "binary rewards, not all equal")
COVERAGE = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck))


def _collect(strategy, observe) -> collections.Counter:
    """Counts of ``observe(example)`` (an iterable of labels) over one derandomized run."""
    seen: collections.Counter = collections.Counter()

    @COVERAGE
    @given(strategy)
    def run(example):
        seen.update(observe(example))
    run()
    return seen


def _batch_labels(batch):
    response = batch.response_mask
    if bool((response & ~batch.loss_mask).any()):
        yield "partial loss mask"
    if bool((batch.length == 0).any()):
        yield "empty response"
    if bool(((batch.length > 0) & (batch.sequence_sum(batch.loss_mask.to(batch.dtype)) == 0))
            .any()):
        yield "response without loss tokens"
    binary = bool(((batch.reward == 0) | (batch.reward == 1)).all())
    yield "binary rewards" if binary else "gaussian rewards"
    if binary and batch.num_sequences > 1 and bool((batch.reward != batch.reward[0]).any()):
        yield "binary rewards, not all equal"
    for name in ("behavior_logprob", "old_logprob", "ref_logprob"):
        yield f"{name} {'set' if getattr(batch, name) is not None else 'unset'}"
    yield f"{int(torch.bincount(batch.group).numel())} groups"


def test_token_batches_draw_partial_masks_empty_responses_and_every_field_choice():
    seen = _collect(testing.token_batches(), _batch_labels)
    for label in ("partial loss mask", "empty response", "binary rewards", "gaussian rewards",
                  "1 groups", "2 groups", "3 groups",
                  *(f"{name} {state}" for name in ("behavior_logprob", "old_logprob",
                                                   "ref_logprob") for state in ("set", "unset"))):
        assert seen[label] >= EXAMPLES // 20, (label, seen)
    for label in RARE:
        assert seen[label] > 0, (label, seen)


def test_token_batches_without_partial_masks_never_clear_a_response_token():
    seen = _collect(testing.token_batches(partial_loss_mask=False), _batch_labels)
    assert seen["partial loss mask"] == 0 and seen["response without loss tokens"] == 0
    assert seen["empty response"] > 0                    # the other cases are still drawn


def test_token_batches_with_edge_masks_always_hold_a_masked_and_a_partly_masked_response():
    seen = _collect(testing.token_batches(edge_masks=True), _edge_labels)
    assert seen["masked response"] == seen["partly masked response"] == EXAMPLES, seen
    assert seen["empty response"] > 0 and seen["2 groups"] > 0       # still drawn around them


def _edge_labels(batch):
    counts = batch.sequence_sum(batch.loss_mask.to(batch.dtype))
    if int(batch.length[0]) > 0 and float(counts[0]) == 0:
        yield "masked response"
    if 0 < float(counts[1]) < int(batch.length[1]):
        yield "partly masked response"
    yield from (label for label in _batch_labels(batch) if label in ("empty response",
                                                                      "2 groups"))


def test_token_batches_with_logprobs_fixed_set_all_or_none():
    for flag in (True, False):
        seen = _collect(testing.token_batches(with_logprobs=flag), _batch_labels)
        state = "set" if flag else "unset"
        for name in ("behavior_logprob", "old_logprob", "ref_logprob"):
            assert seen[f"{name} {state}"] == EXAMPLES, (flag, seen)


def test_layouts_draw_every_kind_with_and_without_permutation_and_extra_capacity():
    seen = _collect(testing.layouts(), lambda lay: [
        (lay.kind, lay.permutation_seed is not None), ("extra", lay.extra_capacity > 0)])
    for kind in testing.LAYOUT_KINDS:
        for permuted in (True, False):
            assert seen[(kind, permuted)] > 0, (kind, permuted, seen)
    assert seen[("extra", True)] > 0 and seen[("extra", False)] > 0
    fixed = _collect(testing.layouts(permute=False), lambda lay: [lay.permutation_seed])
    assert set(fixed) == {None}


def test_micro_batch_splits_draw_both_kinds_every_count_and_optional_layouts():
    seen = _collect(testing.micro_batch_splits(max_micro_batches=4), lambda s: [
        ("by_rows", s.by_rows), ("count", s.num_micro_batches), ("layout", s.layout is not None)])
    for label in (("by_rows", True), ("by_rows", False), ("layout", True), ("layout", False),
                  *(("count", k) for k in range(1, 5))):
        assert seen[label] > 0, (label, seen)
    assert {k for _, k in seen if isinstance(k, int) and not isinstance(k, bool)} == {1, 2, 3, 4}


def test_estimators_draw_every_requested_aggregation():
    aggregations = tuple(est_lib.Aggregation)
    seen = _collect(testing.estimators(aggregations=aggregations), lambda e: [e.aggregation])
    assert set(seen) == set(aggregations)


def test_mdps_draw_every_reward_kind_and_size():
    seen = _collect(testing.mdps(max_vocab_size=4, max_len=3, max_prompts=3),
                    lambda m: [type(m.reward_fn).__name__, ("vocab", m.vocab_size),
                               ("len", m.max_len), ("prompts", m.num_prompts)])
    for label in (rewards.RandomTable.__name__, rewards.LengthReward.__name__,
                  rewards.TokenCount.__name__, rewards.Parity.__name__,
                  *(("vocab", v) for v in (2, 3, 4)), *(("len", n) for n in (1, 2, 3)),
                  *(("prompts", n) for n in (1, 2, 3))):
        assert seen[label] > 0, (label, seen)
