"""tokenmdp.course.tutorials.t04, tutorial 4's helpers: the conditional and inverse lengths against a loop
over the enumerated responses, every printed weight and sequence total against the aggregations'
closed forms, the gradient tables against direct cosines and norms, the micro-batch table against
losses and gradients recomputed on their own, and a figure with titles and labelled axes."""

import math

import matplotlib.pyplot as plt
import pytest
import torch

from tokenmdp.course.tutorials import t04
from tokenmdp.estimators import (
    Aggregation,
    Estimator,
    GroupMean,
    Reinforce,
    RewardAsAdvantage,
    loss,
    loss_weights,
    per_micro_batch_token_mean_loss,
    prepare,
)
from tokenmdp.exact import (
    TabularPolicy,
    TokenMDP,
    aggregation_gradients,
    expected_length,
    flat_grad,
    gradient,
    sample,
)
from tokenmdp.exact.world.rewards import RandomTable
from tokenmdp.packing import pack_first_fit_decreasing, split_micro_batches

EXACT_TOL = 1e-12   # two float64 computations of the same quantity
FD_TOL = 1e-6       # a central finite difference with step FD_STEP against autograd
FD_STEP = 1e-5
EOS = 2
MAX_LEN = 3


def _world():
    # two prompts of unequal weight, so that D(x) matters in every expectation
    mdp = TokenMDP(3, MAX_LEN, RandomTable(seed=3), prompts=[(0,), (1, 0)], prompt_probs=[0.3, 0.7])
    policy = TabularPolicy(mdp, generator=torch.Generator().manual_seed(1), init_std=1.0)
    return mdp, policy


def _joint_probs_by_hand(mdp, policy):
    # D(x) π(y|x) per response, from the per-token log-probs of the enumerated batch
    enum = mdp.enumerate()
    with torch.no_grad():
        logprob = torch.where(enum.loss_mask, policy.token_logprobs(enum), 0.0).sum(-1)
    weight = {prompt: float(p) for prompt, p in zip(mdp.prompts, mdp.prompt_probs)}
    return [(weight[x] * math.exp(float(lp)), y) for (x, y), lp in zip(mdp.responses(), logprob)]


def _demo_batch(mdp, policy):
    drawn = sample(mdp, policy, 6, group_size=3, generator=torch.Generator().manual_seed(11))
    estimator = Estimator(surrogate=Reinforce(), advantage=GroupMean(),
                          aggregation=Aggregation.TOKEN_MEAN)
    return pack_first_fit_decreasing(prepare(drawn, estimator), capacity=8)


def test_conditional_length_is_the_enumerated_conditional_mean():
    mdp, policy = _world()
    joint = _joint_probs_by_hand(mdp, policy)
    for answer in range(mdp.vocab_size):
        mass = sum(p for p, y in joint if y[0] == answer)
        by_hand = sum(p * len(y) for p, y in joint if y[0] == answer) / mass
        assert abs(t04.conditional_length(mdp, policy, answer).item() - by_hand) < EXACT_TOL
    assert t04.conditional_length(mdp, policy, EOS).item() == 1.0     # an empty answer: |y| = 1


def test_conditional_length_is_differentiable():
    mdp, policy = _world()
    grad = flat_grad(t04.conditional_length(mdp, policy, 0), policy)
    assert grad.abs().max() > 0
    with torch.no_grad():
        i = int(grad.abs().argmax())
        flat = policy.table.view(-1)
        flat[i] += FD_STEP
        up = float(t04.conditional_length(mdp, policy, 0))
        flat[i] -= 2 * FD_STEP
        down = float(t04.conditional_length(mdp, policy, 0))
    assert abs((up - down) / (2 * FD_STEP) - float(grad[i])) < FD_TOL


def test_conditional_length_rejects_a_bad_answer():
    mdp, policy = _world()
    with pytest.raises(ValueError, match="answer"):
        t04.conditional_length(mdp, policy, 3)
    with pytest.raises(TypeError, match="answer"):
        t04.conditional_length(mdp, policy, 0.0)


