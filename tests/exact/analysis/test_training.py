"""train_exact: one update against a closed-form tabular step, the large-batch limit against the
exact expected gradient, staleness and the engine reproduced by hand, determinism, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from tests.exact.conftest import OnlyTokenLogprobs, make_policy
from tokenmdp import estimators
from tokenmdp.estimators import Estimator, Surrogate, SurrogateTerms, loss, prepare
from tokenmdp.exact import (
    ExactTrainingRun,
    TabularPolicy,
    gradient,
    inference_copy,
    moments,
    objective,
    sample,
    sequence_kl,
    train_exact,
)

EXACT_TOL = 1e-12
#: The large-batch update is within this many standard errors (‖·‖ of the mean of B group
#: gradients around E[ĝ], whose mean square is tr Var / B) of the exact expected gradient.
NORM_SE_FACTOR = 4.0
LR = 0.5


def _theta(policy):
    return parameters_to_vector(policy.parameters()).detach().clone()


def _rloo_step_by_hand(mdp, policy, batch):
    """ĝ of RLOO on a sampled batch in closed form for a tabular policy: Σ_i (1/S) (R_i − mean
    of the others in its group) Σ_t (e_{y_t} − π(·|s_t)) in the row of state s_t."""
    table = policy.table.detach()
    g = torch.zeros_like(table)
    rewards, groups = batch.reward.tolist(), batch.group.tolist()
    S = len(rewards)
    for i, (_prompt, response) in enumerate(batch.sequences()):
        others = [rewards[j] for j in range(S) if groups[j] == groups[i] and j != i]
        advantage = rewards[i] - sum(others) / len(others)
        x = torch.tensor([int(batch.prompt_index[i])])
        for t, token in enumerate(response):
            s = int(mdp.state_index(x, torch.tensor([response[:t]], dtype=torch.long)))
            score = -torch.softmax(table[s], dim=0)
            score[token] += 1.0
            g[s] += advantage / S * score
    return g.reshape(-1)


def test_one_update_is_the_closed_form_tabular_step(mdp):
    policy = make_policy(TabularPolicy, mdp)
    run = train_exact(mdp, policy, estimators.get("rloo"), updates=1, group_size=3,
                      groups_per_update=5, lr=LR, generator=torch.Generator().manual_seed(4))
    batch = sample(mdp, policy, 15, generator=torch.Generator().manual_seed(4), group_size=3)
    g = _rloo_step_by_hand(mdp, policy, batch)
    assert (_theta(run.policy) - (_theta(policy) + LR * g)).abs().max() < EXACT_TOL
    with torch.no_grad():
        assert abs(run.objective[1] - float(objective(mdp, run.policy))) < EXACT_TOL
        assert abs(run.objective[0] - float(objective(mdp, policy))) < EXACT_TOL
    true = gradient(mdp, policy)
    assert abs(run.gradient_norm[0] - g.norm()) < EXACT_TOL
    assert abs(run.true_gradient_norm[0] - true.norm()) < EXACT_TOL
    assert abs(run.cosine[0] - g @ true / (g.norm() * true.norm())) < EXACT_TOL
    assert run.behavior_kl[0] == 0.0 and run.updates == 1


def test_a_large_batch_update_follows_the_exact_expected_gradient(mdp):
    policy = make_policy(TabularPolicy, mdp, seed=2)
    est, groups = estimators.get("rloo"), 4000
    run = train_exact(mdp, policy, est, updates=1, group_size=2, groups_per_update=groups,
                      lr=LR, generator=torch.Generator().manual_seed(0))
    m = moments(mdp, policy, est, group_size=2, method="enumeration")
    step = (_theta(run.policy) - _theta(policy)) / LR
    assert (m.mean - gradient(mdp, policy)).norm() < 1e-10   # RLOO is unbiased
    assert (step - m.mean).norm() < NORM_SE_FACTOR * math.sqrt(m.total_variance / groups)
    # and a step with the sign flipped is far outside
    assert (-step - m.mean).norm() > 10 * NORM_SE_FACTOR * math.sqrt(m.total_variance / groups)


def _by_hand(mdp, policy, est, *, updates, staleness, engine, seed, G=2, B=3):
    """The loop re-written: θ_{t+1} = θ_t + LR ĝ_t, batch from engine(θ_{t−k}), old = θ_{t−k}."""
    generator, thetas = torch.Generator().manual_seed(seed), [_theta(policy)]
    current = TabularPolicy(mdp, generator=torch.Generator().manual_seed(0))
    for t in range(updates):
        old = TabularPolicy(mdp, generator=torch.Generator().manual_seed(0))
        vector_to_parameters(thetas[max(t - staleness, 0)], old.parameters())
        mu = old if engine is None else engine(old)
        batch = sample(mdp, mu, G * B, generator=generator, group_size=G)
        with torch.no_grad():
            batch = batch.replace(old_logprob=old.token_logprobs(batch))
        batch = prepare(batch, est, max_len=mdp.max_len)
        vector_to_parameters(thetas[-1], current.parameters())
        value = loss(current.token_logprobs(batch), batch, est)[0]
        (grad,) = torch.autograd.grad(value, [current.table])
        thetas.append(thetas[-1] - LR * grad.reshape(-1))
    return thetas


@pytest.mark.parametrize("staleness", [0, 1, 3])
@pytest.mark.parametrize("with_engine", [False, True], ids=["no engine", "engine"])
def test_staleness_and_the_engine_match_the_loop_written_out(mdp, staleness, with_engine):
    policy = make_policy(TabularPolicy, mdp, seed=5)

    def engine(p):
        return inference_copy(p, noise_std=0.5, generator=torch.Generator().manual_seed(9))

    est = estimators.get("minirl")                 # reads old_logprob (mask) and μ (TIS)
    run = train_exact(mdp, policy, est, updates=5, group_size=2, groups_per_update=3, lr=LR,
                      generator=torch.Generator().manual_seed(1), staleness=staleness,
                      engine=engine if with_engine else None)
    thetas = _by_hand(mdp, policy, est, updates=5, staleness=staleness,
                      engine=engine if with_engine else None, seed=1)
    assert (_theta(run.policy) - thetas[-1]).abs().max() < EXACT_TOL
    if with_engine:
        with torch.no_grad():
            kl0 = float(sequence_kl(mdp, policy, engine(policy)))
        assert kl0 > 0 and abs(run.behavior_kl[0] - kl0) < EXACT_TOL


def test_a_stale_run_differs_from_the_on_policy_run(mdp):
    policy, est = make_policy(TabularPolicy, mdp, seed=5), estimators.get("ppo")
    runs = [train_exact(mdp, policy, est, updates=4, group_size=2, groups_per_update=3, lr=LR,
                        generator=torch.Generator().manual_seed(1), staleness=k) for k in (0, 2)]
    assert torch.equal(runs[0].objective[:2], runs[1].objective[:2])   # update 0: the same batch
    assert (runs[0].objective[2:] - runs[1].objective[2:]).abs().max() > 1e-6


def test_determinism_and_the_input_policy_is_untouched(mdp):
    policy, est = make_policy(TabularPolicy, mdp, seed=1), estimators.get("grpo")
    before = _theta(policy)

    def run(seed):
        return train_exact(mdp, policy, est, updates=6, group_size=4, groups_per_update=2,
                           optimizer=lambda p: torch.optim.Adam(p, lr=0.1), reference=policy,
                           generator=torch.Generator().manual_seed(seed))
    a, b, c = run(3), run(3), run(4)
    assert torch.equal(a.objective, b.objective) and torch.equal(_theta(a.policy), _theta(b.policy))
    assert not torch.equal(a.objective, c.objective)
    assert torch.equal(_theta(policy), before)
    assert torch.equal(_theta(a.policy_at(0)), before) and a.parameters.shape == (7, before.numel())
    assert torch.equal(_theta(a.policy_at(6)), _theta(a.policy))
    with torch.no_grad():
        assert abs(float(objective(mdp, a.policy_at(3))) - a.objective[3]) < EXACT_TOL
    assert gradient(mdp, a.policy_at(2)).shape == before.shape      # differentiable
    with pytest.raises(ValueError, match="t:"):
        a.policy_at(7)
    with pytest.raises(TypeError, match="t:"):
        a.policy_at(1.0)
    assert set(a.metrics) >= {"clip_fraction", "kl_ref"} and a.metrics["kl_ref"].shape == (6,)
    assert a.objective.dtype == torch.float64 and a.objective.shape == (7,)


def test_zero_updates_and_the_summary_properties(mdp):
    policy = make_policy(TabularPolicy, mdp)
    run = train_exact(mdp, policy, estimators.get("rloo"), updates=0, group_size=2, lr=LR,
                      generator=torch.Generator().manual_seed(0))
    assert run.updates == 0 and run.objective.shape == (1,) and run.max_drawdown == 0.0
    curve = ExactTrainingRun(objective=torch.tensor([0.0, 1.0, 0.5, 2.0, 1.2, 1.9],
                                                    dtype=torch.float64),
                             gradient_norm=torch.zeros(5), true_gradient_norm=torch.zeros(5),
                             cosine=torch.zeros(5), behavior_kl=torch.zeros(5), metrics={},
                             parameters=torch.zeros(6, 1), policy=policy)
    assert curve.max_drawdown == pytest.approx(0.8, abs=EXACT_TOL)
    assert curve.final_objective == 1.9


class _NaNSurrogate(Surrogate):
    def __call__(self, logprobs_RC, batch):
        return SurrogateTerms(logprobs_RC * float("nan"), None)

    def describe(self):
        return "nan"


def test_a_non_finite_update_raises_naming_it(mdp):
    policy = make_policy(TabularPolicy, mdp)
    with pytest.raises(FloatingPointError, match="update 0"):
        train_exact(mdp, policy, Estimator(surrogate=_NaNSurrogate()), updates=2, group_size=2,
                    lr=LR, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(lr=None), ValueError, "lr, optimizer"),
    (dict(optimizer=lambda p: torch.optim.SGD(p, lr=1.0)), ValueError, "lr, optimizer"),
    (dict(lr=0.0), ValueError, "lr"),
    (dict(lr=float("nan")), ValueError, "lr"),
    (dict(lr=None, optimizer="adam"), TypeError, "optimizer"),
    (dict(lr=None, optimizer=lambda p: None), TypeError, "optimizer"),
    (dict(updates=-1), ValueError, "updates"),
    (dict(updates=2.0), TypeError, "updates"),
    (dict(updates=True), TypeError, "updates"),
    (dict(group_size=0), ValueError, "group_size"),
    (dict(groups_per_update=0), ValueError, "groups_per_update"),
    (dict(staleness=-1), ValueError, "staleness"),
    (dict(generator=0), TypeError, "generator"),
    (dict(engine="fp8"), TypeError, "engine"),
    (dict(engine=lambda p: "not a policy"), TypeError, "engine"),
    (dict(estimator="rloo"), TypeError, "estimator"),
    (dict(estimator=estimators.get("grpo")), ValueError, "reference"),
])
def test_bad_input_raises_naming_the_argument(mdp, kwargs, error, match):
    policy = make_policy(TabularPolicy, mdp)
    args = dict(estimator=estimators.get("rloo"), updates=1, group_size=2, lr=LR,
                generator=torch.Generator().manual_seed(0))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        train_exact(mdp, policy, **args)


def test_a_policy_that_cannot_sample_is_refused(mdp):
    wrapped = OnlyTokenLogprobs(make_policy(TabularPolicy, mdp))
    with pytest.raises(TypeError, match="policy"):
        train_exact(mdp, wrapped, estimators.get("rloo"), updates=1, group_size=2, lr=LR,
                    generator=torch.Generator().manual_seed(0))
    float32 = make_policy(TabularPolicy, mdp).float()
    with pytest.raises(TypeError, match="float64"):
        train_exact(mdp, float32, estimators.get("rloo"), updates=1, group_size=2, lr=LR,
                    generator=torch.Generator().manual_seed(0))
