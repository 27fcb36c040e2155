"""Every branch of :class:`~tokenmdp.exact.lab.step_gradients.StepGradients` — the dense ``ĝ``, the
first-sample term, and ``sq_norms`` on its tabular multi-path, tabular one-path and Jacobian
branches — against an independent computation: each draw built as a batch of its own
(:meth:`TokenMDP.make_batch`), prepared, and differentiated by autograd through the policy.

The draws are groups of responses to one prompt that share prefixes and repeat a response, so
the multi-path branch sums coefficients of several tokens in one state. Then the moments of a
policy taken as "large" (no covariance: the sparse mean and ``sq_norms`` path) against the same
moments through the dense per-batch gradients.
"""

import importlib

import pytest
import torch

from tokenmdp import estimators as E
from tokenmdp.exact import LogLinearPolicy, NeuralPolicy, TabularPolicy, moments
from tokenmdp.exact.lab.step_gradients import StepGradients, state_action_jacobian

# the module (``tokenmdp.exact.moments`` the attribute is the function)
moments_module = importlib.import_module("tokenmdp.exact.lab.moments")

#: float64; the two computations differ only in the order of summation.
TOL = 1e-12
ESTIMATORS = ("grpo", "minirl", "dapo_mis", "dr_grpo", "reinforce")


def _policies(mdp, cls):
    make = lambda c, s: c(mdp, generator=torch.Generator().manual_seed(s))  # noqa: E731
    return make(cls, 0), make(cls, 1), make(cls, 2)   # policy, old, behaviour


def _reference(mdp):
    """The KL reference policy (GRPO's KL term needs one)."""
    return TabularPolicy(mdp, generator=torch.Generator().manual_seed(3))


def _fields(mdp, old, behavior):
    enum = mdp.enumerate()
    with torch.no_grad():
        return {"behavior_logprob": behavior.token_logprobs(enum),
                "old_logprob": old.token_logprobs(enum),
                "ref_logprob": _reference(mdp).token_logprobs(enum)}


def _draws(mdp, width):
    """Draws of ``width`` responses to one prompt: prefix-sharing, repeated, mixed prompts."""
    n = mdp.responses_per_prompt
    g = torch.Generator().manual_seed(width)
    rows = [torch.randint(0, n, (width,), generator=g) + n * (d % mdp.num_prompts)
            for d in range(6)]
    rows.append(torch.full((width,), n - 1))                   # one response, repeated
    return torch.stack(rows)


def _independent(mdp, policy, old, behavior, est, rows, *, first_only=False):
    """``ĝ`` of one draw by autograd: its own batch, ``prepare``, ``loss``, ``−∇_θ``."""
    enum = mdp.enumerate()
    resp = torch.zeros(rows.numel(), mdp.max_len, dtype=torch.long)
    for i, r in enumerate(rows.tolist()):
        toks = enum.tokens[r][enum.response_mask[r]]
        resp[i, :toks.numel()] = toks
    batch = mdp.make_batch(enum.prompt_index[rows], resp, enum.length[rows],
                           group=torch.zeros(rows.numel(), dtype=torch.long))
    with torch.no_grad():
        batch = batch.replace(behavior_logprob=behavior.token_logprobs(batch),
                              old_logprob=old.token_logprobs(batch),
                              ref_logprob=_reference(mdp).token_logprobs(batch))
    batch = E.prepare(batch, est, max_len=mdp.max_len)
    params = list(policy.parameters())
    lp = policy.token_logprobs(batch)
    if first_only:   # sample 1's own term: only its tokens carry the gradient
        lp = torch.where(batch.sequence_id == 0, lp, lp.detach())
    value, _ = E.loss(lp, batch, est)
    grads = torch.autograd.grad(-value, params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if gr is None else gr).reshape(-1)
                      for p, gr in zip(params, grads)])


