"""Built-in rewards: hand-worked values, and vectorized form == scalar form on every response."""

import math

import pytest
import torch

from tokenmdp.exact import TokenMDP
from tokenmdp.exact.world.rewards import (
    ContainsPattern,
    ExactMatch,
    LengthReward,
    OverlongPenalty,
    Parity,
    RandomTable,
    TokenCount,
)

EOS = 3  # vocabulary {0, 1, 2, EOS=3} below

REWARDS = {
    "exact": ExactMatch((0, 1, EOS)),
    "exact_per_prompt": ExactMatch({(0,): (1, EOS), (2, 1): (EOS,)}),
    "contains": ContainsPattern((1, 1)),
    "count": TokenCount(2, scale=0.5),
    "parity": Parity(1),
    "length": LengthReward(-0.25, base=1.0, content=TokenCount(0)),
    "random": RandomTable(seed=11),
    "random_binary": RandomTable(seed=11, binary_p=0.3),
    "overlong": OverlongPenalty(TokenCount(1), max_len=4, cache_len=2),
}


@pytest.mark.parametrize("name", sorted(REWARDS))
def test_vectorized_table_equals_scalar_calls(name):
    reward = REWARDS[name]
    mdp = TokenMDP(4, 4, reward, prompts=[(0,), (2, 1)])
    scalar = torch.tensor([reward(p, r, eos=mdp.eos) for p, r in mdp.responses()],
                          dtype=torch.float64)
    assert torch.equal(mdp.rewards, scalar)
    assert mdp.rewards.std() > 0  # not a constant table


def test_hand_worked_reward_values():
    assert ExactMatch((0, 1, EOS))((0,), (0, 1, EOS), eos=EOS) == 1.0
    assert ExactMatch((0, 1, EOS))((0,), (0, 1), eos=EOS) == 0.0        # truncated: no EOS
    assert ContainsPattern((1, 1))((0,), (0, 1, 1, EOS), eos=EOS) == 1.0
    assert ContainsPattern((1, 1))((0,), (1, 0, 1, EOS), eos=EOS) == 0.0
    assert TokenCount(2, scale=0.5)((0,), (2, 2, 0, EOS), eos=EOS) == 1.0  # 0.5 * 2
    assert Parity(1)((0,), (1, 2, EOS), eos=EOS) == 1.0                 # 1 + 2 = 3, odd
    assert Parity(0)((0,), (1, 2, EOS), eos=EOS) == 0.0
    assert LengthReward(-0.25, base=1.0)((0,), (1, 2, EOS), eos=EOS) == 0.25  # 1 - 0.25 * 3


def test_overlong_penalty_follows_dapo_equation_13():
    # L_max = 8, L_cache = 4: no penalty up to length 4, then (4 - |y|) / 4, -1 when cut off.
    pen = OverlongPenalty(lambda x, y: 0.0, max_len=8, cache_len=4, eos=EOS)
    lengths = {4: 0.0, 5: -0.25, 6: -0.5, 8: -1.0}
    for n, expected in lengths.items():
        assert pen((0,), (0,) * (n - 1) + (EOS,)) == expected
    assert pen((0,), (0,) * 8) == -1.0                       # truncated at the limit
    keep = OverlongPenalty(lambda x, y: 0.0, max_len=8, cache_len=4, eos=EOS,
                           truncated_is_overlong=False)
    assert keep((0,), (0,) * 7 + (1,)) == -1.0               # |y| = 8 = L_max: (4 - 8) / 4


def test_random_table_is_seeded_and_order_independent():
    a = TokenMDP(3, 3, RandomTable(seed=5), prompts=[(0,), (1,)])
    b = TokenMDP(3, 3, RandomTable(seed=5), prompts=[(1,), (0,)])
    c = TokenMDP(3, 3, RandomTable(seed=6), prompts=[(0,), (1,)])
    ra = dict(zip(a.responses(), a.rewards.tolist()))
    rb = dict(zip(b.responses(), b.rewards.tolist()))
    assert ra == rb
    assert not torch.equal(a.rewards, c.rewards)
    assert 0.0 <= float(a.rewards.min()) and float(a.rewards.max()) < 1.0


def test_plain_callable_reward_is_used_as_is():
    mdp = TokenMDP(3, 2, lambda x, y: float(len(y)) + x[0])
    assert mdp.rewards.tolist() == [float(len(y)) for _, y in mdp.responses()]


def test_non_finite_reward_is_rejected_naming_the_argument():
    with pytest.raises(ValueError, match="reward: returned a non-finite"):
        TokenMDP(3, 2, lambda x, y: math.nan if len(y) == 2 else 0.0)
    with pytest.raises(ValueError, match="reward"):
        TokenMDP(3, 2, lambda x, y: math.inf)
