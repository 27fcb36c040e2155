"""Rejection masks without IS weighting (verl ``rollout_rs``): hand-worked keeps at every
statistic and reduction (padded and packed), agreement with an independent transcription of
verl's rule on padded rows, factor exactly 1 on kept tokens (an all-accepting band is no
correction bit for bit), the gradient identity with rejects in or out of the normalizer, the
diagnostics, verl's option strings, bad bands, and the exact mean against a closed form."""

from __future__ import annotations

import math

import pytest
import torch

from tests.estimators.estimator_helpers import LOG_W, make_batch, per_token_values, weighted_batch
from tokenmdp.estimators import (
    Aggregation,
    Estimator,
    NoCorrection,
    Reinforce,
    RejectionSampling,
    RewardAsAdvantage,
    loss,
    prepare,
    step_counts,
)
from tokenmdp.estimators.corrections.rejection import rejection_keep_mask, rejection_statistic
from tokenmdp.exact import TabularPolicy, TokenMDP, flat_grad, inference_copy
from tokenmdp.exact import sequence_probs as exact_sequence_probs
from tokenmdp.exact.lab.moments import moments
from tokenmdp.exact.world import rewards

EXACT = 1e-12  # float64 closed forms of a few terms
TIE = 1e-12    # float64 enumeration sums of ~30 terms

# ℓ = log π_old - log μ per loss token:
#   seq 0: [0.5, -1.0, 1.2]  k1 = -ℓ, k2 = [0.125, 0.5, 0.72], k3 = [0.1487, 0.3679, 1.1201]
#   seq 1: [0.1, 0.2]        k2 = [0.005, 0.02], k3 = [0.00517, 0.0214]


def _batch(packed=False):
    return weighted_batch([1.0, -0.5], packed_order=[1, 0] if packed else None)


_per_token = per_token_values


T, F = True, False
CASES = [
    # token k1: exp(k1) = μ/π_old = [0.61, 2.72, 0.30], [0.90, 0.82] against [0.5, 2]
    (dict(statistic="k1", low=0.5, high=2.0), [T, F, F, T, T]),
    (dict(statistic="k2", high=0.3), [T, F, F, T, T]),
    (dict(statistic="k3", high=0.4), [T, T, F, T, T]),
    # sums of k1: -0.7, -0.3, products μ/π_old 0.497, 0.741 against [0.5, 2]
    (dict(statistic="k1", reduce="sum", low=0.5, high=2.0), [F, F, F, T, T]),
    # means of k1: geometric means 0.792, 0.861 against [0.8, 1.25] (a single C = 1.25)
    (dict(statistic="k1", reduce="mean", high=1.25), [F, F, F, T, T]),
    (dict(statistic="k3", reduce="sum", high=1.0), [F, F, F, T, T]),     # 1.637, 0.027
    (dict(statistic="k2", reduce="mean", high=0.4), [F, F, F, T, T]),    # 0.448, 0.0125
    (dict(statistic="k2", reduce="max", high=0.6), [F, F, F, T, T]),     # 0.72, 0.02
    (dict(statistic="k3", reduce="max", high=1.2), [T, T, T, T, T]),     # 1.120, 0.021
]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize(("kwargs", "keep"), CASES, ids=[str(i) for i in range(len(CASES))])
def test_hand_worked_keeps_and_factor_one(kwargs, keep, packed):
    batch = _batch(packed)
    part = RejectionSampling(masked_in_normalizer=False, **kwargs)
    out = part(batch)
    assert _per_token(batch, out.keep_RC) == keep
    assert _per_token(batch, out.factor_RC) == [1.0 if k else 0.0 for k in keep]


def test_statistics_by_hand():
    batch = _batch()
    log_w = (batch.old_logprob - batch.behavior_logprob) * batch.loss_mask
    k3 = [math.expm1(v) - v for v in LOG_W[0] + LOG_W[1]]
    got = _per_token(batch, rejection_statistic(log_w, batch, statistic="k3", reduce="token"))
    assert got == pytest.approx(k3, abs=EXACT)
    mean_k2 = [(0.125 + 0.5 + 0.72) / 3] * 3 + [(0.005 + 0.02) / 2] * 2
    got = _per_token(batch, rejection_statistic(log_w, batch, statistic="k2", reduce="mean"))
    assert got == pytest.approx(mean_k2, abs=EXACT)


