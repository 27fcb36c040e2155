"""Issue 32: the registry entries whose aliases name a TRL ``GRPOTrainer`` / ``RLOOTrainer``
option equal TRL's loss, transcribed here (on padded ``[B, T]`` tensors) from its definitions.

Read for facts, not copied: TRL's ``GRPOTrainer._compute_loss`` / ``_generate_and_score_
completions`` / ``get_off_policy_mask`` as of the ``casinca/trl`` fork of huggingface/trl at
commit 2674c4f8 (``trl/trainer/grpo_trainer.py``; the stored huggingface/trl copies predate
SAPO / LUSPO / OPSM), the ``GRPOConfig`` docstring (2020-2026 header: ``sapo_temperature_pos``
1.0, ``sapo_temperature_neg`` 1.05, ``scale_rewards`` 'group' default, ``beta`` 0.0), and
huggingface/trl ``trl/trainer/rloo_trainer.py`` at 00313f21 (RLOOConfig: ``beta`` 0.05,
``epsilon`` 0.2, ``normalize_advantages`` False).

* ``coef_1 = exp(log π − log π_old)`` per token, or ``exp(mean_t …)`` per sequence at
  ``importance_sampling_level='sequence'``; ``sapo``: ``−(4/τ) σ(τ (coef_1 − 1)) Â`` with
  ``τ = τ_pos`` where ``Â > 0``; otherwise ``−min(coef_1 Â, clip(coef_1, 1 − ε, 1 + ε_high) Â)``.
* Then × the OPSM mask (keep iff ``Â ≥ 0`` or ``mean_t (log μ − sg log π) ≤ δ``, μ the
  sampling log-probs, π_old without them), × the vLLM IS ratio (``token_truncate``:
  ``min(exp(log π_old − log μ), clip_max)`` per token), ``+ β k3``.
* Reductions: ``grpo`` / ``sapo`` mean over each completion then over completions, ``dapo`` sum
  over the step's tokens, ``dr_grpo`` sum / ``(B · max_completion_length)``, ``luspo``
  ``mean_i(|y_i| · loss_i)`` on the ``[B, 1]`` sequence loss.
* Advantages ``(R − group mean) / (std + 1e-4)``; ``scale_rewards='batch'`` uses ``torch.std``
  (ddof 1) of the whole batch's rewards. Where the registry's std epsilon differs (1e-6, named in
  the aliases and covered by ``test_trl_loss_types.py``) the loss is compared given the
  registry's advantages.

RLOOTrainer's loss is a *sequence* ratio ``exp(Σ_t log π − Σ_t log π_old)`` clipped and averaged
over sequences, with ``β Σ_t (log π_old − log π_ref)`` subtracted from the reward (β 0.05): the
registry's ``rloo`` (weighted NLL) matches its advantage and its on-policy gradient only.
"""

from __future__ import annotations

import pytest
import torch

from tests.estimators.estimator_helpers import make_batch, response_values
from tests.estimators.registry.padded import padded
from tokenmdp import estimators
from tokenmdp.estimators import loss, prepare

EXACT = 1e-12
L_MAX = 4

LOG_R = [[0.3, -0.1, 0.05], [-0.4, 0.25], [0.1, -0.3, 0.2, 0.4], [-0.05],
         [0.35, -0.25, 0.1], [-0.3, 0.2]]
LOG_W = [[0.9, -0.2, 1.1], [-0.8, -0.6], [-0.5, -0.6, -0.5, -0.6], [-1.2],
         [-0.7, -0.6, -0.55], [0.8, 0.9]]                      # log π_old − log μ
#: OPSM's mean_t log(μ/π_θ) per sequence: 0.775, 0.45 and 0.55 where Â < 0 (δ = 0.5 pinned)
REWARDS = [1.0, 0.0, 0.3, 0.9, 0.2, 0.7]                       # Â: + − − + − +
#: mean_t log r ∈ ±4e-3 around LUSPO's band [1 − 2e-3, 1 + 2.5e-3]
LOG_R_SEQ = [[3e-3, 4e-3, 2e-3], [-1e-3, 0.0], [-4e-3, -3e-3, -2e-3, -3e-3], [1e-3],
             [4e-3, 3e-3, 2e-3], [-3e-3, -4e-3]]


