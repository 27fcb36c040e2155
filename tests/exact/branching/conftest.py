"""The exact world's small MDP (``tests/exact/conftest.py``) with a tabular π, a stale π_old and
an inference-copy sampler μ, for the branching tests."""

import pytest
import torch

from tokenmdp.exact import TabularPolicy, inference_copy, stale_copy


@pytest.fixture
def pi(mdp):
    return TabularPolicy(mdp, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def old(mdp, pi):
    return stale_copy(mdp, pi, distance=0.5)


@pytest.fixture
def mu(old):
    return inference_copy(old, noise_std=0.3, generator=torch.Generator().manual_seed(1))
