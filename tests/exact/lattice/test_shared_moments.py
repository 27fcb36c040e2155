"""Exact moments for shared-parameter policies (issue 27): in the policy's own parameter ``W``,
equal to the enumeration twin (whose prefix policy shares ``W``) on both routes — the projected
logit-space covariance (small lattices) and the vector messages with projected Gram matrices
(any length) — and the Monte Carlo fallback in the same coordinates."""

import pytest
import torch

from tokenmdp import estimators as E
from tokenmdp import exact as X
from tokenmdp.exact import lattice as L
from tokenmdp.exact.lattice.exact_moments import form_moments

from .conftest import policies, twin

TOL = 1e-10
MAX_Z = 4.5
NAMES = ["dapo", "grpo", "minirl", "sequence_is", "grpo_rs_token", "ppo_verl", "token_snis"]


def _world(features):
    mdp = L.LatticeMDP(L.token_count(0, 3, modulus=2), 3, length_reward=-0.1)
    g = torch.Generator().manual_seed(0)
    feats = None if features is None else torch.randn(3, 2, features, generator=g,
                                                      dtype=torch.float64)
    pi = L.SharedLatticePolicy(mdp, features=feats, generator=g)
    _, mu, old = policies(mdp, 2, noise=1.0, distance=0.5)
    return mdp, pi, mu, old


@pytest.mark.parametrize("features", [None, 2, 3])
@pytest.mark.parametrize("name", NAMES)
def test_shared_moments_equal_enumeration_on_both_routes(features, name):
    mdp, pi, mu, old = _world(features)
    tm, e_pi, e_mu, e_old = twin(mdp, pi, mu, old)
    est = E.get(name)
    want = X.moments(tm, e_pi, est, group_size=2, behavior=e_mu, old=e_old, reference=e_mu,
                     method="enumeration")
    got = L.moments(mdp, pi, est, group_size=2, behavior=mu, old=old, reference=mu)
    assert got.method == "lattice" and got.mean.numel() == pi.num_parameters
    assert float((got.mean - want.mean).abs().max()) <= TOL
    assert abs(got.total_variance - want.total_variance) <= TOL
    assert float((got.covariance - want.covariance).abs().max()) <= TOL
    # the route for lattices too large for a covariance: vector messages, projected Gram
    logp = {"policy": pi.logprobs().detach(), "behavior_logprob": mu.logprobs().detach(),
            "old_logprob": old.logprobs().detach(), "ref_logprob": mu.logprobs().detach()}
    form, _ = L.lattice_form(est, 2, max_len=mdp.max_len)
    long = form_moments(mdp, logp, form, est, 2, L.gradient(mdp, pi), keep_cov=False,
                        policy=pi)
    assert long.covariance is None
    assert float((long.mean - want.mean).abs().max()) <= TOL
    assert abs(long.total_variance - want.total_variance) <= TOL


def test_shared_per_decision_falls_back_in_the_policys_coordinates():
    """Per-decision IS with shared parameters is not exact (three measures in the square's
    cross terms); the Monte Carlo fallback reports in ``W``'s coordinates and agrees with the
    enumeration within its standard errors."""
    mdp, pi, mu, old = _world(3)
    tm, e_pi, e_mu, e_old = twin(mdp, pi, mu, old)
    est = E.get("per_decision_is")
    with pytest.raises(ValueError, match="shared parameters"):
        L.moments(mdp, pi, est, group_size=2, behavior=mu, method="lattice")
    got = L.moments(mdp, pi, est, group_size=2, behavior=mu, num_samples=3000)
    want = X.moments(tm, e_pi, est, group_size=2, behavior=e_mu, method="enumeration")
    assert got.method == "monte_carlo" and got.mean.numel() == pi.num_parameters
    z = (got.mean - want.mean).abs() / got.mean_se.clamp(min=1e-300)
    assert float(z.max()) <= MAX_Z
    assert abs(got.total_variance - want.total_variance) <= MAX_Z * got.total_variance_se