def _world(log_r=LOG_R, log_w=LOG_W, rewards=REWARDS, *, same_mu=False):
    g = torch.Generator().manual_seed(5)
    old = [(-0.3 - torch.rand(len(r), generator=g, dtype=torch.float64)).tolist() for r in log_r]
    ref = [(-0.4 - torch.rand(len(r), generator=g, dtype=torch.float64)).tolist() for r in log_r]
    mu = old if same_mu else [[o - w for o, w in zip(os_, ws, strict=True)]
                              for os_, ws in zip(old, log_w, strict=True)]
    batch = make_batch([[9]] * len(log_r), [[1 + i] * len(r) for i, r in enumerate(log_r)],
                       rewards=rewards, groups=[i // 2 for i in range(len(log_r))], old=old,
                       behavior=mu, ref=ref)
    lp = (batch.old_logprob + response_values(batch, log_r)).requires_grad_(True)
    return batch, lp


def _ours(name, batch, lp, est=None):
    est = est or estimators.get(name)
    step = prepare(batch, est, max_len=L_MAX)
    value, _ = loss(lp, step, est)
    return value, torch.autograd.grad(value, lp)[0], step


def _pad(batch, values_RC, log_r):
    return padded(batch, values_RC, [len(r) for r in log_r], L_MAX)


def trl_is_ratio(old, sampling, mask, *, mode, clip_max):
    diff = (old - sampling) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, max=clip_max)
    return ratio.masked_fill(ratio > clip_max, 0.0)


def trl_grpo_loss(log_prob, old, adv_B, mask, *, loss_type, level="token", eps=0.2,
                  eps_high=None, tau=(1.0, 1.05), beta=0.0, ref=None, is_ratio=None,
                  sampling=None, threshold=None):
    m = mask.to(log_prob.dtype)
    A = adv_B[:, None]
    eps_high = eps if eps_high is None else eps_high
    if threshold is not None:                                   # OPSM
        kl = sampling - log_prob.detach()
        seq_kl = (kl * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1.0)
        opsm = ((A >= 0) | (seq_kl <= threshold)).to(m.dtype)
    log_ratio = log_prob - old
    if level == "sequence":
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0))[:, None]
    coef_1 = torch.exp(log_ratio)
    if loss_type == "sapo":
        t = torch.where(A > 0, A.new_tensor(tau[0]), A.new_tensor(tau[1]))   # float64
        per_token = -(torch.sigmoid(t * (coef_1 - 1)) * 4 / t) * A
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps_high)
        per_token = -torch.minimum(coef_1 * A, coef_2 * A)
    if threshold is not None:
        per_token = per_token * opsm
    if is_ratio is not None:
        per_token = per_token * is_ratio
    if beta:
        per_token = per_token + beta * (torch.exp(ref - log_prob) - (ref - log_prob) - 1)
    if loss_type in ("grpo", "sapo"):
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "dapo":                    # num_items_in_batch, one process, one step
        return (per_token * m).sum() / m.sum()
    if loss_type == "dr_grpo":
        return (per_token * m).sum() / (per_token.size(0) * L_MAX)
    if loss_type == "luspo":
        return (per_token * m.sum(1, keepdim=True)).mean()
    raise ValueError(loss_type)


def trl_advantage(rewards, group_size, *, scale):
    mean = rewards.view(-1, group_size).mean(1).repeat_interleave(group_size)
    if scale == "batch":
        std = rewards.std().expand_as(rewards)
    else:
        std = rewards.view(-1, group_size).std(1).repeat_interleave(group_size)
    adv = rewards - mean
    return adv if scale == "none" else adv / (std + 1e-4)


def _theirs(batch, lp, step, log_r=LOG_R, *, with_sampling=True, advantage_B=None, **kw):
    log_prob, mask = _pad(batch, lp, log_r)
    old, _ = _pad(batch, batch.old_logprob, log_r)
    ref, _ = _pad(batch, batch.ref_logprob, log_r)
    mu, _ = _pad(batch, batch.behavior_logprob, log_r)
    adv_B = _pad(batch, step.advantage, log_r)[0][:, 0] if advantage_B is None else advantage_B
    if kw.pop("is_mode", None):
        kw["is_ratio"] = trl_is_ratio(old, mu, mask.to(old.dtype), mode="token_truncate",
                                      clip_max=2.0)
    if "threshold" in kw:
        kw["sampling"] = mu if with_sampling else old
    value = trl_grpo_loss(log_prob, old, adv_B, mask, ref=ref, **kw)
    return value, torch.autograd.grad(value, lp)[0], adv_B


