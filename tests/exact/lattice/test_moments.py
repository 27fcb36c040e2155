"""Exact moments on the lattice against the enumeration engine on the twin TokenMDP (mean,
total variance and covariance, float64, 1e-12), the Monte Carlo fallback within its standard
errors, and the per-step gradients against autograd through the library's prepare and loss."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmdp import estimators
from tokenmdp import exact as E
from tokenmdp.exact import lattice as L
from tokenmdp.testing.lattice_strategies import lattice_mdps

from .conftest import policies, twin

TOL = 1e-12
#: Largest |Monte Carlo mean − exact| in standard errors, over every coordinate.
MAX_Z = 5.0

EXACT = {"reinforce": (1, 2, 3), "rloo": (2, 3), "token_is": (1, 3), "minirl": (1, 2, 4),
         "minirl_no_is": (1, 3), "minirl_mis": (3,), "minirl_len_norm": (1, 2, 3),
         "grpo": (2, 3), "dr_grpo": (1, 3), "sapo": (3,), "dppo_kl": (2,), "grpo_mis": (3,),
         "dr_grpo_tis": (2,), "token_mean_reinforce": (1,)}
#: The token mean is exact at G = 1 (its normalizer is then 1/|y|).
CUSTOM = {"token_mean_reinforce": estimators.Estimator(
    name="token_mean_reinforce", surrogate=estimators.Reinforce(),
    aggregation=estimators.Aggregation.TOKEN_MEAN)}


def lattice():
    return L.LatticeMDP(L.token_count(0, 3, modulus=2), 3, length_reward=-0.1)


def both(mdp, name, G, seed=0, **kw):
    pi, mu, old = policies(mdp, seed)
    ref = L.LatticePolicy(mdp, generator=torch.Generator().manual_seed(seed + 7))
    tm, e_pi, e_mu, e_old, e_ref = twin(mdp, pi, mu, old, ref)
    est = CUSTOM[name] if name in CUSTOM else estimators.get(name)
    a = L.moments(mdp, pi, est, group_size=G, behavior=mu, old=old, reference=ref, **kw)
    b = E.moments(tm, e_pi, est, group_size=G, behavior=e_mu, old=e_old, reference=e_ref,
                  method="enumeration")
    return a, b


def assert_equal_moments(a, b):
    assert a.method == "lattice"
    assert (a.mean - b.mean).abs().max() <= TOL
    assert abs(a.total_variance - b.total_variance) <= TOL
    assert (a.covariance - b.covariance).abs().max() <= TOL
    assert (a.true_gradient - b.true_gradient).abs().max() <= TOL


@pytest.mark.parametrize("name,G", [(n, G) for n, gs in EXACT.items() for G in gs])
def test_exact_moments_equal_enumeration(name, G):
    a, b = both(lattice(), name, G)
    assert_equal_moments(a, b)


@settings(max_examples=12, deadline=None)
@given(lattice_mdps(max_len=3, max_vocab=3), st.sampled_from(["minirl", "grpo", "rloo"]),
       st.integers(2, 3))
def test_exact_moments_equal_enumeration_on_random_automata(mdp, name, G):
    a, b = both(mdp, name, G, seed=mdp.num_states)
    assert_equal_moments(a, b)


@pytest.mark.parametrize("name", ["gspo", "gmpo", "grpo_trl_mis"])
def test_monte_carlo_fallback_within_standard_errors(name):
    """Not exact on the lattice (GSPO's and GMPO's geometric means, a sequence-level masked
    weight): ``auto`` falls back to Monte Carlo and says so; it agrees with the enumeration
    within its standard errors."""
    a, b = both(lattice(), name, 3, num_samples=4000)
    assert a.method == "monte_carlo" and a.covariance is None
    assert ((a.mean - b.mean).abs() / a.mean_se.clamp(min=1e-300)).max() <= MAX_Z
    assert abs(a.total_variance - b.total_variance) <= MAX_Z * a.total_variance_se
    assert abs(a.cosine - b.cosine) <= MAX_Z * a.cosine_se


def test_monte_carlo_agrees_with_exact_at_long_length():
    """At T = 48 (far past any enumeration) the sampled moments of a supported estimator agree
    with the lattice's exact ones within their standard errors."""
    mdp = L.LatticeMDP(L.pattern_appeared([0, 1], 3), 48)
    pi, mu, old = policies(mdp, 3, noise=0.2)
    with torch.no_grad():
        pi.logits[..., -1] -= 2.0
    est = estimators.get("minirl")
    exact = L.moments(mdp, pi, est, group_size=4, behavior=mu, old=old)
    mc = L.moments(mdp, pi, est, group_size=4, behavior=mu, old=old, method="monte_carlo",
                   num_samples=3000)
    assert exact.method == "lattice" and mc.method == "monte_carlo"
    seen = mc.mean_se > 0                      # nodes the samples visited
    assert ((mc.mean - exact.mean).abs()[seen] / mc.mean_se[seen]).max() <= MAX_Z
    assert exact.mean[~seen].abs().max() <= 1e-4   # the others are rare
    assert abs(mc.total_variance - exact.total_variance) <= MAX_Z * mc.total_variance_se


