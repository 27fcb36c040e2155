"""Routing replay in the exact world (tokenmdp.rl.replay_exact, tokenmdp.rl.replay_bias): the MoE
policy under a fixed routing against independent computations — the model's own log-probs summed
by hand, a loop over every token and layer for the flip fraction, central finite differences for
the replayed gradient, the closed form E[ĝ] = ∇L_{π_old}(π_θ) of the token-ratio estimator on
π_old's own samples — and the three identities of replay: R2 is a no-op on the first mini-batch,
R3 makes π_old = μ when only the expert selection differs, the router gets no gradient for K = 1.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tokenmdp.course.setups import copy_task
from tokenmdp.estimators import Aggregation, Estimator, LeaveOneOut, NoCorrection, TokenRatio
from tokenmdp.exact import gradient, objective, sequence_kl, sequence_logprobs
from tokenmdp.exact.world.ground_truth import state_logprobs
from tokenmdp.rl.replay_bias import ReplayWorld, replay_gradient
from tokenmdp.rl.replay_exact import (
    EnginePolicy,
    RoutedPolicy,
    engine_model,
    enumeration_routing,
    expected_flip_fraction,
    moe_policy,
)

#: Two float64 computations of one quantity by different routes.
EXACT_TOL = 1e-12
#: A central finite difference of a smooth float64 function with step FD_STEP.
FD_STEP, FD_TOL = 1e-5, 1e-7
#: Probabilities of a float32 engine against the same numbers summed in another order.
FLOAT32_TOL = 1e-5
RLOO = Estimator(surrogate=TokenRatio(), advantage=LeaveOneOut(), correction=NoCorrection(),
                 aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM)


@pytest.fixture(scope="module")
def world():
    mdp, _ = copy_task()
    old = moe_policy(mdp, seed=0)
    return ReplayWorld(mdp, old, engine_model(old, selection_noise=1.0, seed=1))


def _router_mask(model):
    return torch.cat([torch.full((p.numel(),), "router" in name)
                      for name, p in model.named_parameters()])


def test_the_free_routed_policy_is_the_model_summed_by_hand(world):
    mdp, old = world.mdp, world.old
    enum = mdp.enumerate()
    by_hand = old.token_logprobs(enum).sum(-1)                    # one pass, summed per row
    assert torch.allclose(sequence_logprobs(mdp, RoutedPolicy(mdp, old)), by_hand, atol=EXACT_TOL,
                          rtol=0)
    with torch.no_grad():
        assert abs(float(objective(mdp, old) - objective(mdp, RoutedPolicy(mdp, old)))) < EXACT_TOL
    assert torch.allclose(gradient(mdp, old), gradient(mdp, RoutedPolicy(mdp, old)), atol=EXACT_TOL,
                          rtol=0)


def test_replaying_the_models_own_routing_is_bitwise_the_free_model(world):
    mdp, old = world.mdp, world.old
    own = RoutedPolicy(mdp, old, enumeration_routing(mdp, old))
    free = RoutedPolicy(mdp, old)
    for k in range(mdp.max_len):
        assert torch.equal(own.level_logits(k), free.level_logits(k))


def test_r2_is_a_no_op_on_the_first_minibatch_and_not_after(world):
    none = replay_gradient(world, world.old, RLOO, "none")
    r2 = replay_gradient(world, world.old, RLOO, "r2")
    assert torch.equal(none.mean, r2.mean) and none.variance == r2.variance
    assert r2.target_shift == 0.0
    stale = world.stale(0.4)                      # routing drifts: R2 now changes the policy
    assert replay_gradient(world, stale, RLOO, "r2").target_shift > 1e-3


def test_r3_makes_pi_old_equal_mu_when_only_the_selection_differs(world):
    mdp = world.mdp
    with torch.no_grad():
        assert float(sequence_kl(mdp, world.mu, world.old_policy("r3"))) < EXACT_TOL
        assert float(sequence_kl(mdp, world.mu, world.old_policy("none"))) > 1e-4
        for a, b in zip(state_logprobs(mdp, world.mu), state_logprobs(mdp, world.old_policy("r3"))):
            assert torch.allclose(a, b, atol=EXACT_TOL, rtol=0)
    # with other numerics as well (bf16), R3 removes the routing part only
    bf16 = ReplayWorld(mdp, world.old, engine_model(world.old, precision="bf16", selection_noise=1.0,
                                                    seed=1))
    with torch.no_grad():
        left = float(sequence_kl(mdp, bf16.mu, bf16.old_policy("r3")))
        assert 0 < left < float(sequence_kl(mdp, bf16.mu, bf16.old_policy("none")))


def test_the_router_gets_no_gradient_with_one_expert_per_token(world):
    mdp = world.mdp
    for top_k in (1, 2):
        model = moe_policy(mdp, seed=3, top_k=top_k)
        engine = engine_model(model, selection_noise=1.0, seed=1)
        replayed = RoutedPolicy(mdp, model, enumeration_routing(mdp, engine))
        for policy in (model, replayed):
            g = gradient(mdp, policy)
            router = g[_router_mask(model)]
            if top_k == 1:
                assert torch.count_nonzero(router) == 0 and g.norm() > 0
            else:
                assert router.abs().max() > 1e-6


def test_the_replayed_gradient_matches_finite_differences(world):
    mdp = world.mdp
    model = world.stale(0.2)
    policy = world.policy(model, "r3")
    u = torch.randn(gradient(mdp, policy).numel(), generator=torch.Generator().manual_seed(0),
                    dtype=torch.float64)
    theta = torch.nn.utils.parameters_to_vector(model.parameters()).detach()

    def J_at(t):
        torch.nn.utils.vector_to_parameters(t, model.parameters())
        with torch.no_grad():
            return float(objective(mdp, policy))
    fd = (J_at(theta + FD_STEP * u) - J_at(theta - FD_STEP * u)) / (2 * FD_STEP)
    torch.nn.utils.vector_to_parameters(theta, model.parameters())
    assert abs(fd - float(gradient(mdp, policy) @ u)) < FD_TOL


def test_the_flip_fraction_matches_a_loop_over_tokens_and_layers(world):
    mdp = world.mdp
    a, b = world.engine_routing, world.old_routing
    enum = mdp.enumerate()
    with torch.no_grad():   # μ(y|x) from the engine's own token log-probs, summed by hand
        mu_y = world.engine.token_logprobs(enum).double().sum(-1).exp()
    w = mdp.prompt_probs[mdp.terminal_prompt_index] * mu_y
    differ = recorded = 0.0
    for r in range(mdp.num_sequences):
        n = int((enum.sequence_id[r] >= 0).sum())
        for c in range(n - 1):                              # the last token is never routed
            for layer in range(a.shape[2]):
                recorded += float(w[r])
                differ += float(w[r]) * (set(a[r, c, layer].tolist()) != set(b[r, c, layer].tolist()))
    assert abs(world.flip_fraction() - differ / recorded) < FLOAT32_TOL
    assert 0.05 < world.flip_fraction() < 1                 # the engine does flip some records
    assert expected_flip_fraction(mdp, a, a, world.mu) == 0.0


def test_on_pi_olds_own_samples_the_expected_gradient_is_the_surrogates():
    # E[Σ_t r_t Â ∇log π_θ] over π_old's samples = ∇L_{π_old}(π_θ) (RLOO, no correction)
    mdp, _ = copy_task()
    old = moe_policy(mdp, seed=0)
    world = ReplayWorld(mdp, old, engine_model(old))          # fp64, no noise: μ = π_old
    assert world.flip_fraction() == 0.0
    on = replay_gradient(world, old, RLOO, "none")
    assert on.relative_bias < 1e-10 and on.surrogate_gap < 1e-10
    stale = replay_gradient(world, world.stale(0.3), RLOO, "none")
    assert stale.surrogate_gap < 1e-10 and stale.relative_bias > 1e-2   # first-order, not ∇J


def test_an_engine_policy_is_normalized_and_equals_the_model_without_perturbation(world):
    mdp = world.mdp
    same = EnginePolicy(mdp, engine_model(world.old))
    for a, b in zip(state_logprobs(mdp, same), state_logprobs(mdp, world.old)):
        assert torch.allclose(a, b.detach(), atol=EXACT_TOL, rtol=0)
    bf16 = EnginePolicy(mdp, engine_model(world.old, precision="bf16"))
    assert list(bf16.parameters()) == []
    for lp in state_logprobs(mdp, bf16):
        assert torch.allclose(lp.exp().sum(-1), torch.ones((), dtype=torch.float64), atol=1e-14)


def test_bad_inputs_raise_naming_the_argument(world):
    mdp = world.mdp
    with pytest.raises(TypeError, match="model"):
        RoutedPolicy(mdp, copy.deepcopy(world.engine).float())
    with pytest.raises(ValueError, match="routing"):
        RoutedPolicy(mdp, world.old, world.old_routing[:3])
    with pytest.raises(ValueError, match="precision"):
        engine_model(world.old, precision="int4")
    with pytest.raises(TypeError, match="mdp"):
        moe_policy("copy task")
    with pytest.raises(ValueError, match="direction"):
        world.stale(0.1, torch.zeros_like(gradient(mdp, world.old)))
    with pytest.raises(TypeError, match="world"):
        replay_gradient(None, world.old, RLOO, "r2")


def test_r3s_first_update_follows_the_engines_own_gradient(world):
    # the engine's selection is locally constant in θ, so the policy with the engine's experts
    # replayed and the engine itself have the same gradient at θ_old (not at a stale θ)
    mdp = world.mdp
    engine_grad = gradient(mdp, world.engine_at(world.old))
    assert torch.allclose(gradient(mdp, world.policy(world.old, "r3")), engine_grad,
                          atol=EXACT_TOL, rtol=0)
    assert (engine_grad - gradient(mdp, world.old)).norm() > 1e-2 * engine_grad.norm()
    r3 = replay_gradient(world, world.old, RLOO, "r3")
    assert r3.engine_bias < 1e-10 and r3.relative_bias > 0.05
    bf16 = ReplayWorld(mdp, world.old, engine_model(world.old, precision="bf16"))
    with pytest.raises(TypeError, match="engine"):
        bf16.engine_at(world.old)
    assert math.isnan(replay_gradient(bf16, world.old, RLOO, "r3").engine_bias)
