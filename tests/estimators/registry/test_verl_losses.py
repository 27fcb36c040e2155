"""Issue 32: the registry entries whose aliases name a verl ``policy_loss.loss_mode`` and
``loss_agg_mode`` equal verl's documented loss, written here from its definition on padded
``[B, T]`` tensors (read in ``verl-project/verl`` at commit 018f23b5f83a, file
``verl/trainer/ppo/core_algos.py``; defaults from ``verl/workers/config/actor.py`` at
0123a352e879 and ``examples/dppo_trainer/run_qwen3_30b_a3b_megatron.sh`` at 08aef7ff7419).

Transcribed here (the rest of verl's losses in ``test_verl_losses_2.py``):

* ``agg_loss``: ``token-mean`` ``Σ m ℓ / Σ m``; ``seq-mean-token-mean`` the mean over sequences
  with a token of ``Σ_t m ℓ / (|y_i| + 1e-8)``; ``seq-mean-token-sum-norm`` the mean over those
  sequences of ``Σ_t m ℓ``, divided by ``loss_scale_factor``, by default the tensor's width
  ``T`` (the padded response length). The ``1e-8`` moves a seq-mean-token-mean loss by a
  relative ``1e-8 / |y_i|``: every comparison runs with it (within ``VERL_EPS``) and without it
  (within ``EXACT``).
* ``compute_grpo_outcome_advantage``: ``(R - mean_g) / (std_g + 1e-6)`` (``torch.std``, i.e.
  ddof 1), or ``R - mean_g`` with ``norm_adv_by_std_in_grpo=False``; a group of one gets mean 0,
  std 1.
* ``loss_mode=vanilla``: ``ℓ = max(-A r, -A clip(r, 1-ε_low, 1+ε_high))``, then where ``A < 0``
  ``min(ℓ, -A c)`` with ``clip_ratio_c`` ``c = 3`` (``log r`` clamped to ±20 first);
  ``use_kl_loss``: ``kl_loss_coef · agg_loss(low_var_kl)`` with the same ``loss_agg_mode``,
  ``low_var_kl = clamp(exp(k) - k - 1, ±10)``, ``k = clamp(ref - log π, ±20)``.
* ``loss_mode=cispo``: ``ℓ = -sg(clip(r, 1-clip_ratio_low, 1+clip_ratio_high)) A log π``
  (``clip_ratio_low`` defaults to 0.2: a floor at 0.8).
* ``loss_mode=sapo``: ``ℓ = -(4/τ) σ(τ (r - 1)) A``, ``τ = tau_pos`` (1.0) where ``A > 0``, else
  ``tau_neg`` (1.05); always ``seq-mean-token-mean``.
"""

from __future__ import annotations

import math

import torch

from tests.estimators.estimator_helpers import make_batch, response_values
from tests.estimators.registry.padded import padded
from tokenmdp import estimators
from tokenmdp.estimators import PPOClip, loss, prepare

#: float64 sums of a dozen terms, two routes.
EXACT = 1e-12
#: verl's ``+ 1e-8`` in per-sequence token counts (and GMPO's means): a relative 1e-8 at most.
VERL_EPS = 1e-8
#: ``max_response_length``: the padded width verl's seq-mean-token-sum-norm divides by.
L_MAX = 5

# A > 0 in sequences 0 and 3, A < 0 in 1 and 2; r = e^0.5 = 1.65 (above both clip bands),
# e^-0.5 = 0.61 (below), 4 (above the dual clip, at A < 0), and small moves inside the band;
# p_old 0.9 -> p 0.98 (A > 0) is inside DPPO's TV threshold 0.15 and beyond its KL one 0.05.
LOG_R = [[0.5, math.log(0.98 / 0.9), -0.1], [-0.5, math.log(4.0), 0.1],
         [0.1, 0.5, -0.05, 0.2], [-0.5]]
# log π_old: low enough that every log π = log π_old + log r is below 0 (DPPO uses p = e^log π)
OLD = [[-0.9, math.log(0.9), -0.8], [-0.6, -2.0, -1.1], [-1.2, -1.0, -0.7, -0.9], [-0.5]]
REWARDS = [1.0, 0.0, 0.3, 0.9]
GROUPS = [0, 0, 1, 1]