def test_expected_inverse_length_by_enumeration():
    mdp, policy = _world()
    by_hand = sum(p / len(y) for p, y in _joint_probs_by_hand(mdp, policy))
    assert abs(t04.expected_inverse_length(mdp, policy).item() - by_hand) < EXACT_TOL
    # Jensen: E[1/|y|] >= 1/E|y|, strictly for a spread of lengths
    assert by_hand > 1 / expected_length(mdp, policy).item()


# The tutorial's five classic rules, in its column order (the prompt mean is the token mean there).
FIVE = [Aggregation.TOKEN_MEAN, Aggregation.SEQUENCE_MEAN_TOKEN_MEAN,
        Aggregation.SEQUENCE_MEAN_TOKEN_SUM, Aggregation.CONSTANT, Aggregation.TOKEN_SUM]


def test_weight_table_rows_are_the_closed_form_weights():
    mdp, policy = _world()
    batch = _demo_batch(mdp, policy)
    weights = {m: loss_weights(batch, m, max_len=MAX_LEN) for m in FIVE}
    table = t04.weight_table(batch, weights, eos=EOS)
    S, N = batch.num_sequences, batch.num_loss_tokens
    tokens = int((batch.sequence_id >= 0).sum())
    assert len(table.rows) == tokens and len(str(table).splitlines()) == tokens + 1
    for r, c, s, token, counted, length, advantage, *w in table.rows:
        assert token == int(batch.tokens[r, c]) and counted == bool(batch.loss_mask[r, c])
        n_s = int((batch.loss_mask & (batch.sequence_id == s)).sum())     # this sequence's tokens
        assert length == n_s and advantage == float(batch.advantage[r, c])
        expected = [1 / N, 1 / (S * n_s), 1 / S, 1 / (S * MAX_LEN), 1.0] if counted else [0.0] * 5
        assert [m for m in weights] == FIVE
        assert max(abs(a - b) for a, b in zip(w, expected)) < EXACT_TOL, (r, c)
    assert "EOS" in str(table)


def test_sequence_total_table_sums_each_sequence():
    mdp, policy = _world()
    batch = _demo_batch(mdp, policy)
    weights = {m: loss_weights(batch, m, max_len=MAX_LEN) for m in FIVE}
    totals = {m: batch.sequence_sum(weights[m]) for m in FIVE}
    table = t04.sequence_total_table(batch, totals, max_len=MAX_LEN)
    *per_sequence, last = table.rows
    assert len(per_sequence) == batch.num_sequences
    for s, length, *values in per_sequence:
        mine = batch.sequence_id == s
        by_hand = [float(weights[m][mine].sum()) for m in FIVE]
        assert length == int((batch.loss_mask & mine).sum())
        assert max(abs(a - b) for a, b in zip(values, by_hand, strict=True)) < EXACT_TOL
    assert last[0] == "sum"
    assert abs(last[2] - 1.0) < EXACT_TOL and abs(last[6] - batch.num_loss_tokens) < EXACT_TOL
    assert str(table).startswith(f"S = {batch.num_sequences} sequences")


def test_cosine_table_against_direct_cosines():
    mdp, policy = _world()
    estimator = Estimator(surrogate=Reinforce(), advantage=RewardAsAdvantage(),
                          aggregation=Aggregation.TOKEN_MEAN)
    results = {r.aggregation: r for r in aggregation_gradients(mdp, policy, estimator,
                                                               group_size=2)}
    grad_J = gradient(mdp, policy)
    grad_len = flat_grad(expected_length(mdp, policy), policy)
    table = t04.cosine_table(results, grad_J, grad_len)
    assert [row[0] for row in table.rows] == [m.value for m in results]
    for (_, norm, cos_J, _, cos_given, slope), r in zip(table.rows, results.values()):
        direct = float(torch.nn.functional.cosine_similarity(r.mean, grad_J, dim=0))
        assert abs(norm - float(torch.linalg.vector_norm(r.mean))) < EXACT_TOL
        assert abs(cos_given - direct) < EXACT_TOL and abs(cos_J - direct) < EXACT_TOL
        assert abs(slope - float(r.mean @ grad_len) / norm) < EXACT_TOL


