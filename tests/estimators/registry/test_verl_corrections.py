"""The registry entries whose aliases name verl's ``algorithm.rollout_correction`` against a
transcription of verl's documented formulas (written here from their definitions, on padded
``[B, T]`` tensors), given the same advantages.

Read in ``verl-project/verl``: ``verl/trainer/ppo/rollout_corr_helper.py`` at ``be3e5054f4ad``
(``compute_rollout_correction_weights``, ``compute_rollout_rejection_mask``) and
``verl/trainer/ppo/core_algos.py`` at ``5b98636684f9`` (``compute_policy_loss_vanilla``,
``agg_loss``, ``kl_penalty``). Transcribed:

* IS weights ``w = exp(clamp(log π_old − log μ, ±20))`` (``rollout_is=token``) or
  ``exp(clamp(Σ_t …, ±20))`` per row (``sequence``), zeroed on padding; a float
  ``rollout_is_threshold`` truncates (``min(w, C)``), a ``'lower_upper'`` string zeroes the
  weights outside ``[lower, upper]`` (IcePop; ``response_mask`` unchanged);
  ``rollout_is_batch_normalize`` divides them by their mean over the valid tokens (token) or
  over the rows' per-row means (sequence), after the truncation;
* ``rollout_rs`` ``token_k1`` / ``seq_sum_k1`` keep a token when ``log lower ≤ −log w ≤ log
  upper`` (summed over the row for ``seq_sum``); rejected tokens leave ``response_mask``;
* the vanilla policy loss: PPO's clip of ``r = exp(clamp(log π − log π_old, ±20))``, the dual
  clip ``min(−A·clip_ratio_c, ·)`` on ``A < 0`` (3; it does not bind on these inputs, asserted),
  times the IS weights, then ``agg_loss`` over ``response_mask`` with the engine's global
  counts (``batch_num_tokens`` the mini-batch's mask sum, ``global_batch_size`` its sequence
  count); ``use_kl_loss`` adds ``kl_loss_coef · agg_loss(low_var_kl)`` over the same mask,
  ``low_var_kl = clamp(exp(d) − d − 1, ±10)``, ``d = clamp(ref − log π, ±20)``, unweighted.

``seq-mean-token-mean`` divides each row by ``count + 1e-8`` there: transcribed with
``count_eps`` 0 (exact comparison) and its effect bounded separately (< 1e-8 relative).
The SNIS factors alone are already checked against verl's normalization for
``SelfNormalizedIS(cap=2.0)`` in ``tests/estimators/corrections/test_self_normalized.py``;
here the registry entries ``token_snis`` / ``sequence_snis`` are (loss for the token entry,
factors for the sequence entry, whose sequence-ratio surrogate verl does not have).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.estimators.registry.padded import padded, peer_world
from tokenmdp import estimators
from tokenmdp.estimators import SelfNormalizedIS, loss, prepare

#: float64 sums of a dozen terms, two routes.
EXACT = 1e-12

LOG_R = [[0.3, -0.1, 0.05], [-0.4, 0.25], [0.1, -0.3, 0.2, 0.4], [-0.05]]   # r beyond 1 ± 0.2
# log π_old/μ: w = [1.65, 0.45, 6.69], [1.11, 1.35], [0.37, 1.22, 2.01, 7.39], [1.05];
# row sums 1.6, 0.4, 1.9, 0.05 (seq_sum_k1 in [0.5, 2] keeps rows 1 and 3 only)
LOG_W = [[0.5, -0.8, 1.9], [0.1, 0.3], [-1.0, 0.2, 0.7, 2.0], [0.05]]
B = len(LOG_R)


def _world():
    g = torch.Generator().manual_seed(5)
    old = [(-0.2 - torch.rand(len(r), generator=g, dtype=torch.float64)).tolist() for r in LOG_R]
    ref = [(-0.3 - torch.rand(len(r), generator=g, dtype=torch.float64)).tolist() for r in LOG_R]
    return peer_world(LOG_R, LOG_W, old, ref, [1.0, 0.0, 0.3, 0.9], [0, 0, 1, 1])


def _padded(batch, values_RC):
    return padded(batch, values_RC, [len(r) for r in LOG_R])


# ------------------------------------------------------------------ verl, transcribed
def verl_is_weights(log_ratio, mask, level, threshold, batch_normalize=False):
    m = mask.to(log_ratio.dtype)
    if level == "token":
        raw = torch.exp(log_ratio.clamp(-20.0, 20.0))
    else:
        raw = torch.exp((log_ratio * m).sum(-1, keepdim=True).clamp(-20.0, 20.0)).expand_as(m)
    raw = raw * m
    if isinstance(threshold, str):                                     # 'lower_upper': IcePop
        lower, upper = (float(x) for x in threshold.split("_", 1))
        w = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    else:
        w = raw.clamp(max=float(threshold))
    w = w.detach()
    if batch_normalize:
        if level == "token":
            mean = (w * m).sum() / m.sum()
        else:
            rows = m.sum(-1) > 0
            mean = ((w * m).sum(-1) / m.sum(-1).clamp(min=1))[rows].mean()
        w = w / mean
    return w


def verl_rejection_mask(log_ratio, mask, option, threshold):
    lower, upper = (float(x) for x in threshold.split("_", 1))
    k1 = -log_ratio.clamp(-20.0, 20.0)
    if option == "seq_sum_k1":
        k1 = (k1 * mask).sum(-1, keepdim=True).expand_as(k1)
    keep = (k1 >= math.log(lower)) & (k1 <= math.log(upper))
    return mask & keep


def verl_agg(loss_mat, mask, mode, *, global_batch_size, count_eps=0.0):
    m = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return (loss_mat * m).sum() / m.sum()
    counts = m.sum(-1)
    per_row = (loss_mat * m).sum(-1)
    if mode == "seq-mean-token-mean":
        per_row = per_row / (counts + count_eps).clamp(min=1e-300)
    elif mode != "seq-mean-token-sum":
        raise ValueError(mode)
    return (per_row * (counts > 0)).sum() / global_batch_size


def verl_actor_loss(log_prob, old, adv, mask, *, mode, eps_low, eps_high, is_weights=None,
                    ref=None, kl_coef=0.0, clip_ratio_c=3.0, global_batch_size=B,
                    count_eps=0.0):
    ratio = torch.exp((log_prob - old).clamp(-20.0, 20.0))
    clipped = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_low, 1 + eps_high))
    pg = torch.where(adv < 0, torch.minimum(-adv * clip_ratio_c, clipped), clipped)
    if is_weights is not None:
        pg = pg * is_weights
    out = verl_agg(pg, mask, mode, global_batch_size=global_batch_size, count_eps=count_eps)
    if kl_coef:
        d = (ref - log_prob).clamp(-20.0, 20.0)
        kld = (torch.exp(d) - d - 1).clamp(-10.0, 10.0)
        out = out + kl_coef * verl_agg(kld, mask, mode, global_batch_size=global_batch_size,
                                       count_eps=count_eps)
    return out


# ------------------------------------------------------------------ helpers
def _ours(est, batch, lp):
    est = estimators.get(est) if isinstance(est, str) else est
    step = prepare(batch, est)
    value, _ = loss(lp, step, est)
    return value, torch.autograd.grad(value, lp)[0], step


def _fields(batch, lp, step):
    log_prob, mask = _padded(batch, lp)
    old, _ = _padded(batch, batch.old_logprob)
    ref, _ = _padded(batch, batch.ref_logprob)
    adv, _ = _padded(batch, step.advantage)
    log_ratio = old - _padded(batch, batch.behavior_logprob)[0]
    return log_prob, old, ref, adv, mask, log_ratio


def _assert_dual_clip_idle(log_prob, old, adv, mask):
    assert not bool(((adv < 0) & (torch.exp(log_prob - old) > 3.0) & mask).any())


def _assert_same(ours, grad, theirs, lp):
    their_grad = torch.autograd.grad(theirs, lp)[0]
    assert abs(float((ours - theirs).detach())) < EXACT
    assert float((grad - their_grad).abs().max()) < EXACT


ENTRIES = {  # name: (loss_agg_mode, eps_high, use_kl_loss)
    "ppo": ("token-mean", 0.2, False),
    "grpo": ("seq-mean-token-mean", 0.2, True),
    "dapo": ("token-mean", 0.28, False),
}


# ------------------------------------------------------------------ rollout_is=token
@pytest.mark.parametrize("base", ["ppo", "grpo", "dapo"])
def test_token_truncated_is_at_2_is_the_tis_entry(base):
    batch, lp = _world()
    value, grad, step = _ours(f"{base}_tis", batch, lp)
    log_prob, old, ref, adv, mask, log_ratio = _fields(batch, lp, step)
    mode, eps_high, kl = ENTRIES[base]
    w = verl_is_weights(log_ratio, mask, "token", 2.0)
    assert int(((torch.exp(log_ratio) > 2.0) & mask).sum()) == 3            # truncation binds
    assert int(((torch.exp(log_ratio) < 2.0) & mask).sum()) == 7            # ... and not
    r = torch.exp(log_prob - old)
    assert bool((r.clamp(0.8, 1 + eps_high) != r)[mask].any())              # PPO clip binds
    _assert_dual_clip_idle(log_prob, old, adv, mask)
    theirs = verl_actor_loss(log_prob, old, adv, mask, mode=mode, eps_low=0.2, eps_high=eps_high,
                             is_weights=w, ref=ref, kl_coef=0.04 if kl else 0.0)
    _assert_same(value, grad, theirs, lp)
    if mode == "seq-mean-token-mean":                                        # verl's + 1e-8
        with_eps = verl_actor_loss(log_prob, old, adv, mask, mode=mode, eps_low=0.2,
                                   eps_high=eps_high, is_weights=w, ref=ref, kl_coef=0.04,
                                   count_eps=1e-8)
        gap = abs(float((with_eps - theirs).detach()))
        assert 0 < gap < 1e-8 * abs(float(theirs.detach()))


@pytest.mark.parametrize("base", ["ppo", "grpo"])
def test_icepop_band_with_response_mask_kept_is_the_mis_entry(base):
    batch, lp = _world()
    value, grad, step = _ours(f"{base}_mis", batch, lp)
    log_prob, old, ref, adv, mask, log_ratio = _fields(batch, lp, step)
    mode, eps_high, kl = ENTRIES[base]
    w = verl_is_weights(log_ratio, mask, "token", "0.5_5.0")
    raw = torch.exp(log_ratio)
    assert int(((raw < 0.5) & mask).sum()) == 2 and int(((raw > 5.0) & mask).sum()) == 2
    assert int(((w > 0) & mask).sum()) == 6                                  # 6 kept, 4 zeroed
    _assert_dual_clip_idle(log_prob, old, adv, mask)
    theirs = verl_actor_loss(log_prob, old, adv, mask, mode=mode, eps_low=0.2, eps_high=eps_high,
                             is_weights=w, ref=ref, kl_coef=0.04 if kl else 0.0)
    _assert_same(value, grad, theirs, lp)
    # the zeroed tokens stay in the normalizer: dropping them from the mask is another loss
    dropped = verl_actor_loss(log_prob, old, adv, mask & (w > 0), mode=mode, eps_low=0.2,
                              eps_high=eps_high, is_weights=w, ref=ref,
                              kl_coef=0.04 if kl else 0.0)
    assert abs(float((dropped - theirs).detach())) > 1e-3


# ------------------------------------------------------------------ rollout_rs
@pytest.mark.parametrize(("name", "option", "kept"), [("grpo_rs_token", "token_k1", 5),
                                                      ("grpo_rs_seq", "seq_sum_k1", 3)])
def test_rejection_k1_in_0_5_2_is_the_rs_entry(name, option, kept):
    batch, lp = _world()
    value, grad, step = _ours(name, batch, lp)
    log_prob, old, ref, adv, mask, log_ratio = _fields(batch, lp, step)
    keep = verl_rejection_mask(log_ratio, mask, option, "0.5_2.0")
    assert int(keep.sum()) == kept and int(mask.sum()) == 10                 # rejects and keeps
    _assert_dual_clip_idle(log_prob, old, adv, mask)
    # no IS weights; the rejection mask replaces response_mask in the loss, the normalizers
    # and the KL term; global_batch_size stays the mini-batch's sequence count
    theirs = verl_actor_loss(log_prob, old, adv, keep, mode="seq-mean-token-mean", eps_low=0.2,
                             eps_high=0.2, ref=ref, kl_coef=0.04)
    _assert_same(value, grad, theirs, lp)
    d = ref - log_prob                      # the KL term over the kept tokens, not all of them
    kld = torch.exp(d) - d - 1
    kl_full, kl_kept = (verl_agg(kld, m, "seq-mean-token-mean", global_batch_size=B)
                        for m in (mask, keep))
    assert abs(float((kl_full - kl_kept).detach())) > 1e-4
    if option == "seq_sum_k1":   # two rows rejected whole: agg_loss's own default count differs
        assert int((keep.sum(-1) == 0).sum()) == 2
        local = verl_actor_loss(log_prob, old, adv, keep, mode="seq-mean-token-mean",
                                eps_low=0.2, eps_high=0.2, ref=ref, kl_coef=0.04,
                                global_batch_size=2)
        assert float(local.detach()) == pytest.approx(2.0 * float(theirs.detach()), abs=EXACT)
    else:
        assert int(((keep.sum(-1) > 0) & (keep.sum(-1) < mask.sum(-1))).sum()) == 2  # partial


# ------------------------------------------------------------------ batch normalization
@pytest.mark.parametrize(("threshold", "cap"), [(1e9, None), (2.0, 2.0)],
                         ids=["no-truncation", "threshold-2"])
def test_token_batch_normalized_is_weights_are_token_snis(threshold, cap):
    # verl's vanilla loss with a clip that never binds (clip_ratio 1e6) is -A·r per token;
    # with seq-mean-token-sum and the token SNIS weights it is token_snis's loss
    batch, lp = _world()
    est = estimators.get("token_snis")
    if cap is not None:
        est = est.replace(correction=SelfNormalizedIS(cap=cap))
    value, grad, step = _ours(est, batch, lp)
    log_prob, old, ref, adv, mask, log_ratio = _fields(batch, lp, step)
    w = verl_is_weights(log_ratio, mask, "token", threshold, batch_normalize=True)
    assert float((w * mask).sum() / mask.sum()) == pytest.approx(1.0, abs=EXACT)
    if cap is not None:
        assert not torch.allclose(w, verl_is_weights(log_ratio, mask, "token", 1e9, True))
    _assert_dual_clip_idle(log_prob, old, adv, mask)
    theirs = verl_actor_loss(log_prob, old, adv, mask, mode="seq-mean-token-sum", eps_low=1e6,
                             eps_high=1e6, is_weights=w)
    _assert_same(value, grad, theirs, lp)


@pytest.mark.parametrize(("name", "level"), [("token_snis", "token"),
                                             ("sequence_snis", "sequence")])
@pytest.mark.parametrize(("threshold", "cap"), [(1e9, None), (2.0, 2.0)],
                         ids=["no-truncation", "threshold-2"])
def test_batch_normalized_is_weights_are_the_snis_factors(name, level, threshold, cap):
    batch, lp = _world()
    correction = estimators.get(name).correction
    if cap is not None:
        correction = SelfNormalizedIS(level=level, cap=cap)
    log_prob, old, ref, adv, mask, log_ratio = _fields(batch, lp, prepare(batch, name))
    w = verl_is_weights(log_ratio, mask, level, threshold, batch_normalize=True)
    factor, _ = _padded(batch, correction(batch).factor_RC)
    assert float((factor - w).abs().max()) < EXACT
    raw = verl_is_weights(log_ratio, mask, level, 1e9)
    assert bool(((raw > 2.0) & mask).any()) and bool(((raw < 2.0) & mask).any())  # C binds


def test_the_aliases_name_the_verl_options():
    def aliases(name):
        return estimators.describe(name).split("Other names:")[1]
    for base in ("ppo", "grpo", "dapo"):
        assert "rollout_is=token, rollout_is_threshold=2" in aliases(f"{base}_tis")
    for base in ("ppo", "grpo"):
        text = aliases(f"{base}_mis")
        assert "rollout_is_threshold='0.5_5.0'" in text and "response_mask kept" in text
    assert "rollout_rs=token_k1, rollout_rs_threshold='0.5_2.0'" in aliases("grpo_rs_token")
    assert "rollout_rs=seq_sum_k1, rollout_rs_threshold='0.5_2.0'" in aliases("grpo_rs_seq")
    for name, level in (("token_snis", "token"), ("sequence_snis", "sequence")):
        text = aliases(name)
        assert f"rollout_is={level} with rollout_is_batch_normalize=True" in text
        assert "SelfNormalizedIS(cap=2.0)" in text
