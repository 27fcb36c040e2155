"""The peers' ``S`` (every sampled sequence) as the default, the other convention as a named
option, ``CONSTANT`` with any positive constant, and the prompt-mean aggregation.

References are independent transcriptions of the peers' documented reducers on padded tensors
(TRL's ``grpo`` / ``dr_grpo`` loss types, verl's ``seq-mean-token-sum-norm``, SkyRL's prompt
mean: token mean within each group, mean over the groups), written with plain loops.
"""

from __future__ import annotations

import pytest
import torch

from tests.estimators.estimator_helpers import DTYPE, make_batch, repack, split_rows
from tokenmdp.estimators import (
    Aggregation,
    Estimator,
    GroupMean,
    Reinforce,
    SequenceCount,
    count_groups,
    loss,
    loss_weights,
    prepare,
)

EXACT = 1e-12  # float64, a few dozen terms
WITH = SequenceCount.WITH_LOSS_TOKENS


def _three_with_the_middle_masked():
    batch = make_batch([[5], [6], [7]], [[1, 2], [3, 4, 1], [2]], rewards=[1.0, 0.0, 1.0])
    return batch.replace(loss_mask=batch.loss_mask & (batch.sequence_id != 1))


def test_the_issue_example_constant_normalizer_counts_every_sampled_sequence():
    batch = _three_with_the_middle_masked()
    peers = loss_weights(batch, Aggregation.CONSTANT, max_len=4)
    assert torch.allclose(peers[batch.loss_mask], torch.full((3,), 1 / 12, dtype=DTYPE),
                          atol=EXACT, rtol=0)
    ours_before = loss_weights(batch, Aggregation.CONSTANT, max_len=4, sequences=WITH)
    assert torch.allclose(ours_before[batch.loss_mask], torch.full((3,), 0.125, dtype=DTYPE),
                          atol=EXACT, rtol=0)


def _padded(batch, values_RC):
    """Per-sequence lists of (value, mask) over response tokens, as a padded ``[B, T]`` table."""
    rows = []
    for s in range(batch.num_sequences):
        on = (batch.sequence_id == s) & (batch.response_position >= 0)
        rows.append(list(zip(values_RC[on].tolist(), batch.loss_mask[on].tolist(), strict=True)))
    return rows


def _peer_reducers(rows, groups, max_completion_length):
    """The reducers of the peers, transcribed from their documentation (loops, no tokenmdp)."""
    seq_means, seq_sums = [], []
    for row in rows:
        n = sum(m for _, m in row)
        total = sum(v for v, m in row if m)
        seq_means.append(total / max(n, 1))
        seq_sums.append(total)
    out = {
        Aggregation.SEQUENCE_MEAN_TOKEN_MEAN: sum(seq_means) / len(rows),        # TRL grpo
        Aggregation.CONSTANT: sum(seq_sums) / (len(rows) * max_completion_length),  # dr_grpo
        Aggregation.SEQUENCE_MEAN_TOKEN_SUM: sum(seq_sums) / len(rows),
    }
    per_group = {}
    for row, g in zip(rows, groups, strict=True):
        tot, n = per_group.get(g, (0.0, 0))
        per_group[g] = (tot + sum(v for v, m in row if m), n + sum(m for _, m in row))
    out[Aggregation.PROMPT_MEAN_TOKEN_MEAN] = sum(t / max(n, 1) for t, n in per_group.values()) \
        / len(per_group)
    return out


@pytest.mark.parametrize("mode", [Aggregation.SEQUENCE_MEAN_TOKEN_MEAN, Aggregation.CONSTANT,
                                  Aggregation.SEQUENCE_MEAN_TOKEN_SUM,
                                  Aggregation.PROMPT_MEAN_TOKEN_MEAN])
def test_the_default_loss_equals_the_peers_reducers_with_a_fully_masked_completion(mode):
    gen = torch.Generator().manual_seed(0)
    responses = [[1, 2], [3, 4, 1], [2], [4, 4, 4, 1], [3]]
    groups = [0, 0, 1, 1, 1]
    batch = make_batch([[9]] * 5, responses, rewards=[1.0, 0.0, 1.0, 0.0, 1.0], groups=groups)
    batch = batch.replace(loss_mask=batch.loss_mask & (batch.sequence_id != 1))  # overlong
    est = Estimator(surrogate=Reinforce(), advantage=GroupMean(), aggregation=mode)
    step = prepare(batch, est, max_len=6)
    lp = (-torch.rand(batch.tokens.shape, generator=gen, dtype=DTYPE)).requires_grad_(True)
    value, _ = loss(lp, step, est)
    per_token = -step.advantage * lp.detach()            # each peer's per-token loss
    expected = _peer_reducers(_padded(batch, per_token), groups, max_completion_length=6)[mode]
    assert value.item() == pytest.approx(expected, abs=EXACT)


def test_prompt_mean_hand_worked():
    # group 0: 1 + 3 tokens, group 1: 2 tokens; P = 2 -> 1/(2·4) and 1/(2·2)
    batch = make_batch([[9]] * 3, [[1], [2, 3, 4], [1, 2]], groups=[0, 0, 1])
    w = loss_weights(batch, Aggregation.PROMPT_MEAN_TOKEN_MEAN)
    for s, expected in ((0, 1 / 8), (1, 1 / 8), (2, 1 / 4)):
        on = (batch.sequence_id == s) & batch.loss_mask
        assert torch.allclose(w[on], torch.full_like(w[on], expected), atol=EXACT, rtol=0)
    assert count_groups(batch) == 2
    # from outside: the step has 4 groups, so every weight halves
    w4 = loss_weights(batch, Aggregation.PROMPT_MEAN_TOKEN_MEAN, num_groups=4)
    assert torch.allclose(w4, w / 2, atol=EXACT, rtol=0)


