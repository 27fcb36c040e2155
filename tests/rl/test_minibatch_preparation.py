"""The trainer's per-mini-batch preparation: each mini-batch is its own optimizer step, so its
loss weights are those :func:`tokenmdp.estimators.prepare` gives it alone — masked-IS rejects
that leave the normalizer included — and the shuffle into mini-batches is a partition.

The batch (one group of 4 in the step, ``old_logprob = 0``) has the behaviour log-probs set so
that ``w = π_old/μ = e`` on the tokens marked ``R`` below, above the MIS threshold 2:

    sequence 0: ``5 6 7``  (``. R .``)   sequence 1: ``5 6``  (``R R``, wholly rejected)
    sequence 2: ``5``      (``.``)       sequence 3: ``6 7``  (``. .``)

so 8 loss tokens in 4 sequences, of which 5 tokens in 3 sequences are kept.
"""

from __future__ import annotations

import pytest
import torch

from tokenmdp import estimators as E
from tokenmdp.batch import TokenBatch
from tokenmdp.rl.update import prepare_minibatch, split_minibatches

EXACT_TOL = 1e-15
MAX_LEN = 3
REJECTED = {(0, 1), (1, 0), (1, 1)}    # (sequence, response position) with w = e > 2
KEPT_TOKENS, KEPT_SEQUENCES, ALL_TOKENS, ALL_SEQUENCES = 5, 3, 8, 4


def _step() -> TokenBatch:
    batch = TokenBatch.from_sequences([[3], [3], [3], [3]], [[5, 6, 7], [5, 6], [5], [6, 7]],
                                      rewards=[1.0, 0.0, 1.0, 0.0], groups=[0, 0, 0, 0])
    behavior = torch.zeros_like(batch.advantage)
    for s, t in REJECTED:
        behavior[(batch.sequence_id == s) & (batch.response_position == t)] = -1.0
    return batch.replace(old_logprob=torch.zeros_like(behavior), behavior_logprob=behavior)


def _mis(mode: E.Aggregation, in_normalizer: bool) -> E.Estimator:
    return E.Estimator(surrogate=E.Reinforce(), aggregation=mode,
                       correction=E.MaskedIS(high=2.0, masked_in_normalizer=in_normalizer))


def _rejected_mask(batch: TokenBatch) -> torch.Tensor:
    out = torch.zeros_like(batch.loss_mask)
    for s, t in REJECTED:
        out |= (batch.sequence_id == s) & (batch.response_position == t)
    return out


@pytest.mark.parametrize("sequences", list(E.SequenceCount))
@pytest.mark.parametrize("mode", list(E.Aggregation))
def test_masked_is_rejects_leave_the_minibatch_weights(mode, sequences):
    """Rejected tokens leave ``N_tokens`` and ``|y_i|``; the wholly rejected sequence leaves
    ``S`` only when ``S`` counts the sequences with a loss token (not by default)."""
    step = _step()
    est = _mis(mode, in_normalizer=False).replace(sequence_count=sequences)
    part = prepare_minibatch(E.prepare(step, est, max_len=MAX_LEN), est, max_len=MAX_LEN)
    rejected = _rejected_mask(step)
    assert bool((part.loss_weight[rejected] == 0).all())
    kept = step.loss_mask & ~rejected
    per_seq = {0: 2, 2: 1, 3: 2}              # kept tokens of each kept sequence
    n_seq = ALL_SEQUENCES if sequences is E.SequenceCount.SAMPLED else KEPT_SEQUENCES
    expected = torch.zeros_like(part.loss_weight)
    for r, c in kept.nonzero().tolist():
        n_i = per_seq[int(step.sequence_id[r, c])]
        expected[r, c] = {E.Aggregation.TOKEN_MEAN: 1 / KEPT_TOKENS,
                          E.Aggregation.SEQUENCE_MEAN_TOKEN_MEAN: 1 / (n_seq * n_i),
                          E.Aggregation.SEQUENCE_MEAN_TOKEN_SUM: 1 / n_seq,
                          E.Aggregation.CONSTANT: 1 / (n_seq * MAX_LEN),
                          E.Aggregation.TOKEN_SUM: 1.0,
                          # one group: the token mean of its kept tokens
                          E.Aggregation.PROMPT_MEAN_TOKEN_MEAN: 1 / KEPT_TOKENS}[mode]
    torch.testing.assert_close(part.loss_weight, expected, rtol=0, atol=EXACT_TOL)


@pytest.mark.parametrize("mode", [E.Aggregation.TOKEN_MEAN, E.Aggregation.SEQUENCE_MEAN_TOKEN_SUM])
def test_rejects_kept_in_the_normalizer_keep_their_weight(mode):
    step = _step()
    est = _mis(mode, in_normalizer=True)
    part = prepare_minibatch(E.prepare(step, est, max_len=MAX_LEN), est, max_len=MAX_LEN)
    scale = ALL_TOKENS if mode is E.Aggregation.TOKEN_MEAN else ALL_SEQUENCES
    torch.testing.assert_close(part.loss_weight, step.loss_mask.to(step.dtype) / scale, rtol=0,
                               atol=EXACT_TOL)


@pytest.mark.parametrize(("name", "in_normalizer"), [
    *((n, flag) for n in ("dapo_mis", "grpo_mis", "minirl_mis") for flag in (True, False)),
    *((n, None) for n in ("minirl", "grpo", "ppo"))])
def test_each_shuffled_minibatch_is_weighted_as_its_own_step(name, in_normalizer):
    """Through the trainer's shuffle: every mini-batch's weights are ``prepare`` of that
    mini-batch alone, and its advantages are the step's (not recomputed on the part).
    ``in_normalizer`` replaces the masked-IS part's (threshold 2); None: no masked IS."""
    est = E.get(name)
    if in_normalizer is not None:
        est = est.replace(correction=E.MaskedIS(high=2.0, masked_in_normalizer=in_normalizer))
    step = _step().replace(ref_logprob=torch.zeros_like(_step().advantage))
    prepared = E.prepare(step, est, max_len=MAX_LEN)
    parts = split_minibatches(prepared, 2, generator=torch.Generator().manual_seed(0),
                              capacity=4)
    assert len(parts) == 2
    for part in parts:
        mine = prepare_minibatch(part, est, max_len=MAX_LEN)
        alone = E.prepare(part, est, max_len=MAX_LEN)
        torch.testing.assert_close(mine.loss_weight, alone.loss_weight, rtol=0, atol=EXACT_TOL)
        assert torch.equal(mine.advantage, part.advantage)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_split_minibatches_is_a_balanced_partition_of_the_sequences(n):
    step = _step()
    parts = split_minibatches(step, n, generator=torch.Generator().manual_seed(n), capacity=4)
    sizes = [p.num_sequences for p in parts]
    assert len(parts) == n and max(sizes) - min(sizes) <= 1 and sum(sizes) == 4
    seen = sorted(repr(seq) for p in parts for seq in p.sequences())
    assert seen == sorted(repr(seq) for seq in step.sequences())
    assert all(p.capacity == 4 for p in parts)
