"""The registry's advantages against transcriptions of verl's ``algorithm.adv_estimator``s
(written here from their definitions on padded ``[B, T]`` tensors), with each difference the
aliases name asserted as a difference and equality elsewhere.

Read in ``verl-project/verl``: ``verl/trainer/ppo/core_algos.py`` at ``5b98636684f9``
(``compute_grpo_outcome_advantage``, ``compute_rloo_outcome_advantage``,
``compute_reinforce_plus_plus_baseline_outcome_advantage``, ``compute_opo_outcome_advantage``,
``compute_policy_loss_vanilla``, ``agg_loss``) and ``verl_F.masked_whiten``. Transcribed, with
``R_i`` the row's score and ``g`` its group (``uid``):

* ``grpo``: ``(R − mean_g) / (std_g + 1e-6)`` (``torch.std``, Bessel), or ``R − mean_g`` when
  ``norm_adv_by_std_in_grpo=False``; a one-response group has mean 0 and std 1;
* ``rloo``: ``n/(n−1) (R − mean_g)``; a one-response group keeps ``R``;
* ``reinforce_plus_plus_baseline``: ``R − mean_g`` (mean 0 for one response) tiled over the row,
  then whitened over ``response_mask``: token-weighted mean, Bessel variance, ``rsqrt(var +
  1e-8)``;
* ``opo``: ``R − Σ_g |y| R / Σ_g |y|`` with ``|y|`` the row's ``response_mask`` sum; baseline 0
  for one response;
* the vanilla loss (PPO clip, dual clip ``clip_ratio_c = 3`` on ``A < 0``, ``token-mean``).

Where the registry refuses a one-response group (``grpo``, ``rloo``: ``ValueError``) that is
asserted; ``dr_grpo`` gives it deviation 0 where verl keeps ``R``, as its aliases say.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.estimators.estimator_helpers import make_batch, response_values
from tests.estimators.registry.padded import padded
from tokenmdp import estimators
from tokenmdp.estimators import loss, prepare

#: float64 sums of a dozen terms, two routes.
EXACT = 1e-12
L_MAX = 4

# two groups (3 and 2 responses) of different lengths; WITH_ONE adds a one-response group
REWARDS = [1.0, 0.0, 0.6, 0.2, 0.9]
GROUPS = [0, 0, 0, 1, 1]
LENGTHS = [3, 1, 2, 4, 2]
ONE = (0.7, 2, 3)                                           # reward, group, length


def _world(with_one=False, log_r=None):
    rewards, groups, lengths = list(REWARDS), list(GROUPS), list(LENGTHS)
    if with_one:
        rewards, groups, lengths = rewards + [ONE[0]], groups + [ONE[1]], lengths + [ONE[2]]
    g = torch.Generator().manual_seed(11)
    old = [(-0.2 - torch.rand(n, generator=g, dtype=torch.float64)).tolist() for n in lengths]
    batch = make_batch([[9]] * len(lengths), [[1 + i] * n for i, n in enumerate(lengths)],
                       rewards=rewards, groups=groups, old=old, behavior=old, ref=old)
    log_r = log_r or [[0.0] * n for n in lengths]
    lp = (batch.old_logprob + response_values(batch, log_r)).requires_grad_(True)
    return batch, lp, lengths


def _rows(batch, lengths):
    """verl's inputs: the scores ``[B]``, the uids ``[B]`` and ``response_mask`` ``[B, T]``."""
    _, mask = padded(batch, batch.old_logprob, lengths, L_MAX)
    return batch.reward.clone(), batch.group.tolist(), mask


# ------------------------------------------------------------------ verl, transcribed
def _by_group(index):
    members = {}
    for i, uid in enumerate(index):
        members.setdefault(uid, []).append(i)
    return members


