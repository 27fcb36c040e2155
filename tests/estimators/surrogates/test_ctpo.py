"""CTPO-LA: position-scaled log-space bounds by hand, the clipped cumulative-ratio term and its
gradient by hand (padded and packed), agreement with an independent transcription of the
authors' loss (min / max of unclipped and clipped surrogates under autograd, padded rows),
wide bounds = per-decision IS bit for bit, on-policy = REINFORCE, the registry entry's exact
moments, and bad hyperparameters."""

from __future__ import annotations

import math

import pytest
import torch

from tests.estimators.estimator_helpers import make_batch, repack, response_values
from tokenmdp import estimators
from tokenmdp.estimators import (
    Aggregation,
    CTPOClip,
    Estimator,
    RewardAsAdvantage,
    ctpo_bounds,
    ctpo_term,
    loss,
    per_decision_term,
)
from tokenmdp.exact import TabularPolicy, TokenMDP, inference_copy, moments
from tokenmdp.exact.world import rewards

EXACT = 1e-12

# per-token log r: seq 0 and seq 1 share [0.02, 0.05, -0.3] (cumulative [0.02, 0.07, -0.23]);
# seq 2 is one token with log r = 0.1
LOG_R = [[0.02, 0.05, -0.3], [0.02, 0.05, -0.3], [0.1]]
ADV = [1.0, -1.0, 2.0]


def _fixture(packed):
    batch = make_batch([[7], [7], [8]], [[1, 2, 3], [1, 2, 3], [4]],
                       old=[[-1.0, -2.0, -0.5], [-1.0, -2.0, -0.5], [-1.5]])
    if packed:
        batch = repack(batch, [[2, 0], [1]], capacity=6)
    lp = (batch.old_logprob + response_values(batch, LOG_R)).requires_grad_(True)
    adv = response_values(batch, [[a] * len(r) for a, r in zip(ADV, LOG_R, strict=True)])
    return batch, lp, adv


def _ordered(batch, values_RC):
    keys = list(zip(batch.sequence_id[batch.loss_mask].tolist(),
                    batch.position[batch.loss_mask].tolist(), strict=True))
    return [v for _, v in sorted(zip(keys, values_RC[batch.loss_mask].tolist(), strict=True))]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_bounds_by_hand(packed):
    batch, _, _ = _fixture(packed)
    lo, hi, c = ctpo_bounds(batch, clip_low=0.025, clip_high=0.05, dual_clip=0.07, power=0.5)
    roots = [1.0, math.sqrt(2), math.sqrt(3)] * 2 + [1.0]
    assert _ordered(batch, lo) == pytest.approx([-0.025 * s for s in roots], abs=EXACT)
    assert _ordered(batch, hi) == pytest.approx([0.05 * s for s in roots], abs=EXACT)
    assert _ordered(batch, c) == pytest.approx([0.07 * s for s in roots], abs=EXACT)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_term_and_gradient_by_hand(packed):
    batch, lp, adv = _fixture(packed)
    terms = ctpo_term(lp, batch.old_logprob, adv, batch)
    r3 = math.sqrt(3)
    # Â = +1: cumulative 0.02 <= 0.05, 0.07 <= 0.0707, -0.23 (no lower bound): all free
    # Â = -1: 0.02 and 0.07 in [lo, c]; -0.23 < lo_3 = -0.0433: held there, no gradient
    # Â = +2: 0.1 > hi_1 = 0.05: held at e^0.05, no gradient
    value = [math.exp(0.02), math.exp(0.07), math.exp(-0.23),
             -math.exp(0.02), -math.exp(0.07), -math.exp(-0.025 * r3), 2 * math.exp(0.05)]
    coef = [math.exp(0.02), math.exp(0.07), math.exp(-0.23),
            -math.exp(0.02), -math.exp(0.07), 0.0, 0.0]
    assert _ordered(batch, terms.term_RC.detach()) == pytest.approx(value, abs=EXACT)
    (grad,) = torch.autograd.grad(terms.term_RC.sum(), lp)
    assert _ordered(batch, grad) == pytest.approx(coef, abs=EXACT)
    assert _ordered(batch, terms.clipped_RC) == [False] * 5 + [True, True]


def _authors_transcription(lp_rows, old_rows, adv_rows, mask, *, low, high, c, power, cap):
    """The authors' loss written out on padded rows (one sequence a row), under autograd:
    cumulative log-ratio with a straight-through prefix, log-space clamp, PPO min, dual clip."""
    m = mask.to(lp_rows.dtype)
    cum = torch.cumsum((lp_rows - old_rows).clamp(-20.0, 20.0) * m, dim=-1)
    log_ratio = torch.clamp(cum.detach() + lp_rows - lp_rows.detach(), max=cap)
    ratio = torch.exp(log_ratio)
    t = torch.cumsum(m, dim=-1).clamp(min=1.0) ** power
    clipped = torch.exp(torch.clamp(log_ratio, -low * t, high * t))
    loss1 = torch.maximum(-adv_rows * ratio, -adv_rows * clipped)
    loss2 = torch.minimum(-adv_rows * torch.exp(c * t), loss1)
    per_token = torch.where(adv_rows < 0, loss2, loss1)
    return (per_token * m).sum()


@pytest.mark.parametrize("params", [dict(low=0.025, high=0.05, c=0.05, power=0.5),
                                    dict(low=0.05, high=0.04, c=0.08, power=0.0),
                                    dict(low=0.01, high=0.03, c=0.02, power=1.0)],
                         ids=["defaults", "uniform", "linear"])
