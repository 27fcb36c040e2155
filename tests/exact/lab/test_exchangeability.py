"""The exchangeability method equals full enumeration of group draws, for every registry
estimator, in the hardest scenario (stale and discrepant sampling, a KL reference)."""

import pytest
import torch

from tests.exact.conftest import make_policy
from tokenmdp import estimators as E
from tokenmdp.exact import TabularPolicy, TokenMDP, inference_copy, stale_copy
from tokenmdp.exact.lab.exchangeability import reduces_to_types
from tokenmdp.exact.lab.moments import moments
from tokenmdp.exact.world.rewards import ExactMatch, LengthReward

EXACT_TOL = 1e-11


@pytest.fixture(scope="module")
def scenario():
    mdp = TokenMDP(3, 3, LengthReward(0.0, content=ExactMatch((0, 1, 2))),
                   prompts=[(0,), (1,)], prompt_probs=[0.3, 0.7])
    pi = make_policy(TabularPolicy, mdp, seed=4)
    old = stale_copy(mdp, pi, distance=0.4)
    mu = inference_copy(old, noise_std=0.4, generator=torch.Generator().manual_seed(5))
    return mdp, pi, dict(behavior=mu, old=old, reference=old)


@pytest.mark.parametrize("name", E.names())
def test_exchangeability_equals_enumeration(scenario, name):
    mdp, pi, kw = scenario
    est = E.get(name)
    a = moments(mdp, pi, est, group_size=3, method="enumeration", **kw)
    if not reduces_to_types(est):   # a part couples the group beyond types: refused, and
        with pytest.raises(ValueError, match="couples"):            # never chosen by exact
            moments(mdp, pi, est, group_size=3, method="exchangeability", **kw)
        assert moments(mdp, pi, est, group_size=3, method="exact", **kw).method == "enumeration"
        return
    b = moments(mdp, pi, est, group_size=3, method="exchangeability", **kw)
    torch.testing.assert_close(b.mean, a.mean, rtol=0, atol=EXACT_TOL)
    assert abs(b.total_variance - a.total_variance) < EXACT_TOL * max(1.0, a.total_variance)
    torch.testing.assert_close(b.covariance, a.covariance, rtol=0, atol=EXACT_TOL)
    assert a.mean.norm() > 1e-6  # not a comparison of zeros


@pytest.mark.parametrize("G", [2, 4])
def test_exchangeability_other_group_sizes(scenario, G):
    mdp, pi, kw = scenario
    est = E.get("dapo_mis")
    a = moments(mdp, pi, est, group_size=G, method="enumeration", **kw)
    b = moments(mdp, pi, est, group_size=G, method="exchangeability", **kw)
    torch.testing.assert_close(b.mean, a.mean, rtol=0, atol=EXACT_TOL)
    assert abs(b.total_variance - a.total_variance) < EXACT_TOL * max(1.0, a.total_variance)


def test_exchangeability_refuses_what_it_cannot_do(scenario):
    mdp, pi, kw = scenario
    with pytest.raises(ValueError, match="exchangeability"):
        moments(mdp, pi, E.get("dapo"), group_size=2, method="exchangeability",
                prompts_per_batch=2, **kw)