def _check(steps, mdp, policy, old, behavior, est, ids, *, first_only=False, one_path=False):
    expected = torch.stack([_independent(mdp, policy, old, behavior, est, rows,
                                         first_only=first_only) for rows in ids])
    torch.testing.assert_close(steps(ids, first_only=first_only), expected, rtol=TOL, atol=TOL)
    draw, pair, coef = steps.coefficients(ids, first_only=first_only)
    sq = steps.sq_norms(draw, pair, coef, ids.shape[0], one_path=one_path)
    torch.testing.assert_close(sq, (expected * expected).sum(1), rtol=TOL, atol=TOL)
    assert bool((expected.abs().sum(1) > 0).any())          # not a vacuous comparison


@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("width", [2, 3])
def test_tabular_multi_path_sq_norms_are_the_norms_of_the_autograd_gradients(mdp, name, width):
    policy, old, behavior = _policies(mdp, TabularPolicy)
    est = E.get(name)
    steps = StepGradients(mdp, policy, est, _fields(mdp, old, behavior), width)
    assert steps.jacobian is None                            # the closed-form tabular branch
    _check(steps, mdp, policy, old, behavior, est, _draws(mdp, width))


@pytest.mark.parametrize("name", ["reinforce", "token_is", "sequence_is"])
def test_tabular_one_path_sq_norms_of_single_responses(mdp, name):
    policy, old, behavior = _policies(mdp, TabularPolicy)
    # the reward as advantage: a draw of one response has no group statistics
    est = E.get(name).replace(advantage=E.RewardAsAdvantage())
    one = StepGradients(mdp, policy, est, _fields(mdp, old, behavior), 1)
    _check(one, mdp, policy, old, behavior, est, _draws(mdp, 1), one_path=True)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_tabular_one_path_sq_norms_of_first_sample_terms(mdp, name):
    policy, old, behavior = _policies(mdp, TabularPolicy)
    est = E.get(name)
    three = StepGradients(mdp, policy, est, _fields(mdp, old, behavior), 3)
    _check(three, mdp, policy, old, behavior, est, _draws(mdp, 3), first_only=True,
           one_path=True)


@pytest.mark.parametrize("cls", [LogLinearPolicy, NeuralPolicy, TabularPolicy])
@pytest.mark.parametrize("name", ["grpo", "minirl"])
def test_jacobian_branch_sq_norms_are_the_norms_of_the_autograd_gradients(mdp, cls, name):
    policy, old, behavior = _policies(mdp, cls)
    est = E.get(name)
    jac = state_action_jacobian(mdp, policy)                 # closed form for TabularPolicy
    steps = StepGradients(mdp, policy, est, _fields(mdp, old, behavior), 2, jacobian=jac)
    assert steps.jacobian is not None
    _check(steps, mdp, policy, old, behavior, est, _draws(mdp, 2))
    _check(steps, mdp, policy, old, behavior, est, _draws(mdp, 2), first_only=True)


@pytest.mark.parametrize(("name", "method", "group_size"), [
    ("grpo", "enumeration", 2), ("dapo_mis", "enumeration", 2), ("minirl", "enumeration", 3),
    ("grpo", "exchangeability", 3), ("rloo", "exchangeability", 2)])
def test_large_policy_moments_equal_the_dense_per_batch_moments(mdp, monkeypatch, name, method,
                                                                 group_size):
    """Without the covariance (a policy above ``MAX_COVARIANCE_DIM``) the moments come from the
    sparse coefficient mean and ``sq_norms``; they must equal the dense per-batch ones."""
    policy, old, behavior = _policies(mdp, TabularPolicy)
    est = E.get(name)
    kwargs = dict(group_size=group_size, behavior=behavior, old=old, method=method,
                  reference=_reference(mdp))
    dense = moments(mdp, policy, est, **kwargs)
    assert dense.covariance is not None
    monkeypatch.setattr(moments_module, "MAX_COVARIANCE_DIM", 0)
    sparse = moments(mdp, policy, est, **kwargs)
    assert sparse.covariance is None and sparse.method == dense.method == method
    torch.testing.assert_close(sparse.mean, dense.mean, rtol=TOL, atol=TOL)
    assert sparse.total_variance == pytest.approx(dense.total_variance, rel=1e-10, abs=TOL)
    assert dense.total_variance > 0 and float(dense.mean.norm()) > 0
    torch.testing.assert_close(sparse.true_gradient, dense.true_gradient, rtol=0, atol=0)