def _assert_equal(ours, theirs):
    assert abs(float((ours[0] - theirs[0]).detach())) < EXACT
    assert float((ours[1] - theirs[1]).abs().max()) < EXACT


def _clip_counts(adv_B, eps_high):
    """Tokens clipped above with Â > 0, clipped below with Â < 0, and unclipped (PPO's band)."""
    r = torch.tensor([x for row in LOG_R for x in row], dtype=torch.float64).exp()
    a = torch.tensor([float(adv_B[s]) for s, row in enumerate(LOG_R) for _ in row])
    return (int(((a > 0) & (r > 1 + eps_high)).sum()), int(((a < 0) & (r < 0.8)).sum()),
            int(((r > 0.8) & (r < 1 + eps_high)).sum()))


def _signs(adv_B):
    return int((adv_B > 0).sum()), int((adv_B < 0).sum())


def test_sapo_is_trl_loss_type_sapo():
    batch, lp = _world()
    ours = _ours("sapo", batch, lp)
    theirs = _theirs(batch, lp, ours[2], loss_type="sapo", tau=(1.0, 1.05))
    _assert_equal(ours, theirs)
    assert _signs(theirs[2]) == (3, 3)                       # both temperatures used
    # mutation: swapping the temperatures (τ_neg on Â > 0) is detected
    swapped = _theirs(batch, lp, ours[2], loss_type="sapo", tau=(1.05, 1.0))
    assert float((swapped[1] - ours[1]).abs().max()) > 1e-4


def test_luspo_is_trl_loss_type_luspo_at_sequence_level():
    batch, lp = _world(LOG_R_SEQ)
    ours = _ours("luspo", batch, lp)
    kw = dict(loss_type="luspo", level="sequence", eps=2e-3, eps_high=2.5e-3)
    theirs = _theirs(batch, lp, ours[2], LOG_R_SEQ, **kw)
    _assert_equal(ours, theirs)
    s = torch.tensor([sum(r) / len(r) for r in LOG_R_SEQ], dtype=torch.float64).exp()
    adv = theirs[2]
    clipped = ((adv > 0) & (s > 1 + 2.5e-3)) | ((adv < 0) & (s < 1 - 2e-3))
    assert 0 < int(clipped.sum()) < len(LOG_R_SEQ)           # clipped and unclipped sequences
    assert _signs(adv) == (3, 3)
    # mutation: TRL's GSPO-style token mean ('grpo' reduction) instead of the length weight
    grpo = _theirs(batch, lp, ours[2], LOG_R_SEQ, **{**kw, "loss_type": "grpo"})
    assert abs(float((grpo[0] - ours[0]).detach())) > 1e-4


@pytest.mark.parametrize(("name", "loss_type", "eps_high", "beta"),
                         [("grpo_tis", "grpo", 0.2, 0.04), ("dapo_tis", "dapo", 0.28, 0.0),
                          ("dr_grpo_tis", "dr_grpo", 0.2, 0.0)])
def test_tis_entries_are_trl_token_truncate_at_clip_max_2(name, loss_type, eps_high, beta):
    batch, lp = _world()
    ours = _ours(name, batch, lp)
    kw = dict(loss_type=loss_type, eps=0.2, eps_high=eps_high, beta=beta, is_mode=True)
    theirs = _theirs(batch, lp, ours[2], **kw)
    _assert_equal(ours, theirs)
    w = torch.tensor([x for row in LOG_W for x in row], dtype=torch.float64).exp()
    assert 0 < int((w > 2).sum()) < len(w)                   # truncated and kept weights
    assert all(_clip_counts(theirs[2], eps_high))
    # mutation: clip_max 3 (TRL's default cap) instead of 2 changes the gradient
    log_prob, mask = _pad(batch, lp, LOG_R)
    old, _ = _pad(batch, batch.old_logprob, LOG_R)
    mu, _ = _pad(batch, batch.behavior_logprob, LOG_R)
    ref, _ = _pad(batch, batch.ref_logprob, LOG_R)
    kw.pop("is_mode")
    at3 = trl_grpo_loss(log_prob, old, theirs[2], mask, ref=ref, **kw,
                        is_ratio=trl_is_ratio(old, mu, mask.to(old.dtype),
                                              mode="token_truncate", clip_max=3.0))
    assert float((torch.autograd.grad(at3, lp)[0] - ours[1]).abs().max()) > 1e-4