def _verl_keep(log_ratio, mask, option, upper, lower=None):
    """An independent transcription of verl's rule on padded rows ``[S, T]`` (one sequence a
    row): ``-log r``, ``(log r)²/2`` or ``exp(log r) - 1 - log r`` of ``log r`` held to ±20,
    per token or summed / averaged / maximized over the row, k1 against the log bounds."""
    lr = log_ratio.clamp(-20.0, 20.0)
    kind = option[-2:]
    stat = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": torch.exp(lr) - 1.0 - lr}[kind]
    m = mask.to(lr.dtype)
    if option.startswith("token"):
        s = stat
    elif option.startswith("seq_sum"):
        s = (stat * m).sum(-1, keepdim=True).expand_as(stat)
    elif option.startswith("seq_mean"):
        s = ((stat * m).sum(-1) / m.sum(-1)).unsqueeze(-1).expand_as(stat)
    else:
        s = stat.masked_fill(~mask, float("-inf")).max(-1, keepdim=True).values.expand_as(stat)
    if kind == "k1":
        lower = 1.0 / upper if lower is None else lower
        return (s >= math.log(lower)) & (s <= math.log(upper))
    return s <= upper


OPTIONS = [("token_k1", 1.3, None), ("token_k2", 0.05, None), ("token_k3", 0.05, None),
           ("seq_sum_k1", 2.0, 0.7), ("seq_sum_k2", 0.2, None), ("seq_sum_k3", 0.2, None),
           ("seq_mean_k1", 1.15, None), ("seq_mean_k2", 0.06, None), ("seq_mean_k3", 0.06, None),
           ("seq_max_k2", 0.12, None), ("seq_max_k3", 0.12, None)]


@pytest.mark.parametrize(("option", "upper", "lower"), OPTIONS, ids=[o[0] for o in OPTIONS])
def test_agrees_with_a_transcription_of_verls_rule(option, upper, lower):
    g = torch.Generator().manual_seed(7)
    lengths = [4, 1, 3, 5, 2, 4]
    log_w = [(0.35 * torch.randn(n, generator=g, dtype=torch.float64)).tolist() for n in lengths]
    behavior = [[-1.0] * n for n in lengths]
    old = [[-1.0 + v for v in lw] for lw in log_w]
    batch = make_batch([[9]] * len(lengths), [[1] * n for n in lengths], old=old,
                       behavior=behavior)
    threshold = upper if lower is None else f"{lower}_{upper}"
    part = RejectionSampling.from_verl(option, threshold)
    assert part.verl_option == option
    keep = part(batch).keep_RC
    rows = torch.zeros(len(lengths), max(lengths), dtype=torch.float64)
    mask = torch.zeros(rows.shape, dtype=torch.bool)
    for s, lw in enumerate(log_w):
        rows[s, :len(lw)] = torch.tensor(lw, dtype=torch.float64)
        mask[s, :len(lw)] = True
    expected = _verl_keep(rows, mask, option, upper, lower)
    assert _per_token(batch, keep) == expected[mask].tolist()
    assert 0 < int((~keep & batch.loss_mask).sum()) < int(batch.loss_mask.sum())  # it binds


def _estimator(correction, aggregation=Aggregation.TOKEN_MEAN):
    return Estimator(surrogate=Reinforce(), advantage=RewardAsAdvantage(),
                     correction=correction, aggregation=aggregation)


@pytest.mark.parametrize("masked_in_normalizer", [True, False])
@pytest.mark.parametrize("part", [dict(statistic="k1", low=1e-9, high=1e9),
                                  dict(statistic="k3", reduce="mean", high=1e9),
                                  dict(statistic="k2", reduce="max", high=1e9)],
                         ids=["token_k1", "seq_mean_k3", "seq_max_k2"])
