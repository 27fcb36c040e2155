"""Issue 32: the registry entries whose aliases name an OpenRLHF ``advantage_estimator`` against a
transcription (padded ``[B, T]`` tensors) of OpenRLHF's documented computation.

Read for facts, not copied: OpenRLHF/OpenRLHF ``openrlhf/trainer/ppo_utils/experience_maker.py``
at 89308a0b (``compute_advantages_and_returns``, ``get_cumulative_returns``),
``openrlhf/models/utils.py`` at 473f61bd (``compute_approx_kl``, ``compute_reward``),
``openrlhf/models/loss.py``, ``openrlhf/trainer/ray/ppo_actor.py`` and
``openrlhf/cli/train_ppo_ray.py`` at f5b3f08a (``PolicyLoss``, the KL loss, the defaults:
``init_kl_coef`` 0.01, ``kl_estimator`` k1, ``eps_clip`` 0.2, ``dual_clip`` None, ``gamma`` 1,
``reward_clip_range`` (-10, 10)).

* Shaped reward: ``rloo`` ``R_i − mean_{j≠i} R_j``; ``reinforce_baseline`` ``R_i − mean_g R``;
  clamped to ``reward_clip_range``.
* Token rewards: ``−β k1_t`` (``k1 = log π_old − log π_ref`` clamped to ±10; zero under
  ``use_kl_loss``) plus the shaped reward on the last response token; the advantage is the
  reward-to-go (γ = 1).
* ``reinforce_baseline`` (not ``rloo``) whitens over every action token of the batch:
  ``(A − m) · rsqrt(clamp(var, min=1e-8))``, ``var`` the population (``/N``) variance.
* Loss: ``−min(r Â, clip(r, 0.8, 1.2) Â)`` averaged over the micro-batch's tokens, plus
  ``β · mean_t k(log π, log π_ref)`` under ``use_kl_loss``.

OpenRLHF casts the KL and the advantage statistics to float32; the transcription keeps float64
(a precision choice, not part of the formula). Neither ±10 clamp binds in these worlds.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.estimators.estimator_helpers import make_batch, response_values
from tests.estimators.registry.padded import padded
from tokenmdp import estimators
from tokenmdp.estimators import PPOClip, loss, prepare

EXACT = 1e-12
G = 3
#: Â signs per sequence: + − ∓ ... ; sequence 1 (Â < 0) has a token with r = 4 > 3 (dual clip)
LOG_R = [[0.3, -0.1, 0.05], [math.log(4.0), 0.25], [0.1, -0.3, 0.2, 0.4], [-0.05],
         [0.35, -0.25, 0.1], [-0.3, 0.2]]
REWARDS = [1.0, 0.0, 0.4, 0.2, 0.9, 0.5]


def _world(log_r=LOG_R):
    g = torch.Generator().manual_seed(7)
    old = [(-0.3 - torch.rand(len(r), generator=g, dtype=torch.float64)).tolist() for r in log_r]
    ref = [(torch.tensor(o, dtype=torch.float64) + 0.2
            - 0.6 * torch.rand(len(o), generator=g, dtype=torch.float64)).tolist() for o in old]
    batch = make_batch([[9]] * len(log_r), [[1 + i] * len(r) for i, r in enumerate(log_r)],
                       rewards=REWARDS, groups=[i // G for i in range(len(log_r))], old=old,
                       behavior=old, ref=ref)
    lp = (batch.old_logprob + response_values(batch, log_r)).requires_grad_(True)
    return batch, lp


def _pad(batch, values_RC, log_r=LOG_R):
    return padded(batch, values_RC, [len(r) for r in log_r])


def _ours(name, batch, lp, est=None):
    est = est or estimators.get(name)
    step = prepare(batch, est)
    value, _ = loss(lp, step, est)
    return value, torch.autograd.grad(value, lp)[0], _pad(batch, step.advantage)[0]


def openrlhf_advantages(rewards, old, ref, mask, *, estimator, kl_coef=0.01, use_kl_loss=False,
                        ddof=0):
    r = rewards.view(-1, G)
    if estimator == "rloo":
        r = r - (r.sum(-1, keepdim=True) - r) / (G - 1)
    else:                                                     # reinforce_baseline
        r = r - r.mean(-1, keepdim=True)
    r = r.reshape(-1).clamp(-10, 10)
    m = mask.to(old.dtype)
    kl = torch.zeros_like(old) if use_kl_loss else (old - ref).clamp(-10, 10)
    last = (m.size(1) - 1 - m.long().fliplr().argmax(1, keepdim=True))
    token_reward = torch.zeros_like(kl).scatter_(1, last, r[:, None]) - max(kl_coef, 0.0) * kl
    returns = (token_reward * m).flip(1).cumsum(1).flip(1)   # γ = 1
    if estimator == "rloo":
        return returns
    mean = (returns * m).sum() / m.sum()
    var = ((returns - mean).pow(2) * m).sum() / (m.sum() - ddof)
    return (returns - mean) * var.clamp(min=1e-8).rsqrt()


def openrlhf_loss(log_prob, old, adv, mask, *, eps=0.2, dual_clip=None, kl_coef=0.0, ref=None):
    m = mask.to(log_prob.dtype)
    ratio = torch.exp(log_prob - old)
    surr1, surr2 = ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv
    clip1 = torch.minimum(surr1, surr2)
    if dual_clip is None:
        per_token = -clip1
    else:
        per_token = -torch.where(adv < 0, torch.maximum(clip1, dual_clip * adv), clip1)
    value = (per_token * m).sum() / m.sum()                  # token_level_loss
    if kl_coef:                                               # use_kl_loss, kl_estimator k1
        value = value + kl_coef * (((log_prob - ref).clamp(-10, 10) * m).sum() / m.sum())
    return value


def _theirs(batch, lp, adv_BT, **kw):
    log_prob, mask = _pad(batch, lp)
    old, _ = _pad(batch, batch.old_logprob)
    ref, _ = _pad(batch, batch.ref_logprob)
    value = openrlhf_loss(log_prob, old, adv_BT, mask, ref=ref, **kw)
    return value, torch.autograd.grad(value, lp)[0]


def _inputs(batch):
    mask = _pad(batch, batch.old_logprob)[1]
    return (batch.reward, _pad(batch, batch.old_logprob)[0], _pad(batch, batch.ref_logprob)[0],
            mask)


def _branches(adv, mask):
    """The PPO branches the world hits: clipped above / below, unclipped, dual clip."""
    r = torch.exp(torch.tensor([x for row in LOG_R for x in row], dtype=torch.float64))
    a = adv[mask]
    return (int(((a > 0) & (r > 1.2)).sum()), int(((a < 0) & (r < 0.8)).sum()),
            int(((r > 0.8) & (r < 1.2)).sum()), int(((a < 0) & (r > 3)).sum()))


def _population_var(adv, mask):
    a = adv[mask]
    return float(((a - a.mean()) ** 2).mean())


def test_reinforce_pp_kl_is_openrlhf_reinforce_baseline_up_to_the_documented_variance_floor():
    batch, lp = _world()
    value, grad, ours = _ours("reinforce_pp_kl", batch, lp)
    rewards, old, ref, mask = _inputs(batch)
    theirs = openrlhf_advantages(rewards, old, ref, mask, estimator="reinforce_baseline")
    # documented: var floored at 1e-8 there, + 1e-8 here; ours = theirs · sqrt(v / (v + 1e-8))
    v = _population_var(_raw_returns(rewards, old, ref, mask), mask)
    c = math.sqrt(v / (v + 1e-8))
    assert float((ours - theirs * c)[mask].abs().max()) < EXACT
    assert float((ours - theirs)[mask].abs().max()) > 1e-10                  # a real difference
    # the loss is positively homogeneous in Â: theirs = ours / c, value and gradient
    their_value, their_grad = _theirs(batch, lp, theirs)
    assert abs(float(value.detach()) - c * float(their_value.detach())) < EXACT
    assert float((grad - c * their_grad).abs().max()) < EXACT
    # given the same advantages the losses are equal (no dual clip in either)
    assert abs(float((value - _theirs(batch, lp, ours)[0]).detach())) < EXACT
    up, down, inside, _ = _branches(ours, mask)
    assert up and down and inside
    assert float((ours[mask] != ours[mask][0]).sum()) > 0                  # token-varying Â
    # mutation: a Bessel-corrected variance (verl's) is not OpenRLHF's
    bessel = openrlhf_advantages(rewards, old, ref, mask, estimator="reinforce_baseline",
                                 ddof=1)
    assert float((ours - bessel * c)[mask].abs().max()) > 1e-3


def _raw_returns(rewards, old, ref, mask, kl_coef=0.01):
    """The unwhitened reward-to-go of ``reinforce_baseline`` (for the variance ``v``)."""
    r = rewards.view(-1, G)
    r = (r - r.mean(-1, keepdim=True)).reshape(-1)
    m = mask.to(old.dtype)
    last = (m.size(1) - 1 - m.long().fliplr().argmax(1, keepdim=True))
    token_reward = torch.zeros_like(old).scatter_(1, last, r[:, None]) - kl_coef * (old - ref)
    return (token_reward * m).flip(1).cumsum(1).flip(1)


def _baseline_world():
    batch, lp = _world()
    rewards, old, ref, mask = _inputs(batch)
    theirs = openrlhf_advantages(rewards, old, ref, mask, estimator="reinforce_baseline",
                                 use_kl_loss=True)
    d = (rewards.view(-1, G) - rewards.view(-1, G).mean(-1, keepdim=True)).reshape(-1)
    n = mask.sum(1).to(d.dtype)
    m = (n * d).sum() / n.sum()
    v_pop = float((n * (d - m) ** 2).sum() / n.sum())
    v_bessel = float((n * (d - m) ** 2).sum() / (n.sum() - 1))
    return batch, lp, mask, theirs, math.sqrt(v_pop / (v_bessel + 1e-8))


def test_reinforce_pp_baseline_differs_from_openrlhf_use_kl_loss_by_the_documented_amounts():
    batch, lp, mask, theirs, c = _baseline_world()
    value, grad, ours = _ours("reinforce_pp_baseline", batch, lp)
    # documented: Bessel variance + 1e-8 here, population variance floored there
    assert float((ours - theirs * c)[mask].abs().max()) < EXACT
    assert abs(c - 1) > 1e-3
    up, down, inside, dual = _branches(ours, mask)
    assert up and down and inside and dual == 1
    # documented: the dual clip at 3 here, none there; with it added the losses are equal
    # (OpenRLHF's KL loss at init_kl_coef 0: its 0.01 default is the next test)
    with_dual = _theirs(batch, lp, theirs * c, dual_clip=3.0)
    assert abs(float((value - with_dual[0]).detach())) < EXACT
    assert float((grad - with_dual[1]).abs().max()) < EXACT
    plain = _theirs(batch, lp, theirs * c)
    hit = (batch.sequence_id == 1) & (batch.position == 1)               # the r = 4 token
    a, n = float(ours[1, 0]), int(mask.sum())
    assert a < 0
    assert float((plain[0] - value).detach()) == pytest.approx(-(4.0 - 3.0) * a / n, abs=EXACT)
    assert float((plain[1] - grad)[hit]) == pytest.approx(-4.0 * a / n, abs=EXACT)
    assert float((plain[1] - grad)[~hit].abs().max()) < EXACT
    # mutation: the registry without its dual clip equals the plain OpenRLHF loss instead
    est = estimators.get("reinforce_pp_baseline")
    no_dual = _ours(None, batch, lp, est.replace(surrogate=PPOClip(0.2, 0.2)))
    assert abs(float((no_dual[0] - plain[0]).detach())) < EXACT
    assert abs(float((no_dual[0] - with_dual[0]).detach())) > 1e-4


def test_under_use_kl_loss_openrlhf_adds_the_token_mean_kl_the_alias_names():
    """OpenRLHF's ``use_kl_loss`` adds ``init_kl_coef · mean_t k1(log π, log π_ref)`` (0.01) to
    the loss; with the two other named differences removed, that term is the whole gap: in
    value, and in gradient ``0.01 / N`` on every loss token (k1's derivative is 1)."""
    batch, lp, mask, theirs, c = _baseline_world()
    value, grad, _ = _ours("reinforce_pp_baseline", batch, lp)
    their_value, their_grad = _theirs(batch, lp, theirs * c, dual_clip=3.0, kl_coef=0.01)
    log_prob, _ = _pad(batch, lp)
    ref, _ = _pad(batch, batch.ref_logprob)
    n = int(mask.sum())
    kl_term = 0.01 * float(((log_prob.detach() - ref)[mask]).sum()) / n
    assert abs(kl_term) > 1e-4                                       # a real difference
    assert float((their_value - value).detach()) == pytest.approx(kl_term, abs=EXACT)
    diff = their_grad - grad
    assert float((diff[batch.loss_mask] - 0.01 / n).abs().max()) < EXACT
    assert float(diff[~batch.loss_mask].abs().max()) < EXACT
    assert "init_kl_coef × the token mean of k" in estimators.describe("reinforce_pp_baseline")


def test_rloo_has_openrlhf_rloos_advantage_without_the_kl_reward():
    batch, lp = _world()
    rewards, old, ref, mask = _inputs(batch)
    _, _, ours = _ours("rloo", batch, lp)
    theirs = openrlhf_advantages(rewards, old, ref, mask, estimator="rloo", kl_coef=0.0)
    assert float((ours - theirs)[mask].abs().max()) < EXACT
    a = ours[:, 0]
    assert int((a > 0).sum()) and int((a < 0).sum())
    # mutation: OpenRLHF's default init_kl_coef 0.01 puts the k1 reward-to-go into Â
    default = openrlhf_advantages(rewards, old, ref, mask, estimator="rloo")
    assert float((ours - default)[mask].abs().max()) > 1e-3


def test_openrlhf_rloo_on_policy_is_this_gradient_times_s_over_n():
    """OpenRLHF trains ``rloo`` with PPO's clip over the batch's token mean: on-policy and at
    ``init_kl_coef=0`` its gradient is this entry's times ``S / N_tokens`` (the alias says so);
    with its defaults off-policy it is another estimator (checked to differ)."""
    batch, _ = _world()
    rewards, old, ref, mask = _inputs(batch)
    on = batch.old_logprob.clone().requires_grad_(True)
    _, grad, _ = _ours("rloo", batch, on)
    theirs = openrlhf_advantages(rewards, old, ref, mask, estimator="rloo", kl_coef=0.0)
    _, their_grad = _theirs(batch, on, theirs)
    s_over_n = batch.num_sequences / int(mask.sum())
    assert float((their_grad - grad * s_over_n).abs().max()) < EXACT
    assert float(grad.abs().max()) > 1e-2
    batch, lp = _world()
    value, grad, _ = _ours("rloo", batch, lp)
    default = openrlhf_advantages(rewards, old, ref, mask, estimator="rloo")
    their_value, their_grad = _theirs(batch, lp, default)
    assert float((grad * s_over_n - their_grad).abs().max()) > 1e-3
    text = estimators.describe("rloo")
    for phrase in ("init_kl_coef=0", "PPO's clip over the batch's token mean", "S/N_tokens"):
        assert phrase in text, phrase


def test_the_aliases_name_these_openrlhf_options():
    def aliases(name):
        return estimators.describe(name).split("Other names:")[1]
    text = aliases("reinforce_pp_kl")
    for phrase in ("reinforce_baseline without use_kl_loss", "init_kl_coef 0.01",
                   "kl_estimator k1", "eps_clip 0.2", "population variance",
                   "floored at 1e-8 where here 1e-8 is added"):
        assert phrase in text, phrase
    text = aliases("reinforce_pp_baseline")
    for phrase in ("no dual clip", "population variance floored at 1e-8", "unless use_kl_loss"):
        assert phrase in text, phrase
    assert "OpenRLHF advantage_estimator=rloo" in aliases("rloo")