def test_prompt_mean_counts_a_wholly_masked_group_only_when_sampled_counts():
    batch = make_batch([[9]] * 3, [[1], [2, 3], [1, 2]], groups=[0, 1, 1])
    batch = batch.replace(loss_mask=batch.loss_mask & (batch.sequence_id != 0))
    assert (count_groups(batch), count_groups(batch, sequences=WITH)) == (2, 1)
    sampled = loss_weights(batch, Aggregation.PROMPT_MEAN_TOKEN_MEAN)
    with_tokens = loss_weights(batch, Aggregation.PROMPT_MEAN_TOKEN_MEAN, sequences=WITH)
    on = batch.loss_mask
    assert torch.allclose(sampled[on], torch.full((4,), 1 / 8, dtype=DTYPE), atol=EXACT, rtol=0)
    assert torch.allclose(with_tokens[on], torch.full((4,), 1 / 4, dtype=DTYPE), atol=EXACT,
                          rtol=0)


@pytest.mark.parametrize("sequences", list(SequenceCount))
def test_prompt_mean_stacked_steps_equal_each_step_alone(sequences):
    responses = [[1], [2, 3], [1, 2, 3, 4], [4], [3, 3], [2]]
    groups, step = [0, 0, 1, 0, 0, 1], [0, 0, 0, 1, 1, 1]   # group ids reused across steps
    batch = make_batch([[9]] * 6, responses, groups=groups)
    batch = batch.replace(loss_mask=batch.loss_mask & (batch.sequence_id != 5))
    stacked = loss_weights(batch, Aggregation.PROMPT_MEAN_TOKEN_MEAN, step=torch.tensor(step),
                           sequences=sequences)
    for k, idx in ((0, [0, 1, 2]), (1, [3, 4, 5])):
        alone = make_batch([[9]] * 3, [responses[i] for i in idx],
                           groups=[groups[i] for i in idx])
        if k == 1:
            alone = alone.replace(loss_mask=alone.loss_mask & (alone.sequence_id != 2))
        w = loss_weights(alone, Aggregation.PROMPT_MEAN_TOKEN_MEAN, sequences=sequences)
        for j, i in enumerate(idx):
            on_s = (batch.sequence_id == i) & batch.loss_mask
            on_a = (alone.sequence_id == j) & alone.loss_mask
            assert torch.allclose(stacked[on_s], w[on_a], atol=EXACT, rtol=0)


def test_prompt_mean_micro_batch_losses_sum_to_the_step_loss():
    gen = torch.Generator().manual_seed(4)
    lengths = [1, 4, 2, 3, 5, 1, 2, 3]
    batch = make_batch([[9]] * 8, [[1] * n for n in lengths],
                       rewards=[1.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.0, 1.0],
                       groups=[0, 0, 0, 0, 1, 1, 1, 1])
    batch = repack(batch, [[0, 1, 2], [3, 4], [5, 6], [7]], capacity=10)
    est = Estimator(surrogate=Reinforce(), advantage=GroupMean(),
                    aggregation=Aggregation.PROMPT_MEAN_TOKEN_MEAN)
    step = prepare(batch, est)
    lp = (-torch.rand(batch.tokens.shape, generator=gen, dtype=DTYPE)).requires_grad_(True)
    full, _ = loss(lp, step, est)
    rows = [[0], [1, 2], [3]]
    total = sum(loss(lp[torch.as_tensor(r)], part, est)[0]
                for r, part in zip(rows, split_rows(step, rows), strict=True))
    assert total.item() == pytest.approx(full.item(), abs=EXACT)


def test_constant_accepts_any_positive_number():
    batch = _three_with_the_middle_masked()                # the longest response has 3 tokens
    for c in (1, 1.5, 2, 1000.0):
        w = loss_weights(batch, Aggregation.CONSTANT, max_len=c)
        assert torch.allclose(w[batch.loss_mask], torch.full((3,), 1 / (3 * c), dtype=DTYPE),
                              atol=EXACT, rtol=0)
    est = Estimator(surrogate=Reinforce(), aggregation=Aggregation.CONSTANT)
    step = prepare(batch, est, max_len=0.5)
    assert torch.allclose(step.loss_weight[batch.loss_mask],
                          torch.full((3,), 1 / 1.5, dtype=DTYPE), atol=EXACT, rtol=0)
    with pytest.raises(ValueError, match="max_len"):
        prepare(batch, est, max_len=0)


def test_the_estimator_takes_the_convention_as_a_named_option():
    batch = _three_with_the_middle_masked()
    est = Estimator(surrogate=Reinforce(), aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM)
    assert est.sequence_count is SequenceCount.SAMPLED
    default = prepare(batch, est).loss_weight[batch.loss_mask]
    named = prepare(batch, est.replace(sequence_count=WITH)).loss_weight[batch.loss_mask]
    assert torch.allclose(default * 3, named * 2, atol=EXACT, rtol=0)   # S = 3 against S = 2
    with pytest.raises(TypeError, match="sequence_count"):
        Estimator(surrogate=Reinforce(), sequence_count="sampled")
