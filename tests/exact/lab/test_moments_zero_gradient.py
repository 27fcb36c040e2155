"""A zero reward has ∇J = 0 exactly: Monte Carlo moments stay defined where they can be.

GRPO's k3 penalty to a different reference still moves the policy, so ĝ is not zero. The relative
bias and the cosine divide by ‖∇J‖, so their standard errors are undefined (None); the mean, the
total variance and the MSE (here the second moment E‖ĝ‖²) keep theirs.
"""

import math

import torch

from tokenmdp import estimators
from tokenmdp.exact import TabularPolicy, TokenMDP, moments
from tokenmdp.exact.world.rewards import LengthReward


def test_monte_carlo_moments_with_a_zero_true_gradient():
    mdp = TokenMDP(3, 2, LengthReward(0.0))  # R = 0 for every response
    policy = TabularPolicy(mdp, generator=torch.Generator().manual_seed(0))
    reference = TabularPolicy(mdp, generator=torch.Generator().manual_seed(2))
    m = moments(mdp, policy, estimators.get("grpo"), group_size=2, method="monte_carlo",
                reference=reference, num_samples=64, generator=torch.Generator().manual_seed(1))
    assert float(m.true_gradient.abs().max()) == 0.0
    assert m.relative_bias_se is None and m.cosine_se is None
    assert math.isfinite(m.total_variance) and m.total_variance > 0  # the k3 term is sampled
    assert m.mse_se is not None and math.isfinite(m.mse_se)
    assert m.mse == m.total_variance + float(m.bias @ m.bias)
