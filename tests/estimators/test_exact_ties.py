"""Ties to the exact world: on the full enumeration, weighted by probabilities, the estimators'
loss gradients equal the true gradients (float64).

* REINFORCE with weights ``D(x) π(y|x)``: ``-∇loss = ∇J``;
* sequence IS with weights ``D(x) μ(y|x)`` (samples from the behaviour): ``-∇loss = ∇J``;
* token IS with the same weights: ``-∇loss = ∇L_μ(π)``, the trust-region surrogate;
* k1 in the reward: ``-∇loss = ∇(J - β KL(π ‖ π_ref))``.

A per-prompt constant baseline (the group mean over the enumeration) changes none of them,
because ``Σ_y ∇π(y|x) = 0`` and ``Σ_a ∇π(a|s) = 0`` exactly.
"""

from __future__ import annotations

import pytest
import torch

from tests.estimators.estimator_helpers import repack
from tokenmdp.estimators import (
    Aggregation,
    Estimator,
    GroupMean,
    ImportanceSampling,
    KLPenalty,
    Level,
    Reinforce,
    RewardAsAdvantage,
    SequenceRatio,
    TokenRatio,
    kl_k1,
    loss,
    prepare,
)
from tokenmdp.exact import (
    TabularPolicy,
    TokenMDP,
    flat_grad,
    gradient,
    inference_copy,
    objective,
    sequence_kl,
    sequence_probs,
    stale_copy,
    surrogate,
)
from tokenmdp.exact.world import rewards

TIE = 1e-12  # float64: enumeration sums of ~100 terms of size <= ~10


@pytest.fixture(scope="module")
def world():
    mdp = TokenMDP(vocab_size=3, max_len=3, reward=rewards.RandomTable(seed=0),
                   prompts=((0,), (1,)), prompt_probs=(0.3, 0.7))
    pi = TabularPolicy(mdp, generator=torch.Generator().manual_seed(0))
    old = stale_copy(mdp, pi, distance=0.7)  # π_old: the training engine at the rollout weights
    mu = inference_copy(old, noise_std=0.3, generator=torch.Generator().manual_seed(1))
    ref = TabularPolicy(mdp, generator=torch.Generator().manual_seed(2))
    return mdp, pi, old, mu, ref


def _weighted(mdp, batch, sampler):
    """``batch`` with loss weight ``D(x) p(y|x)`` on every loss token, ``p`` the sampler."""
    with torch.no_grad():
        p_S = mdp.prompt_probs[batch.prompt_index] * sequence_probs(mdp, sampler)
    return batch.replace(loss_weight=batch.to_tokens(p_S) * batch.loss_mask)


def _fields(batch, **policies):
    with torch.no_grad():
        return batch.replace(**{f"{k}_logprob": p.token_logprobs(batch)
                                for k, p in policies.items()})


def _loss_grad(policy, batch, est):
    value, _ = loss(policy.token_logprobs(batch), batch, est)
    return flat_grad(value, policy)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("advantage", [RewardAsAdvantage(), GroupMean()], ids=["R", "R-mean"])
def test_reinforce_loss_gradient_is_the_true_gradient(world, advantage, packed):
    mdp, pi, *_ = world
    batch = mdp.enumerate()
    if packed:  # two or three sequences per row: the same estimator in another layout
        n = batch.num_sequences
        batch = repack(batch, [list(range(i, min(i + 3, n))) for i in range(0, n, 3)],
                       capacity=3 * batch.capacity)
    est = Estimator(surrogate=Reinforce(), advantage=advantage, aggregation=Aggregation.TOKEN_SUM)
    step = _weighted(mdp, prepare(batch, est), pi)
    g = _loss_grad(pi, step, est)
    true = gradient(mdp, pi)
    assert true.abs().max() > 1e-2
    assert torch.allclose(-g, true, atol=TIE, rtol=0)


@pytest.mark.parametrize("advantage", [RewardAsAdvantage(), GroupMean()], ids=["R", "R-mean"])
def test_sequence_is_gradient_under_a_behaviour_policy_is_the_true_gradient(world, advantage):
    # ρ(y) = Π_t π_θ/μ = (Π_t π_old/μ, the sequence-level IS correction) · (Π_t π_θ/π_old)
    mdp, pi, old, mu, _ = world
    est = Estimator(surrogate=SequenceRatio(), advantage=advantage,
                    correction=ImportanceSampling(level=Level.SEQUENCE),
                    aggregation=Aggregation.TOKEN_SUM)
    batch = _fields(mdp.enumerate(), old=old, behavior=mu)
    step = _weighted(mdp, prepare(batch, est), mu)
    g = _loss_grad(pi, step, est)
    assert torch.allclose(-g, gradient(mdp, pi), atol=TIE, rtol=0)


@pytest.mark.parametrize("advantage", [RewardAsAdvantage(), GroupMean()], ids=["R", "R-mean"])
def test_token_is_gradient_is_the_gradient_of_the_trust_region_surrogate(world, advantage):
    mdp, pi, old, mu, _ = world
    est = Estimator(surrogate=TokenRatio(), advantage=advantage,
                    correction=ImportanceSampling(level=Level.TOKEN),
                    aggregation=Aggregation.TOKEN_SUM)
    batch = _fields(mdp.enumerate(), old=old, behavior=mu)
    step = _weighted(mdp, prepare(batch, est), mu)
    g = _loss_grad(pi, step, est)
    expected = flat_grad(surrogate(mdp, pi, mu), pi)
    assert torch.allclose(-g, expected, atol=TIE, rtol=0)
    # not the true gradient: π is away from μ, so the first-order surrogate differs
    assert (expected - gradient(mdp, pi)).abs().max() > 1e-3


def test_k1_in_the_reward_gives_the_sequence_reverse_kl_gradient(world):
    mdp, pi, _, _, ref = world
    beta = 0.4
    est = Estimator(surrogate=Reinforce(), advantage=RewardAsAdvantage(),
                    aggregation=Aggregation.TOKEN_SUM,
                    kl=KLPenalty(coef=beta, in_reward=True, estimator=kl_k1))
    batch = _fields(mdp.enumerate(), old=pi, ref=ref)  # k1 at π_old = π (before the update)
    step = _weighted(mdp, prepare(batch, est), pi)
    g = _loss_grad(pi, step, est)
    expected = flat_grad(objective(mdp, pi) - beta * sequence_kl(mdp, pi, ref), pi)
    assert torch.allclose(-g, expected, atol=TIE, rtol=0)
