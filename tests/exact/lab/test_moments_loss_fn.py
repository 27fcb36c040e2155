"""Bring your own loss: moments() of a loss callable, against the registry and brute force."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.exact.conftest import make_policy
from tokenmdp import estimators as E
from tokenmdp.exact import NeuralPolicy, TabularPolicy, TokenMDP, sequence_probs, stale_copy
from tokenmdp.exact.lab.loss_fn_gradients import count_ordered_draws
from tokenmdp.exact.lab.moments import moments
from tokenmdp.exact.lab.step_gradients import _stacked_batch
from tokenmdp.exact.world.rewards import RandomTable

#: exact identities hold to float64 round-off accumulated over ~10^3 draws
EXACT_TOL = 1e-10
G = 3


@pytest.fixture
def lab():
    """7 responses per prompt, two prompts: 2 · 7^3 = 686 ordered groups of 3, 168 multisets."""
    mdp = TokenMDP(3, 2, RandomTable(seed=2), prompts=[(0,), (1,)], prompt_probs=[0.4, 0.6])
    pi = make_policy(TabularPolicy, mdp, seed=0)
    old = stale_copy(mdp, pi, distance=0.6)
    ref = make_policy(TabularPolicy, mdp, seed=5)
    return mdp, pi, old, ref


def grpo_by_hand(logprobs_RC, batch, unbiased_std=True):
    """GRPO (Shao et al. 2024, Eq. 3) on padded rows, written from the paper, not the library:
    (R − mean_g)/(std_g + 1e-6), PPO clip 0.2, k3 KL with β = 0.04, 1/|y_i| then the mean over
    the sequences."""
    mask = batch.loss_mask.to(logprobs_RC.dtype)
    rewards = batch.reward.view(-1, G)
    std = rewards.std(1, keepdim=True, unbiased=unbiased_std)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (std + 1e-6)).reshape(-1, 1)
    ratio = torch.exp(logprobs_RC - batch.old_logprob)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    log_r = batch.ref_logprob - logprobs_RC
    k3 = torch.exp(log_r) - log_r - 1
    per_token = -(surrogate - 0.04 * k3) * mask
    return (per_token.sum(1) / mask.sum(1)).mean()


def micro_batch_token_mean(logprobs_RC, batch, rows_per_micro_batch=2):
    """The gradient-accumulation style many trainers shipped: a token mean inside each
    micro-batch of rows, the micro-batch losses averaged (``advantage`` from ``prepare``)."""
    losses = []
    for start in range(0, batch.num_rows, rows_per_micro_batch):
        rows = slice(start, start + rows_per_micro_batch)
        mask = batch.loss_mask[rows]
        terms = batch.advantage[rows] * logprobs_RC[rows]
        losses.append(-(terms * mask).sum() / mask.sum())
    return torch.stack(losses).mean()


def close(a, b, tol=EXACT_TOL):
    torch.testing.assert_close(a, b, rtol=0, atol=tol)


def same_moments(a, b, tol=EXACT_TOL):
    close(a.mean, b.mean, tol)
    close(a.true_gradient, b.true_gradient, tol)
    assert abs(a.total_variance - b.total_variance) <= tol
    close(a.covariance, b.covariance, tol)


@pytest.mark.parametrize("order_invariant", [False, True])
def test_a_hand_written_grpo_has_the_registry_entrys_exact_moments(lab, order_invariant):
    mdp, pi, old, ref = lab
    registry = moments(mdp, pi, E.get("grpo"), group_size=G, behavior=old, reference=ref,
                       method="enumeration")
    mine = moments(mdp, pi, grpo_by_hand, group_size=G, behavior=old, reference=ref,
                   method="exact", order_invariant=order_invariant)
    assert mine.method == "enumeration"
    assert mine.num_draws == (168 if order_invariant else 686)
    assert registry.relative_bias > 0.05           # clip, std and KL: a real bias to match
    same_moments(mine, registry)
    # and the exchangeability method of the registry entry agrees too
    same_moments(mine, moments(mdp, pi, E.get("grpo"), group_size=G, behavior=old,
                               reference=ref, method="exchangeability"))


def test_a_slightly_wrong_hand_written_loss_is_told_apart(lab):
    mdp, pi, old, ref = lab
    registry = moments(mdp, pi, E.get("grpo"), group_size=G, behavior=old, reference=ref)
    wrong = moments(mdp, pi, lambda lp, b: grpo_by_hand(lp, b, unbiased_std=False),
                    group_size=G, behavior=old, reference=ref)   # the population std instead
    assert float((wrong.mean - registry.mean).norm()) > 1e3 * EXACT_TOL


def test_the_librarys_own_loss_as_a_callable_with_prepare_by_name(lab):
    mdp, pi, old, ref = lab
    for name in ("dr_grpo", "rloo"):          # CONSTANT (needs max_len) and a plain mean
        est = E.get(name)
        same_moments(moments(mdp, pi, lambda lp, b, est=est: E.loss(lp, b, est)[0],
                             group_size=G, behavior=old, prepare=name, order_invariant=True),
                     moments(mdp, pi, est, group_size=G, behavior=old, method="enumeration"))


def test_a_neural_policy_goes_through_the_jacobian(lab):
    mdp, *_ = lab
    pi = make_policy(NeuralPolicy, mdp, seed=1)
    est = E.get("rloo")
    same_moments(moments(mdp, pi, lambda lp, b: E.loss(lp, b, est)[0], group_size=2,
                         prepare=est),
                 moments(mdp, pi, est, group_size=2, method="enumeration"))


def _brute_force(mdp, policy, loss_fn, prepare, group_size):
    """E[ĝ] and tr Cov[ĝ] over every ordered group of one prompt (itertools.product), ĝ by
    autograd through the policy itself (no coefficients, no Jacobian)."""
    enum = mdp.enumerate()
    params = list(policy.parameters())
    with torch.no_grad():
        mu = sequence_probs(mdp, policy)
        own = policy.token_logprobs(enum)
    mean, second = 0.0, 0.0
    for group in itertools.product(range(mdp.responses_per_prompt), repeat=group_size):
        p = torch.prod(mu[list(group)])
        batch, _ = _stacked_batch(enum, torch.tensor([group]), group_size,
                                  {"behavior_logprob": own, "old_logprob": own})
        batch = prepare(batch)
        grads = torch.autograd.grad(-loss_fn(policy.token_logprobs(batch), batch), params)
        g = torch.cat([x.reshape(-1) for x in grads])
        mean = mean + p * g
        second = second + p * (g @ g)
    return mean, float(second - mean @ mean)


def test_a_per_micro_batch_token_mean_gets_its_exact_bias():
    mdp1 = TokenMDP(3, 2, RandomTable(seed=2), prompts=[(0,)])
    pi1 = make_policy(TabularPolicy, mdp1, seed=0)
    est = E.Estimator(surrogate=E.Reinforce(), advantage=E.GroupMean(),
                      aggregation=E.Aggregation.TOKEN_MEAN)
    prep = lambda b: E.prepare(b, est)                                      # noqa: E731
    mine = moments(mdp1, pi1, micro_batch_token_mean, group_size=G, prepare=prep)
    assert mine.method == "enumeration" and mine.num_draws == count_ordered_draws(mdp1, G)
    mean, var = _brute_force(mdp1, pi1, micro_batch_token_mean, prep, G)
    close(mine.mean, mean)
    assert abs(mine.total_variance - var) <= EXACT_TOL
    # it is not the registry's token mean (the step's count), which one micro-batch would be
    token_mean = moments(mdp1, pi1, est, group_size=G, method="enumeration")
    assert float((mine.mean - token_mean.mean).norm()) > 1e-3 * float(token_mean.mean.norm())
    one = moments(mdp1, pi1, lambda lp, b: micro_batch_token_mean(lp, b, G), group_size=G,
                  prepare=prep)
    same_moments(one, token_mean)
    # the micro-batches cut the group by row, so the order matters: multisets would be wrong
    assumed = moments(mdp1, pi1, micro_batch_token_mean, group_size=G, prepare=prep,
                      order_invariant=True)
    assert float((assumed.mean - mine.mean).norm()) > 1e-4
    # and Monte Carlo (ordered draws) agrees with the exact mean within its standard errors
    mc = moments(mdp1, pi1, micro_batch_token_mean, group_size=G, prepare=prep,
                 method="monte_carlo", num_samples=3000)
    z = (mc.mean - mine.mean) / mc.mean_se.clamp(min=1e-12)
    assert float(z.abs().max()) < 4.5


def test_bad_callables_and_options_are_refused_clearly(lab):
    mdp, pi, old, ref = lab
    kw = dict(group_size=2)
    with pytest.raises(TypeError, match="estimator: expected an Estimator or a loss callable"):
        moments(mdp, pi, 3, **kw)
    with pytest.raises(TypeError, match="estimator: expected an Estimator or a loss callable"):
        moments(mdp, pi, "grpo", **kw)
    with pytest.raises(TypeError, match=r"loss_fn\(logprobs_RC, batch\)"):
        moments(mdp, pi, lambda lp: lp.sum(), **kw)
    with pytest.raises(TypeError, match=r"take its \[0\]"):
        moments(mdp, pi, lambda lp, b: E.loss(lp, b, "rloo"), prepare="rloo", **kw)
    with pytest.raises(TypeError, match="scalar tensor"):
        moments(mdp, pi, lambda lp, b: lp, **kw)
    with pytest.raises(TypeError, match="scalar tensor"):
        moments(mdp, pi, lambda lp, b: 1.0, **kw)
    with pytest.raises(TypeError, match="prepare: must return a TokenBatch"):
        moments(mdp, pi, lambda lp, b: lp.sum(), prepare=lambda b: None, **kw)
    with pytest.raises(ValueError, match="prepare: changed the batch's loss_mask"):
        moments(mdp, pi, lambda lp, b: lp.sum(),
                prepare=lambda b: b.replace(loss_mask=b.response_mask & (b.position > 1)), **kw)
    with pytest.raises(TypeError, match="prepare: only with a loss callable"):
        moments(mdp, pi, E.get("rloo"), prepare="rloo", **kw)
    with pytest.raises(TypeError, match="prepare: expected a callable"):
        moments(mdp, pi, lambda lp, b: lp.sum(), prepare=3, **kw)
    with pytest.raises(ValueError, match="exchangeability needs an Estimator"):
        moments(mdp, pi, lambda lp, b: lp.sum(), method="exchangeability", **kw)
    with pytest.raises(ValueError, match="exchangeability needs an Estimator"):
        moments(mdp, pi, E.get("rloo"), method="exchangeability", order_invariant=False, **kw)
    with pytest.raises(TypeError, match="order_invariant"):
        moments(mdp, pi, E.get("rloo"), order_invariant="yes", **kw)
    with pytest.raises(ValueError, match="not finite"):
        moments(mdp, pi, lambda lp, b: (lp.sum() - 1).sqrt() * 0 + lp.sum() ** 0.5, **kw)


def test_a_loss_that_ignores_the_log_probs_has_zero_mean(lab):
    mdp, pi, _, _ = lab
    m = moments(mdp, pi, lambda lp, b: b.reward.sum(), group_size=2)
    assert float(m.mean.abs().max()) == 0.0 and m.total_variance == 0.0


def test_compares_python_entry_point_takes_a_callable_too():
    from tokenmdp.reports.comparison import Setup, build_lab, measure
    lab = build_lab(Setup(max_len=2, group_size=2))
    est = E.get("grpo")          # π_ref = π_old in the comparison; prepare inside the callable
    mine = measure(lab, lambda lp, b: E.loss(lp, E.prepare(b, est), est)[0])
    assert mine.method == "enumeration"
    same_moments(mine, measure(lab, est))
