"""Token-level advantages through ``prepare``: reward-to-go with a per-token KL-in-reward penalty
(REINFORCE++ / OpenRLHF), hand-worked, against loops, through the invariance checks, and its
exact moments against a brute-force average over every ordered group."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tests.estimators.estimator_helpers import make_batch
from tokenmdp import estimators as E
from tokenmdp import testing
from tokenmdp.batch import TokenBatch
from tokenmdp.estimators import KLPenalty, RewardToGo, kl_k1, reward_to_go
from tokenmdp.exact import TabularPolicy, TokenMDP, sequence_probs, stale_copy
from tokenmdp.exact.lab.moments import moments
from tokenmdp.exact.world.rewards import RandomTable
from tokenmdp.packing import pack_first_fit_decreasing, select_sequences

EXACT = 1e-12
BRUTE = 1e-10  # the exact lab and a loop over 343 ordered groups, float64


def _per_token(batch: TokenBatch, values_RC) -> list[list[float]]:
    """Values of each sequence's loss tokens in response order (any layout)."""
    out = []
    for s in range(batch.num_sequences):
        sel = (batch.sequence_id == s) & batch.loss_mask
        order = batch.position[sel].argsort()
        out.append(values_RC[sel][order].tolist())
    return out


def _batch():
    # k1 = log π_old - log π_ref per token: sequence 0: 0.1, 0.2, 0.3; sequence 1: 0.5;
    # sequence 2 (group 1): -0.2, 0.4
    ref = [[-1.0, -1.0, -1.0], [-2.0], [-0.5, -0.7]]
    old = [[-0.9, -0.8, -0.7], [-1.5], [-0.7, -0.3]]
    return make_batch([[5], [5], [6]], [[1, 2, 3], [4], [2, 1]], rewards=[1.0, 0.0, 0.3],
                      groups=[0, 0, 1], old=old, behavior=old, ref=ref)


def _estimator(**part):
    return E.Estimator(surrogate=E.Reinforce(), advantage=RewardToGo(**part),
                       kl=KLPenalty(coef=0.5, in_reward=True, estimator=kl_k1),
                       aggregation=E.Aggregation.TOKEN_SUM)


def test_reward_to_go_hand_worked_in_any_layout():
    batch = _batch()
    want = [[0.6, 0.5, 0.3], [0.5], [0.2, 0.4]]
    permuted = select_sequences(batch, torch.tensor([2, 0, 1]))   # new ids: old 2, 0, 1
    for laid, expect in ((batch, want), (pack_first_fit_decreasing(batch, 12), want),
                         (permuted, [want[2], want[0], want[1]])):
        v = torch.where(laid.loss_mask, laid.old_logprob - laid.ref_logprob, 0.0)
        for got, w in zip(_per_token(laid, reward_to_go(v, laid)), expect, strict=True):
            assert got == pytest.approx(w, abs=EXACT)


def test_reward_to_go_matches_a_loop_on_packed_rows():
    g = torch.Generator().manual_seed(3)
    lengths = [4, 1, 3, 2, 5]
    batch = make_batch([[1, 2]] * 5, [[1] * n for n in lengths], rewards=[0.0] * 5)
    batch = pack_first_fit_decreasing(batch, 9)
    values = torch.where(batch.loss_mask, torch.randn(batch.tokens.shape, generator=g,
                                                      dtype=torch.float64), 0.0)
    for seq_values, seq_rtg in zip(_per_token(batch, values),
                                   _per_token(batch, reward_to_go(values, batch)), strict=True):
        loop = [sum(seq_values[t:]) for t in range(len(seq_values))]
        assert seq_rtg == pytest.approx(loop, abs=EXACT)


def test_reward_to_go_advantage_hand_worked():
    batch = _batch()
    # group means: group 0 → R - 0.5 = 0.5, -0.5; group 1 (one response) → 0; β = 0.5
    raw = [[0.5 - 0.5 * 0.6, 0.5 - 0.5 * 0.5, 0.5 - 0.5 * 0.3], [-0.5 - 0.5 * 0.5],
           [0.0 - 0.5 * 0.2, 0.0 - 0.5 * 0.4]]
    plain = E.prepare(batch, _estimator(whiten=False))
    for got, want in zip(_per_token(plain, plain.advantage), raw, strict=True):
        assert got == pytest.approx(want, abs=EXACT)
    # whitened over the 6 loss tokens, population variance (ddof 0), eps 0
    flat = [x for row in raw for x in row]
    m = sum(flat) / 6
    s = math.sqrt(sum((x - m) ** 2 for x in flat) / 6)
    white = E.prepare(batch, _estimator(whiten=True, ddof=0, eps=0.0))
    for got, want in zip(_per_token(white, white.advantage), raw, strict=True):
        assert got == pytest.approx([(x - m) / s for x in want], abs=EXACT)
    # no baseline: R itself
    none = E.prepare(batch, _estimator(whiten=False, baseline="none"))
    assert _per_token(none, none.advantage)[1] == pytest.approx([0.0 - 0.25], abs=EXACT)


