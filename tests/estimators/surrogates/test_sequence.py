"""Sequence-level surrogates: hand-worked ratios, GSPO-token vs GSPO, layouts, long sequences."""

from __future__ import annotations

import math

import pytest
import torch

from tests.estimators.estimator_helpers import DTYPE, make_batch, per_token_values, repack, response_values
from tokenmdp.estimators import (
    GSPO,
    MAX_LOG_RATIO,
    Aggregation,
    Estimator,
    GroupNormalized,
    GSPOToken,
    ImportanceSampling,
    Level,
    SequenceRatio,
    gspo_term,
    gspo_token_term,
    loss,
    prepare,
    sequence_log_ratio,
    sequence_ratio_term,
)

EXACT = 1e-12  # float64 closed forms
GRAD = 1e-10  # float64 gradients through a few dozen operations

# Two sequences: prompt [7], response of 3 tokens; prompt [8], response of 1 token.
# log r per response token: seq 0 [0.3, -0.1, 0.4] (sum 0.6, mean 0.2); seq 1 [-0.5].
# Â: seq 0 +1, seq 1 -1.
OLD = [[math.log(0.5), math.log(0.25), math.log(0.4)], [math.log(0.3)]]
LOG_R = [[0.3, -0.1, 0.4], [-0.5]]
ADV = [[1.0, 1.0, 1.0], [-1.0]]


def _fixture(packed: bool):
    batch = make_batch([[7], [8]], [[1, 2, 3], [4]], rewards=[1.0, 0.0], old=OLD)
    if packed:  # one row: [7 1 2 3 8 4]
        batch = repack(batch, [[0, 1]], capacity=6)
    lp = (batch.old_logprob + response_values(batch, LOG_R)).requires_grad_(True)
    return batch, lp, response_values(batch, ADV)


_per_token = per_token_values  # response-token values, layout-free


@pytest.mark.parametrize("packed", [False, True])
def test_geometric_mean_and_product_sequence_log_ratios(packed):
    batch, lp, _ = _fixture(packed)
    assert sequence_log_ratio(lp, batch.old_logprob, batch, geometric=True).tolist() == \
        pytest.approx([0.2, -0.5], abs=EXACT)  # (0.3 - 0.1 + 0.4)/3 and -0.5/1
    assert sequence_log_ratio(lp, batch.old_logprob, batch, geometric=False).tolist() == \
        pytest.approx([0.6, -0.5], abs=EXACT)


@pytest.mark.parametrize("packed", [False, True])
def test_gspo_hand_worked_values_and_clip(packed):
    batch, lp, adv = _fixture(packed)
    s0, s1 = math.exp(0.2), math.exp(-0.5)  # 1.2214, 0.6065
    # ε = 0.1: seq 0 min(1.2214, 1.1) = 1.1 (clipped); seq 1 min(-0.6065, -0.9) = -0.9 (clipped)
    tight = gspo_term(lp, batch.old_logprob, adv, batch, eps_low=0.1, eps_high=0.1)
    assert _per_token(batch, tight.term_RC) == pytest.approx([1.1] * 3 + [-0.9], abs=EXACT)
    assert _per_token(batch, tight.clipped_RC.to(DTYPE)) == [1.0] * 4
    (g,) = torch.autograd.grad(tight.term_RC.sum(), lp)
    assert g.abs().max() == 0.0
    # ε = 0.5: both inside [0.5, 1.5]; each token carries s_i Â, and the gradient of the
    # sequence's token sum with respect to each of its log-probs is s_i Â (|y| · s Â / |y|).
    wide = gspo_term(lp, batch.old_logprob, adv, batch, eps_low=0.5, eps_high=0.5)
    assert _per_token(batch, wide.term_RC) == pytest.approx([s0] * 3 + [-s1], abs=EXACT)
    (g,) = torch.autograd.grad(wide.term_RC.sum(), lp)
    assert _per_token(batch, g) == pytest.approx([s0] * 3 + [-s1], abs=EXACT)


@pytest.mark.parametrize("packed", [False, True])
def test_sequence_ratio_spreads_rho_over_the_tokens(packed):
    batch, lp, adv = _fixture(packed)
    rho0, rho1 = math.exp(0.6), math.exp(-0.5)
    out = sequence_ratio_term(lp, batch.old_logprob, adv, batch)
    assert _per_token(batch, out.term_RC) == pytest.approx([rho0 / 3] * 3 + [-rho1], abs=EXACT)
    (g,) = torch.autograd.grad(out.term_RC.sum(), lp)
    assert _per_token(batch, g) == pytest.approx([rho0] * 3 + [-rho1], abs=EXACT)