def world(log_r=LOG_R, old=OLD):
    """Two groups of two sequences; ``lp`` the differentiable ``log π_θ`` ``[R, C]``."""
    ref = [[o - 0.3 + 0.2 * ((3 * s + t) % 4) for t, o in enumerate(row)]
           for s, row in enumerate(old)]
    batch = make_batch([[9]] * len(old), [[1 + i] * len(r) for i, r in enumerate(old)],
                       rewards=REWARDS, groups=GROUPS, old=old, behavior=old, ref=ref)
    lp = (batch.old_logprob + response_values(batch, log_r)).requires_grad_(True)
    return batch, lp


def views(batch, lp, width=L_MAX):
    """``log π``, ``log π_old``, ``log π_ref`` and the mask as padded ``[B, T]`` tensors."""
    lengths = [int(((batch.sequence_id == s) & batch.loss_mask).sum())
               for s in range(batch.num_sequences)]
    log_prob, mask = padded(batch, lp, lengths, width)
    old, _ = padded(batch, batch.old_logprob, lengths, width)
    ref, _ = padded(batch, batch.ref_logprob, lengths, width)
    return log_prob, old, ref, mask


def ours(name, batch, lp, est=None):
    """The registry entry's loss, its gradient in ``lp`` and its prepared step."""
    est = estimators.get(name) if est is None else est
    step = prepare(batch, est, max_len=L_MAX)
    value, _ = loss(lp, step, est)
    return value, torch.autograd.grad(value, lp)[0], step


def padded_advantage(batch, step, width=L_MAX):
    """The registry step's advantage as verl's ``[B, T]`` advantages (0 off the mask)."""
    lengths = [int(((batch.sequence_id == s) & batch.loss_mask).sum())
               for s in range(batch.num_sequences)]
    return padded(batch, step.advantage, lengths, width)[0]


# ---- verl, transcribed ----------------------------------------------------------------------

def verl_agg(loss_BT, mask, mode, *, eps=VERL_EPS, scale=None):
    m = mask.to(loss_BT.dtype)
    token_sums = (loss_BT * m).sum(-1)
    counts = m.sum(-1)
    live = (counts > 0).to(loss_BT.dtype)                     # sequences with a loss token
    if mode == "token-mean":
        return token_sums.sum() / m.sum()
    if mode == "seq-mean-token-mean":
        return (token_sums / (counts + eps) * live).sum() / live.sum()
    if mode == "seq-mean-token-sum-norm":
        return (token_sums * live).sum() / live.sum() / (mask.shape[-1] if scale is None else scale)
    raise ValueError(mode)


def verl_grpo_advantage(rewards, groups, mask, *, norm_by_std=True, eps=1e-6):
    adv = torch.empty_like(rewards)
    for g in set(groups.tolist()):
        members = groups == g
        scores = rewards[members]
        mean, std = (scores.mean(), scores.std()) if len(scores) > 1 else (0.0, 1.0)
        adv[members] = (scores - mean) / (std + eps) if norm_by_std else scores - mean
    return adv[:, None] * mask.to(rewards.dtype)


def verl_vanilla(log_prob, old, adv, *, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0):
    ratio = torch.exp(torch.clamp(log_prob - old, -20.0, 20.0))
    ppo = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))
    return torch.where(adv < 0, torch.minimum(ppo, -adv * clip_ratio_c), ppo)


def verl_low_var_kl(log_prob, ref):
    k = torch.clamp(ref - log_prob, -20.0, 20.0)
    return torch.clamp(torch.exp(k) - k - 1, -10.0, 10.0)


def verl_cispo(log_prob, old, adv, *, clip_low=0.2, clip_high=0.2):
    ratio = torch.exp(torch.clamp(log_prob - old, -20.0, 20.0))
    return -torch.clamp(ratio, 1 - clip_low, 1 + clip_high).detach() * adv * log_prob


def verl_sapo(log_prob, old, adv, *, tau_pos=1.0, tau_neg=1.05):
    ratio = torch.exp(torch.clamp(log_prob - old, -20.0, 20.0))
    tau = torch.where(adv > 0, torch.as_tensor(tau_pos, dtype=adv.dtype),
                      torch.as_tensor(tau_neg, dtype=adv.dtype))
    return -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv


