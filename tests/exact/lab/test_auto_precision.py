"""Issue 32: ``method="auto"`` reaches a stated precision at the lower cost. On a world where
the fixed 4096 Monte Carlo batches give the mean only to 7% of ‖∇J‖, while the enumeration of
its 251,940 group draws takes about a second, ``auto`` now runs the enumeration; asked for less
precision it runs Monte Carlo with the batches a pilot says reach it, and reports what it
reached (``Moments.relative_se``)."""

import pytest
import torch

from tokenmdp import estimators as E
from tokenmdp.exact import TabularPolicy, TokenMDP, inference_copy, moments, stale_copy
from tokenmdp.exact.lab.method_choice import (
    DEFAULT_NUM_SAMPLES,
    MC_COST_PER_BATCH,
    PILOT_SAMPLES,
    samples_for,
)
from tokenmdp.exact.world.rewards import RandomTable

#: The enumeration of dapo's group draws at G = 8 here (the exact cost auto weighs).
DRAWS = 251_940


@pytest.fixture(scope="module")
def world():
    mdp = TokenMDP(4, 2, RandomTable(seed=1), prompts=[(0,), (1,)], prompt_probs=[0.4, 0.6])
    pi = TabularPolicy(mdp, generator=torch.Generator().manual_seed(1))
    old = stale_copy(mdp, pi, distance=0.3)
    mu = inference_copy(old, noise_std=0.3, generator=torch.Generator().manual_seed(2))
    return mdp, pi, dict(behavior=mu, old=old)


def test_auto_runs_exact_where_monte_carlo_would_need_longer_to_reach_the_precision(world):
    mdp, pi, kw = world
    fixed = moments(mdp, pi, E.get("dapo"), group_size=8, target_rse=None, **kw)
    assert fixed.method == "monte_carlo" and fixed.num_draws == DEFAULT_NUM_SAMPLES
    assert fixed.relative_se > 0.05                     # the imprecision the review found
    precise = moments(mdp, pi, E.get("dapo"), group_size=8, **kw)      # target_rse = 1%
    exact = moments(mdp, pi, E.get("dapo"), group_size=8, method="exact", **kw)
    assert precise.method == exact.method == "enumeration" and precise.num_draws == DRAWS
    assert torch.equal(precise.mean, exact.mean) and precise.relative_se == 0.0


@pytest.mark.parametrize("target", [0.2, 0.03])
def test_auto_runs_the_monte_carlo_that_reaches_a_looser_precision(world, target):
    mdp, pi, kw = world
    m = moments(mdp, pi, E.get("dapo"), group_size=8, target_rse=target, **kw)
    assert m.method == "monte_carlo"
    assert m.num_draws >= DEFAULT_NUM_SAMPLES and MC_COST_PER_BATCH * m.num_draws < DRAWS
    # the pilot's estimate of the spread is a sample estimate: the precision reached is the
    # target's to within the pilot's own error (a few tens of percent at 512 batches)
    assert m.relative_se < 1.5 * target
    if m.num_draws > DEFAULT_NUM_SAMPLES:
        assert m.relative_se > 0.5 * target


def test_the_batches_needed_scale_as_the_squared_ratio_of_errors():
    assert samples_for(0.1, 0.01) == PILOT_SAMPLES * 100
    assert samples_for(0.001, 0.01) == DEFAULT_NUM_SAMPLES       # never below the default
    assert samples_for(float("inf"), 0.01) == DEFAULT_NUM_SAMPLES


@pytest.mark.parametrize("bad", [0, -0.1, True, "1%"])
def test_a_target_that_is_not_a_positive_number_is_refused(world, bad):
    mdp, pi, kw = world
    with pytest.raises(ValueError, match="target_rse: expected a number > 0 or None"):
        moments(mdp, pi, E.get("reinforce"), group_size=2, target_rse=bad, **kw)