def test_closed_form_table_rows_and_widths():
    mean, target = torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.5])
    table = t04.closed_form_table([("x", "f(x)", mean, target)], label="what", width=6, decimals=2)
    assert table.rows == [("x", "f(x)", 5.0, float(target.norm()), 0.5)]
    header, line = str(table).splitlines()
    assert header.startswith("  what") and line.startswith("     x") and " 5.00 " in line


def test_conditional_length_table_reads_the_first_and_last_steps():
    detailed = {"constant": [(0.1, 3.0, 2.0, 4.0), (0.5, 2.5, 2.0, 4.0), (0.9, 2.1, 2.0, 4.0)],
                "token-mean": [(0.1, 3.0, 2.0, 4.0), (0.8, 2.0, 1.5, 4.5)]}
    table = t04.conditional_length_table(detailed)
    assert table.rows == [("constant", 2.0, 2.0, 4.0, 4.0), ("token-mean", 2.0, 1.5, 4.0, 4.5)]
    assert len(str(table).splitlines()) == 3


def test_micro_batch_table_against_separately_computed_losses():
    mdp, policy = _world()
    sft = Estimator(surrogate=Reinforce(), advantage=RewardAsAdvantage(),
                    aggregation=Aggregation.TOKEN_MEAN)
    corpus = sample(mdp, policy, 6, generator=torch.Generator().manual_seed(21))
    corpus = corpus.replace(reward=torch.ones(corpus.num_sequences, dtype=torch.float64))
    step = pack_first_fit_decreasing(prepare(corpus, sft), capacity=8)

    def losses(K):
        parts = [mb.batch for mb in split_micro_batches(step, K)]
        summed = sum(loss(policy.token_logprobs(p), p, sft)[0] for p in parts)
        naive = sum(per_micro_batch_token_mean_loss(policy.token_logprobs(p), p, sft)[0]
                    for p in parts) / K
        return [p.num_loss_tokens for p in parts], summed, naive

    splits = [(K, *losses(K)) for K in (1, 2)]
    table = t04.micro_batch_table(step, loss(policy.token_logprobs(step), step, sft)[0],
                                  splits, policy)
    full = loss(policy.token_logprobs(step), step, sft)[0]
    full_grad = flat_grad(full, policy)
    for (K, counts, s, d_sum, g_sum, n, d_naive, g_naive) in table.rows:
        counts_again, summed, naive = losses(K)
        assert counts == counts_again and sum(counts) == step.num_loss_tokens
        assert abs(s - summed.item()) < EXACT_TOL and abs(n - naive.item()) < EXACT_TOL
        assert abs(d_sum - (summed - full).item()) < EXACT_TOL
        assert abs(d_naive - (naive - full).item()) < EXACT_TOL
        assert abs(g_naive - float((flat_grad(naive, policy) - full_grad).norm())) < EXACT_TOL
        assert abs(g_sum) < EXACT_TOL                          # step-wide weights: exact for any K
    assert abs(table.rows[0][6]) < EXACT_TOL                   # K = 1: the two losses agree
    assert str(table).startswith(f"full step: {step.num_loss_tokens} loss tokens")


def test_length_drift_figure_has_titles_labels_and_legends():
    track = [(0.1 * k, 3.0 - 0.1 * k) for k in range(4)]
    detailed = {"constant": [(a, b, 2.0, 4.0) for a, b in track],
                "token-mean": [(a, b, 2.0 - 0.1 * k, 4.0 + 0.1 * k) for k, (a, b) in enumerate(track)]}
    tracks = {name: track for name in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                       "constant", "token-sum")}
    fig = t04.length_drift_figure(tracks, detailed, lr=0.5)
    try:
        axes = fig.axes
        assert len(axes) == 4
        assert all(ax.get_title() and ax.get_ylabel() for ax in axes)
        assert all("0.5" in ax.get_xlabel() for ax in axes[2:])
        assert axes[1].get_legend() is not None and axes[3].get_legend() is not None
        labels = [t.get_text() for t in axes[3].get_legend().get_texts()]
        assert "constant (every ∇J mode)" in labels
    finally:
        plt.close(fig)
    with pytest.raises(ValueError, match="tracks"):
        t04.length_drift_figure({"no-such-mode": track}, {}, lr=0.5)