def verl_grpo(scores, index, norm_adv_by_std_in_grpo=True, epsilon=1e-6):
    out = scores.clone()
    for rows in _by_group(index).values():
        s = scores[rows]
        mean, std = (s.mean(), s.std()) if len(rows) > 1 else (s.new_tensor(0.0),
                                                                s.new_tensor(1.0))
        out[rows] = (s - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else s - mean
    return out


def verl_rloo(scores, index):
    out = scores.clone()
    for rows in _by_group(index).values():
        n = len(rows)
        if n > 1:
            out[rows] = scores[rows] * n / (n - 1) - scores[rows].mean() * n / (n - 1)
    return out


def verl_rpp_baseline(scores, index, mask):
    d = scores.clone()
    for rows in _by_group(index).values():
        if len(rows) > 1:
            d[rows] = scores[rows] - scores[rows].mean()
    m = mask.to(scores.dtype)
    tiled = d[:, None] * m
    mean = (tiled * m).sum() / m.sum()
    var = (((tiled - mean) ** 2) * m).sum() / m.sum() * (m.sum() / (m.sum() - 1))
    return ((tiled - mean) * torch.rsqrt(var + 1e-8) * m)[:, 0]       # one value a row


def verl_opo(scores, index, mask):
    lengths = mask.sum(-1).to(scores.dtype)
    out = scores.clone()
    for rows in _by_group(index).values():
        if len(rows) > 1:
            out[rows] = scores[rows] - (lengths[rows] * scores[rows]).sum() / lengths[rows].sum()
    return out


def verl_vanilla_token_mean(log_prob, old, adv, mask, clip_ratio=0.2, clip_ratio_c=3.0):
    ratio = torch.exp((log_prob - old).clamp(-20.0, 20.0))
    clipped = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_ratio, 1 + clip_ratio))
    pg = torch.where(adv < 0, torch.minimum(-adv * clip_ratio_c, clipped), clipped)
    m = mask.to(pg.dtype)
    return (pg * m).sum() / m.sum()


VERL = {
    "grpo": lambda s, i, m: verl_grpo(s, i),
    "dr_grpo": lambda s, i, m: verl_grpo(s, i, norm_adv_by_std_in_grpo=False),
    "rloo": lambda s, i, m: verl_rloo(s, i),
    "reinforce_pp_baseline": verl_rpp_baseline,
    "opo": verl_opo,
}


def _ours(name, batch):
    step = prepare(batch, estimators.get(name), max_len=L_MAX)
    return torch.stack([step.advantage[(step.sequence_id == s) & step.loss_mask][0]
                        for s in range(batch.num_sequences)]), step


def aliases(name):
    return estimators.describe(name).split("Other names:")[1]


# ------------------------------------------------------------------ equality
@pytest.mark.parametrize("name", list(VERL))
def test_the_advantages_equal_verls_without_one_response_groups(name):
    batch, _, lengths = _world()
    scores, index, mask = _rows(batch, lengths)
    ours, _ = _ours(name, batch)
    theirs = VERL[name](scores, index, mask)
    assert float((ours - theirs).abs().max()) < EXACT
    assert float(theirs.abs().min()) > 1e-3                          # no group is constant
    if name == "opo":      # the length weighting matters here: not the plain group mean
        assert float((theirs - verl_grpo(scores, index, False)).abs().max()) > 1e-2
    if name == "reinforce_pp_baseline":   # the token weighting matters: not one row each
        d = verl_grpo(scores, index, False)
        assert float((theirs - (d - d.mean()) / (d.var() + 1e-8).sqrt()).abs().max()) > 1e-2


def test_verl_names_each_estimator_in_the_aliases():
    assert "verl adv_estimator=grpo" in aliases("grpo")
    assert "verl norm_adv_by_std_in_grpo=False" in aliases("dr_grpo")
    assert "verl adv_estimator=rloo" in aliases("rloo")
    assert "verl adv_estimator=reinforce_plus_plus_baseline" in aliases("reinforce_pp_baseline")
    assert "verl adv_estimator=opo" in aliases("opo")


# ------------------------------------------------------------------ one-response groups
def test_one_response_group_opo_differs_as_documented():
    assert "a one-response group's baseline is 0 there, its deviation 0 here" in aliases("opo")
    batch, _, lengths = _world(with_one=True)
    scores, index, mask = _rows(batch, lengths)
    ours, _ = _ours("opo", batch)
    theirs = verl_opo(scores, index, mask)
    assert float((ours[:-1] - theirs[:-1]).abs().max()) < EXACT     # the other groups: equal
    assert float(ours[-1]) == 0.0 and float(theirs[-1]) == ONE[0]   # verl: R - 0 = 0.7


