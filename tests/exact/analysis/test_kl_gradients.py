"""KL gradients, exactly: the four targets against independent sums over responses, and what each
placement of k1/k2/k3 delivers in expectation (bandit and sequence, on- and off-policy)."""

import pytest
import torch

from tests.exact.conftest import make_policy
from tokenmdp.estimators import KLPenalty, kl_k1, kl_k2, kl_k3
from tokenmdp.exact import (
    TabularPolicy,
    TokenMDP,
    sequence_kl,
    sequence_logprobs,
    state_visitation,
)
from tokenmdp.exact.analysis.kl_gradients import (
    kl_gradients,
    kl_penalty_moments,
    sampled_penalty_gradients,
    state_kl,
)
from tokenmdp.exact.world.rewards import RandomTable

EXACT_TOL = 1e-10   # two float64 routes to one vector (sums in another order)
FAR = 1e-3          # a different gradient: at least this far, relative to ‖∇KL(π‖π_ref)‖
Z_TOL = 4.5         # Monte Carlo against exact, in standard errors (largest of the coordinates)
BETA = 0.5


def bandit_mdp():
    return TokenMDP(4, 1, RandomTable(seed=1), prompts=[(0,), (1,)], prompt_probs=[0.3, 0.7])


def three_policies(mdp):
    return [make_policy(TabularPolicy, mdp, seed=s) for s in (0, 1, 2)]   # π, π_ref, μ


def _rel(a, b, scale):
    return float((a - b).norm() / scale.norm())


def test_chain_rule_sequence_kl_is_visitation_weighted_state_kl(mdp):
    pi, ref, _ = three_policies(mdp)
    with torch.no_grad():
        by_states = float((state_visitation(mdp, pi) * state_kl(mdp, pi, ref)).sum())
        assert abs(by_states - float(sequence_kl(mdp, pi, ref))) < EXACT_TOL
        assert bool((state_kl(mdp, pi, ref) >= 0).all())


def _score_function_sums(mdp, pi, ref):
    # ∇KL(π‖ref) = Σ_y D π(y) log(π/ref)(y) ∇log π(y), ∇KL(ref‖π) = −Σ_y D ref(y) ∇log π(y):
    # one autograd call per response, no state visitation
    lp = sequence_logprobs(mdp, pi)
    with torch.no_grad():
        lr = sequence_logprobs(mdp, ref)
        weight = mdp.prompt_probs[mdp.terminal_prompt_index]
    reverse = forward = 0.0
    for i in range(mdp.num_sequences):
        grads = torch.autograd.grad(lp[i], list(pi.parameters()), retain_graph=True)
        score = torch.cat([g.reshape(-1) for g in grads])
        p_i = float(weight[i] * lp[i].detach().exp())
        reverse = reverse + p_i * float(lp[i].detach() - lr[i]) * score
        forward = forward - float(weight[i] * lr[i].exp()) * score
    return reverse, forward


def test_targets_match_score_function_sums(mdp):
    pi, ref, _ = three_policies(mdp)
    got = kl_gradients(mdp, pi, ref)
    reverse, forward = _score_function_sums(mdp, pi, ref)
    assert _rel(got.reverse, reverse, reverse) < EXACT_TOL
    assert _rel(got.forward, forward, reverse) < EXACT_TOL
    # in a sequence task the partial gradients are different vectors
    assert _rel(got.reverse_per_state, got.reverse, got.reverse) > FAR
    assert _rel(got.forward_per_state, got.forward, got.reverse) > FAR


def test_in_a_bandit_per_state_targets_are_the_sequence_targets():
    mdp = bandit_mdp()
    pi, ref, _ = three_policies(mdp)
    got = kl_gradients(mdp, pi, ref)
    assert _rel(got.reverse_per_state, got.reverse, got.reverse) < EXACT_TOL
    assert _rel(got.forward_per_state, got.forward, got.reverse) < EXACT_TOL
    assert _rel(got.forward, got.reverse, got.reverse) > FAR


def _delivered(mdp, pi, ref, estimator, in_reward):
    # −E[ĝ]/β: the expected gradient of the penalty alone
    penalty = KLPenalty(coef=BETA, in_reward=in_reward, estimator=estimator)
    return -kl_penalty_moments(mdp, pi, ref, penalty).mean / BETA


