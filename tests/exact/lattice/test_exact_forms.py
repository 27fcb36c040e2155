"""The forms made exact by the Laplace identity and the ratio messages (issue 27): the token
mean over a group at every G, rejects leaving the normalizer, token-level self-normalized IS,
sequence IS and per-decision IS — each equal to the enumeration twin to 1e-10 on random
automata where the masks bind, and to sampled groups at T = 4096 within standard errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmdp import estimators as E
from tokenmdp import exact as X
from tokenmdp.exact import lattice as L
from tokenmdp.testing.lattice_strategies import lattice_mdps

from .conftest import policies, twin

#: float64: the Laplace rule's proven bound is below 1e-11 relative
TOL = 1e-10
#: Sampled means against exact ones, in standard errors
MAX_Z = 4.5

TOKEN_MEAN = E.Estimator(surrogate=E.TokenRatio(), advantage=E.GroupMean(),
                         aggregation=E.Aggregation.TOKEN_MEAN)
NEW = {name: E.get(name) for name in (
    "dapo", "ppo", "cispo_tis", "dapo_mis", "ppo_verl", "ppo_entropy", "grpo_batch_std",
    "grpo_rs_token", "sequence_is", "per_decision_is", "token_snis")}
NEW["token_mean_snis"] = TOKEN_MEAN.replace(correction=E.SelfNormalizedIS(cap=1.5))
NEW["token_mean_rejects_out"] = TOKEN_MEAN.replace(correction=E.RejectionSampling(
    statistic="k1", high=1.25, low=0.8, masked_in_normalizer=False))


def _compare(mdp, est, G, seed, noise=1.0, distance=0.5):
    pi, mu, old = policies(mdp, seed, noise=noise, distance=distance)
    ref = L.LatticePolicy(mdp, generator=torch.Generator().manual_seed(seed + 3))
    tm, e_pi, e_mu, e_old, e_ref = twin(mdp, pi, mu, old, ref)
    kw = dict(group_size=G, behavior=mu, old=old, reference=ref)
    got = L.moments(mdp, pi, est, method="lattice", **kw)
    want = X.moments(tm, e_pi, est, group_size=G, behavior=e_mu, old=e_old, reference=e_ref,
                     method="enumeration")
    assert got.method == "lattice"
    scale = max(float(want.mean.abs().max()), 1.0)
    assert float((got.mean - want.mean).abs().max()) <= TOL * scale
    assert abs(got.total_variance - want.total_variance) <= TOL * max(want.total_variance, 1.0)
    assert float((got.covariance - want.covariance).abs().max()) <= TOL * scale
    return got, want


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("G", [2, 3])
def test_new_forms_equal_enumeration(name, G):
    mdp = L.LatticeMDP(L.token_count(0, 3, modulus=2), 3, length_reward=-0.1)
    got, want = _compare(mdp, NEW[name], G, seed=2)
    assert float(want.mean.norm()) > 1e-3


@settings(max_examples=15, deadline=None)
@given(lattice_mdps(max_len=3, max_vocab=3), st.sampled_from(sorted(NEW)), st.integers(2, 3),
       st.floats(0.2, 1.5))
def test_new_forms_equal_enumeration_on_random_automata(mdp, name, G, noise):
    _compare(mdp, NEW[name], G, seed=mdp.num_states, noise=noise)


def test_the_masks_bind_where_they_are_checked():
    """The rejection band and the masked-IS band reject some tokens and keep others on the
    lattice of the comparison, so the kept counts are really random."""
    mdp = L.LatticeMDP(L.token_count(0, 3, modulus=2), 3, length_reward=-0.1)
    pi, mu, old = policies(mdp, 2, noise=1.0, distance=0.5)
    fields = {"old_logprob": old.logprobs().detach(), "behavior_logprob": mu.logprobs().detach()}
    for est in (NEW["grpo_rs_token"], NEW["token_mean_rejects_out"], NEW["dapo_mis"]):
        keep = L.token_table(lambda b, c=est.correction: c(b).keep_RC, mdp.shape, fields)
        assert 0 < int(keep.sum()) < keep.numel(), est.name


def test_sequence_ratios_refuse_their_cap_and_fall_back():
    """A sequence ratio past ``e^20`` on some response is capped by the library, so the product
    is not a product: ``lattice`` refuses with the reason, ``auto`` samples."""
    mdp = L.LatticeMDP(L.token_count(0, 3, modulus=2), 40)
    pi, mu, old = policies(mdp, 1, noise=3.0, distance=0.0)
    for name in ("sequence_is", "per_decision_is"):
        with pytest.raises(ValueError, match="cap on some response"):
            L.moments(mdp, pi, E.get(name), group_size=2, behavior=mu, method="lattice")
        got = L.moments(mdp, pi, E.get(name), group_size=2, behavior=mu, num_samples=64)
        assert got.method == "monte_carlo"


def _long_world(T=4096):
    """A parity automaton over three tokens; EOS about 1/200 per token, so responses are a few
    hundred tokens and the lengths (hence the token mean's normalizer) vary widely."""
    mdp = L.LatticeMDP(L.token_count(0, 3, modulus=2), T)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 3, generator=g, dtype=torch.float64)
    base[:, -1] -= 5.0
    noise = 0.3 * torch.randn(2, 3, generator=g, dtype=torch.float64)
    pi = L.LatticePolicy(mdp, logits=base.expand(T, 2, 3))
    mu = L.LatticePolicy(mdp, logits=(base + noise).expand(T, 2, 3)).requires_grad_(False)
    return mdp, pi, mu


