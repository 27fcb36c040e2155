"""DPPO's TV and binary-KL masks and OPSM: hand-worked masks, the masked gradient identity, an
independent binary KL, on-policy REINFORCE, layouts, bad arguments."""

from __future__ import annotations

import math

import pytest
import torch

from tests.estimators.estimator_helpers import make_batch, repack, response_values
from tokenmdp.estimators import (
    DPPO,
    Aggregation,
    Estimator,
    OffPolicySequenceMask,
    PPOClip,
    dppo_keep_mask,
    dppo_term,
    loss,
    off_policy_sequence_keep_mask,
    prepare,
)

EXACT = 1e-12

# One response of 4 tokens: p_old = 0.5 everywhere; p = 0.7, 0.6, 0.3, 0.7; Â = +1, +1, -1, -1.
# TV (δ 0.15): +0.2 with Â > 0 -> masked; +0.1 -> kept; -0.2 with Â < 0 -> masked; +0.2 with
# Â < 0 (p rises, not the way a negative advantage pushes it) -> kept.
P_OLD = [0.5, 0.5, 0.5, 0.5]
P_NEW = [0.7, 0.6, 0.3, 0.7]
ADV = [1.0, 1.0, -1.0, -1.0]


def _fixture(p_new=P_NEW, packed=False):
    batch = make_batch([[7], [8]], [[1, 2, 3, 4], [5]], rewards=[1.0, 0.0],
                       old=[[math.log(p) for p in P_OLD], [math.log(0.5)]])
    if packed:
        batch = repack(batch, [[1, 0]], capacity=7)
    lp = response_values(batch, [[math.log(p) for p in p_new], [math.log(0.5)]])
    adv = response_values(batch, [ADV, [1.0]])
    return batch, lp.requires_grad_(True), adv


def _seq0(batch, values_RC):
    on = (batch.sequence_id == 0) & batch.loss_mask
    order = batch.position[on].argsort()
    return values_RC[on][order].tolist()


def _binary_kl(p_old, p):
    return p_old * math.log(p_old / p) + (1 - p_old) * math.log((1 - p_old) / (1 - p))


def test_tv_mask_by_hand():
    batch, lp, adv = _fixture()
    keep = dppo_keep_mask(lp, batch.old_logprob, adv, divergence="tv", delta_low=0.15,
                          delta_high=0.15)
    assert _seq0(batch, keep) == [False, True, False, True]


def test_kl_mask_matches_an_independent_binary_kl():
    p_new = [0.9, 0.55, 0.2, 0.9]
    batch, lp, adv = _fixture(p_new)
    delta = 0.05
    keep = dppo_keep_mask(lp, batch.old_logprob, adv, divergence="kl", delta_low=delta,
                          delta_high=delta)
    want = []
    for p_old, p, a in zip(P_OLD, p_new, ADV, strict=True):
        far = _binary_kl(p_old, p) > delta
        want.append(not (far and ((a > 0 and p > p_old) or (a <= 0 and p < p_old))))
    assert want == [False, True, False, True]  # the fixture exercises both sides
    assert _seq0(batch, keep) == want


def test_kl_mask_is_finite_at_certain_tokens():
    # p_old = 1 and p = 1: the binary KL is 0 (0 log 0 terms), the token is kept, nothing NaN.
    batch = make_batch([[7]], [[1]], rewards=[1.0], old=[[0.0]])
    lp = response_values(batch, [[0.0]])
    adv = response_values(batch, [[1.0]])
    keep = dppo_keep_mask(lp, batch.old_logprob, adv, divergence="kl", delta_low=0.05,
                          delta_high=0.05)
    assert bool(keep[batch.loss_mask].all())


def test_dppo_gradient_is_the_masked_ratio_weighted_score():
    batch, lp, adv = _fixture()
    terms = dppo_term(lp, batch.old_logprob, adv, divergence="tv", delta_low=0.15,
                      delta_high=0.15)
    (g,) = torch.autograd.grad(terms.term_RC[batch.loss_mask].sum(), lp)
    want = [m * (p / q) * a for m, p, q, a in zip([0, 1, 0, 1], P_NEW, P_OLD, ADV, strict=True)]
    assert _seq0(batch, g) == pytest.approx(want, abs=EXACT)
    assert _seq0(batch, terms.clipped_RC) == [True, False, True, False]
    capped = dppo_term(lp, batch.old_logprob, adv, divergence="tv", delta_low=0.15,
                       delta_high=0.15, cap=1.1)
    (g_cap,) = torch.autograd.grad(capped.term_RC[batch.loss_mask].sum(), lp)
    assert _seq0(batch, g_cap) == pytest.approx([0.0, 1.1, 0.0, -1.1], abs=EXACT)