@pytest.mark.parametrize("aggregation", list(Aggregation), ids=lambda a: a.value)
def test_an_all_accepting_band_is_no_correction_bit_for_bit(part, masked_in_normalizer,
                                                           aggregation):
    batch = _batch(packed=True)
    results = []
    for correction in (NoCorrection(),
                       RejectionSampling(masked_in_normalizer=masked_in_normalizer, **part)):
        est = _estimator(correction, aggregation)
        lp = batch.old_logprob.clone().requires_grad_(True)
        step = prepare(batch, est, max_len=4)
        value, metrics = loss(lp, step, est)
        results.append((value, torch.autograd.grad(value, lp)[0], step.loss_weight,
                        step_counts(batch, est), metrics["masked_fraction"]))
    (v0, g0, w0, c0, _), (v1, g1, w1, c1, masked) = results
    assert torch.equal(v0, v1) and torch.equal(g0, g1) and torch.equal(w0, w1)
    assert c0 == c1 and float(masked) == 0.0


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_gradient_identity_with_rejects_in_and_out_of_the_normalizer(packed):
    # token k1 in [0.5, 2] keeps 3 of 5 tokens; with token-mean weights, rejects in the
    # normalizer give keep · (base gradient); out of it the kept ones are scaled by N / N_kept
    batch = _batch(packed)
    lp = batch.old_logprob.clone().requires_grad_(True)
    keep = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    base = _estimator(NoCorrection())
    (g_base,) = torch.autograd.grad(loss(lp, prepare(batch, base), base)[0], lp)
    g_base = torch.tensor(_per_token(batch, g_base), dtype=torch.float64)
    for in_norm, scale in ((True, 1.0), (False, 5.0 / 3.0)):
        est = _estimator(RejectionSampling(statistic="k1", low=0.5, high=2.0,
                                           masked_in_normalizer=in_norm))
        value, metrics = loss(lp, prepare(batch, est), est)
        (g,) = torch.autograd.grad(value, lp)
        assert _per_token(batch, g) == pytest.approx((g_base * keep * scale).tolist(), abs=EXACT)
        assert float(metrics["masked_fraction"]) == pytest.approx(0.4, abs=EXACT)
        assert step_counts(batch, est) == ((5, 2) if in_norm else (3, 2))


def test_diagnostics_by_hand():
    batch = _batch(packed=True)
    token = RejectionSampling(statistic="k2", high=0.3, masked_in_normalizer=False)
    d = token.diagnostics(batch)
    assert float(d["rs_masked_fraction"]) == pytest.approx(2 / 5, abs=EXACT)
    assert float(d["rs_seq_masked_fraction"]) == pytest.approx(1 / 2, abs=EXACT)
    assert float(d["rs_statistic_mean"]) == pytest.approx((0.125 + 0.5 + 0.72 + 0.005 + 0.02) / 5,
                                                          abs=EXACT)
    assert float(d["rs_statistic_max"]) == pytest.approx(0.72, abs=EXACT)
    seq = RejectionSampling(statistic="k1", reduce="sum", low=0.5, high=2.0,
                            masked_in_normalizer=False)
    d = seq.diagnostics(batch)
    assert float(d["rs_masked_fraction"]) == pytest.approx(3 / 5, abs=EXACT)
    assert float(d["rs_seq_masked_fraction"]) == pytest.approx(1 / 2, abs=EXACT)
    assert float(d["rs_statistic_mean"]) == pytest.approx((-0.7 - 0.3) / 2, abs=EXACT)
    assert float(d["rs_statistic_max"]) == pytest.approx(-0.3, abs=EXACT)  # sums of k1 = -ℓ


def test_verl_options_and_labels():
    geo = RejectionSampling.from_verl("seq_mean_k1", "0.999_1.001")
    assert (geo.statistic, geo.reduce, geo.low, geo.high) == ("k1", "mean", 0.999, 1.001)
    assert geo.masked_in_normalizer is False
    single = RejectionSampling.from_verl("token_k1", 2.0)
    assert single.low == 0.5 and single.high == 2.0
    k3 = RejectionSampling.from_verl("seq_max_k3", "0.01", masked_in_normalizer=True)
    assert (k3.statistic, k3.reduce, k3.low, k3.high) == ("k3", "max", None, 0.01)
    assert k3.describe() == "RS seq_max_k3 <= 0.01 (rejects kept in normalizer)"
    assert geo.describe() == "RS seq_mean_k1 [0.999, 1.001] (rejects out of normalizer)"


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(statistic="k1", low=2.0, high=0.5), ValueError, "low"),       # inverted band
    (dict(statistic="k1", low=1.0, high=1.0), ValueError, "low"),       # empty band
    (dict(statistic="k1", low=-0.5, high=2.0), ValueError, "low"),
    (dict(statistic="k3", high=-0.01), ValueError, "high"),            # negative threshold
    (dict(statistic="k2", high=0.0), ValueError, "high"),
    (dict(statistic="k2", high=math.nan), ValueError, "high"),
    (dict(statistic="k3", high=0.1, low=0.01), ValueError, "low"),      # k3 has no lower bound
    (dict(statistic="k4", high=0.1), ValueError, "statistic"),
    (dict(statistic="k2", high=0.1, reduce="median"), ValueError, "reduce"),
    (dict(statistic="k1", high=2.0, reduce="max"), ValueError, "reduce"),
    (dict(statistic="k2", high="0.1"), TypeError, "high"),
])
def test_bad_hyperparameters_raise_naming_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        RejectionSampling(masked_in_normalizer=False, **kwargs)


