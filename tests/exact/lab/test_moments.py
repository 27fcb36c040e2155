"""Exact moments of estimators: the identities of the estimator theory, float64, exactly."""

import math

import pytest
import torch

from tests.exact.conftest import OnlyTokenLogprobs, make_policy
from tokenmdp import estimators as E
from tokenmdp.exact import (
    TabularPolicy,
    TokenMDP,
    flat_grad,
    gradient,
    inference_copy,
    sequence_probs,
    stale_copy,
    surrogate,
)
from tokenmdp.exact.analysis.length_bias import length_normalized_objective
from tokenmdp.exact.lab.group_draws import count_draws
from tokenmdp.exact.lab.moments import moments
from tokenmdp.exact.world.rewards import ExactMatch, RandomTable, TokenCount

#: exact identities hold to float64 round-off accumulated over ~10^4 draws
EXACT_TOL = 1e-10
#: Monte Carlo vs exact: largest |z| allowed
MAX_Z = 4.0

SEQ_SUM = E.Aggregation.SEQUENCE_MEAN_TOKEN_SUM


def est(surrogate=None, advantage=None, correction=None, aggregation=SEQ_SUM):
    return E.Estimator(surrogate=surrogate or E.Reinforce(),
                       advantage=advantage or E.RewardAsAdvantage(),
                       correction=correction or E.NoCorrection(), aggregation=aggregation)


@pytest.fixture
def small():
    """15 responses per prompt, two prompts: C(18, 3) = 816 group draws of 3 per prompt."""
    mdp = TokenMDP(3, 3, RandomTable(seed=2), prompts=[(0,), (1,)], prompt_probs=[0.4, 0.6])
    return mdp, make_policy(TabularPolicy, mdp, seed=0)


def close(a, b, tol=EXACT_TOL):
    torch.testing.assert_close(a, b, rtol=0, atol=tol)


def test_reinforce_and_leave_one_out_are_unbiased_group_mean_is_scaled(small):
    mdp, pi = small
    G = 3
    g = gradient(mdp, pi)
    close(moments(mdp, pi, est(), group_size=G, method="exact").mean, g)
    close(moments(mdp, pi, est(advantage=E.LeaveOneOut()), group_size=G).mean, g)
    close(moments(mdp, pi, est(advantage=E.GroupMean()), group_size=G).mean, (G - 1) / G * g)
    assert count_draws(mdp, G) == 2 * math.comb(15 + G - 1, G)


def test_sequence_is_is_unbiased_off_policy_and_token_is_follows_the_surrogate(small):
    mdp, pi = small
    mu = stale_copy(mdp, pi, distance=0.8)
    g = gradient(mdp, pi)
    seq = moments(mdp, pi, est(E.SequenceRatio(), E.LeaveOneOut()), group_size=2,
                  behavior=mu)
    close(seq.mean, g)
    tok = moments(mdp, pi, est(E.TokenRatio()), group_size=2, behavior=mu)
    grad_L = flat_grad(surrogate(mdp, pi, mu), pi)
    close(tok.mean, grad_L)
    assert (tok.mean - g).norm() > 1e-3 * g.norm()       # ∇L_μ(π) ≠ ∇J when π ≠ μ
    on = moments(mdp, pi, est(E.TokenRatio()), group_size=2)
    close(on.mean, g)                                      # ... and equal where π = μ


def test_grpo_with_binary_rewards_and_two_samples():
    mdp = TokenMDP(3, 3, ExactMatch((0, 2)), prompts=[(0,), (1,)])
    pi = make_policy(TabularPolicy, mdp, seed=1)
    g = gradient(mdp, pi)
    pop = moments(mdp, pi, est(advantage=E.GroupNormalized(ddof=0, eps=0.0)), group_size=2)
    sample = moments(mdp, pi, est(advantage=E.GroupNormalized(ddof=1, eps=0.0)), group_size=2)
    close(pop.mean, g)
    close(sample.mean, g / math.sqrt(2))


def test_length_normalization_ascends_reward_per_token(small):
    mdp, pi = small
    per_token = E.Aggregation.SEQUENCE_MEAN_TOKEN_MEAN
    m = moments(mdp, pi, est(aggregation=per_token), group_size=3)
    close(m.mean, flat_grad(length_normalized_objective(mdp, pi), pi))
    # with a leave-one-out baseline, prompt x's baseline is b_x = J_x (others' expected reward),
    # so the estimator ascends E[(R - b_x)/|y|] with b_x held fixed
    loo = moments(mdp, pi, est(advantage=E.LeaveOneOut(), aggregation=per_token), group_size=3)
    with torch.no_grad():
        per_prompt = (sequence_probs(mdp, pi) * mdp.rewards).view(mdp.num_prompts, -1).sum(1)
    baseline = per_prompt[mdp.terminal_prompt_index]
    w = mdp.prompt_probs[mdp.terminal_prompt_index]
    target = (w * sequence_probs(mdp, pi) * (mdp.rewards - baseline)
              / mdp.terminal_lengths).sum()
    close(loo.mean, flat_grad(target, pi))


