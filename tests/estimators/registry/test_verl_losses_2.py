"""Issue 32, continued from ``test_verl_losses.py`` (same verl commit, same helpers): the rest of
verl's ``policy_loss.loss_mode`` values, written here from their definitions on padded
``[B, T]`` tensors, against the registry entries their aliases name.

* ``dppo_tv`` / ``dppo_kl``: ``ℓ = -A sg(min(r, clip_ratio_c)) log π · M``, ``M`` detached:
  where ``A > 0`` kept iff ``p - p_old <= clip_ratio_high`` (TV) or ``D <= clip_ratio_high`` or
  ``p <= p_old`` (KL); where ``A <= 0`` kept iff ``p - p_old >= -clip_ratio_low`` or
  ``D <= clip_ratio_low`` or ``p >= p_old``; ``p = e^log π``, ``D = p_old log(p_old/p) +
  (1-p_old) log((1-p_old+1e-8)/(1-p+1e-8))``. The example script: thresholds 0.15 (TV) / 0.05
  (KL), ``clip_ratio_c=10000``, ``norm_adv_by_std_in_grpo=False``, ``seq-mean-token-sum-norm``.
  Left unset, ``clip_ratio_c`` is ``ActorConfig``'s 3.0 (the loss's own fallback 20.0 is never
  reached through ``ActorConfig``): the weight is then capped at 3.
* ``geo_mean``: per sequence ``exp(Σ_t m ℓ_t / (|y| + 1e-8))``, ``ℓ = sgn(A) min(sgn(A) log r,
  sgn(A) clamp(log r, -clip_ratio_low, clip_ratio_high))``, times ``-Σ_t m A / (|y| + 1e-8)``,
  then ``torch.mean`` over the rows (whatever ``loss_agg_mode`` says).
* ``clip_cov``: PPO's ``max(-A r, -A clip(r))`` (no dual clip) times 0 on
  ``max(⌊clip_cov_ratio N⌋, 1)`` tokens drawn by ``torch.randperm`` among those with
  ``clip_cov_lb < (A - mean A)(log π - mean log π) < clip_cov_ub`` (means over the mask, the
  current ``log π``) that PPO does not clip; defaults 2e-4, 1, 5. The draw is forced here: a
  single candidate (and a budget of one), so no random number decides the result.
* ``kl_cov``: ``-A r``, and ``-A r + ppo_kl_coef |log r|`` on the ``max(⌊kl_cov_ratio N⌋, 1)``
  tokens of largest covariance (``torch.topk``, current ``log π``); ``PolicyLossConfig``
  defaults 2e-4 and 0.1. The largest covariance here is well clear of the next (no tie).

Both covariance losses select from the *current* ``log π``; the registry selects once per step
from ``log π_old`` (``tests/estimators/surrogates/test_covariance.py`` tests that selection against
loops and brute force). Here ``log π`` stays near ``log π_old`` so the two select the same token,
asserted before the losses are compared.
"""

from __future__ import annotations

import math

import torch

from tests.estimators.registry.test_verl_losses import (
    EXACT,
    LOG_R,
    OLD,
    VERL_EPS,
    aliases,
    assert_equals_verl,
    ours,
    verl_agg,
    verl_grpo_advantage,
    views,
    world,
)
from tokenmdp import estimators
from tokenmdp.estimators import DPPO
from tokenmdp.estimators.surrogates.covariance import CLIP_COV_SCALE, KL_COV_SELECTED


def verl_dppo(log_prob, old, adv, *, divergence, low, high, clip_ratio_c=10000.0):
    ratio = torch.exp(torch.clamp(log_prob - old, -20.0, 20.0))
    weight = torch.clamp(ratio, max=clip_ratio_c).detach()
    p, p_old = torch.exp(log_prob), torch.exp(old)
    if divergence == "tv":
        up_ok, down_ok = p - p_old <= high, p - p_old >= -low
    else:
        d = p_old * (old - log_prob) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        up_ok, down_ok = (d <= high) | (p <= p_old), (d <= low) | (p >= p_old)
    keep = torch.where(adv > 0, up_ok, down_ok).detach().to(log_prob.dtype)
    return -adv * weight * log_prob * keep, keep


def verl_geo_mean(log_prob, old, adv, mask, *, low=0.4, high=0.4, eps=VERL_EPS):
    m = mask.to(log_prob.dtype)
    log_r = log_prob - old
    s = torch.sign(adv)
    bounded = s * torch.min(s * log_r, s * torch.clamp(log_r, -low, high))
    n = m.sum(-1)
    ratio = torch.exp((bounded * m).sum(-1) / (n + eps))
    seq_adv = (adv * m).sum(-1) / (n + eps)
    return (-seq_adv * ratio).mean()


def masked_mean(x, mask):
    return x[mask].mean()


