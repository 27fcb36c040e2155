"""Aggregation: hand-worked loss weights, step counts from outside, micro-batch invariance."""

from __future__ import annotations

import pytest
import torch

from tests.estimators.estimator_helpers import DTYPE, make_batch, repack, split_rows
from tokenmdp.estimators import (
    Aggregation,
    Estimator,
    GroupMean,
    PPOClip,
    SequenceCount,
    count_step,
    loss,
    loss_weights,
    per_micro_batch_token_mean_loss,
    prepare,
)

EXACT = 1e-12  # float64, one division per weight
SUM = 1e-12  # float64 sums of a few dozen terms

# Four sequences (each its own group) with 1, 3, 2 and 0 response tokens: N_tokens = 6, and
# S = 4 sampled sequences (the peers' convention, the default; the empty one counts) or S = 3
# with SequenceCount.WITH_LOSS_TOKENS. Per loss token of sequence 0, 1, 2, with S = 4:
#   token-mean               1/6, 1/6, 1/6
#   seq-mean-token-mean      1/(4·1), 1/(4·3), 1/(4·2)
#   seq-mean-token-sum       1/4 each
#   constant (L_max = 4)     1/(4·4) each
#   token-sum                1 each
#   prompt-mean-token-mean   1/(P N_g) with P = 4 groups: as seq-mean-token-mean here
EXPECTED = {
    Aggregation.TOKEN_MEAN: [1 / 6] * 3,
    Aggregation.SEQUENCE_MEAN_TOKEN_MEAN: [1 / 4, 1 / 12, 1 / 8],
    Aggregation.SEQUENCE_MEAN_TOKEN_SUM: [1 / 4] * 3,
    Aggregation.CONSTANT: [1 / 16] * 3,
    Aggregation.TOKEN_SUM: [1.0] * 3,
    Aggregation.PROMPT_MEAN_TOKEN_MEAN: [1 / 4, 1 / 12, 1 / 8],
}
# The same with S = 3 (and P = 3): the sequences/groups with a loss token.
EXPECTED_WITH_LOSS_TOKENS = {
    Aggregation.TOKEN_MEAN: [1 / 6] * 3,
    Aggregation.SEQUENCE_MEAN_TOKEN_MEAN: [1 / 3, 1 / 9, 1 / 6],
    Aggregation.SEQUENCE_MEAN_TOKEN_SUM: [1 / 3] * 3,
    Aggregation.CONSTANT: [1 / 12] * 3,
    Aggregation.TOKEN_SUM: [1.0] * 3,
    Aggregation.PROMPT_MEAN_TOKEN_MEAN: [1 / 3, 1 / 9, 1 / 6],
}


def _batch():
    return make_batch([[5], [6, 6], [7], [9]], [[1], [2, 3, 4], [1, 2], []],
                      rewards=[1.0, 0.0, 1.0, 0.0])


def _per_sequence_weights(batch, weights):
    out = []
    for s in range(3):
        w = weights[(batch.sequence_id == s) & batch.loss_mask]
        assert torch.allclose(w, w[0].expand_as(w), atol=0, rtol=0)  # constant in the sequence
        out.append(w[0].item())
    return out


@pytest.mark.parametrize("mode", list(Aggregation))
def test_hand_worked_loss_weights(mode):
    batch = _batch()
    weights = loss_weights(batch, mode, max_len=4)
    assert _per_sequence_weights(batch, weights) == pytest.approx(EXPECTED[mode], abs=EXACT)
    assert (weights[~batch.loss_mask] == 0).all()
    weights = loss_weights(batch, mode, max_len=4, sequences=SequenceCount.WITH_LOSS_TOKENS)
    assert _per_sequence_weights(batch, weights) == pytest.approx(
        EXPECTED_WITH_LOSS_TOKENS[mode], abs=EXACT)


@pytest.mark.parametrize("mode", list(Aggregation))
def test_counts_from_outside_change_the_weights_of_the_modes_that_use_them(mode):
    batch = _batch()
    weights = loss_weights(batch, mode, num_tokens=12, num_sequences=8, num_groups=8, max_len=4)
    scale = 1.0 if mode is Aggregation.TOKEN_SUM else 0.5
    assert _per_sequence_weights(batch, weights) == pytest.approx(
        [scale * w for w in EXPECTED[mode]], abs=EXACT)


def test_count_step_counts_loss_tokens_and_the_sequences_s_counts():
    assert count_step(_batch()) == (6, 4)
    assert count_step(_batch(), sequences="with-loss-tokens") == (6, 3)