@pytest.mark.parametrize(("option", "threshold", "match"), [
    ("token_k1,seq_mean_k3", 2.0, "rollout_rs"), ("seq_k2", 1.0, "rollout_rs"),
    ("token_k5", 1.0, "rollout_rs"), ("token_k1", "a_b", "rollout_rs_threshold"),
    ("token_k2", True, "rollout_rs_threshold"), ("seq_mean_k3", "0.1_0.2", "low"),
    ("seq_max_k1", 2.0, "reduce"),
])
def test_bad_verl_options_raise(option, threshold, match):
    with pytest.raises(ValueError, match=match):
        RejectionSampling.from_verl(option, threshold)
    with pytest.raises(TypeError, match="masked_in_normalizer"):
        RejectionSampling(statistic="k2", high=1.0, masked_in_normalizer=1)


def test_keep_mask_function_validates_too():
    with pytest.raises(ValueError, match="low"):
        rejection_keep_mask(torch.zeros(1, 1), statistic="k1", low=3.0, high=2.0)


# ------------------------------------------------------------------ exact moments
@pytest.fixture(scope="module")
def world():
    """Two prompts, 15 responses each; π_old = π and a discrepant inference copy μ."""
    mdp = TokenMDP(3, 3, rewards.RandomTable(seed=2), prompts=[(0,), (1,)],
                   prompt_probs=[0.4, 0.6])
    pi = TabularPolicy(mdp, generator=torch.Generator().manual_seed(0))
    mu = inference_copy(pi, noise_std=0.5, generator=torch.Generator().manual_seed(1))
    return mdp, pi, mu


@pytest.mark.parametrize("part", [dict(statistic="k3", high=0.1),
                                  dict(statistic="k1", reduce="mean", low=0.8, high=1.25)],
                         ids=["token_k3", "seq_mean_k1"])
def test_exact_mean_is_the_closed_form(world, part):
    # REINFORCE, A = R, sequence-mean of token sums, rejects in the normalizer, one response
    # per batch: E[ĝ] = Σ_x D(x) Σ_y μ(y|x) R(y) Σ_t keep_t ∇log π(y_t)
    mdp, pi, mu = world
    correction = RejectionSampling(masked_in_normalizer=True, **part)
    est = _estimator(correction, Aggregation.SEQUENCE_MEAN_TOKEN_SUM)
    m = moments(mdp, pi, est, group_size=1, behavior=mu, old=pi)
    batch = mdp.enumerate()
    lp = pi.token_logprobs(batch)
    with torch.no_grad():
        fields = batch.replace(old_logprob=lp.detach(), behavior_logprob=mu.token_logprobs(batch))
        keep = correction(fields).factor_RC
        p = mdp.prompt_probs[batch.prompt_index] * exact_sequence_probs(mdp, mu)
    expected = flat_grad((p * (keep * lp).sum(1) * mdp.rewards).sum(), pi)
    torch.testing.assert_close(m.mean, expected, rtol=0, atol=TIE)
    assert 0 < float((batch.loss_mask & (keep == 0)).sum()) < float(batch.loss_mask.sum())


def test_extreme_log_ratios_stay_finite_in_float32():
    # ℓ = ±60 is held at ±20 (as verl holds it): k3 = e^20 - 21 is finite in float32
    batch = _batch().to(dtype=torch.float32)
    batch = batch.replace(behavior_logprob=torch.where(
        (batch.sequence_id == 0) & batch.loss_mask, batch.old_logprob - 60.0,
        batch.behavior_logprob + 60.0 * batch.loss_mask))
    for statistic in ("k1", "k2", "k3"):
        for reduce in ("token", "sum", "mean"):
            part = RejectionSampling(statistic=statistic, reduce=reduce, high=2.0,
                                     masked_in_normalizer=False)
            assert torch.isfinite(part.statistic_RC(batch)).all()
            assert not bool((part(batch).keep_RC & batch.loss_mask).any())   # all rejected