def verl_clip_cov(log_prob, old, adv, mask, *, clip=0.2, ratio_=2e-4, lb=1.0, ub=5.0):
    """The loss matrix and the candidate tokens (the draw is left to the caller's check)."""
    ratio = torch.exp(log_prob - old)
    unclipped, clipped = -adv * ratio, -adv * torch.clamp(ratio, 1 - clip, 1 + clip)
    ppo_clips = (clipped > unclipped) & mask
    cov = ((adv - masked_mean(adv, mask)) * (log_prob - masked_mean(log_prob.detach(), mask)))
    cov = cov.detach().masked_fill(~mask | ppo_clips, -math.inf)
    candidates = (cov > lb) & (cov < ub) & mask
    budget = max(int(ratio_ * int(mask.sum())), 1)
    assert int(candidates.sum()) <= budget, "the draw would be random"
    corr = (~candidates).to(log_prob.dtype)                  # all candidates fit the budget
    return torch.maximum(unclipped, clipped) * corr, candidates, ppo_clips


def verl_kl_cov(log_prob, old, adv, mask, *, ratio_=2e-4, coef=0.1):
    log_r = log_prob - old
    plain = -adv * torch.exp(log_r)
    valid_adv, valid_lp = adv[mask].detach(), log_prob[mask].detach()
    cov = (valid_adv - valid_adv.mean()) * (valid_lp - valid_lp.mean())
    k = max(1, int(len(cov) * ratio_))
    top = torch.topk(cov, k).indices
    assert k == len(cov) or float(cov.sort(descending=True).values[k - 1]
                                  - cov.sort(descending=True).values[k]) > 0.1   # no near tie
    selected = torch.zeros(len(cov), dtype=torch.bool)
    selected[top] = True
    chosen = torch.zeros_like(mask)
    chosen[mask] = selected
    return torch.where(chosen, plain + coef * log_r.abs(), plain), chosen


def _dppo_adv(batch, mask):
    return verl_grpo_advantage(batch.reward, batch.group, mask, norm_by_std=False)


# ---- DPPO -----------------------------------------------------------------------------------

def test_dppo_tv_and_kl_are_the_example_scripts_verl_losses():
    keeps = []
    for name, delta in (("dppo_tv", 0.15), ("dppo_kl", 0.05)):
        batch, lp = world()
        value, grad, _ = ours(name, batch, lp)
        log_prob, old, _, mask = views(batch, lp)
        adv = _dppo_adv(batch, mask)
        pg, keep = verl_dppo(log_prob, old, adv, divergence=name[-2:], low=delta, high=delta)
        dropped = mask & (keep == 0)
        assert (dropped & (adv > 0)).any() and (dropped & (adv < 0)).any(), name
        assert (mask & (keep == 1) & (adv > 0)).any() and (mask & (keep == 1) & (adv < 0)).any()
        assert (mask & (keep == 1) & (torch.exp(log_prob - old) > 3)).any()  # a weight above 3
        assert_equals_verl(value, grad, lp, lambda eps, pg=pg, mask=mask: verl_agg(
            pg, mask, "seq-mean-token-sum-norm"))
        assert f"loss_mode={name}" in aliases(name) and "clip_ratio_c = 10000" in aliases(name)
        keeps.append(keep)
    assert not torch.equal(*keeps)                  # the p_old 0.9 -> 0.98 token: TV keeps it


def test_dppo_with_actor_configs_clip_ratio_c_is_dppo_capped_at_3():
    # clip_ratio_c left at ActorConfig's 3.0: the r = 4 token (A < 0, p rises: kept) weighs 3
    for name, delta in (("dppo_tv", 0.15), ("dppo_kl", 0.05)):
        batch, lp = world()
        plain_value, plain_grad, step = ours(name, batch, lp)
        capped = estimators.get(name)
        capped = capped.replace(surrogate=DPPO(name[-2:], delta, delta, cap=3.0))
        value, grad, _ = ours(name, batch, lp, est=capped)
        log_prob, old, _, mask = views(batch, lp)
        pg, _ = verl_dppo(log_prob, old, _dppo_adv(batch, mask), divergence=name[-2:], low=delta,
                          high=delta, clip_ratio_c=3.0)
        assert_equals_verl(value, grad, lp, lambda eps, pg=pg, mask=mask: verl_agg(
            pg, mask, "seq-mean-token-sum-norm"))
        hit = (batch.sequence_id == 1) & (batch.position == 2)
        w, a = float(step.loss_weight[hit]), float(step.advantage[hit])
        assert abs(float(plain_grad[hit] - grad[hit]) + w * (4.0 - 3.0) * a) < EXACT
        assert torch.equal(plain_grad[~hit], grad[~hit])


# ---- GMPO -----------------------------------------------------------------------------------

