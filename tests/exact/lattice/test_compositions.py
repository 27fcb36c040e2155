"""Issue 33, gap 4: compositions outside the registry. ``exact_support`` states a verdict for
each clause (a correction's level, rejects in or out of the normalizer, a self-normalized
weight, a KL in the reward, the token mean's coupling, a sequence mask, an entropy bonus, an
asymmetric capped DPPO), and ``moments(method="auto")`` on the lattice answers with the
enumeration of the twin TokenMDP: to rounding where it claims exact, within its standard
errors where it falls back to Monte Carlo; ``method="lattice"`` refuses those."""

from __future__ import annotations

import pytest
import torch

from tokenmdp import estimators as E
from tokenmdp import exact as X
from tokenmdp.exact import lattice as L

from .conftest import policies, twin

#: float64: the lattice's dynamic programme against the enumeration's sum over responses
TOL = 1e-10
#: Monte Carlo against the enumeration, in standard errors (largest of the coordinates)
MAX_Z = 4.5

GRPO = E.get("grpo")
TOKEN_MEAN = E.Estimator(surrogate=E.TokenRatio(), advantage=E.GroupMean(),
                         aggregation=E.Aggregation.TOKEN_MEAN)
BAND = dict(statistic="k1", high=1.3, low=0.7)
COMPOSITIONS = {
    # name: (estimator, G, exact, a word of the reason)
    "masked_is_in": (GRPO.replace(correction=E.MaskedIS(high=1.3, masked_in_normalizer=True,
                                                        low=0.7)), 2, True, ""),
    "masked_is_out": (GRPO.replace(correction=E.MaskedIS(high=1.3, masked_in_normalizer=False,
                                                             low=0.7)), 2, True, ""),
    "rejection_token_in": (GRPO.replace(correction=E.RejectionSampling(
        **BAND, masked_in_normalizer=True)), 2, True, ""),
    "rejection_token_out": (GRPO.replace(correction=E.RejectionSampling(
        **BAND, masked_in_normalizer=False)), 3, True, ""),
    "rejection_sequence": (GRPO.replace(correction=E.RejectionSampling(
        statistic="k3", reduce="mean", high=0.05, masked_in_normalizer=True)), 2, False,
        "not token-level"),
    "snis_token": (GRPO.replace(correction=E.SelfNormalizedIS()), 2, False,
                   "constant-weight rules only"),
    "snis_token_mean": (TOKEN_MEAN.replace(correction=E.SelfNormalizedIS()), 3, True, ""),
    "snis_token_mean_capped": (TOKEN_MEAN.replace(correction=E.SelfNormalizedIS(cap=1.1)), 2,
                               True, ""),
    "snis_sequence": (TOKEN_MEAN.replace(correction=E.SelfNormalizedIS(level="sequence")), 2,
                      False, "not token-level"),
    "token_mean_rejection_out": (TOKEN_MEAN.replace(correction=E.RejectionSampling(
        **BAND, masked_in_normalizer=False)), 3, True, ""),
    "token_mean_masked_is_out": (TOKEN_MEAN.replace(correction=E.MaskedIS(
        high=1.3, masked_in_normalizer=False, low=0.7)), 2, True, ""),
    "sequence_is_token_mean": (E.get("sequence_is").replace(
        aggregation=E.Aggregation.TOKEN_MEAN), 3, True, ""),
    "sequence_is_len_norm": (E.get("sequence_is").replace(
        aggregation=E.Aggregation.SEQUENCE_MEAN_TOKEN_MEAN), 2, True, ""),
    "sequence_is_truncated": (E.get("sequence_is").replace(
        correction=E.TruncatedIS(cap=1.5, level="sequence")), 2, False, "product a product"),
    "per_decision_vs_old_token_mean": (E.get("per_decision_is").replace(
        surrogate=E.PerDecisionRatio(against="old"), aggregation=E.Aggregation.TOKEN_MEAN), 2,
        True, ""),
    "entropy_cispo_tis": (E.Estimator(surrogate=E.EntropyBonus(E.CISPO(), 0.05),
                                      advantage=E.GroupMean(), correction=E.TruncatedIS(1.5),
                                      aggregation=E.Aggregation.SEQUENCE_MEAN_TOKEN_SUM),
                          2, True, ""),
    "dppo_asymmetric_cap": (E.Estimator(surrogate=E.DPPO("kl", delta_low=0.02, delta_high=0.2,
                                                         cap=2.0),
                                        advantage=E.GroupMean(),
                                        aggregation=E.Aggregation.CONSTANT), 3, True, ""),
    "k2_weighted_in_loss": (GRPO.replace(kl=E.KLPenalty(coef=0.1, in_reward=False,
                                                        estimator=E.kl_k2,
                                                        importance_weighted=True)), 2, True,
                            ""),
    "kl_in_reward": (GRPO.replace(kl=E.KLPenalty(coef=0.1, in_reward=True)), 2, False,
                     "in the reward"),
    "token_mean_g1": (E.Estimator(surrogate=E.PPOClip(), advantage=E.RewardAsAdvantage(),
                                  aggregation=E.Aggregation.TOKEN_MEAN), 1, True, ""),
    "token_mean_g2": (E.Estimator(surrogate=E.PPOClip(), advantage=E.RewardAsAdvantage(),
                                  aggregation=E.Aggregation.TOKEN_MEAN), 2, True, ""),
    "sequence_mask_opsm": (GRPO.replace(surrogate=E.OffPolicySequenceMask(E.PPOClip(),
                                                                          delta=0.05)), 2,
                           False, "not token-local"),
}


