"""What ``S`` counts, stacked steps (``step=``) and a lone step alike. By default
(``SequenceCount.SAMPLED``, the peers' convention) every sampled sequence of the step counts; with
``SequenceCount.WITH_LOSS_TOKENS`` a sequence with an empty response, one whose response is wholly
loss-masked, or one whose every token a ``mask`` drops (masked-IS rejects), is not a sequence of
the mean.

The reference is hand counting: each step's ``N_tokens`` and ``S`` are written out below, and
the weights follow the closed forms of the module table of
:mod:`tokenmdp.estimators.aggregation`.
"""

import pytest
import torch

from tests.estimators.estimator_helpers import make_batch
from tokenmdp import estimators as E

EXACT_TOL = 1e-15
MAX_LEN = 4

# step 0: a counted sequence (2 tokens), an empty response, a response whose loss mask is
# cleared; step 1: two counted sequences (3 and 1 tokens); step 2: only uncounted sequences
RESPONSES = [[3, 3], [], [3, 3, 3], [3, 3, 3], [3], [], [3]]
STEP = [0, 0, 0, 1, 1, 2, 2]
MASKED = (2, 6)                       # sequences whose loss mask is cleared
N_TOKENS = {0: 2, 1: 4, 2: 0}         # counted tokens of each step
N_SEQUENCES = {0: 1, 1: 2, 2: 0}      # sequences with a counted token
N_SAMPLED = {0: 3, 1: 2, 2: 2}        # every sampled sequence
WITH = E.SequenceCount.WITH_LOSS_TOKENS


def _batch():
    batch = make_batch([[1, 2]] * len(RESPONSES), RESPONSES, capacity=6)
    cleared = torch.isin(batch.sequence_id, torch.tensor(MASKED))
    return batch.replace(loss_mask=batch.loss_mask & ~cleared)


def _expected(batch, mode, counts_of):
    """Closed-form weights: token t of sequence i in step k (``counts_of(k) = (N_tokens, S)``)."""
    out = torch.zeros(batch.tokens.shape, dtype=batch.dtype)
    per_seq = batch.sequence_sum(batch.loss_mask.to(batch.dtype))
    for r, c in batch.loss_mask.nonzero().tolist():
        i = int(batch.sequence_id[r, c])
        n_tok, n_seq = counts_of(STEP[i])
        out[r, c] = {E.Aggregation.TOKEN_MEAN: 1 / n_tok,
                     E.Aggregation.SEQUENCE_MEAN_TOKEN_MEAN: 1 / (n_seq * per_seq[i]),
                     E.Aggregation.SEQUENCE_MEAN_TOKEN_SUM: 1 / n_seq,
                     E.Aggregation.CONSTANT: 1 / (n_seq * MAX_LEN),
                     E.Aggregation.TOKEN_SUM: 1.0,
                     # one group per sequence: P counts what S counts
                     E.Aggregation.PROMPT_MEAN_TOKEN_MEAN: 1 / (n_seq * per_seq[i])}[mode]
    return out


@pytest.mark.parametrize("mode", list(E.Aggregation))
def test_stacked_steps_count_only_sequences_with_a_counted_token(mode):
    batch = _batch()
    weights = E.loss_weights(batch, mode, max_len=MAX_LEN, step=torch.tensor(STEP),
                             sequences=WITH)
    expected = _expected(batch, mode, lambda k: (N_TOKENS[k], N_SEQUENCES[k]))
    torch.testing.assert_close(weights, expected, rtol=0, atol=EXACT_TOL)


@pytest.mark.parametrize("mode", list(E.Aggregation))
def test_stacked_steps_count_every_sampled_sequence_by_default(mode):
    batch = _batch()
    weights = E.loss_weights(batch, mode, max_len=MAX_LEN, step=torch.tensor(STEP))
    expected = _expected(batch, mode, lambda k: (N_TOKENS[k], N_SAMPLED[k]))
    torch.testing.assert_close(weights, expected, rtol=0, atol=EXACT_TOL)


