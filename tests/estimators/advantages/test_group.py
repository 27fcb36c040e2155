"""Advantages: hand-worked groups, an independent loop implementation, constant groups."""

from __future__ import annotations

import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmdp.estimators import (
    BatchNormalized,
    GroupMean,
    GroupNormalized,
    LeaveOneOut,
    RewardAsAdvantage,
    batch_normalized_advantage,
    group_mean_advantage,
    group_normalized_advantage,
    leave_one_out_advantage,
    reward_advantage,
)

EXACT = 1e-12  # float64, a few roundings

# Three interleaved groups with non-contiguous ids:
#   id 7 (A): R = 1, 0, 0, 1  mean 0.5, deviations ±0.5, sample std sqrt(1/3) = 0.57735,
#             population std 0.5, leave-one-out ±(4/3)·0.5 = ±2/3
#   id 3 (B): R = 1, 1        constant: every advantage exactly 0
#   id 9 (C): R = 2, 5        mean 3.5, deviations ∓1.5, sample std sqrt(4.5) = 2.12132,
#             population std 1.5, leave-one-out 2 - 5 = -3 and 5 - 2 = 3
REWARDS = torch.tensor([1.0, 1.0, 0.0, 2.0, 0.0, 1.0, 1.0, 5.0], dtype=torch.float64)
GROUPS = torch.tensor([7, 3, 7, 9, 7, 3, 7, 9])
S3 = 3 ** -0.5


def test_group_mean_hand_worked():
    assert group_mean_advantage(REWARDS, GROUPS).tolist() == pytest.approx(
        [0.5, 0.0, -0.5, -1.5, -0.5, 0.0, 0.5, 1.5], abs=EXACT)


def test_group_normalized_sample_and_population_std():
    a = 0.5 / S3  # 0.866025
    c = 1.5 / 4.5 ** 0.5  # 0.707107
    assert group_normalized_advantage(REWARDS, GROUPS, ddof=1, eps=0.0).tolist() == \
        pytest.approx([a, 0.0, -a, -c, -a, 0.0, a, c], abs=EXACT)
    assert group_normalized_advantage(REWARDS, GROUPS, ddof=0, eps=0.0).tolist() == \
        pytest.approx([1.0, 0.0, -1.0, -1.0, -1.0, 0.0, 1.0, 1.0], abs=EXACT)
    # ε is added to the std: group A with ε = 0.1 gives 0.5 / (0.5 + 0.1)
    eps = group_normalized_advantage(REWARDS, GROUPS, ddof=0, eps=0.1)
    assert eps[0].item() == pytest.approx(0.5 / 0.6, abs=EXACT)


def test_leave_one_out_hand_worked_and_relation_to_group_mean():
    loo = leave_one_out_advantage(REWARDS, GROUPS)
    assert loo.tolist() == pytest.approx([2 / 3, 0.0, -2 / 3, -3.0, -2 / 3, 0.0, 2 / 3, 3.0],
                                         abs=EXACT)
    # group mean = (G-1)/G × leave-one-out, sample by sample (G = 4, 2, 4, 2, ...)
    sizes = torch.tensor([4, 2, 4, 2, 4, 2, 4, 2], dtype=torch.float64)
    assert torch.allclose(group_mean_advantage(REWARDS, GROUPS), loo * (sizes - 1) / sizes,
                          atol=EXACT, rtol=0)


def test_reward_and_batch_normalization():
    assert reward_advantage(REWARDS).tolist() == REWARDS.tolist()
    values = REWARDS.tolist()
    mean, std = statistics.fmean(values), statistics.stdev(values)
    assert batch_normalized_advantage(REWARDS, ddof=1, eps=0.0).tolist() == pytest.approx(
        [(v - mean) / std for v in values], abs=EXACT)


def _loop_reference(rewards, groups, kind, ddof=1):
    out = []
    for i, (r, g) in enumerate(zip(rewards, groups, strict=True)):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == g]
        others = [rewards[j] for j in range(len(rewards)) if groups[j] == g and j != i]
        if kind == "mean":
            out.append(r - statistics.fmean(members))
        elif kind == "loo":
            out.append(r - statistics.fmean(others))
        else:
            std = statistics.stdev(members) if ddof == 1 else statistics.pstdev(members)
            out.append(0.0 if std == 0 else (r - statistics.fmean(members)) / std)
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.sampled_from([0.0, 0.5, 1.0, 2.5, -1.0])),
                min_size=2, max_size=16))
def test_group_advantages_match_a_loop_over_groups(pairs):
    groups = [g for g, _ in pairs]
    rewards = [r for _, r in pairs]
    sizes = {g: groups.count(g) for g in groups}
    r_t = torch.tensor(rewards, dtype=torch.float64)
    g_t = torch.tensor(groups)
    assert group_mean_advantage(r_t, g_t).tolist() == pytest.approx(
        _loop_reference(rewards, groups, "mean"), abs=1e-9)
    if min(sizes.values()) >= 2:
        assert leave_one_out_advantage(r_t, g_t).tolist() == pytest.approx(
            _loop_reference(rewards, groups, "loo"), abs=1e-9)
        assert group_normalized_advantage(r_t, g_t, ddof=1, eps=0.0).tolist() == pytest.approx(
            _loop_reference(rewards, groups, "norm"), abs=1e-9)


@pytest.mark.parametrize("part", [GroupMean(), GroupNormalized(ddof=1, eps=0.0),
                                  GroupNormalized(ddof=0, eps=1e-6), LeaveOneOut()])
def test_constant_group_gives_exactly_zero_advantage(part):
    # 0.1 three times: the float mean is 0.10000000000000002, so R - mean would be -1.4e-17
    # (and, divided by std + 0, about -1); the advantage must be exactly 0.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.3, 0.7], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1])
    out = part(rewards, groups)
    assert out[:3].tolist() == [0.0, 0.0, 0.0]
    assert out[3].item() != 0.0


def test_parts_describe_their_hyperparameters():
    assert "ddof=0" in GroupNormalized(ddof=0, eps=1e-4).describe()
    assert "0.0001" in GroupNormalized(ddof=0, eps=1e-4).describe()
    assert RewardAsAdvantage()(REWARDS, GROUPS).tolist() == REWARDS.tolist()
    assert BatchNormalized(ddof=0, eps=0.0)(REWARDS, GROUPS).std(unbiased=False).item() == \
        pytest.approx(1.0, abs=EXACT)


def test_bad_inputs_raise_naming_the_argument():
    with pytest.raises(ValueError, match="group_S"):  # singleton group has no sample std
        group_normalized_advantage(REWARDS[:3], torch.tensor([0, 0, 1]), ddof=1, eps=1e-6)
    with pytest.raises(ValueError, match="group_S"):
        leave_one_out_advantage(REWARDS[:3], torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="eps"):
        GroupNormalized(eps=-1e-6)
    with pytest.raises(ValueError, match="ddof"):
        GroupNormalized(ddof=-1)
    with pytest.raises(ValueError, match="reward_S"):
        group_mean_advantage(REWARDS.reshape(2, 4), GROUPS)
    with pytest.raises(ValueError, match="group_S"):
        group_mean_advantage(REWARDS, GROUPS[:3])
    with pytest.raises(TypeError, match="reward_S"):
        group_mean_advantage(GROUPS, GROUPS)