def test_grpo_opsm_is_trl_off_policy_mask_threshold_with_the_sampling_logprobs():
    batch, lp = _world()
    ours = _ours("grpo_opsm", batch, lp)
    kw = dict(loss_type="grpo", eps=0.2, beta=0.04, threshold=0.5)
    theirs = _theirs(batch, lp, ours[2], **kw)
    _assert_equal(ours, theirs)
    seq_kl = torch.tensor([-(sum(r) + sum(w)) / len(r) for r, w in zip(LOG_R, LOG_W,
                                                                        strict=True)])
    adv = theirs[2]
    assert int(((adv < 0) & (seq_kl > 0.5)).sum()) == 2       # dropped
    assert int(((adv < 0) & (seq_kl <= 0.5)).sum()) == 1      # negative, near: kept
    assert int(((adv > 0) & (seq_kl > 0.5)).sum()) == 1       # positive, far: kept
    # mutation: the divergence against π_old instead of μ keeps every sequence here
    wrong = _theirs(batch, lp, ours[2], with_sampling=False, **kw)
    assert abs(float((wrong[0] - ours[0]).detach())) > 1e-4


def test_grpo_opsm_without_sampling_logprobs_measures_against_pi_old():
    log_r = [[0.3, -0.1, 0.05], [-0.9, -0.3], [0.1, -0.3, 0.2, 0.4], [-0.6],
             [0.35, -0.25, 0.1], [-0.3, 0.2]]
    batch, lp = _world(log_r, same_mu=True)                   # μ := π_old in the batch
    ours = _ours("grpo_opsm", batch, lp)
    theirs = _theirs(batch, lp, ours[2], log_r, with_sampling=False, loss_type="grpo",
                     eps=0.2, beta=0.04, threshold=0.5)
    _assert_equal(ours, theirs)
    seq_kl = torch.tensor([-sum(r) / len(r) for r in log_r])
    adv = theirs[2]
    assert int(((adv < 0) & (seq_kl > 0.5)).sum()) == 1      # dropped
    assert int(((adv > 0) & (seq_kl > 0.5)).sum()) == 1      # positive, far: kept


def test_trl_opsm_under_its_default_vllm_correction_is_grpo_opsm_with_trls_sequence_mask():
    """The sampling log-probs come with ``use_vllm``, whose default correction (``sequence_mask``
    at 3) multiplies every term by the sequence ratio: TRL's default is then ``grpo_opsm`` with
    ``grpo_trl_mis``'s correction, not ``grpo_opsm`` (the alias says to switch it off)."""
    batch, lp = _world()
    ours = _ours("grpo_opsm", batch, lp)
    log_prob, mask = _pad(batch, lp, LOG_R)
    old, _ = _pad(batch, batch.old_logprob, LOG_R)
    mu, _ = _pad(batch, batch.behavior_logprob, LOG_R)
    ref, _ = _pad(batch, batch.ref_logprob, LOG_R)
    adv_B = _pad(batch, ours[2].advantage, LOG_R)[0][:, 0]
    ratio = trl_is_ratio(old, mu, mask.to(old.dtype), mode="sequence_mask", clip_max=3.0)
    value = trl_grpo_loss(log_prob, old, adv_B, mask, loss_type="grpo", beta=0.04, ref=ref,
                          is_ratio=ratio, sampling=mu, threshold=0.5)
    theirs = (value, torch.autograd.grad(value, lp)[0])
    assert float((theirs[1] - ours[1]).abs().max()) > 1e-2            # not grpo_opsm itself
    est = estimators.get("grpo_opsm").replace(correction=estimators.get("grpo_trl_mis")
                                              .correction)
    _assert_equal(_ours(None, batch, lp, est), theirs)
    assert "vllm_importance_sampling_correction=False" in estimators.describe("grpo_opsm")