def test_the_gradient_of_each_token_is_its_own_advantage():
    # Reinforce surrogate, token-sum weights: -∂loss/∂log π_t = A_t (the formula, by autograd)
    batch = _batch()
    est = _estimator(whiten=True)
    step = E.prepare(batch, est)
    lp = batch.old_logprob.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(-E.loss(lp, step, est)[0], lp)
    assert torch.equal(torch.where(batch.loss_mask, g, 0.0), step.advantage)
    # the penalty of a later token moves the earlier ones only: the causal form
    assert step.advantage.ne(0).sum() == 6


def test_without_a_penalty_and_whitening_it_is_the_group_mean():
    batch = _batch()
    est = E.Estimator(surrogate=E.Reinforce(), advantage=RewardToGo(whiten=False))
    ref = E.Estimator(surrogate=E.Reinforce(), advantage=E.GroupMean())
    assert torch.equal(E.prepare(batch, est).advantage, E.prepare(batch, ref).advantage)


def test_the_token_penalty_sums_to_the_sequence_penalty():
    batch = _batch()
    est = _estimator()
    per_token = E.token_reward_penalty(batch, est)
    torch.testing.assert_close(batch.sequence_sum(per_token), est.kl.reward_penalty(batch),
                               rtol=0, atol=EXACT)
    assert torch.equal(E.token_reward_penalty(batch, est.replace(kl=None)),
                       torch.zeros_like(per_token))


def test_token_level_parts_refuse_the_per_sequence_paths():
    batch = _batch()
    est = _estimator()
    with pytest.raises(ValueError, match="advantage_S: .*token-level"):
        E.prepare(batch, est, advantage_S=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="token-level"):
        RewardToGo()(batch.reward, batch.group)
    with pytest.raises(TypeError, match="token-level"):
        RewardToGo().per_sequence(batch.reward, batch.group, batch.length)
    assert not RewardToGo().group_local and RewardToGo(whiten=False).group_local
    assert RewardToGo.token_level and RewardToGo.couples_sequences


def test_stacked_steps_are_whitened_each_on_their_own():
    a, b = _batch(), _batch().replace(reward=torch.tensor([0.0, 2.0, 1.0], dtype=torch.float64))
    both = TokenBatch.from_sequences(
        [p for p, _ in a.sequences()] * 2, [r for _, r in a.sequences()] * 2,
        rewards=torch.cat([a.reward, b.reward]), groups=[0, 0, 1, 2, 2, 3])
    both = both.replace(old_logprob=torch.cat([a.old_logprob, b.old_logprob]),
                        ref_logprob=torch.cat([a.ref_logprob, b.ref_logprob]),
                        behavior_logprob=torch.cat([a.old_logprob, b.old_logprob]))
    est = _estimator(whiten=True)
    stacked = E.prepare(both, est, step=torch.tensor([0, 0, 0, 1, 1, 1]))
    torch.testing.assert_close(stacked.advantage[:3], E.prepare(a, est).advantage, rtol=0,
                               atol=EXACT)
    torch.testing.assert_close(stacked.advantage[3:], E.prepare(b, est).advantage, rtol=0,
                               atol=EXACT)


LAYOUTS = [testing.Layout("padded"), testing.Layout("flat", 2, permutation_seed=3),
           testing.Layout("first_fit_decreasing", 1, permutation_seed=7)]
SPLITS = [testing.MicroBatchSplit(2), testing.MicroBatchSplit(3, by_rows=False, seed=5,
                                                              layout=LAYOUTS[2])]


def _random_step(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 1, 4, 2, 2, 5]
    lp = {k: [(-torch.rand(n, generator=g, dtype=torch.float64) * 2).tolist() for n in lengths]
          for k in ("old", "ref")}
    return make_batch([[7]] * 6, [[1 + (i % 3)] * n for i, n in enumerate(lengths)],
                      rewards=torch.rand(6, generator=g, dtype=torch.float64).tolist(),
                      groups=[0, 0, 0, 1, 1, 1], old=lp["old"], behavior=lp["old"], ref=lp["ref"])


@pytest.mark.parametrize("name", ["reinforce_pp_kl", "reinforce_pp_baseline", "grpo_batch_std",
                                  "opo"])
def test_the_new_entries_pass_the_invariance_checks(name):
    est = E.get(name)
    batch = _random_step(1)
    prep = testing.estimator_prepare(est, max_len=5)
    loss_fn = testing.estimator_loss(est)
    testing.check_layout_invariance(loss_fn, batch, LAYOUTS, prepare=prep).assert_ok()
    report = testing.check_micro_batch_invariance(loss_fn, batch, SPLITS, prepare=prep)
    report.assert_ok()
    assert report.gradient_scale > 0