@pytest.mark.parametrize("divergence", ["tv", "kl"])
def test_dppo_on_policy_is_reinforce_and_layout_free(divergence):
    est = Estimator(surrogate=DPPO(divergence=divergence), aggregation=Aggregation.TOKEN_SUM)
    out = []
    for packed in (False, True):
        batch, _, adv = _fixture(P_OLD, packed)
        lp = batch.old_logprob.clone().requires_grad_(True)
        prepared = prepare(batch, est).replace(advantage=adv)
        value, _ = loss(lp, prepared, est)
        (g,) = torch.autograd.grad(value, lp)
        torch.testing.assert_close(g, -torch.where(batch.loss_mask, adv, 0.0), atol=EXACT, rtol=0)
        out.append(value.item())
    assert out[0] == pytest.approx(out[1], abs=EXACT)


# ---------------------------------------------------------------------- OPSM
def test_opsm_masks_negative_far_sequences_only():
    # seq 0: mean log(μ/π) = 0.6 > 0.5 with Â < 0 -> masked; seq 1: the same gap, Â > 0 -> kept;
    # seq 2: Â < 0 but mean gap 0.2 -> kept.
    batch = make_batch([[7], [8], [9]], [[1, 2], [3], [4, 5]], rewards=[0.0, 1.0, 0.0],
                       old=[[-1.0, -1.0], [-1.0], [-1.0, -1.0]])
    lp = response_values(batch, [[-1.4, -1.8], [-1.6], [-1.3, -1.1]])
    mu = response_values(batch, [[-1.0, -1.0], [-1.0], [-1.0, -1.0]])
    adv = response_values(batch, [[-1.0, -1.0], [1.0], [-1.0, -1.0]])
    keep = off_policy_sequence_keep_mask(lp, mu, adv, batch, delta=0.5)
    by_seq = [bool(keep[(batch.sequence_id == s) & batch.loss_mask].all()) for s in range(3)]
    assert by_seq == [False, True, True]
    batch = batch.replace(behavior_logprob=mu, advantage=adv)
    lp = lp.requires_grad_(True)
    base = PPOClip(eps_low=10.0, eps_high=10.0)            # no clip: gradient r Â
    terms = OffPolicySequenceMask(base, delta=0.5)(lp, batch)
    (g,) = torch.autograd.grad(terms.term_RC[batch.loss_mask].sum(), lp)
    ratio = (lp - batch.old_logprob).exp().detach()
    want = torch.where(keep & batch.loss_mask, ratio * adv, 0.0)
    torch.testing.assert_close(g, want, atol=EXACT, rtol=0)
    assert bool((terms.clipped_RC == (~keep)).all())
    assert OffPolicySequenceMask(base).requires == ("old_logprob", "behavior_logprob")
    assert OffPolicySequenceMask(base, against="old").requires == ("old_logprob",)


@pytest.mark.parametrize("against", ["behavior", "old"])
def test_opsm_measures_the_divergence_against_the_chosen_sampler(against):
    """Issue 33: ``against`` picks the log-probs of the divergence. π_old and μ differ here so
    that each choice masks a different sequence (seq 0 is far from μ only, seq 1 from π_old
    only); the expected mask is the mean ``log(sampler/π_θ)`` over the loss tokens, by hand."""
    old = [[-1.0, -1.0], [-0.3, -0.4], [-1.8]]
    mu = [[-0.3, -0.5], [-1.0, -1.0], [-1.0]]
    batch = make_batch([[7], [8], [9]], [[1, 2], [3, 4], [5]], rewards=[0.0, 0.0, 1.0],
                       old=old, behavior=mu)
    lp_lists = [[-1.0, -1.0], [-1.0, -1.1], [-1.9]]
    adv = response_values(batch, [[-1.0, -1.0], [-1.0, -1.0], [-1.0]])
    batch = batch.replace(advantage=adv)
    sampler = mu if against == "behavior" else old
    far = [sum(q - p for q, p in zip(qs, ps, strict=True)) / len(ps) > 0.5
           for qs, ps in zip(sampler, lp_lists, strict=True)]
    assert far == ([True, False, True] if against == "behavior" else [False, True, False])
    lp = response_values(batch, lp_lists).requires_grad_(True)
    base = PPOClip(eps_low=10.0, eps_high=10.0)            # no clip: gradient r Â
    terms = OffPolicySequenceMask(base, delta=0.5, against=against)(lp, batch)
    (g,) = torch.autograd.grad(terms.term_RC[batch.loss_mask].sum(), lp)
    ratio = (lp - batch.old_logprob).exp().detach()
    keep = response_values(batch, [[0.0 if f else 1.0] * len(ps)
                                   for f, ps in zip(far, lp_lists, strict=True)])
    torch.testing.assert_close(g, keep * ratio * adv, atol=EXACT, rtol=0)


@pytest.mark.parametrize(("build", "name"), [
    (lambda: DPPO(delta_low=0.0), "delta_low"),
    (lambda: DPPO(delta_high=-0.1), "delta_high"),
    (lambda: DPPO(divergence="js"), "divergence"),
    (lambda: DPPO(cap=0.0), "cap"),
    (lambda: OffPolicySequenceMask(PPOClip(), delta=-1.0), "delta"),
    (lambda: OffPolicySequenceMask(PPOClip(), against="ref"), "against"),
])
def test_bad_hyperparameters_name_the_argument(build, name):
    with pytest.raises(ValueError, match=name):
        build()
