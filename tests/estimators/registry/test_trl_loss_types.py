"""Issue 32: the registry entries whose aliases name a TRL ``loss_type`` equal TRL's documented
loss (written here from its definition on padded ``[B, T]`` tensors) given the same
advantages: PPO's clip with ``epsilon`` / ``epsilon_high``, the k3 KL ``exp(ref − logπ) −
(ref − logπ) − 1`` times ``beta``, and the loss type's reduction — ``grpo`` a mean over each
completion's tokens then over completions, ``dr_grpo`` the sum over
``B × max_completion_length``, ``dapo`` the sum over the batch's completion tokens. The
advantage TRL computes differs where the aliases say so: its group std gets ``+ 1e-4``."""

from __future__ import annotations

import torch

from tests.estimators.estimator_helpers import make_batch, response_values
from tests.estimators.registry.padded import padded
from tokenmdp import estimators
from tokenmdp.estimators import loss, prepare

#: float64 sums of a dozen terms, two routes.
EXACT = 1e-12

LOG_R = [[0.3, -0.1, 0.05], [-0.4, 0.25], [0.1, -0.3, 0.2, 0.4], [-0.05]]  # r beyond 1 ± 0.28
L_MAX = 4                                        # max_completion_length


def _world():
    g = torch.Generator().manual_seed(3)
    old = [(-0.2 - torch.rand(len(r), generator=g, dtype=torch.float64)).tolist() for r in LOG_R]
    ref = [(-0.3 - torch.rand(len(r), generator=g, dtype=torch.float64)).tolist() for r in LOG_R]
    batch = make_batch([[9]] * 4, [[1 + i] * len(r) for i, r in enumerate(LOG_R)],
                       rewards=[1.0, 0.0, 0.3, 0.9], groups=[0, 0, 1, 1], old=old, behavior=old,
                       ref=ref)
    lp = (batch.old_logprob + response_values(batch, LOG_R)).requires_grad_(True)
    return batch, lp


def _padded(batch, values_RC):
    return padded(batch, values_RC, [len(r) for r in LOG_R], L_MAX)


def trl_loss(loss_type, log_prob, old, ref, adv_B, mask, *, epsilon, epsilon_high, beta):
    m = mask.to(log_prob.dtype)
    coef_1 = torch.exp(log_prob - old)
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + epsilon_high)
    A = adv_B[:, None]
    per_token = -torch.minimum(coef_1 * A, coef_2 * A)
    if beta:
        per_token = per_token + beta * (torch.exp(ref - log_prob) - (ref - log_prob) - 1)
    if loss_type == "grpo":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "dr_grpo":
        return (per_token * m).sum() / (per_token.size(0) * L_MAX)
    if loss_type == "dapo":
        return (per_token * m).sum() / m.sum().clamp(min=1.0)
    raise ValueError(loss_type)


def trl_group_advantage(rewards_B, group_size, *, scale):
    r = rewards_B.view(-1, group_size)
    adv = (r - r.mean(1, keepdim=True)).reshape(-1)
    if scale:                                    # scale_rewards='group': std + 1e-4
        adv = adv / (r.std(1).repeat_interleave(group_size) + 1e-4)
    return adv


def test_the_trl_loss_types_equal_their_registry_entries_given_the_advantages():
    for name, loss_type, eps_high, beta in (("grpo", "grpo", 0.2, 0.04),
                                            ("dr_grpo", "dr_grpo", 0.2, 0.0),
                                            ("dapo", "dapo", 0.28, 0.0)):
        batch, lp = _world()
        est = estimators.get(name)
        step = prepare(batch, est, max_len=L_MAX)
        ours, _ = loss(lp, step, est)
        our_grad = torch.autograd.grad(ours, lp)[0]
        adv_B = torch.stack([step.advantage[(step.sequence_id == s) & step.loss_mask][0]
                             for s in range(len(LOG_R))])
        log_prob, mask = _padded(batch, lp)
        old, _ = _padded(batch, batch.old_logprob)
        ref, _ = _padded(batch, batch.ref_logprob)
        theirs = trl_loss(loss_type, log_prob, old, ref, adv_B, mask, epsilon=0.2,
                          epsilon_high=eps_high, beta=beta)
        their_grad = torch.autograd.grad(theirs, lp)[0]
        assert abs(float((ours - theirs).detach())) < EXACT, name
        assert float((our_grad - their_grad).abs().max()) < EXACT, name


def test_trl_advantages_differ_only_by_their_std_epsilon_which_the_aliases_name():
    batch, _ = _world()
    for name, scale in (("grpo", True), ("dapo", True), ("dr_grpo", False)):
        step = prepare(batch, estimators.get(name), max_len=L_MAX)
        ours = torch.stack([step.advantage[(step.sequence_id == s) & step.loss_mask][0]
                            for s in range(len(LOG_R))])
        theirs = trl_group_advantage(batch.reward, 2, scale=scale)
        if scale:
            assert 1e-6 < float((ours - theirs).abs().max()) < 1e-3       # 1e-6 vs 1e-4
            assert "+ 1e-4" in estimators.describe(name).split("Other names:")[1]
        else:
            assert float((ours - theirs).abs().max()) < EXACT