def test_whitening_per_micro_batch_is_not_micro_batch_invariant():
    # the token whitening is a statistic of the step: recomputed on each micro-batch (prepare
    # per micro-batch), the split changes the estimator
    est = E.get("reinforce_pp_kl")

    def per_micro_batch(logprobs_RC, micro):
        return E.loss(logprobs_RC, E.prepare(micro, est), est)[0]
    report = testing.check_micro_batch_invariance(per_micro_batch, _random_step(2), SPLITS,
                                                  prepare=testing.estimator_prepare(est))
    assert not report.ok


# ------------------------------------------------------------------ exact moments, brute force
def _hand_loss(logprobs_RC, batch, beta):
    """Reinforce with A_t = (R_i - mean_g R) - β Σ_{s>=t} k1_s, whitened over every token with the
    population std (+1e-8 in the root), token mean: written with loops from the formula."""
    rows = []
    for s in range(batch.num_sequences):
        sel = ((batch.sequence_id == s) & batch.loss_mask).nonzero().tolist()
        sel.sort(key=lambda rc: int(batch.position[rc[0], rc[1]]))
        rows.append(sel)
    group = batch.group.tolist()
    rewards = batch.reward.tolist()
    adv = []
    for s, cells in enumerate(rows):
        mates = [rewards[j] for j in range(len(rewards)) if group[j] == group[s]]
        k = [float(batch.old_logprob[r, c] - batch.ref_logprob[r, c]) for r, c in cells]
        base = rewards[s] - sum(mates) / len(mates)
        if max(mates) == min(mates):
            base = 0.0
        adv.append([base - beta * sum(k[t:]) for t in range(len(k))])
    flat = [a for row in adv for a in row]
    if not flat:
        return logprobs_RC.sum() * 0.0
    m = sum(flat) / len(flat)
    var = sum((a - m) ** 2 for a in flat) / len(flat)
    total = 0.0
    for cells, row in zip(rows, adv, strict=True):
        for (r, c), a in zip(cells, row, strict=True):
            total = total - (a - m) / math.sqrt(var + 1e-8) * logprobs_RC[r, c]
    return total / len(flat)


def test_exact_moments_of_the_per_token_kl_estimator_are_a_brute_force_average():
    mdp = TokenMDP(3, 2, RandomTable(seed=2), prompts=[(0,)])          # 7 responses
    pi = TabularPolicy(mdp, generator=torch.Generator().manual_seed(0))
    ref = stale_copy(mdp, pi, distance=0.8)
    beta, G = 0.7, 3
    est = E.Estimator(surrogate=E.Reinforce(),
                      advantage=RewardToGo(baseline="group_mean", whiten=True, ddof=0, eps=1e-8),
                      kl=KLPenalty(coef=beta, in_reward=True, estimator=kl_k1),
                      aggregation=E.Aggregation.TOKEN_MEAN)
    exact = moments(mdp, pi, est, group_size=G, reference=ref, method="enumeration")
    params = list(pi.parameters())
    probs = sequence_probs(mdp, pi).detach()
    pairs = mdp.responses()
    mean, second = 0.0, 0.0
    for group in itertools.product(range(len(pairs)), repeat=G):
        batch = TokenBatch.from_sequences([pairs[i][0] for i in group],
                                          [pairs[i][1] for i in group],
                                          rewards=mdp.rewards[list(group)], groups=[0] * G)
        with torch.no_grad():
            batch = batch.replace(old_logprob=pi.token_logprobs(batch),
                                  behavior_logprob=pi.token_logprobs(batch),
                                  ref_logprob=ref.token_logprobs(batch))
        grads = torch.autograd.grad(-_hand_loss(pi.token_logprobs(batch), batch, beta), params)
        g = torch.cat([x.reshape(-1) for x in grads])
        p = torch.prod(probs[list(group)])
        mean = mean + p * g
        second = second + p * (g @ g)
    torch.testing.assert_close(exact.mean, mean, rtol=0, atol=BRUTE)
    assert exact.total_variance == pytest.approx(float(second - mean @ mean), abs=BRUTE)
    # and the penalty matters: without it the mean moves
    no_kl = moments(mdp, pi, est.replace(kl=None), group_size=G, method="enumeration")
    assert float((no_kl.mean - exact.mean).norm()) > 1e-3


@pytest.mark.parametrize(("make", "error", "match"), [
    (lambda: RewardToGo(baseline="mean"), ValueError, "baseline"),
    (lambda: RewardToGo(whiten=1), TypeError, "whiten"),
    (lambda: RewardToGo(ddof=-1), ValueError, "ddof"),
    (lambda: RewardToGo(eps=-1.0), ValueError, "eps"),
])
def test_bad_hyperparameters_raise_naming_them(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_bad_inputs_raise_naming_them():
    batch = _batch()
    with pytest.raises(ValueError, match="values_RC"):
        reward_to_go(torch.zeros(2, 2, dtype=torch.float64), batch)
    with pytest.raises(ValueError, match="penalty_RC"):
        RewardToGo().token_advantages(batch, batch.reward, torch.zeros(1, dtype=torch.float64))