def test_geo_mean_with_clip_0_4_is_gmpo():
    batch, lp = world()
    value, grad, _ = ours("gmpo", batch, lp)
    log_prob, old, _, mask = views(batch, lp)
    adv = verl_grpo_advantage(batch.reward, batch.group, mask)
    log_r = (log_prob - old).detach()
    pos, neg = mask & (adv > 0), mask & (adv < 0)
    for hit in (pos & (log_r > 0.4), pos & (log_r < -0.4), neg & (log_r < -0.4),   # capped,
                neg & (log_r > 0.4), mask & (log_r.abs() < 0.4)):                 # not, inside
        assert hit.any()
    assert_equals_verl(value, grad, lp, lambda eps: verl_geo_mean(log_prob, old, adv, mask,
                                                                  eps=eps))
    assert "loss_mode=geo_mean" in aliases("gmpo") and "0.4" in aliases("gmpo")


# ---- Clip-Cov and KL-Cov --------------------------------------------------------------------

def _cov_world(candidate_log_r):
    # one very unlikely token (log π_old = -4) in sequence 2 (A < 0): covariance ≈ 1.9, the
    # rest below 0.8 in magnitude, at log π_old and at log π alike
    old = [row[:] for row in OLD]
    old[2][2] = -4.0
    old[0][1] = -1.0                                  # (p_old 0.9 would be a second candidate)
    log_r = [row[:] for row in LOG_R]
    log_r[0][1] = 0.05
    log_r[1][1] = 0.3                                 # no dual-clip token: verl has none here
    log_r[2][2] = candidate_log_r
    return world(log_r, old)


def test_clip_cov_with_one_unclipped_candidate_is_clip_cov():
    batch, lp = _cov_world(0.05)
    value, grad, step = ours("clip_cov", batch, lp)
    log_prob, old, _, mask = views(batch, lp)
    adv = verl_grpo_advantage(batch.reward, batch.group, mask)
    pg, candidates, ppo_clips = verl_clip_cov(log_prob, old, adv, mask)
    ours_detached, _, _, _ = views(batch, step.token_extras[CLIP_COV_SCALE] == 0)
    assert int(candidates.sum()) == 1 and torch.equal(candidates, ours_detached.bool())
    r = torch.exp(log_prob - old).detach()
    assert (ppo_clips & (adv > 0)).any() and (ppo_clips & (adv < 0)).any()
    assert (mask & ~ppo_clips & (adv > 0) & (r < 0.8)).any()           # outside, not clipped
    assert_equals_verl(value, grad, lp, lambda eps: verl_agg(pg, mask, "token-mean"))
    assert float(grad[step.token_extras[CLIP_COV_SCALE] == 0].abs().max()) == 0.0
    assert "loss_mode=clip_cov" in aliases("clip_cov")


def test_clip_cov_where_ppo_clips_the_candidate_verl_leaves_it_and_the_value_differs():
    # the candidate's r = e^-0.5 < 0.8 at A < 0: PPO clips it, so verl has no candidate and keeps
    # its constant term -A·0.8/N; the registry detaches it. Same gradient (zero there anyway).
    batch, lp = _cov_world(-0.5)
    value, grad, step = ours("clip_cov", batch, lp)
    log_prob, old, _, mask = views(batch, lp)
    adv = verl_grpo_advantage(batch.reward, batch.group, mask)
    pg, candidates, _ = verl_clip_cov(log_prob, old, adv, mask)
    assert not candidates.any()
    theirs = verl_agg(pg, mask, "token-mean")
    hit = step.token_extras[CLIP_COV_SCALE] == 0
    a, n = float(step.advantage[hit]), int(batch.loss_mask.sum())
    assert a < 0 and abs(float((theirs - value).detach()) - (-a * 0.8 / n)) < EXACT
    torch.testing.assert_close(torch.autograd.grad(theirs, lp)[0], grad, rtol=0, atol=EXACT)
    assert "tokens PPO already clips left out" in aliases("clip_cov")


def test_kl_cov_is_kl_cov_with_the_penalty_on_either_side():
    for candidate_log_r in (0.3, -0.3):                  # |log r|'s gradient +1, then -1
        batch, lp = _cov_world(candidate_log_r)
        value, grad, step = ours("kl_cov", batch, lp)
        log_prob, old, _, mask = views(batch, lp)
        adv = verl_grpo_advantage(batch.reward, batch.group, mask)
        pg, chosen = verl_kl_cov(log_prob, old, adv, mask)
        ours_chosen, _, _, _ = views(batch, step.token_extras[KL_COV_SELECTED])
        assert int(chosen.sum()) == 1 and torch.equal(chosen, ours_chosen.bool())
        assert abs(float((log_prob - old).detach()[chosen]) - candidate_log_r) < EXACT
        r = torch.exp(log_prob - old).detach()
        assert (mask & (adv > 0) & (r > 1.2)).any() and (mask & (adv < 0) & (r < 0.8)).any()
        assert_equals_verl(value, grad, lp, lambda eps, pg=pg, mask=mask: verl_agg(
            pg, mask, "token-mean"))
    assert "loss_mode=kl_cov" in aliases("kl_cov") and "ppo_kl_coef 0.1" in aliases("kl_cov")