@pytest.mark.parametrize("name", ["grpo", "gspo", "dapo_mis", "minirl_len_norm"])
def test_step_gradients_are_autograd_of_loss_on_the_twin(name):
    """The sampled steps' gradients (coefficients mapped through the softmax score) equal
    autograd of ``loss(prepare(batch))`` through the twin's prefix policy on the same batch."""
    mdp = lattice()
    pi, mu, old = policies(mdp)
    ref = L.LatticePolicy(mdp, generator=torch.Generator().manual_seed(9))
    tm, e_pi, e_ref = twin(mdp, pi, ref)
    logp = {"policy": pi.logprobs().detach(), "behavior_logprob": mu.logprobs().detach(),
            "old_logprob": old.logprobs().detach(), "ref_logprob": ref.logprobs().detach()}
    G = 3
    tokens, states, lengths, rewards = L.sample(mdp, logp["behavior_logprob"], 2 * G,
                                                torch.Generator().manual_seed(1))
    batch, lp = L.group_batch(mdp, tokens, states, lengths, rewards, G, logp)
    est = estimators.get(name)
    got = L.step_gradients(mdp, batch, lp, states, est, logp["policy"].exp())
    for step in range(2):
        part = tm.make_batch(torch.zeros(G, dtype=torch.long), tokens[step * G:(step + 1) * G],
                             lengths[step * G:(step + 1) * G])
        assert torch.equal(part.reward, rewards[step * G:(step + 1) * G])
        rows = batch.group == step
        fields = {k: getattr(batch, k)[rows][:, :part.tokens.shape[1]]
                  for k in ("behavior_logprob", "old_logprob", "ref_logprob")}
        prepared = estimators.prepare(part.replace(**fields), est, max_len=mdp.max_len)
        value, _ = estimators.loss(e_pi.token_logprobs(prepared), prepared, est)
        want = -torch.autograd.grad(value, pi.logits)[0].reshape(-1)
        assert (got[step] - want).abs().max() <= TOL


def test_method_lattice_refuses_what_is_not_exact():
    mdp = lattice()
    pi, mu, old = policies(mdp)
    with pytest.raises(ValueError, match="method: not exact.*gspo.*not token-local"):
        L.moments(mdp, pi, estimators.get("gspo"), group_size=2, method="lattice")
    with pytest.raises(ValueError, match="method: not exact.*kl_cov.*not token-local"):
        L.moments(mdp, pi, estimators.get("kl_cov"), group_size=2, method="lattice")
    with pytest.raises(ValueError, match="reference: .*grpo"):
        L.moments(mdp, pi, estimators.get("grpo"), group_size=2)
    with pytest.raises(ValueError, match="group_size"):
        L.moments(mdp, pi, estimators.get("minirl"), group_size=0)
    few = L.moments(mdp, pi, estimators.get("minirl"), group_size=3, max_configurations=2,
                    num_samples=64)
    assert few.method == "monte_carlo"


def test_exact_support_reasons():
    assert L.exact_support(estimators.get("minirl"), 8) == (True, "")
    ok, why = L.exact_support(estimators.get("dapo"), 1)   # a group std at G = 1 (issue 32)
    assert not ok and why.startswith("undefined at G = 1")
    assert L.exact_support(estimators.get("dr_grpo"), 1) == (True, "")   # group mean: defined
    for name, words in [("gspo", "not token-local"), ("grpo_rs_seq", "not token-level"),
                        ("sequence_snis", "keeps the product a product"),
                        ("ctpo", "not token-local"), ("reinforce_pp_kl", "reads more")]:
        ok, why = L.exact_support(estimators.get(name), 4)
        assert not ok and words in why
    for name in ("dapo", "sequence_is", "per_decision_is", "grpo_rs_token", "token_snis"):
        assert L.exact_support(estimators.get(name), 4) == (True, "")
    assert L.length_weights(estimators.get("minirl_len_norm"), 4, max_len=10) == (0.25, True)
    assert L.length_weights(estimators.get("dr_grpo"), 4, max_len=10) == (1 / 40, False)
    assert L.length_weights(estimators.get("dapo"), 4, max_len=10) is None
    assert L.weight_form(estimators.get("dapo"), 4, max_len=10) == (1.0, "total")


def test_every_exactly_supported_registry_estimator_equals_enumeration():
    """Whatever the registry holds: each entry the lattice claims exact at G = 2 matches the
    enumeration twin."""
    claimed = [n for n in estimators.names() if L.exact_support(estimators.get(n), 2)[0]]
    assert {"reinforce", "rloo", "grpo", "minirl", "minirl_len_norm", "dr_grpo", "dapo",
            "sequence_is", "per_decision_is", "grpo_rs_token"} <= set(claimed)
    for name in claimed:
        a, b = both(lattice(), name, 2)
        assert_equal_moments(a, b)


class LengthWeightedMean(estimators.GroupMean):
    """A group-mean baseline that would read the lengths (it overrides per_sequence)."""

    def per_sequence(self, reward_S, group_S, length_S, step_S=None):
        return super().per_sequence(reward_S, group_S, length_S, step_S) / length_S


def test_advantages_reading_lengths_are_not_exact():
    est = estimators.get("minirl").replace(advantage=LengthWeightedMean())
    ok, why = L.exact_support(est, 4)
    assert not ok and "reads more of the batch" in why