@pytest.mark.parametrize("world", ["bandit", "sequence"])
def test_what_each_placement_delivers_on_policy(world, mdp):
    mdp = bandit_mdp() if world == "bandit" else mdp
    pi, ref, _ = three_policies(mdp)
    t = kl_gradients(mdp, pi, ref)
    expected = {
        (kl_k1, True): t.reverse,                          # the RLHF penalty: reverse KL
        (kl_k1, False): torch.zeros_like(t.reverse),       # E_π[∇log π] = 0
        (kl_k2, False): t.reverse_per_state,               # partial reverse (exact in a bandit)
        (kl_k3, False): t.forward_per_state,               # GRPO: (partial) forward KL
        (kl_k3, True): t.reverse - t.forward_per_state,    # E[(r − 1)∇log π] = −∇KL(ref‖π)
    }
    for (estimator, in_reward), want in expected.items():
        got = _delivered(mdp, pi, ref, estimator, in_reward)
        assert _rel(got, want, t.reverse) < EXACT_TOL, (estimator.__name__, in_reward)
    k2_reward = _delivered(mdp, pi, ref, kl_k2, True)        # matches no target
    for target in (t.reverse, t.forward, t.reverse_per_state, t.forward_per_state):
        assert _rel(k2_reward, target, t.reverse) > FAR


def test_importance_weighted_k3_reaches_the_behaviour_visitation(mdp):
    pi, ref, mu = three_policies(mdp)
    weighted = KLPenalty(coef=BETA, in_reward=False, importance_weighted=True)
    off = -kl_penalty_moments(mdp, pi, ref, weighted, behavior=mu).mean / BETA
    t_mu = kl_gradients(mdp, pi, ref, visitation=mu)
    t_pi = kl_gradients(mdp, pi, ref)
    assert _rel(off, t_mu.forward_per_state, t_pi.reverse) < EXACT_TOL
    assert _rel(off, t_pi.forward_per_state, t_pi.reverse) > FAR        # not the on-policy one
    plain = -kl_penalty_moments(mdp, pi, ref, KLPenalty(coef=BETA, in_reward=False),
                                behavior=mu).mean / BETA
    assert _rel(plain, off, t_pi.reverse) > FAR                          # the weight matters


def test_in_a_bandit_the_importance_weight_recovers_the_on_policy_gradient():
    mdp = bandit_mdp()
    pi, ref, mu = three_policies(mdp)
    weighted = KLPenalty(coef=BETA, in_reward=False, importance_weighted=True)
    off = kl_penalty_moments(mdp, pi, ref, weighted, behavior=mu).mean
    on = kl_penalty_moments(mdp, pi, ref, KLPenalty(coef=BETA, in_reward=False)).mean
    assert float((off - on).norm() / on.norm()) < EXACT_TOL


@pytest.mark.parametrize("in_reward", [True, False])
def test_sampled_batches_agree_with_enumeration(mdp, in_reward):
    pi, ref, _ = three_policies(mdp)
    penalty = KLPenalty(coef=BETA, in_reward=in_reward, estimator=kl_k3)
    exact = kl_penalty_moments(mdp, pi, ref, penalty).mean
    g = sampled_penalty_gradients(mdp, pi, ref, penalty, num_batches=400, batch_size=50,
                                  generator=torch.Generator().manual_seed(0))
    z = (g.mean(0) - exact) / (g.std(0) / g.shape[0] ** 0.5).clamp(min=1e-300)
    assert float(z.abs().max()) < Z_TOL
    wrong = kl_penalty_moments(mdp, pi, ref, KLPenalty(coef=BETA, in_reward=not in_reward,
                                                       estimator=kl_k3)).mean
    assert float(((g.mean(0) - wrong) / (g.std(0) / g.shape[0] ** 0.5)).abs().max()) > Z_TOL


def test_bad_penalty_raises_type_error(mdp):
    pi, ref, _ = three_policies(mdp)
    with pytest.raises(TypeError, match="penalty"):
        kl_penalty_moments(mdp, pi, ref, "k3")
    with pytest.raises(ValueError, match="num_batches"):
        sampled_penalty_gradients(mdp, pi, ref, KLPenalty(coef=1.0, in_reward=False),
                                  num_batches=1, batch_size=4, generator=torch.Generator())


@pytest.mark.parametrize("weighted", [True, False])
def test_sampled_batches_from_a_behavior_agree_with_its_enumeration(mdp, weighted):
    """Issue 33, gap 2: the sampler's ``behavior`` option. Batches drawn from ``μ`` estimate the
    off-policy enumeration and, measurably, not the on-policy one."""
    pi, ref, mu = three_policies(mdp)
    penalty = KLPenalty(coef=BETA, in_reward=False, estimator=kl_k3,
                        importance_weighted=weighted)
    off = kl_penalty_moments(mdp, pi, ref, penalty, behavior=mu).mean
    on = kl_penalty_moments(mdp, pi, ref, penalty).mean
    g = sampled_penalty_gradients(mdp, pi, ref, penalty, num_batches=400, batch_size=50,
                                  generator=torch.Generator().manual_seed(1), behavior=mu)
    se = (g.std(0) / g.shape[0] ** 0.5).clamp(min=1e-300)
    assert float(((g.mean(0) - off) / se).abs().max()) < Z_TOL
    assert float(((g.mean(0) - on) / se).abs().max()) > Z_TOL
