"""Bad input to the exact world: each a ValueError/TypeError naming the argument."""

import pytest
import torch

from tokenmdp import TokenBatch
from tokenmdp.exact import (
    LogLinearPolicy,
    TabularPolicy,
    TokenMDP,
    gradient,
    objective,
    sample,
)
from tokenmdp.exact.world.rewards import TokenCount

from .conftest import make_policy


def reward(x, y):
    return float(len(y))


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(vocab_size=1, max_len=2), ValueError, "vocab_size"),
    (dict(vocab_size=2.0, max_len=2), TypeError, "vocab_size"),
    (dict(vocab_size=3, max_len=0), ValueError, "max_len"),
    (dict(vocab_size=3, max_len=2, prompt_probs=[0.5, 0.6], prompts=[(0,), (1,)]),
     ValueError, "prompt_probs: must sum to 1"),
    (dict(vocab_size=3, max_len=2, prompt_probs=[1.5, -0.5], prompts=[(0,), (1,)]),
     ValueError, "prompt_probs"),
    (dict(vocab_size=3, max_len=2, prompt_probs=[0.5, 0.5]), ValueError, "prompt_probs"),
    (dict(vocab_size=3, max_len=2, prompts=[()]), ValueError, "prompts"),
    (dict(vocab_size=3, max_len=2, prompts=[(5,)]), ValueError, "prompts"),
    (dict(vocab_size=3, max_len=2, prompts=[(0,), (0,)]), ValueError, "prompts"),
])
def test_mdp_rejects_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        TokenMDP(reward=reward, **kwargs)


def test_mdp_rejects_a_non_callable_reward():
    with pytest.raises(TypeError, match="reward"):
        TokenMDP(3, 2, reward=1.0)


def test_policy_built_for_another_mdp_is_rejected():
    a = TokenMDP(3, 2, reward)
    b = TokenMDP(3, 3, reward)
    policy = make_policy(TabularPolicy, a)
    with pytest.raises(ValueError, match="policy: built for another MDP"):
        objective(b, policy)
    same = TokenMDP(3, 2, reward)  # an identical MDP is accepted
    objective(same, policy)


def test_float32_policy_is_rejected():
    mdp = TokenMDP(3, 2, reward)
    policy = make_policy(LogLinearPolicy, mdp).float()
    with pytest.raises(TypeError, match="policy: parameter .*float32"):
        gradient(mdp, policy)


def test_float32_batch_is_rejected_by_exact_policies():
    mdp = TokenMDP(3, 2, reward)
    policy = make_policy(TabularPolicy, mdp)
    with pytest.raises(TypeError, match="batch: float fields are torch.float32"):
        policy.token_logprobs(mdp.enumerate().to(dtype=torch.float32))


def test_batch_that_is_not_from_the_mdp_is_rejected():
    mdp = TokenMDP(3, 2, reward)
    policy = make_policy(TabularPolicy, mdp)
    eos = mdp.eos
    bad = {
        "EOS inside a response": ([[0]], [[eos, 0]]),
        "does not end with EOS": ([[0]], [[0]]),
        "longer than max_len": ([[0]], [[0, 1, eos]]),
        "outside the vocabulary": ([[0]], [[7, eos]]),
        "prompt lengths": ([[0, 1]], [[0, eos]]),
    }
    for match, (prompts, responses) in bad.items():
        batch = TokenBatch.from_sequences(prompts, responses)
        with pytest.raises(ValueError, match=match):
            policy.token_logprobs(batch)


def test_policies_and_sampling_need_explicit_generators():
    mdp = TokenMDP(3, 2, TokenCount(0))
    with pytest.raises(TypeError, match="generator"):
        TabularPolicy(mdp, generator=0)
    with pytest.raises(TypeError, match="mdp"):
        TabularPolicy("mdp", generator=torch.Generator())
    policy = make_policy(TabularPolicy, mdp)
    with pytest.raises(TypeError, match="generator"):
        sample(mdp, policy, 4, generator=None)
    with pytest.raises(ValueError, match="n: must be a positive multiple"):
        sample(mdp, policy, 5, generator=torch.Generator(), group_size=2)
