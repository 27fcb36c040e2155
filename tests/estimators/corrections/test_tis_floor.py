"""Truncated IS with a floor, ``clamp(w, F, C)`` (TRL's ``vllm_importance_sampling_clip_min``):
hand-worked factors at each level, no floor = the plain cap bit for bit, bad floors, and the exact
moments against a closed form summed over the enumeration (float64)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.estimators.estimator_helpers import per_token_values, weighted_batch
from tokenmdp.estimators import (
    Aggregation,
    Estimator,
    Level,
    NoCorrection,
    Reinforce,
    RewardAsAdvantage,
    TruncatedIS,
    loss,
    prepare,
)
from tokenmdp.estimators.corrections.factor import truncated_importance_weight
from tokenmdp.exact import TabularPolicy, TokenMDP, flat_grad, inference_copy
from tokenmdp.exact import sequence_probs as exact_sequence_probs
from tokenmdp.exact.lab.moments import moments
from tokenmdp.exact.world import rewards

EXACT = 1e-12  # float64 closed forms of a few terms
TIE = 1e-12    # float64: enumeration sums of ~30 terms of size <= ~10

# log w = log π_old - log μ per loss token (the batch of test_corrections.py):
#   seq 0: [0.5, -1.0, 1.2]  w = [1.6487, 0.3679, 3.3201]; Σ = 0.7 (W = 2.0138), mean 0.2333
#   seq 1: [0.1, 0.2]        w = [1.1052, 1.2214];        Σ = 0.3 (W = 1.3499), mean 0.15
e = math.exp


def _batch(packed=False):
    return weighted_batch([1.0, -0.5], packed_order=[0, 1] if packed else None)


_per_token = per_token_values


CASES = [
    # token level: the floor lifts w = 0.37 to 0.5; the cap holds 3.32 at 2
    (TruncatedIS(cap=2.0, floor=0.5), [e(0.5), 0.5, 2.0, e(0.1), e(0.2)]),
    # a floor above 1.105 also lifts a token of sequence 1
    (TruncatedIS(cap=2.0, floor=1.15), [e(0.5), 1.15, 2.0, 1.15, e(0.2)]),
    # sequence level: W = 2.01 capped at 2, W = 1.35 lifted to 1.5
    (TruncatedIS(cap=2.0, level=Level.SEQUENCE, floor=1.5), [2.0] * 3 + [1.5] * 2),
    # geometric mean: 1.2628 capped at 1.25, 1.1618 lifted to 1.2
    (TruncatedIS(cap=1.25, level=Level.GEOMETRIC, floor=1.2), [1.25] * 3 + [1.2] * 2),
    # a floor below every factor changes nothing
    (TruncatedIS(cap=3.0, level=Level.GEOMETRIC, floor=1.1), [e(0.7 / 3)] * 3 + [e(0.15)] * 2),
]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize(("correction", "factor"), CASES, ids=[c.describe() for c, _ in CASES])
def test_hand_worked_floored_factors(correction, factor, packed):
    batch = _batch(packed)
    out = correction(batch)
    assert out.keep_RC is None
    assert _per_token(batch, out.factor_RC) == pytest.approx(factor, abs=EXACT)


def test_describe_names_the_band_and_keeps_the_plain_label_without_a_floor():
    assert TruncatedIS(cap=2.0, floor=0.5).describe() == "TIS [0.5, 2] (token)"
    assert TruncatedIS(cap=5.0, level="sequence", floor=0.0).describe() == "TIS [0, 5] (sequence)"
    assert TruncatedIS(cap=2.0).describe() == "TIS C=2 (token)"
    assert TruncatedIS(cap=2.0, level=Level.SEQUENCE, floor=None).describe() == \
        "TIS C=2 (sequence)"


@pytest.mark.parametrize("level", list(Level), ids=[lv.value for lv in Level])
@pytest.mark.parametrize("floor", [None, 0.0], ids=["None", "zero"])
def test_no_floor_is_the_plain_cap_bit_for_bit(level, floor):
    batch = _batch()
    # today's factor, written out: exp(min(log w, log C)) of the level's log w
    log_w = (batch.old_logprob - batch.behavior_logprob) * batch.loss_mask
    if level is not Level.TOKEN:
        sums = torch.zeros(2, dtype=log_w.dtype).index_add_(
            0, batch.sequence_id[batch.loss_mask], log_w[batch.loss_mask])
        if level is Level.GEOMETRIC:
            sums = sums / torch.tensor([3.0, 2.0], dtype=log_w.dtype)
        log_w = torch.where(batch.loss_mask, sums[batch.sequence_id.clamp(min=0)], 0.0)
    expected = log_w.clamp(max=math.log(1.3)).exp()
    factor = TruncatedIS(cap=1.3, level=level, floor=floor)(batch).factor_RC
    assert torch.equal(factor[batch.loss_mask], expected[batch.loss_mask])
    # ... and so is the loss and its gradient
    lp = batch.old_logprob.clone().requires_grad_(True)
    grads = []
    for correction in (TruncatedIS(cap=1.3, level=level),
                       TruncatedIS(cap=1.3, level=level, floor=floor)):
        est = Estimator(surrogate=Reinforce(), aggregation=Aggregation.TOKEN_SUM,
                        correction=correction)
        value, _ = loss(lp, prepare(batch, est), est)
        grads.append(torch.autograd.grad(value, lp)[0])
    assert torch.equal(grads[0], grads[1])


def test_the_floor_multiplies_the_surrogate_and_stays_detached():
    batch = _batch()
    lp = batch.old_logprob.clone().requires_grad_(True)
    base = Estimator(surrogate=Reinforce(), aggregation=Aggregation.TOKEN_SUM)
    floored = base.replace(correction=TruncatedIS(cap=2.0, floor=0.5))
    step = prepare(batch, base)
    (g_base,) = torch.autograd.grad(loss(lp, step, base)[0], lp)
    (g_floor,) = torch.autograd.grad(loss(lp, step, floored)[0], lp)
    factor = torch.tensor([e(0.5), 0.5, 2.0, e(0.1), e(0.2)], dtype=lp.dtype)
    assert _per_token(batch, g_floor) == pytest.approx(
        (torch.tensor(_per_token(batch, g_base), dtype=lp.dtype) * factor).tolist(), abs=EXACT)
    assert not TruncatedIS(cap=2.0, floor=0.5)(batch).factor_RC.requires_grad


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(cap=2.0, floor=-0.1), ValueError, "floor"),
    (dict(cap=2.0, floor=2.0), ValueError, "floor"),        # the band must not be empty
    (dict(cap=2.0, floor=3.0), ValueError, "floor"),
    (dict(cap=2.0, floor=math.inf), ValueError, "floor"),
    (dict(cap=2.0, floor=math.nan), ValueError, "floor"),
    (dict(cap=2.0, floor="0.5"), TypeError, "floor"),
    (dict(cap=2.0, floor=True), TypeError, "floor"),
    (dict(cap=0.0, floor=0.5), ValueError, "cap"),
])
def test_bad_floors_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        TruncatedIS(**kwargs)
    with pytest.raises(error, match=match):
        truncated_importance_weight(torch.zeros(1, 1, dtype=torch.float64), **kwargs)


# ------------------------------------------------------------------ exact moments with a floor
@pytest.fixture(scope="module")
def world():
    """Two prompts, 15 responses each; π_old = π and a discrepant inference copy μ."""
    mdp = TokenMDP(3, 3, rewards.RandomTable(seed=2), prompts=[(0,), (1,)],
                   prompt_probs=[0.4, 0.6])
    pi = TabularPolicy(mdp, generator=torch.Generator().manual_seed(0))
    mu = inference_copy(pi, noise_std=0.5, generator=torch.Generator().manual_seed(1))
    return mdp, pi, mu


def _estimator(correction):
    return Estimator(surrogate=Reinforce(), advantage=RewardAsAdvantage(), correction=correction,
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM)


def _closed_form(mdp, pi, mu, level, floor, cap, keep_graph=False):
    """``E_μ[R(y) Σ_t f_t ∇log π(y_t)]`` with ``f = clamp(w, F, C)`` at ``level``, summed over
    the enumeration (``π_old = π``; None with ``keep_graph``), the weights ``D(x) μ(y|x)`` and
    the per-response ``R(y) Σ_t f_t log π(y_t)`` (``f`` held fixed) whose gradients are the
    estimates of a one-response batch."""
    batch = mdp.enumerate()
    lp = pi.token_logprobs(batch)
    with torch.no_grad():
        log_w = ((lp - mu.token_logprobs(batch)) * batch.loss_mask).sum(1)  # one row each
        if level is Level.GEOMETRIC:
            log_w = log_w / batch.loss_mask.sum(1)
        if level is Level.TOKEN:
            w = (lp - mu.token_logprobs(batch)).exp()
        else:
            w = log_w.exp()[:, None].expand_as(lp)
        f = w.clamp(min=floor or 0.0, max=cap) * batch.loss_mask
        p = mdp.prompt_probs[batch.prompt_index] * exact_sequence_probs(mdp, mu)
    per_response = (f * lp).sum(1) * mdp.rewards   # R(y) Σ_t f_t log π(y_t), f held fixed
    mean = None if keep_graph else flat_grad((p * per_response).sum(), pi)
    return mean, p, per_response


@pytest.mark.parametrize("level", list(Level), ids=[lv.value for lv in Level])
def test_exact_mean_with_a_floor_is_the_closed_form_and_differs_from_plain_tis(world, level):
    mdp, pi, mu = world
    cap, floor = 1.5, 0.8
    kw = dict(group_size=2, behavior=mu, old=pi)
    floored = moments(mdp, pi, _estimator(TruncatedIS(cap=cap, level=level, floor=floor)), **kw)
    plain = moments(mdp, pi, _estimator(TruncatedIS(cap=cap, level=level)), **kw)
    expected, _, _ = _closed_form(mdp, pi, mu, level, floor, cap)
    torch.testing.assert_close(floored.mean, expected, rtol=0, atol=TIE)
    torch.testing.assert_close(plain.mean, _closed_form(mdp, pi, mu, level, None, cap)[0],
                               rtol=0, atol=TIE)
    assert math.isfinite(floored.total_variance) and torch.isfinite(floored.mean).all()
    # the floor binds on this world: the mean moves, by the lifted tokens' contribution
    assert (floored.mean - plain.mean).norm() > 1e-3 * plain.mean.norm()


def test_exact_variance_with_a_floor_is_the_closed_form(world):
    # one response per batch: ĝ(x, y) = R(y) Σ_t f_t ∇log π(y_t), so tr Cov = E‖ĝ‖² − ‖E ĝ‖²
    mdp, pi, mu = world
    cap, floor = 1.5, 0.8
    m = moments(mdp, pi, _estimator(TruncatedIS(cap=cap, floor=floor)), group_size=1,
                behavior=mu, old=pi)
    _, p, per_response = _closed_form(mdp, pi, mu, Level.TOKEN, floor, cap, keep_graph=True)
    params = list(pi.parameters())
    mean, second = 0.0, 0.0
    for i in range(per_response.numel()):
        grads = torch.autograd.grad(per_response[i], params, retain_graph=True,
                                    allow_unused=True)
        g = torch.cat([(torch.zeros_like(q) if gi is None else gi).reshape(-1)
                       for q, gi in zip(params, grads, strict=True)])
        mean = mean + p[i] * g
        second += float(p[i]) * float(g @ g)
    torch.testing.assert_close(m.mean, mean, rtol=0, atol=TIE)
    assert m.total_variance == pytest.approx(second - float(mean @ mean), abs=1e-10)


def test_a_floor_below_every_ratio_is_plain_tis_and_one_above_every_ratio_scales_reinforce(
        world):
    mdp, pi, mu = world
    kw = dict(group_size=2, behavior=mu, old=pi)
    batch = mdp.enumerate()
    with torch.no_grad():
        w = (pi.token_logprobs(batch) - mu.token_logprobs(batch)).exp()[batch.loss_mask]
    low, high = float(w.min()), float(w.max())
    assert low < 1 < high                       # μ is discrepant on both sides
    plain = moments(mdp, pi, _estimator(TruncatedIS(cap=2 * high)), **kw)
    below = moments(mdp, pi, _estimator(TruncatedIS(cap=2 * high, floor=low / 2)), **kw)
    torch.testing.assert_close(below.mean, plain.mean, rtol=0, atol=TIE)
    assert below.total_variance == pytest.approx(plain.total_variance, abs=1e-10)
    # a floor F above every ratio lifts every w to F: the factor is the constant F, so the step
    # is F times uncorrected REINFORCE under μ (mean F·m, variance F²·v)
    floor = 2 * high
    lifted = moments(mdp, pi, _estimator(TruncatedIS(cap=2 * floor, floor=floor)), **kw)
    none = moments(mdp, pi, _estimator(NoCorrection()), **kw)
    torch.testing.assert_close(lifted.mean, floor * none.mean, rtol=0, atol=TIE)
    assert lifted.total_variance == pytest.approx(floor ** 2 * none.total_variance, rel=1e-10)