def assert_equals_verl(value, grad, lp, verl_value_of_eps):
    """``value`` / ``grad`` equal verl's at ``EXACT`` without its 1e-8 and within ``VERL_EPS``
    with it; ``verl_value_of_eps(eps)`` builds verl's loss from ``lp``."""
    for eps, tol in ((0.0, EXACT), (VERL_EPS, VERL_EPS)):
        theirs = verl_value_of_eps(eps)
        their_grad = torch.autograd.grad(theirs, lp, retain_graph=True)[0]
        assert abs(float((value - theirs).detach())) < tol, (eps, float(value), float(theirs))
        assert float((grad - their_grad).abs().max()) < tol, eps


def aliases(name):
    return estimators.describe(name).split("Other names:")[1]


# ---- tests ----------------------------------------------------------------------------------

def test_the_world_hits_every_branch_of_the_vanilla_loss():
    batch, lp = world()
    log_prob, old, _, mask = views(batch, lp)
    adv = verl_grpo_advantage(batch.reward, batch.group, mask)
    r = torch.exp(log_prob - old).detach()
    pos, neg = mask & (adv > 0), mask & (adv < 0)
    for hit in (pos & (r > 1.28), pos & (r < 0.8), pos & (r > 0.8) & (r < 1.2),     # clipped /
                neg & (r < 0.8), neg & (r > 1.28) & (r < 3), neg & (r > 3),         # unclipped
                neg & (r > 0.8) & (r < 1.2)):
        assert hit.any()


def test_verl_grpo_advantage_is_the_registrys():
    batch, lp = world()
    _, _, _, mask = views(batch, lp)
    for name, norm in (("grpo", True), ("dapo", True), ("dr_grpo", False), ("dppo_tv", False)):
        step = prepare(batch, estimators.get(name), max_len=L_MAX)
        theirs = verl_grpo_advantage(batch.reward, batch.group, mask, norm_by_std=norm)
        assert float((padded_advantage(batch, step) - theirs).abs().max()) < EXACT, name


def test_vanilla_seq_mean_token_mean_with_kl_loss_is_grpo_verl():
    batch, lp = world()
    value, grad, _ = ours("grpo_verl", batch, lp)
    log_prob, old, ref, mask = views(batch, lp)
    adv = verl_grpo_advantage(batch.reward, batch.group, mask)

    def theirs(eps):
        pg = verl_agg(verl_vanilla(log_prob, old, adv), mask, "seq-mean-token-mean", eps=eps)
        kl = verl_agg(verl_low_var_kl(log_prob, ref), mask, "seq-mean-token-mean", eps=eps)
        return pg + 0.04 * kl                                   # kl_loss_coef set to 0.04
    assert_equals_verl(value, grad, lp, theirs)
    assert "loss_agg_mode=seq-mean-token-mean" in aliases("grpo")


def test_vanilla_token_mean_is_dapo_verl_and_ppo_verl():
    batch, lp = world()
    log_prob, old, _, mask = views(batch, lp)
    for name, clip_high in (("dapo_verl", 0.28), ("ppo_verl", 0.2)):
        value, grad, step = ours(name, batch, lp)
        # dapo: verl's grpo advantage; ppo: the registry's batch-normalized one, given to verl
        adv = (verl_grpo_advantage(batch.reward, batch.group, mask) if name == "dapo_verl"
               else padded_advantage(batch, step))
        assert_equals_verl(value, grad, lp, lambda eps, h=clip_high, a=adv: verl_agg(
            verl_vanilla(log_prob, old, a, clip_high=h), mask, "token-mean", eps=eps))
    assert "loss_agg_mode=token-mean" in aliases("dapo")
    assert "loss_mode=vanilla" in aliases("ppo_verl")