def _lattice():
    return L.LatticeMDP(L.token_count(0, 3, modulus=2), 3, length_reward=-0.1)


@pytest.mark.parametrize("name", COMPOSITIONS)
def test_auto_answers_with_the_enumeration_and_exact_support_says_why(name):
    est, G, exact, word = COMPOSITIONS[name]
    ok, why = L.exact_support(est, G)
    assert ok is exact and word in why, (name, why)
    mdp = _lattice()
    pi, mu, old = policies(mdp, 4)
    ref = L.LatticePolicy(mdp, generator=torch.Generator().manual_seed(11))
    tm, e_pi, e_mu, e_old, e_ref = twin(mdp, pi, mu, old, ref)
    kw = dict(group_size=G, behavior=mu, old=old, reference=ref)
    got = L.moments(mdp, pi, est, num_samples=3000, generator=torch.Generator().manual_seed(0),
                    **kw)
    want = X.moments(tm, e_pi, est, group_size=G, behavior=e_mu, old=e_old, reference=e_ref,
                     method="enumeration")
    assert float(want.mean.norm()) > 1e-3                       # a gradient to compare
    if exact:
        assert got.method == "lattice"
        assert float((got.mean - want.mean).abs().max()) <= TOL
        assert abs(got.total_variance - want.total_variance) <= TOL
        assert float((got.covariance - want.covariance).abs().max()) <= TOL
    else:
        assert got.method == "monte_carlo"
        z = (got.mean - want.mean).abs() / got.mean_se.clamp(min=1e-300)
        assert float(z.max()) <= MAX_Z, name
        assert abs(got.total_variance - want.total_variance) <= MAX_Z * got.total_variance_se
        with pytest.raises(ValueError, match="method: not exact"):
            L.moments(mdp, pi, est, method="lattice", **kw)


@pytest.mark.parametrize("name", COMPOSITIONS)
def test_the_labs_auto_answers_with_the_enumeration_too(name):
    """The enumerable lab's own ``auto`` (exchangeability, enumeration or Monte Carlo) on the
    same compositions: exact to rounding, or within its standard errors."""
    est, G, _, _ = COMPOSITIONS[name]
    mdp = _lattice()
    pi, mu, old = policies(mdp, 5)
    ref = L.LatticePolicy(mdp, generator=torch.Generator().manual_seed(12))
    tm, e_pi, e_mu, e_old, e_ref = twin(mdp, pi, mu, old, ref)
    kw = dict(group_size=G, behavior=e_mu, old=e_old, reference=e_ref)
    got = X.moments(tm, e_pi, est, generator=torch.Generator().manual_seed(1), **kw)
    want = X.moments(tm, e_pi, est, method="enumeration", **kw)
    if got.method == "monte_carlo":
        z = (got.mean - want.mean).abs() / got.mean_se.clamp(min=1e-300)
        assert float(z.max()) <= MAX_Z and got.relative_se < 0.05, (name, got.relative_se)
    else:
        assert float((got.mean - want.mean).abs().max()) <= TOL, (name, got.method)
        assert abs(got.total_variance - want.total_variance) <= TOL