def test_bad_aggregation_arguments():
    batch = _batch()
    with pytest.raises(TypeError, match="mode"):
        loss_weights(batch, "token-mean")
    with pytest.raises(ValueError, match="max_len"):
        loss_weights(batch, Aggregation.CONSTANT)
    for bad in (0, -4, float("inf"), float("nan"), True, "4"):
        with pytest.raises(ValueError, match="max_len"):
            loss_weights(batch, Aggregation.CONSTANT, max_len=bad)
    with pytest.raises(ValueError, match="sequences"):
        loss_weights(batch, Aggregation.TOKEN_MEAN, sequences="all")
    with pytest.raises(ValueError, match="num_groups"):
        loss_weights(batch, Aggregation.PROMPT_MEAN_TOKEN_MEAN, num_groups=2)
    with pytest.raises(ValueError, match="num_tokens"):
        loss_weights(batch, Aggregation.TOKEN_MEAN, num_tokens=5)
    with pytest.raises(ValueError, match="num_sequences"):
        loss_weights(batch, Aggregation.SEQUENCE_MEAN_TOKEN_SUM, num_sequences=3)
    with pytest.raises(TypeError, match="num_tokens"):
        loss_weights(batch, Aggregation.TOKEN_MEAN, num_tokens=6.0)
    with pytest.raises(ValueError, match="mask"):
        loss_weights(batch, Aggregation.TOKEN_MEAN, mask=~batch.loss_mask)


# ---------------------------------------------------------------------- micro-batch invariance
def _step():
    """Eight sequences of uneven lengths in two groups, packed into four rows."""
    gen = torch.Generator().manual_seed(3)
    lengths = [1, 4, 2, 3, 5, 1, 2, 3]
    old = [(-torch.rand(n, generator=gen, dtype=DTYPE) - 0.1).tolist() for n in lengths]
    batch = make_batch([[9]] * 8, [[1] * n for n in lengths],
                       rewards=[1.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.0, 1.0],
                       groups=[0, 0, 0, 0, 1, 1, 1, 1], old=old)
    batch = repack(batch, [[0, 1, 2], [3, 4], [5, 6], [7]], capacity=10)
    logprobs = batch.old_logprob + 0.3 * torch.randn(batch.tokens.shape, generator=gen,
                                                     dtype=DTYPE) * batch.loss_mask
    return batch, logprobs.requires_grad_(True)


@pytest.mark.parametrize("mode", list(Aggregation))
def test_micro_batch_losses_sum_to_the_full_step_loss(mode):
    batch, lp = _step()
    est = Estimator(surrogate=PPOClip(eps_low=0.2, eps_high=0.28), advantage=GroupMean(),
                    aggregation=mode)
    step = prepare(batch, est, max_len=6)
    full, _ = loss(lp, step, est)
    (g_full,) = torch.autograd.grad(full, lp)
    rows = [[0], [1, 2], [3]]
    parts = split_rows(step, rows)
    total = sum(loss(lp[torch.as_tensor(r)], part, est)[0] for r, part in zip(rows, parts,
                                                                             strict=True))
    (g_parts,) = torch.autograd.grad(total, lp)
    assert total.item() == pytest.approx(full.item(), abs=SUM)
    assert torch.allclose(g_parts, g_full, atol=SUM, rtol=0)


def test_per_micro_batch_normalization_is_a_different_estimator():
    # The counter-example: token-mean over each micro-batch's own tokens. Summed over
    # micro-batches of unequal token counts it is not the step's token mean.
    batch, lp = _step()
    est = Estimator(surrogate=PPOClip(), advantage=GroupMean(), aggregation=Aggregation.TOKEN_MEAN)
    step = prepare(batch, est)
    full, _ = loss(lp, step, est)
    rows = [[0], [1, 2], [3]]
    parts = split_rows(step, rows)
    one_part, _ = per_micro_batch_token_mean_loss(lp, step, est)
    assert one_part.item() == pytest.approx(full.item(), abs=SUM)  # same on the whole step
    mean_of_means = sum(per_micro_batch_token_mean_loss(lp[torch.as_tensor(r)], part, est)[0]
                        for r, part in zip(rows, parts, strict=True)) / len(rows)
    assert abs(mean_of_means.item() - full.item()) > 1e-3


def test_a_counting_mask_beyond_the_loss_mask_is_refused_everywhere_it_is_taken():
    """count_step, count_groups and loss_weights count only loss tokens: a mask that selects
    prompt or padding tokens (here every token: 1 + 3 + 2 + 0 response tokens of 13 in all)
    would count 13 instead of 6 and make every normalizer wrong without a word."""
    from tokenmdp.estimators import count_groups

    batch = make_batch([[1], [2, 3], [4], [5, 6]], [[7], [8, 9, 10], [11, 12], []])
    every_token = batch.sequence_id >= 0
    assert int(every_token.sum()) > int(batch.loss_mask.sum()) == 6
    for call in (lambda: count_step(batch, every_token),
                 lambda: count_groups(batch, every_token, sequences="with-loss-tokens"),
                 lambda: loss_weights(batch, Aggregation.TOKEN_MEAN, mask=every_token)):
        with pytest.raises(ValueError, match="outside batch.loss_mask"):
            call()
    with pytest.raises(ValueError, match="mask_RC: expected a bool tensor"):
        count_step(batch, every_token.to(torch.int64))
    assert count_step(batch, batch.loss_mask) == count_step(batch) == (6, 4)
