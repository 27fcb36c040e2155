"""Small exact MDPs and policies shared by the exact-world tests."""

import pytest
import torch

from tokenmdp.exact import LogLinearPolicy, NeuralPolicy, TabularPolicy, TokenMDP
from tokenmdp.exact.world.rewards import LengthReward, RandomTable

POLICY_CLASSES = (TabularPolicy, LogLinearPolicy, NeuralPolicy)


@pytest.fixture
def mdp() -> TokenMDP:
    """Vocabulary {0, 1, EOS=2}, responses of up to 3 tokens, two prompts of unequal weight,
    a random reward plus a length term (so V, Q and A are all non-trivial)."""
    reward = LengthReward(-0.2, content=RandomTable(seed=3))
    return TokenMDP(3, 3, reward, prompts=[(0,), (1, 0)], prompt_probs=[0.3, 0.7])


class OnlyTokenLogprobs(torch.nn.Module):
    """A policy seen only through the protocol (no prefix fast path), like the transformer."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def next_token_logprobs(self, batch):
        return self.inner.next_token_logprobs(batch)

    def token_logprobs(self, batch):
        return self.inner.token_logprobs(batch)


def make_policy(cls, mdp, seed=0):
    return cls(mdp, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=POLICY_CLASSES, ids=lambda c: c.__name__)
def policy(request, mdp):
    return make_policy(request.param, mdp)