def test_one_response_group_reinforce_pp_baseline_differs_as_documented():
    text = aliases("reinforce_pp_baseline")
    assert "a one-response group keeps its reward there, its deviation is 0 here" in text
    batch, _, lengths = _world(with_one=True)
    scores, index, mask = _rows(batch, lengths)
    ours, _ = _ours("reinforce_pp_baseline", batch)
    theirs = verl_rpp_baseline(scores, index, mask)
    # the whitening is batch-wide, so every row moves; with the group's reward replaced by its
    # deviation 0 (the mean of a one-element group) verl's formula gives the registry's
    as_if_zero = verl_rpp_baseline(torch.cat([scores[:-1], scores.new_zeros(1)]), index, mask)
    assert float((ours - as_if_zero).abs().max()) < EXACT
    assert float((ours - theirs).abs().min()) > 1e-3          # every row moves


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_one_response_group_is_refused_where_verl_keeps_a_finite_value(name):
    batch, _, lengths = _world(with_one=True)
    scores, index, mask = _rows(batch, lengths)
    theirs = VERL[name](scores, index, mask)
    expected = ONE[0] / (1 + 1e-6) if name == "grpo" else ONE[0]    # mean 0, std 1 / kept R
    assert float(theirs[-1]) == pytest.approx(expected, abs=EXACT)
    with pytest.raises(ValueError, match="group"):
        prepare(batch, estimators.get(name))


def test_one_response_group_dr_grpo_differs_from_verl_as_the_alias_says():
    """verl (``norm_adv_by_std_in_grpo=False``) takes a one-response group's mean as 0, so
    its advantage is its reward; the registry's group mean gives it deviation 0."""
    batch, _, lengths = _world(with_one=True)
    scores, index, mask = _rows(batch, lengths)
    ours, _ = _ours("dr_grpo", batch)
    theirs = verl_grpo(scores, index, norm_adv_by_std_in_grpo=False)
    assert float((ours[:-1] - theirs[:-1]).abs().max()) < EXACT      # the rest is equal
    assert float(ours[-1]) == 0.0 and float(theirs[-1]) == pytest.approx(float(scores[-1]))
    assert abs(float(scores[-1])) > 0.1
    assert "one-response group keeps its reward there, its deviation is 0 here" in \
        estimators.describe("dr_grpo")


# ------------------------------------------------------------------ the losses
def test_reinforce_pp_baseline_is_verls_vanilla_loss_with_its_dual_clip():
    # sequence 1 (Â < 0) has a token with r = 4 > 3: the dual clip binds; others cross 1 ± 0.2
    log_r = [[0.3, -0.1, 0.05], [math.log(4.0)], [-0.4, 0.25], [0.1, -0.3, 0.2, 0.4], [-0.05, 0.1]]
    batch, lp, lengths = _world(log_r=log_r)
    est = estimators.get("reinforce_pp_baseline")
    step = prepare(batch, est)
    value, _ = loss(lp, step, est)
    grad = torch.autograd.grad(value, lp)[0]
    scores, index, mask = _rows(batch, lengths)
    adv = verl_rpp_baseline(scores, index, mask)[:, None] * mask
    log_prob, _ = padded(batch, lp, lengths, L_MAX)
    old, _ = padded(batch, batch.old_logprob, lengths, L_MAX)
    assert bool(((adv < 0) & (torch.exp(log_prob - old) > 3.0) & mask).any())
    theirs = verl_vanilla_token_mean(log_prob, old, adv, mask)
    assert abs(float((value - theirs).detach())) < EXACT
    assert float((grad - torch.autograd.grad(theirs, lp)[0]).abs().max()) < EXACT


def test_opo_on_policy_has_the_gradient_of_verls_clipped_loss():
    assert "verl's clipped loss has REINFORCE's gradient" in aliases("opo")
    batch, lp, lengths = _world()                                    # log π = log π_old
    est = estimators.get("opo")
    value, _ = loss(lp, prepare(batch, est), est)
    grad = torch.autograd.grad(value, lp)[0]
    scores, index, mask = _rows(batch, lengths)
    adv = verl_opo(scores, index, mask)[:, None] * mask
    log_prob, _ = padded(batch, lp, lengths, L_MAX)
    old, _ = padded(batch, batch.old_logprob, lengths, L_MAX)
    theirs = verl_vanilla_token_mean(log_prob, old, adv, mask)
    assert float((grad - torch.autograd.grad(theirs, lp)[0]).abs().max()) < EXACT
    assert float(grad.abs().max()) > 1e-2                           # not vacuous