def test_truncated_is_with_a_cap_above_every_ratio_equals_is(small):
    mdp, pi = small
    mu = inference_copy(pi, noise_std=0.3, generator=torch.Generator().manual_seed(0))
    kw = dict(group_size=2, behavior=mu, old=pi)     # stale-free: π_old = π, μ differs
    full = moments(mdp, pi, est(correction=E.ImportanceSampling()), **kw)
    capped = moments(mdp, pi, est(correction=E.TruncatedIS(cap=1e6)), **kw)
    low = moments(mdp, pi, est(correction=E.TruncatedIS(cap=1.0)), **kw)
    close(capped.mean, full.mean)
    assert abs(capped.total_variance - full.total_variance) < EXACT_TOL
    assert (low.mean - full.mean).norm() > 1e-4  # a binding cap does change it
    # the token-level factor π_old/μ makes REINFORCE follow the token surrogate ∇L_μ(π)
    close(full.mean, flat_grad(surrogate(mdp, pi, mu), pi))


def test_minirl_without_masking_is_scaled_surrogate_gradient(small):
    mdp, pi = small
    G = 3
    old = stale_copy(mdp, pi, distance=0.05)   # small step: no token leaves the PPO band
    mu = inference_copy(old, noise_std=0.05, generator=torch.Generator().manual_seed(1))
    m = moments(mdp, pi, E.get("minirl"), group_size=G, behavior=mu, old=old)
    close(m.mean, (G - 1) / G * flat_grad(surrogate(mdp, pi, mu), pi))


def test_dynamic_sampling_rescales_by_the_probability_of_keeping_the_group():
    mdp = TokenMDP(3, 2, ExactMatch((0, 2)))
    pi = make_policy(TabularPolicy, mdp, seed=2)
    base = E.get("dapo")
    plain = moments(mdp, pi, base, group_size=3)
    kept = moments(mdp, pi, base, group_size=3, filter_groups=True)
    assert 0 < kept.keep_probability < 1
    close(kept.mean, plain.mean / kept.keep_probability)


@pytest.mark.parametrize("name", ["reinforce", "grpo", "dapo", "gspo", "cispo_tis"])
def test_monte_carlo_agrees_with_exact_within_four_standard_errors(small, name):
    mdp, pi = small
    old = stale_copy(mdp, pi, distance=0.3)
    mu = inference_copy(old, noise_std=0.2, generator=torch.Generator().manual_seed(3))
    kw = dict(group_size=3, behavior=mu, old=old, reference=old)
    exact = moments(mdp, pi, E.get(name), method="exact", **kw)
    mc = moments(mdp, pi, E.get(name), method="monte_carlo", num_samples=4000,
                 generator=torch.Generator().manual_seed(0), **kw)
    z = (mc.mean - exact.mean) / mc.mean_se.clamp(min=1e-12)
    assert z.abs().max() < MAX_Z
    assert abs(mc.total_variance - exact.total_variance) < MAX_Z * mc.total_variance_se
    assert abs(mc.mse - exact.mse) < MAX_Z * mc.mse_se
    assert mc.mean_se.max() > 0


def test_summary_quantities_are_consistent(small):
    mdp, pi = small
    m = moments(mdp, pi, est(advantage=E.GroupMean()), group_size=3)
    assert abs(m.cosine - 1) < EXACT_TOL                       # a positive multiple of ∇J
    assert m.directional_bias < 1e-6
    assert abs(m.scale - 3 / 2) < 1e-8
    assert abs(m.relative_bias - 1 / 3) < 1e-8
    assert abs(m.mse - (m.total_variance + float(m.bias @ m.bias))) < EXACT_TOL
    assert abs(m.total_variance - float(torch.trace(m.covariance))) < EXACT_TOL


def test_moments_reject_bad_arguments(small):
    mdp, pi = small
    with pytest.raises(ValueError, match="group_size"):
        moments(mdp, pi, E.get("reinforce"), group_size=0)
    with pytest.raises(ValueError, match="method"):
        moments(mdp, pi, E.get("reinforce"), group_size=2, method="guess")
    with pytest.raises(ValueError, match="reference"):
        moments(mdp, pi, E.get("grpo"), group_size=2)
    with pytest.raises(TypeError, match="generator"):
        moments(mdp, pi, E.get("reinforce"), group_size=2, method="monte_carlo", generator=0)
    with pytest.raises(TypeError, match="estimator"):
        moments(mdp, pi, "grpo", group_size=2)
    other = TokenMDP(3, 2, TokenCount(0))
    with pytest.raises(ValueError, match="behavior"):
        moments(mdp, pi, E.get("reinforce"), group_size=2,
                behavior=make_policy(TabularPolicy, other))


def test_tabular_jacobian_closed_form_equals_autograd(small):
    from tokenmdp.exact.lab.step_gradients import state_action_jacobian
    mdp, pi = small
    close(state_action_jacobian(mdp, pi), state_action_jacobian(mdp, OnlyTokenLogprobs(pi)), 1e-15)
    # and a generic policy gives the same moments as its fast path
    a = moments(mdp, pi, E.get("dapo"), group_size=2)
    b = moments(mdp, OnlyTokenLogprobs(pi), E.get("dapo"), group_size=2)
    close(a.mean, b.mean)
    assert abs(a.total_variance - b.total_variance) < EXACT_TOL