def test_the_plain_entries_differ_from_verl_only_at_its_dual_clip():
    # ppo, grpo, dapo, dr_grpo have no dual clip: verl's vanilla loss with c = 3 is theirs
    # except at the A < 0 token with r = 4, whose term -4A becomes -3A with no gradient
    batch, lp = world()
    log_prob, old, ref, mask = views(batch, lp)
    hit = (batch.sequence_id == 1) & (batch.position == 2)      # r = 4 (one prompt token)
    for name, clip_high in (("ppo", 0.2), ("grpo", 0.2), ("dapo", 0.28), ("dr_grpo", 0.2)):
        value, grad, step = ours(name, batch, lp)
        _, verl_grad, _ = ours(name, batch, lp, est=estimators.get(name).replace(
            surrogate=PPOClip(0.2, clip_high, dual_clip=3.0)))
        w, a = float(step.loss_weight[hit]), float(step.advantage[hit])
        assert a < 0
        assert abs(float(grad[hit] - verl_grad[hit]) + w * 4.0 * a) < EXACT   # -4A's gradient
        assert torch.equal(grad[~hit], verl_grad[~hit])
        assert "dual clip" in aliases(name)


def test_vanilla_seq_mean_token_sum_norm_is_dr_grpo_with_verls_dual_clip():
    batch, lp = world()
    log_prob, old, _, mask = views(batch, lp)
    adv = verl_grpo_advantage(batch.reward, batch.group, mask, norm_by_std=False)
    with_dual_clip = estimators.get("dr_grpo").replace(surrogate=PPOClip(0.2, 0.2, dual_clip=3.0))
    value, grad, _ = ours("dr_grpo", batch, lp, est=with_dual_clip)
    pg = verl_vanilla(log_prob, old, adv)
    assert_equals_verl(value, grad, lp, lambda eps: verl_agg(pg, mask, "seq-mean-token-sum-norm"))
    # verl's constant is the tensor's width T: max_len must be the padded response length
    narrow_log_prob, narrow_old, _, narrow_mask = views(batch, lp, width=4)
    narrow = verl_agg(verl_vanilla(narrow_log_prob, narrow_old, adv[:, :4]), narrow_mask,
                      "seq-mean-token-sum-norm")
    assert abs(float((narrow * 4 / L_MAX - value).detach())) < EXACT
    assert "loss_agg_mode=seq-mean-token-sum-norm" in aliases("dr_grpo")


def test_cispo_with_no_floor_is_cispo_and_verls_default_floor_differs_below_0_8():
    batch, lp = world()
    value, grad, step = ours("cispo", batch, lp)
    log_prob, old, _, mask = views(batch, lp)
    adv = verl_grpo_advantage(batch.reward, batch.group, mask)
    assert_equals_verl(value, grad, lp, lambda eps: verl_agg(
        verl_cispo(log_prob, old, adv, clip_low=1.0), mask, "token-mean"))
    # clip_ratio_low at its default 0.2: weight max(r, 0.8) where r < 0.8, the rest unchanged
    default = verl_agg(verl_cispo(log_prob, old, adv), mask, "token-mean")
    default_grad = torch.autograd.grad(default, lp, retain_graph=True)[0]
    r = torch.exp(lp - batch.old_logprob).detach()
    floored = batch.loss_mask & (r < 0.8)
    capped = batch.loss_mask & (r > 1.2)
    assert floored.any() and capped.any() and (batch.loss_mask & ~floored & ~capped).any()
    n = int(batch.loss_mask.sum())
    expected = torch.where(floored, -(0.8 - r) * step.advantage / n, 0.0)
    torch.testing.assert_close(default_grad - grad, expected, rtol=0, atol=EXACT)
    value_gap = -((0.8 - r) * step.advantage * lp.detach())[floored].sum() / n
    assert abs(float((default - value).detach() - value_gap)) < EXACT
    assert "floors the weight at 0.8" in aliases("cispo") and "clip_ratio_low=1" in aliases("cispo")


def test_sapo_is_sapo():
    batch, lp = world()
    value, grad, _ = ours("sapo", batch, lp)
    log_prob, old, _, mask = views(batch, lp)
    adv = verl_grpo_advantage(batch.reward, batch.group, mask)
    assert (mask & (adv > 0)).any() and (mask & (adv < 0)).any()    # both temperatures
    assert_equals_verl(value, grad, lp, lambda eps: verl_agg(
        verl_sapo(log_prob, old, adv), mask, "seq-mean-token-mean", eps=eps))
    assert "loss_mode=sapo" in aliases("sapo")