@pytest.mark.parametrize("name", ["dapo_tis", "cispo"])
def test_token_mean_at_4096_tokens_agrees_with_sampled_groups(name):
    """At T = 4096 (no enumeration possible) the exact token-mean moments against sampled steps
    of the library's own ``prepare``/``loss`` (:func:`~tokenmdp.exact.lattice.step_gradients`):
    the projections of ``ĝ`` on fixed directions and ``‖ĝ‖²``, each within its standard error
    (per-coordinate errors of rare nodes are not well estimated by a few hundred draws)."""
    mdp, pi, mu = _long_world()
    est, G, n = E.get(name), 8, 240
    exact = L.moments(mdp, pi, est, group_size=G, behavior=mu)
    assert exact.method == "lattice"
    logp = {"policy": pi.logprobs().detach(), "behavior_logprob": mu.logprobs().detach(),
            "old_logprob": mu.logprobs().detach()}
    gen = torch.Generator().manual_seed(7)
    tokens, states, lengths, rewards = L.sample(mdp, logp["behavior_logprob"], n * G, gen)
    assert float(lengths.double().std()) > 50                  # the normalizer really varies
    batch, lp = L.group_batch(mdp, tokens, states, lengths, rewards, G, logp)
    g = L.step_gradients(mdp, batch, lp, states, est, logp["policy"].exp())
    directions = torch.stack([exact.mean, exact.true_gradient,
                              torch.randn(exact.mean.shape, generator=gen, dtype=torch.float64)])
    directions = directions / directions.norm(dim=1, keepdim=True)
    samples = torch.cat([g @ directions.T, (g * g).sum(1, keepdim=True)], dim=1)
    want = torch.cat([directions @ exact.mean,
                      torch.tensor([exact.total_variance + float(exact.mean @ exact.mean)])])
    z = (samples.mean(0) - want).abs() / (samples.std(0) / n ** 0.5)
    assert float(z.max()) <= MAX_Z, z


def test_a_normalizer_that_can_vanish_is_refused_by_name():
    """Token SNIS whose weight underflows to 0 on some token: the normalizer Σ w could be 0, so
    there is no Laplace rule; the error names the behaviour policy and the cause."""
    mdp = L.LatticeMDP(L.token_count(0, 3, modulus=2), 3)
    pi = L.LatticePolicy(mdp, generator=torch.Generator().manual_seed(0))
    logits = pi.logits.detach().clone()
    logits[..., 0] -= 900.0                      # π_old all but excludes token 0 ...
    old = L.LatticePolicy(mdp, logits=logits)    # ... so its π_old/μ is e^-900 = 0
    with pytest.raises(ValueError, match="behavior: the importance weight.*Laplace rule"):
        L.moments(mdp, pi, NEW["token_mean_snis"], group_size=2, behavior=pi, old=old,
                  method="lattice")