def test_agrees_with_a_transcription_of_the_authors_loss(params):
    g = torch.Generator().manual_seed(11)
    lengths = [5, 2, 7, 1, 4, 6]
    S, width = len(lengths), max(lengths)
    mask = torch.zeros(S, width, dtype=torch.bool)
    for s, n in enumerate(lengths):
        mask[s, :n] = True
    old_rows = torch.where(mask, -torch.rand(S, width, generator=g, dtype=torch.float64) - 0.1, 0)
    lp_rows = torch.where(mask, old_rows + 0.06 * torch.randn(S, width, generator=g,
                                                              dtype=torch.float64), 0.0)
    adv_S = torch.tensor([1.0, -0.5, -1.5, 2.0, 0.0, -1.0], dtype=torch.float64)
    adv_rows = torch.where(mask, adv_S[:, None], 0.0)
    batch = make_batch([[9]] * S, [[1] * n for n in lengths],
                       old=[old_rows[s, :n].tolist() for s, n in enumerate(lengths)])
    batch = batch.replace(advantage=response_values(batch, [[float(adv_S[s])] * n for s, n in
                                                            enumerate(lengths)]),
                          loss_weight=batch.loss_mask.to(torch.float64))
    part = CTPOClip(clip_low=params["low"], clip_high=params["high"], dual_clip=params["c"],
                    power=params["power"])
    est = Estimator(surrogate=part, aggregation=Aggregation.TOKEN_SUM)
    lp = response_values(batch, [lp_rows[s, :n].tolist() for s, n in enumerate(lengths)])
    x = lp.clone().requires_grad_(True)
    value, metrics = loss(x, batch, est)
    (grad,) = torch.autograd.grad(value, x)
    y = lp_rows.clone().requires_grad_(True)
    expected = _authors_transcription(y, old_rows, adv_rows, mask, cap=10.0, **params)
    (grad_rows,) = torch.autograd.grad(expected, y)
    assert float(value.detach()) == pytest.approx(float(expected.detach()), abs=EXACT)
    assert _ordered(batch, grad) == pytest.approx(grad_rows[mask].tolist(), abs=EXACT)
    assert 0 < float(metrics["clip_fraction"]) < 1          # the clip binds on some tokens


def test_wide_bounds_are_per_decision_is_bit_for_bit():
    batch, lp, adv = _fixture(packed=True)
    wide = ctpo_term(lp, batch.old_logprob, adv, batch, clip_low=1e3, clip_high=1e3,
                     dual_clip=1e3, power=0.0, max_log_ratio=20.0)
    plain = per_decision_term(lp, batch.old_logprob, adv, batch)
    assert torch.equal(wide.term_RC, plain.term_RC)
    g_wide = torch.autograd.grad(wide.term_RC.sum(), lp)[0]
    assert torch.equal(g_wide, torch.autograd.grad(plain.term_RC.sum(), lp)[0])


def test_on_policy_it_is_reinforce():
    batch, _, adv = _fixture(packed=False)
    lp = batch.old_logprob.clone().requires_grad_(True)
    terms = ctpo_term(lp, batch.old_logprob, adv, batch)
    (grad,) = torch.autograd.grad(terms.term_RC.sum(), lp)
    assert torch.equal(grad, adv * batch.loss_mask)
    assert not bool(terms.clipped_RC.any())


def test_against_behavior_reads_the_sampler():
    batch, lp, adv = _fixture(packed=False)
    shifted = batch.replace(behavior_logprob=batch.old_logprob, old_logprob=batch.old_logprob + 1)
    est = Estimator(surrogate=CTPOClip(against="behavior"), advantage=RewardAsAdvantage(),
                    aggregation=Aggregation.TOKEN_SUM)
    assert est.requires("loss") == ("behavior_logprob",)
    value, _ = loss(lp, shifted.replace(advantage=adv, loss_weight=batch.loss_mask.double()), est)
    expected = ctpo_term(lp, batch.old_logprob, adv, batch).term_RC.sum()
    assert float(value.detach()) == pytest.approx(-float(expected.detach()), abs=EXACT)


def test_registry_entry_exact_moments_are_finite_and_biased_towards_per_decision():
    mdp = TokenMDP(2, 3, rewards.RandomTable(seed=1), prompts=[(0,), (1,)])
    pi = TabularPolicy(mdp, generator=torch.Generator().manual_seed(5))
    old = inference_copy(pi, noise_std=0.3, generator=torch.Generator().manual_seed(6))
    est = estimators.get("ctpo")
    m = moments(mdp, pi, est, group_size=2, behavior=old, old=old)
    assert torch.isfinite(m.mean).all() and math.isfinite(m.total_variance)
    wide = est.replace(surrogate=CTPOClip(clip_low=1e3, clip_high=1e3, dual_clip=1e3))
    unclipped = moments(mdp, pi, wide, group_size=2, behavior=old, old=old)
    assert m.total_variance < unclipped.total_variance      # the clip removes variance
    # the authors' defaults (horizon-llm/CTPO ctpo.sh and core_algos.py)
    assert (est.surrogate.clip_low, est.surrogate.clip_high, est.surrogate.dual_clip,
            est.surrogate.power, est.surrogate.max_log_ratio) == (0.025, 0.05, 0.05, 0.5, 10.0)
    assert est.correction.describe() == "TIS C=5 (sequence)"
    assert est.aggregation is Aggregation.TOKEN_MEAN


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(clip_low=-0.1), "clip_low"), (dict(clip_high=0.0), "clip_high"),
    (dict(dual_clip=-1.0), "dual_clip"), (dict(power=-0.5), "power"),
    (dict(max_log_ratio=0.0), "max_log_ratio"), (dict(against="ref"), "against"),
])
def test_bad_hyperparameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CTPOClip(**kwargs)
