"""Per-decision IS: the cumulative ratio by hand in two layouts, its gradient coefficient, and
exact ties on an enumerable MDP — the expectation it estimates (each decision's prefix under
π_θ, the continuation under μ), ∇J in a bandit, and a total variance below sequence IS's."""

from __future__ import annotations

import math

import pytest
import torch

from tests.estimators.estimator_helpers import make_batch, repack, response_values
from tokenmdp import estimators
from tokenmdp.estimators import (
    Aggregation,
    Estimator,
    PerDecisionRatio,
    RewardAsAdvantage,
    cumulative_log_ratio,
    loss,
    per_decision_term,
    prepare,
)
from tokenmdp.exact import (
    TabularPolicy,
    TokenMDP,
    flat_grad,
    gradient,
    inference_copy,
    moments,
    sequence_probs,
)
from tokenmdp.exact.world import rewards

EXACT = 1e-12
TIE = 1e-12  # float64 enumeration sums

LOG_R = [[0.3, -0.1, 0.5], [-0.5]]


def _fixture(packed: bool):
    batch = make_batch([[7, 7], [8]], [[1, 2, 3], [4]], rewards=[1.0, 0.0],
                       behavior=[[-1.0, -2.0, -0.5], [-1.5]])
    if packed:
        batch = repack(batch, [[1, 0]], capacity=7)
    lp = (batch.behavior_logprob + response_values(batch, LOG_R)).requires_grad_(True)
    adv = response_values(batch, [[2.0, 2.0, 2.0], [-1.0]])
    return batch, lp, adv


def _ordered(batch, values_RC):
    keys = list(zip(batch.sequence_id[batch.loss_mask].tolist(),
                    batch.position[batch.loss_mask].tolist(), strict=True))
    return [v for _, v in sorted(zip(keys, values_RC[batch.loss_mask].tolist(), strict=True))]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_cumulative_ratio_and_its_gradient_by_hand(packed):
    batch, lp, adv = _fixture(packed)
    cum = cumulative_log_ratio(lp - batch.behavior_logprob, batch)
    assert _ordered(batch, cum) == pytest.approx([0.3, 0.2, 0.7, -0.5], abs=EXACT)
    terms = per_decision_term(lp, batch.behavior_logprob, adv, batch)
    (g,) = torch.autograd.grad(terms.term_RC[batch.loss_mask].sum(), lp)
    want = [2 * math.exp(0.3), 2 * math.exp(0.2), 2 * math.exp(0.7), -math.exp(-0.5)]
    assert _ordered(batch, terms.term_RC.detach()) == pytest.approx(want, abs=EXACT)
    assert _ordered(batch, g) == pytest.approx(want, abs=EXACT)   # ρ_{1:t} Â, own score only


def test_a_one_token_response_is_sequence_is_and_on_policy_is_reinforce():
    batch = make_batch([[7]], [[1]], rewards=[1.0], behavior=[[-1.0]])
    lp = (batch.behavior_logprob + response_values(batch, [[0.4]])).requires_grad_(True)
    adv = response_values(batch, [[1.5]])
    terms = per_decision_term(lp, batch.behavior_logprob, adv, batch)
    (g,) = torch.autograd.grad(terms.term_RC[batch.loss_mask].sum(), lp)
    assert g[batch.loss_mask].item() == pytest.approx(1.5 * math.exp(0.4), abs=EXACT)
    batch, _, adv = _fixture(False)
    on = batch.behavior_logprob.clone().requires_grad_(True)
    terms = per_decision_term(on, batch.behavior_logprob, adv, batch)
    (g,) = torch.autograd.grad(terms.term_RC[batch.loss_mask].sum(), on)
    torch.testing.assert_close(g, torch.where(batch.loss_mask, adv, 0.0), atol=EXACT, rtol=0)


# ---------------------------------------------------------------------- exact ties
def _world(max_len: int):
    mdp = TokenMDP(vocab_size=3, max_len=max_len, reward=rewards.RandomTable(seed=3),
                   prompts=((0,), (1,)), prompt_probs=(0.4, 0.6))
    pi = TabularPolicy(mdp, generator=torch.Generator().manual_seed(4))
    mu = inference_copy(pi, noise_std=0.5, generator=torch.Generator().manual_seed(5))
    return mdp, pi, mu


