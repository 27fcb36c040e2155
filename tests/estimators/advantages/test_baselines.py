"""REINFORCE++-baseline, TRL's batch-std GRPO and OPO: hand-worked groups, a loop transcription
of each formula, per-step statistics, the lengths read from the loss mask, bad hyperparameters."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.estimators.estimator_helpers import make_batch
from tokenmdp import estimators as E
from tokenmdp.estimators import (
    GroupMeanBatchStd,
    OPOBaseline,
    ReinforcePPBaseline,
    group_mean_batch_std_advantage,
    opo_advantage,
    reinforce_pp_baseline_advantage,
    weighted_whiten,
)
from tokenmdp.packing import pack_first_fit_decreasing, select_sequences

EXACT = 1e-12  # float64, a few roundings
LOOP = 1e-9    # against the loop transcription (different summation orders)

R = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
G = torch.tensor([0, 0, 1, 1])
L = torch.tensor([3, 1, 2, 2])


def test_reinforce_pp_baseline_hand_worked():
    # d = R - group mean = 0.5, -0.5, 0, 0 (group 1 is constant); N = 8 tokens;
    # m = (3·0.5 - 0.5)/8 = 0.125; v = (3·0.375² + 0.625² + 4·0.125²)/7 = 0.875/7 = 0.125
    a = reinforce_pp_baseline_advantage(R, G, L, ddof=1, eps=0.0)
    s = 0.125 ** 0.5
    assert a.tolist() == pytest.approx([0.375 / s, -0.625 / s, -0.125 / s, -0.125 / s], abs=EXACT)
    # the population variance (OpenRLHF's): 0.875/8
    a0 = reinforce_pp_baseline_advantage(R, G, L, ddof=0, eps=0.0)
    assert a0[0].item() == pytest.approx(0.375 / (0.875 / 8) ** 0.5, abs=EXACT)
    # eps is added to the variance, inside the square root
    a_eps = reinforce_pp_baseline_advantage(R, G, L, ddof=1, eps=0.01)
    assert a_eps[0].item() == pytest.approx(0.375 / 0.135 ** 0.5, abs=EXACT)
    # token weighting matters: with every length 1 it is the sequence-weighted whitening
    ones = reinforce_pp_baseline_advantage(R, G, torch.ones(4), ddof=1, eps=0.0)
    d = [0.5, -0.5, 0.0, 0.0]
    assert ones.tolist() == pytest.approx([x / statistics.stdev(d) for x in d], abs=EXACT)


def test_batch_std_hand_worked():
    # std of R = [1, 0, 1, 1] with ddof 1: mean 0.75, Σ dev² = 0.75, /3 → 0.25, std 0.5
    a = group_mean_batch_std_advantage(R, G, ddof=1, eps=0.0)
    assert a.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=EXACT)
    a = group_mean_batch_std_advantage(R, G)                    # TRL's eps 1e-4 on the std
    assert a[0].item() == pytest.approx(0.5 / 0.5001, abs=EXACT)
    # the std of the rewards, not of the deviations (those would give std sqrt(1/6))
    assert a[0].item() != pytest.approx(0.5 / (1 / 6) ** 0.5, abs=1e-3)


def test_opo_hand_worked():
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.0], dtype=torch.float64)
    lengths = torch.tensor([3, 1, 1, 3])
    # group 0: b = (3·1 + 1·0)/4 = 0.75; group 1: b = (1·2 + 3·0)/4 = 0.5
    assert opo_advantage(rewards, G, lengths).tolist() == pytest.approx(
        [0.25, -0.75, 1.5, -0.5], abs=EXACT)
    # equal lengths: the plain group mean
    assert opo_advantage(rewards, G, torch.ones(4)).tolist() == pytest.approx(
        E.group_mean_advantage(rewards, G).tolist(), abs=EXACT)
    # a group without loss tokens falls back to the plain mean (finite)
    none = opo_advantage(rewards, G, torch.tensor([0, 0, 1, 3]))
    assert none[:2].tolist() == pytest.approx([0.5, -0.5], abs=EXACT)


@pytest.mark.parametrize("fn", [
    lambda r, g, n: reinforce_pp_baseline_advantage(r, g, n),
    lambda r, g, n: group_mean_batch_std_advantage(r, g),
    lambda r, g, n: opo_advantage(r, g, n),
])
def test_constant_rewards_give_exactly_zero(fn):
    rewards = torch.full((5,), 0.1, dtype=torch.float64)   # 0.1·5 / 5 is not exactly 0.1
    out = fn(rewards, torch.tensor([0, 0, 0, 1, 1]), torch.tensor([1, 2, 3, 1, 2]))
    assert out.tolist() == [0.0] * 5


# ------------------------------------------------------------------ loop transcriptions
def _loop_rpp(rewards, groups, lengths, ddof, eps):
    d = []
    for r, g in zip(rewards, groups, strict=True):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == g]
        d.append(r - sum(members) / len(members))
    tokens = [x for x, n in zip(d, lengths, strict=True) for _ in range(n)]  # one per token
    if not tokens or max(tokens) == min(tokens):
        return [0.0] * len(d)
    m = sum(tokens) / len(tokens)
    var = sum((x - m) ** 2 for x in tokens) / max(len(tokens) - ddof, 1)
    return [(x - m) / math.sqrt(var + eps) for x in d]


def _loop_batch_std(rewards, groups, ddof, eps):
    out = []
    n = len(rewards)
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - ddof)) if n > ddof else 0.0
    for r, g in zip(rewards, groups, strict=True):
        members = [rewards[j] for j in range(n) if groups[j] == g]
        dev = r - sum(members) / len(members)
        out.append(0.0 if max(members) == min(members) else dev / (std + eps))
    return out


def _loop_opo(rewards, groups, lengths):
    out = []
    for r, g in zip(rewards, groups, strict=True):
        idx = [j for j in range(len(rewards)) if groups[j] == g]
        total = sum(lengths[j] for j in idx)
        b = (sum(lengths[j] * rewards[j] for j in idx) / total if total
             else sum(rewards[j] for j in idx) / len(idx))
        out.append(0.0 if max(rewards[j] for j in idx) == min(rewards[j] for j in idx)
                   else r - b)
    return out


CASES = st.lists(st.tuples(st.integers(0, 3), st.sampled_from([0.0, 0.5, 1.0, 2.5, -1.0]),
                           st.integers(0, 5)), min_size=2, max_size=12)


@settings(max_examples=80, deadline=None)
@given(CASES, st.integers(0, 1), st.sampled_from([0.0, 1e-8, 0.3]))
def test_each_formula_matches_its_loop_transcription(cases, ddof, eps):
    groups = [g for g, _, _ in cases]
    rewards = [r for _, r, _ in cases]
    lengths = [n for _, _, n in cases]
    r_t, g_t = torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups)
    n_t = torch.tensor(lengths)
    got = reinforce_pp_baseline_advantage(r_t, g_t, n_t, ddof=ddof, eps=eps)
    if eps > 0 or sum(lengths) > ddof:
        want = _loop_rpp(rewards, groups, lengths, ddof, eps)
        if eps > 0 or all(math.isfinite(w) for w in want):
            assert got.tolist() == pytest.approx(want, abs=LOOP, rel=LOOP)
    assert bool(torch.isfinite(got).all()) or eps == 0
    assert group_mean_batch_std_advantage(r_t, g_t, ddof=ddof, eps=eps + 1e-4).tolist() == \
        pytest.approx(_loop_batch_std(rewards, groups, ddof, eps + 1e-4), abs=LOOP, rel=LOOP)
    assert opo_advantage(r_t, g_t, n_t).tolist() == pytest.approx(
        _loop_opo(rewards, groups, lengths), abs=LOOP, rel=LOOP)


def test_stacked_steps_are_each_their_own_batch():
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.0, 1.0, 0.5], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    lengths = torch.tensor([3, 1, 1, 3, 2, 4])
    step = torch.tensor([0, 0, 0, 0, 1, 1])
    for fn in (lambda r, g, n, s: reinforce_pp_baseline_advantage(r, g, n, step_S=s),
               lambda r, g, n, s: group_mean_batch_std_advantage(r, g, step_S=s),
               lambda r, g, n, s: opo_advantage(r, g, n)):
        both = fn(rewards, groups, lengths, step)
        for k in (0, 1):
            sel = step == k
            alone = fn(rewards[sel], groups[sel], lengths[sel], None)
            torch.testing.assert_close(both[sel], alone, rtol=0, atol=EXACT)
    # and the batch-wide ones differ from one step over everything
    assert not torch.allclose(reinforce_pp_baseline_advantage(rewards, groups, lengths)[:4],
                              reinforce_pp_baseline_advantage(rewards, groups, lengths,
                                                              step_S=step)[:4])


def test_weighted_whiten_is_the_whitening_of_repeated_entries():
    values = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64)
    weight = torch.tensor([2.0, 1.0, 3.0], dtype=torch.float64)
    repeated = values.repeat_interleave(weight.long())
    flat = (repeated - repeated.mean()) / (repeated.var(unbiased=True) + 1e-8).sqrt()
    got = weighted_whiten(values, weight, ddof=1, eps=1e-8)
    torch.testing.assert_close(got.repeat_interleave(weight.long()), flat, rtol=0, atol=EXACT)


def _batch():
    return make_batch([[9], [8, 7], [9], [6]], [[1, 2, 3], [4], [5], [6, 1, 2]],
                      rewards=[1.0, 0.0, 2.0, 0.0], groups=[0, 0, 1, 1])


@pytest.mark.parametrize("part", [ReinforcePPBaseline(), OPOBaseline()])
def test_prepare_reads_the_lengths_from_the_loss_mask_in_any_layout(part):
    batch = _batch()
    mask = batch.loss_mask.clone()
    first = (batch.sequence_id == 0) & mask
    mask[first.nonzero()[0, 0], first.nonzero()[0, 1]] = False      # sequence 0: 2 loss tokens
    batch = batch.replace(loss_mask=mask)
    est = E.Estimator(surrogate=E.Reinforce(), advantage=part)
    counts = torch.tensor([2, 1, 1, 3])
    want = part(batch.reward, batch.group, length_S=counts)
    got = E.prepare(batch, est)
    assert got.advantage[got.sequence_id == 0][got.loss_mask[got.sequence_id == 0]].tolist() \
        == pytest.approx([float(want[0])] * 2, abs=EXACT)
    packed = E.prepare(pack_first_fit_decreasing(batch, 7), est)
    for s in range(4):
        a = got.advantage[(got.sequence_id == s) & got.loss_mask]
        b = packed.advantage[(packed.sequence_id == s) & packed.loss_mask]
        torch.testing.assert_close(a, b, rtol=0, atol=EXACT)
        assert a.numel() == 0 or a[0].item() == pytest.approx(float(want[s]), abs=EXACT)


@pytest.mark.parametrize("part", [ReinforcePPBaseline(), GroupMeanBatchStd(), OPOBaseline(),
                                  E.BatchNormalized(), E.GroupNormalized()])
def test_data_parallel_ranks_get_the_step_advantages_from_gathered_sequences(part):
    # two ranks with whole groups each: per_sequence over every rank's rewards, groups and
    # loss-token counts, then prepare(..., advantage_S=share) on each rank = the whole step
    est = E.Estimator(surrogate=E.Reinforce(), advantage=part)
    whole = make_batch([[9]] * 6, [[1, 2, 3], [4], [5, 6], [1], [2, 2, 2, 2], [3, 1]],
                       rewards=[1.0, 0.0, 2.0, 0.5, 0.0, 1.5], groups=[0, 0, 1, 1, 2, 2])
    ranks = [select_sequences(whole, torch.tensor([0, 1])),
             select_sequences(whole, torch.tensor([2, 3, 4, 5]))]
    reward = torch.cat([r.reward for r in ranks])
    group = torch.cat([r.group + 10 * i for i, r in enumerate(ranks)])   # distinct ids
    length = torch.cat([r.loss_mask.sum(1) for r in ranks])              # padded rows
    gathered = part.per_sequence(reward, group, length)
    shares = gathered.split([r.num_sequences for r in ranks])
    full = E.prepare(whole, est)
    for rank, share, ids in zip(ranks, shares, ([0, 1], [2, 3, 4, 5]), strict=True):
        got = E.prepare(rank, est, advantage_S=share)
        torch.testing.assert_close(got.advantage, full.advantage[ids], rtol=0, atol=EXACT)
    if not part.group_local:   # each rank alone would be another estimator
        alone = E.prepare(ranks[0], est).advantage
        assert not torch.allclose(alone, full.advantage[[0, 1]])


def test_the_parts_need_the_lengths_when_called_on_rewards():
    with pytest.raises(ValueError, match="length_S"):
        ReinforcePPBaseline()(R, G)
    with pytest.raises(ValueError, match="length_S"):
        OPOBaseline()(R, G, length_S=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="length_S"):
        opo_advantage(R, G, torch.tensor([1, -1, 2, 2]))
    assert GroupMeanBatchStd()(R, G).shape == (4,)                   # needs none
    assert not ReinforcePPBaseline.group_local and not GroupMeanBatchStd.group_local
    assert OPOBaseline.group_local


@pytest.mark.parametrize(("make", "match"), [
    (lambda: ReinforcePPBaseline(ddof=-1), "ddof"),
    (lambda: ReinforcePPBaseline(ddof=1.0), "ddof"),
    (lambda: ReinforcePPBaseline(eps=-1e-8), "eps"),
    (lambda: GroupMeanBatchStd(ddof=True), "ddof"),
    (lambda: GroupMeanBatchStd(eps=math.nan), "eps"),
    (lambda: weighted_whiten(R, R, ddof=-2, eps=0.0), "ddof"),
])
def test_bad_hyperparameters_raise_naming_them(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_describe_names_the_hyperparameters():
    assert "ddof=0" in ReinforcePPBaseline(ddof=0).describe()
    assert "0.001" in GroupMeanBatchStd(eps=1e-3).describe()
    assert "OPO" in OPOBaseline().describe()