def _random_batch(seed, per_token_advantage):
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 1, 4, 2, 5, 2]
    responses = [[1] * n for n in lengths]
    old = [(-torch.rand(n, generator=gen, dtype=DTYPE) - 0.2).tolist() for n in lengths]
    batch = make_batch([[5]] * 6, responses, rewards=[1.0, 0.0, 0.5, 1.0, 0.0, 0.2],
                       groups=[0, 0, 0, 1, 1, 1], old=old)
    lp = (batch.old_logprob + 0.05 * torch.randn(batch.tokens.shape, generator=gen, dtype=DTYPE)
          * batch.loss_mask).requires_grad_(True)
    est = Estimator(surrogate=GSPO(eps_low=0.2, eps_high=0.2), advantage=GroupNormalized(),
                    aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_MEAN)
    batch = prepare(batch, est)
    if per_token_advantage:
        noise = torch.rand(batch.tokens.shape, generator=gen, dtype=DTYPE) * batch.loss_mask
        batch = batch.replace(advantage=batch.advantage + noise)
    return batch, lp, est


def test_gspo_token_equals_gspo_in_value_and_gradient_for_sequence_constant_advantages():
    batch, lp, est = _random_batch(0, per_token_advantage=False)
    seq_loss, _ = loss(lp, batch, est)
    tok_loss, _ = loss(lp, batch, est.replace(surrogate=GSPOToken(eps_low=0.2, eps_high=0.2)))
    (g_seq,) = torch.autograd.grad(seq_loss, lp)
    (g_tok,) = torch.autograd.grad(tok_loss, lp)
    assert tok_loss.item() == pytest.approx(seq_loss.item(), abs=EXACT)
    assert torch.allclose(g_tok, g_seq, atol=GRAD, rtol=0)
    assert g_seq.abs().max() > 1e-3  # not vacuous: the gradient is there


def test_gspo_token_differs_from_gspo_with_per_token_advantages():
    # The identity needs Â constant in each sequence; with per-token Â the token gradients
    # s_i Â_it ∇log π_t differ from GSPO's (mean over the sequence of Â) s_i ∇log π_t.
    batch, lp, est = _random_batch(1, per_token_advantage=True)
    (g_seq,) = torch.autograd.grad(loss(lp, batch, est)[0], lp)
    tok = est.replace(surrogate=GSPOToken(eps_low=0.2, eps_high=0.2))
    (g_tok,) = torch.autograd.grad(loss(lp, batch, tok)[0], lp)
    assert (g_tok - g_seq).abs().max() > 1e-3


def test_gspo_token_direct_values_match_gspo():
    batch, lp, adv = _fixture(packed=True)
    a = gspo_term(lp, batch.old_logprob, adv, batch, eps_low=0.5, eps_high=0.5).term_RC
    b = gspo_token_term(lp, batch.old_logprob, adv, batch, eps_low=0.5, eps_high=0.5).term_RC
    assert torch.allclose(a, b, atol=EXACT, rtol=0)


@pytest.mark.parametrize("pattern", ["plus", "minus", "alternating"])
def test_sequence_is_over_4096_tokens_with_unit_log_ratios_stays_finite(pattern):
    n = 4096
    steps = {"plus": [1.0] * n, "minus": [-1.0] * n,
             "alternating": [(-1.0) ** t for t in range(n)]}[pattern]
    old = [[-3.0] * n]
    behavior = [[-3.0 - s for s in steps]]  # log(π_old/μ) = ±1 per token as well
    batch = make_batch([[0]], [[1] * n], rewards=[1.0], old=old, behavior=behavior)
    lp = (batch.old_logprob + response_values(batch, [steps])).requires_grad_(True)
    est = Estimator(surrogate=SequenceRatio(), correction=ImportanceSampling(level=Level.SEQUENCE),
                    aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM)
    value, metrics = loss(lp, prepare(batch, est), est)
    (g,) = torch.autograd.grad(value, lp)
    assert math.isfinite(value.item()) and torch.isfinite(g).all()
    assert all(math.isfinite(v.item()) for v in metrics.values())
    if pattern == "plus":  # Σ log r = 4096: both factors held at e^20, no gradient
        assert value.item() == pytest.approx(-math.exp(2 * MAX_LOG_RATIO), rel=1e-12)
        assert g.abs().max() == 0.0 and metrics["clip_fraction"].item() == 1.0
    elif pattern == "minus":  # ρ(y) = e^-4096 underflows to exactly 0
        assert value.item() == 0.0 and g.abs().max() == 0.0
    else:  # Σ log r = 0: ρ = 1, each token's gradient is -ρ Â = -1 (A = R = 1, weight 1)
        assert value.item() == pytest.approx(-1.0, abs=1e-9)
        assert torch.allclose(g[batch.loss_mask], torch.full((n,), -1.0, dtype=DTYPE),
                              atol=1e-9)