def _estimator_gradient(mdp, pi, mu):
    """``-∇loss`` of per-decision IS with ``R`` as advantage over the enumeration, each
    response weighted by ``D(x) μ(y|x)``: the estimator's exact expectation."""
    est = Estimator(surrogate=PerDecisionRatio(), advantage=RewardAsAdvantage(),
                    aggregation=Aggregation.TOKEN_SUM)
    batch = mdp.enumerate()
    with torch.no_grad():
        batch = batch.replace(behavior_logprob=mu.token_logprobs(batch))
        p_S = mdp.prompt_probs[batch.prompt_index] * sequence_probs(mdp, mu)
    step = prepare(batch, est)
    step = step.replace(loss_weight=step.to_tokens(p_S) * step.loss_mask)
    value, _ = loss(pi.token_logprobs(step), step, est)
    return -flat_grad(value, pi)


def _per_decision_target(mdp, pi, mu):
    """Σ_x D(x) Σ_y Σ_t π(y_≤t|x) μ(y_>t|y_≤t) R(y) ∇log π(y_t|y_<t), term by term."""
    batch = mdp.enumerate()
    lp_pi = pi.token_logprobs(batch)
    with torch.no_grad():
        lp_mu = mu.token_logprobs(batch)
    weights = torch.zeros_like(lp_mu)
    for s in range(batch.num_sequences):
        cells = ((batch.sequence_id == s) & batch.loss_mask).nonzero().tolist()
        cells.sort(key=lambda rc: int(batch.position[rc[0], rc[1]]))
        total_mu = sum(float(lp_mu[r, c]) for r, c in cells)
        prefix_pi = prefix_mu = 0.0
        for r, c in cells:
            prefix_pi += float(lp_pi[r, c].detach())
            prefix_mu += float(lp_mu[r, c])
            weights[r, c] = (float(mdp.prompt_probs[batch.prompt_index[s]])
                             * math.exp(prefix_pi + total_mu - prefix_mu) * float(batch.reward[s]))
    return flat_grad((weights * lp_pi).sum(), pi)


def test_per_decision_is_estimates_each_decision_with_the_continuation_of_mu():
    mdp, pi, mu = _world(max_len=3)
    got = _estimator_gradient(mdp, pi, mu)
    target = _per_decision_target(mdp, pi, mu)
    assert target.abs().max() > 1e-2
    torch.testing.assert_close(got, target, atol=TIE, rtol=0)
    # not ∇J: the continuation after each decision is μ's (only sequence IS re-weights it)
    assert (got - gradient(mdp, pi)).abs().max() > 1e-3


def test_per_decision_is_is_unbiased_for_the_true_gradient_in_a_bandit():
    mdp, pi, mu = _world(max_len=1)
    torch.testing.assert_close(_estimator_gradient(mdp, pi, mu), gradient(mdp, pi), atol=TIE,
                               rtol=0)


def test_total_variance_below_sequence_is_on_an_enumerable_mdp():
    # Both registry entries with the whole ratio against μ (old = μ), G = 2, exact enumeration.
    mdp, pi, mu = _world(max_len=3)
    pd = moments(mdp, pi, estimators.get("per_decision_is"), group_size=2, behavior=mu, old=mu,
                 method="exact")
    seq = moments(mdp, pi, estimators.get("sequence_is"), group_size=2, behavior=mu, old=mu,
                  method="exact")
    assert math.isfinite(pd.total_variance) and pd.total_variance > 0
    assert pd.total_variance < seq.total_variance
    # sequence IS with a leave-in group mean is unbiased up to the scale (1 - 1/G)
    torch.testing.assert_close(seq.mean, 0.5 * seq.true_gradient, atol=1e-10, rtol=0)


def test_bad_against_names_the_argument():
    with pytest.raises(ValueError, match="against"):
        PerDecisionRatio(against="ref")