@pytest.mark.parametrize("mode", list(E.Aggregation))
def test_a_lone_step_counts_only_sequences_with_a_counted_token(mode):
    batch = _batch()
    assert E.count_step(batch, sequences=WITH) == (sum(N_TOKENS.values()),
                                                   sum(N_SEQUENCES.values()))
    weights = E.loss_weights(batch, mode, max_len=MAX_LEN, sequences=WITH)
    expected = _expected(batch, mode, lambda k: (sum(N_TOKENS.values()),
                                                 sum(N_SEQUENCES.values())))
    torch.testing.assert_close(weights, expected, rtol=0, atol=EXACT_TOL)


@pytest.mark.parametrize("mode", list(E.Aggregation))
def test_a_lone_step_counts_every_sampled_sequence_by_default(mode):
    batch = _batch()
    assert E.count_step(batch) == (sum(N_TOKENS.values()), len(RESPONSES))
    weights = E.loss_weights(batch, mode, max_len=MAX_LEN)
    expected = _expected(batch, mode, lambda k: (sum(N_TOKENS.values()), len(RESPONSES)))
    torch.testing.assert_close(weights, expected, rtol=0, atol=EXACT_TOL)


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "lone"])
@pytest.mark.parametrize("mode", [E.Aggregation.SEQUENCE_MEAN_TOKEN_SUM,
                                  E.Aggregation.SEQUENCE_MEAN_TOKEN_MEAN])
def test_a_sequence_whose_tokens_the_mask_drops_leaves_the_sequence_count(mode, stacked):
    """``mask`` (the loss mask minus masked-IS rejects) drops every token of sequence 3: with
    ``WITH_LOSS_TOKENS`` step 1 then has one sequence, so the other's tokens weigh 1 (not 1/2);
    by default the rejected sequence stays one of the step's sampled sequences."""
    batch = _batch()
    mask = batch.loss_mask & (batch.sequence_id != 3)
    kwargs = {"step": torch.tensor(STEP)} if stacked else {}
    on_4 = mask & (batch.sequence_id == 4)
    # step 1 alone: seq 4 (with a token) of seqs 3, 4; lone: seqs 0 and 4 of all seven
    for sequences, n_seq in ((WITH, 1 if stacked else 2), ("sampled", 2 if stacked else 7)):
        weights = E.loss_weights(batch, mode, max_len=MAX_LEN, mask=mask, sequences=sequences,
                                 **kwargs)
        torch.testing.assert_close(weights[on_4], torch.full((1,), 1 / n_seq,
                                                             dtype=batch.dtype),
                                   rtol=0, atol=EXACT_TOL)
        assert bool((weights[~mask] == 0).all())


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "minirl"])
def test_prepared_stacked_steps_with_empty_sequences_equal_each_step_alone(name):
    """Through :func:`~tokenmdp.estimators.prepare`: every step of the stack, uncounted
    sequences included, gets the weights it gets when prepared alone."""
    est = E.get(name)
    g = torch.Generator().manual_seed(5)
    lp = [(-torch.rand(len(r), generator=g, dtype=torch.float64)).tolist() for r in RESPONSES]
    rewards = torch.rand(len(RESPONSES), generator=g, dtype=torch.float64).tolist()
    groups = [0, 0, 0, 1, 1, 2, 2]

    def build(idx):
        b = make_batch([[1, 2]] * len(idx), [RESPONSES[i] for i in idx],
                       rewards=[rewards[i] for i in idx],
                       groups=[groups[i] - groups[idx[0]] for i in idx], capacity=6,
                       old=[lp[i] for i in idx], behavior=[lp[i] for i in idx],
                       ref=[lp[i] for i in idx])
        cleared = torch.isin(b.sequence_id, torch.tensor([j for j, i in enumerate(idx)
                                                          if i in MASKED]))
        return b.replace(loss_mask=b.loss_mask & ~cleared)

    stacked = build(list(range(len(RESPONSES))))
    prepared = E.prepare(stacked, est, step=torch.tensor(STEP), max_len=MAX_LEN)
    for k in sorted(set(STEP)):
        idx = [i for i, s in enumerate(STEP) if s == k]
        alone = E.prepare(build(idx), est, max_len=MAX_LEN)
        torch.testing.assert_close(prepared.loss_weight[idx], alone.loss_weight, rtol=0,
                                   atol=EXACT_TOL)