def test_grpo_batch_std_is_trl_scale_rewards_batch_with_loss_type_dapo():
    rewards = [1.0, 0.0, 0.3, 0.9, 0.2, 0.7]
    batch, lp = _world()
    est = estimators.get("grpo_batch_std")
    step = prepare(batch, est)
    value, _ = loss(lp, step, est)
    ours = (value, torch.autograd.grad(value, lp)[0])
    adv_B = trl_advantage(torch.tensor(rewards, dtype=torch.float64), 2, scale="batch")
    theirs = _theirs(batch, lp, step, advantage_B=adv_B, loss_type="dapo", eps=0.2)
    _assert_equal(ours, theirs)                  # TRL's own advantage, not ours
    assert _signs(adv_B) == (3, 3) and all(_clip_counts(adv_B, 0.2))
    # mutation: the group std (scale_rewards='group') instead of the batch's
    group = trl_advantage(torch.tensor(rewards, dtype=torch.float64), 2, scale="group")
    assert float((group - adv_B).abs().max()) > 0.1


def trl_rloo(logps_B, old_logps_B, rewards, kl_B, group_size, *, beta=0.05, eps=0.2):
    r = (rewards - beta * kl_B).view(-1, group_size)
    baseline = (r.sum(1, keepdim=True) - r) / (group_size - 1)
    adv = (r - baseline).reshape(-1)                         # normalize_advantages=False
    coef_1 = torch.exp(logps_B - old_logps_B)
    coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps)
    return -torch.minimum(coef_1 * adv, coef_2 * adv).mean(), adv


def _trl_rloo_on(batch, lp, log_r, *, beta):
    log_prob, mask = _pad(batch, lp, log_r)
    old, _ = _pad(batch, batch.old_logprob, log_r)
    ref, _ = _pad(batch, batch.ref_logprob, log_r)
    m = mask.to(old.dtype)
    value, adv = trl_rloo((log_prob * m).sum(1), (old * m).sum(1), batch.reward,
                          ((old - ref) * m).sum(-1), 2, beta=beta)
    return value, torch.autograd.grad(value, lp)[0], adv


def test_rloo_has_trl_rlootrainers_advantage_and_on_policy_gradient_at_beta_0():
    zero = [[0.0] * len(r) for r in LOG_R]
    batch, lp = _world(zero)                                  # on-policy: π_θ = π_old
    ours = _ours("rloo", batch, lp)
    value, grad, adv = _trl_rloo_on(batch, lp, zero, beta=0.0)
    assert float((_pad(batch, ours[2].advantage, zero)[0][:, 0] - adv).abs().max()) < EXACT
    assert float((grad - ours[1]).abs().max()) < EXACT
    assert _signs(adv) == (3, 3)
    # mutation: TRL's default β = 0.05 (sequence k1 in the reward) changes the gradient
    _, grad_b, _ = _trl_rloo_on(batch, lp, zero, beta=0.05)
    assert float((grad_b - ours[1]).abs().max()) > 1e-4


def test_trl_rlootrainer_off_policy_or_at_its_default_beta_is_another_estimator():
    """RLOOTrainer clips a sequence ratio and takes ``0.05 Σ_t k1`` off the reward by default:
    off-policy, or at that β, it differs from ``rloo`` (the alias says: beta=0.0, on-policy)."""
    batch, lp = _world()
    ours = _ours("rloo", batch, lp)
    for beta in (0.0, 0.05):
        _, grad, _ = _trl_rloo_on(batch, lp, LOG_R, beta=beta)
        assert float((grad - ours[1]).abs().max()) > 1e-2, beta
    assert "TRL RLOOTrainer with beta=0.0, on-policy" in estimators.describe("rloo")


def test_the_aliases_name_these_trl_options():
    def aliases(name):
        return estimators.describe(name).split("Other names:")[1]
    assert "sapo_temperature_neg 1.05" in aliases("sapo")
    assert "loss_type='luspo', importance_sampling_level='sequence'" in aliases("luspo")
    assert "epsilon 2e-3, epsilon_high 2.5e-3" in aliases("luspo")
    for name in ("grpo_tis", "dapo_tis", "dr_grpo_tis"):
        assert "token_truncate', clip_max=2" in aliases(name)
    assert "off_policy_mask_threshold" in aliases("grpo_opsm")
    assert "scale_rewards='batch'" in aliases("grpo_batch_std")
    assert "TRL RLOOTrainer" in aliases("rloo")
