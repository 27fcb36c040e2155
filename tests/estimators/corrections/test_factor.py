"""Training–inference corrections: token, sequence and geometric-mean factors; the normalizer."""

from __future__ import annotations

import math

import pytest
import torch

from tests.estimators.estimator_helpers import DTYPE, make_batch, per_token_values, weighted_batch
from tokenmdp.estimators import (
    Aggregation,
    Estimator,
    ImportanceSampling,
    Level,
    MaskedIS,
    NoCorrection,
    Reinforce,
    SequenceCount,
    TruncatedIS,
    loss,
    prepare,
    step_counts,
)

EXACT = 1e-12  # float64 closed forms

# log w = log π_old - log μ per loss token:
#   seq 0: [0.5, -1.0, 1.2]  w = [1.6487, 0.3679, 3.3201]; Σ = 0.7 (W = 2.0138), mean 0.2333
#   seq 1: [0.1, 0.2]        w = [1.1052, 1.2214];        Σ = 0.3 (W = 1.3499), mean 0.15
e = math.exp


def _batch(packed=False):
    return weighted_batch([1.0, 0.0], packed_order=[0, 1] if packed else None)


_per_token = per_token_values


CASES = [
    # token level
    (ImportanceSampling(level=Level.TOKEN), [e(0.5), e(-1), e(1.2), e(0.1), e(0.2)], None),
    (TruncatedIS(cap=2.0), [e(0.5), e(-1), 2.0, e(0.1), e(0.2)], None),
    (MaskedIS(high=2.0, masked_in_normalizer=True),  # threshold: rejects w = 3.32
     [e(0.5), e(-1), 0.0, e(0.1), e(0.2)], [1, 1, 0, 1, 1]),
    (MaskedIS(low=0.5, high=2.0, masked_in_normalizer=True),  # band: also rejects w = 0.37
     [e(0.5), 0.0, 0.0, e(0.1), e(0.2)], [1, 0, 0, 1, 1]),
    # sequence level: products W_0 = e^0.7 = 2.01, W_1 = e^0.3
    (ImportanceSampling(level=Level.SEQUENCE), [e(0.7)] * 3 + [e(0.3)] * 2, None),
    (TruncatedIS(cap=2.0, level=Level.SEQUENCE), [2.0] * 3 + [e(0.3)] * 2, None),
    (MaskedIS(high=2.0, level=Level.SEQUENCE, masked_in_normalizer=True),
     [0.0] * 3 + [e(0.3)] * 2, [0, 0, 0, 1, 1]),
    # geometric mean: e^(0.7/3) = 1.2628, e^0.15 = 1.1618
    (ImportanceSampling(level=Level.GEOMETRIC), [e(0.7 / 3)] * 3 + [e(0.15)] * 2, None),
    (TruncatedIS(cap=1.2, level=Level.GEOMETRIC), [1.2] * 3 + [e(0.15)] * 2, None),
    (MaskedIS(low=0.5, high=1.2, level=Level.GEOMETRIC, masked_in_normalizer=True),
     [0.0] * 3 + [e(0.15)] * 2, [0, 0, 0, 1, 1]),
]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(("correction", "factor", "keep"), CASES,
                         ids=[c.describe() for c, _, _ in CASES])
def test_hand_worked_correction_factors(correction, factor, keep, packed):
    batch = _batch(packed)
    out = correction(batch)
    assert _per_token(batch, out.factor_RC) == pytest.approx(factor, abs=EXACT)
    if keep is None:
        assert out.keep_RC is None
    else:
        assert _per_token(batch, out.keep_RC.to(DTYPE)) == keep


def test_no_correction_needs_no_log_probs():
    batch = make_batch([[1]], [[2]], rewards=[1.0])
    assert NoCorrection()(batch) == (None, None)


@pytest.mark.parametrize("in_normalizer", [True, False])
def test_masked_tokens_stay_in_the_normalizer_only_when_told(in_normalizer):
    batch = _batch()
    est = Estimator(surrogate=Reinforce(), aggregation=Aggregation.TOKEN_MEAN,
                    correction=MaskedIS(low=0.5, high=2.0, masked_in_normalizer=in_normalizer))
    step = prepare(batch, est)
    # 5 loss tokens, 2 rejected: 1/5 on every token, or 1/3 on the kept ones and 0 on the rest
    expected = [0.2] * 5 if in_normalizer else [1 / 3, 0.0, 0.0, 1 / 3, 1 / 3]
    assert _per_token(step, step.loss_weight) == pytest.approx(expected, abs=EXACT)
    assert step_counts(batch, est) == ((5, 2) if in_normalizer else (3, 2))
    _, metrics = loss(step.old_logprob.clone(), step, est)
    assert metrics["masked_fraction"].item() == pytest.approx(2 / 5, abs=EXACT)


def test_sequence_level_rejection_removes_the_sequence_from_the_count():
    batch = _batch()
    est = Estimator(surrogate=Reinforce(), aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM,
                    correction=MaskedIS(high=2.0, level=Level.SEQUENCE,
                                        masked_in_normalizer=False),
                    sequence_count=SequenceCount.WITH_LOSS_TOKENS)
    step = prepare(batch, est)
    # sequence 0 (W = 2.01) is rejected: S = 1, so sequence 1's tokens get weight 1
    assert _per_token(step, step.loss_weight) == pytest.approx([0, 0, 0, 1, 1], abs=EXACT)
    # counting every sampled sequence (the default), the rejected one stays in S = 2
    step = prepare(batch, est.replace(sequence_count=SequenceCount.SAMPLED))
    assert _per_token(step, step.loss_weight) == pytest.approx([0, 0, 0, 0.5, 0.5], abs=EXACT)


def test_factor_multiplies_the_surrogate_in_the_loss():
    batch = _batch()
    lp = batch.old_logprob.clone().requires_grad_(True)
    base = Estimator(surrogate=Reinforce(), aggregation=Aggregation.TOKEN_SUM)
    tis = base.replace(correction=TruncatedIS(cap=2.0))
    step = prepare(batch, base)
    (g_base,) = torch.autograd.grad(loss(lp, step, base)[0], lp)
    (g_tis,) = torch.autograd.grad(loss(lp, step, tis)[0], lp)
    factor = TruncatedIS(cap=2.0)(batch).factor_RC
    assert torch.allclose(g_tis, g_base * factor, atol=EXACT, rtol=0)


def test_bad_corrections_raise():
    with pytest.raises(ValueError, match="cap"):
        TruncatedIS(cap=0.0)
    with pytest.raises(ValueError, match="low"):
        MaskedIS(low=3.0, high=2.0, masked_in_normalizer=True)
    with pytest.raises(TypeError):
        MaskedIS(high=2.0)  # the normalizer choice must be explicit
    batch = make_batch([[1]], [[2]], rewards=[1.0], old=[[-1.0]])
    with pytest.raises(ValueError, match="behavior_logprob"):
        TruncatedIS()(batch)
