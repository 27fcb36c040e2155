"""ESS and χ² of the correction weights ``w = π_old/μ`` in the estimator metrics.

Against a direct computation from the definitions (Kong's ``(Σw)²/(n Σw²)``, ``mean w² − 1``) at
the token and the sequence level, on hand-made batches in two layouts; against the exact χ² of
:func:`tokenmdp.exact.world.chi_square.chi_square` on an enumerable MDP, which the Monte Carlo average
of the metric must approach; float32 precision near ``w = 1``; neutral values without tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.estimators.estimator_helpers import make_batch, repack
from tokenmdp.estimators import (
    Estimator,
    ImportanceSampling,
    Level,
    MaskedIS,
    NoCorrection,
    Reinforce,
    TruncatedIS,
    loss,
    prepare,
)
from tokenmdp.estimators.corrections.diagnostics import (
    batch_weight_sums,
    correction_diagnostics,
    diagnostics_from_sums,
    ess_and_chi2,
    weight_sums,
)
from tokenmdp.exact import TabularPolicy, TokenMDP, inference_copy, sample, sequence_probs
from tokenmdp.exact.world.chi_square import chi_square
from tokenmdp.exact.world.rewards import RandomTable

EXACT = 1e-12      # float64 sums of a few terms, in another order
Z_TOL = 4.0        # |Monte Carlo mean - exact| in standard errors
FLOAT32_TOL = 1e-9  # absolute error of the float32 χ² near w = 1 (the naive formula: ~1e-7)

OLD = [[-0.5, -1.2, -0.1], [-2.0, -0.3], [-0.7]]
BEHAVIOR = [[-0.6, -0.9, -0.4], [-1.5, -0.3], [-1.4]]


def _batch(**kw):
    return make_batch([[1], [2], [3]], [[4, 5, 6], [7, 8], [9]], rewards=[1.0, 0.0, 2.0],
                      groups=[0, 0, 1], old=OLD, behavior=BEHAVIOR, **kw)


def _definitions(log_w):
    w = [math.exp(v) for v in log_w]
    return sum(w) ** 2 / (len(w) * sum(x * x for x in w)), sum(x * x for x in w) / len(w) - 1


def _metrics(batch, correction):
    est = Estimator(surrogate=Reinforce(), correction=correction)
    batch = prepare(batch, est)
    logprobs = torch.zeros(batch.tokens.shape, dtype=batch.dtype)
    return loss(logprobs, batch, est)[1]


TOKEN_LOG_W = [o - b for os_, bs in zip(OLD, BEHAVIOR) for o, b in zip(os_, bs)]
SEQUENCE_LOG_W = [sum(o - b for o, b in zip(os_, bs)) for os_, bs in zip(OLD, BEHAVIOR)]


@pytest.mark.parametrize("correction, sequence", [
    (NoCorrection(), False), (TruncatedIS(cap=2.0), False),
    (ImportanceSampling(level=Level.SEQUENCE), True),
    (MaskedIS(low=0.5, high=5.0, level=Level.GEOMETRIC, masked_in_normalizer=True), True)])
def test_metrics_are_the_definitions(correction, sequence):
    m = _metrics(_batch(), correction)
    ess, chi2 = _definitions(TOKEN_LOG_W)
    assert m["is_ess"].item() == pytest.approx(ess, abs=EXACT)
    assert m["is_chi2"].item() == pytest.approx(chi2, abs=EXACT)
    assert ("is_seq_ess" in m) == sequence and ("is_seq_chi2" in m) == sequence
    if sequence:
        ess, chi2 = _definitions(SEQUENCE_LOG_W)
        assert m["is_seq_ess"].item() == pytest.approx(ess, abs=EXACT)
        assert m["is_seq_chi2"].item() == pytest.approx(chi2, abs=EXACT)


def test_the_layout_does_not_change_them():
    batch = _batch()
    packed = repack(batch, [[0, 2], [1]], capacity=8)
    a = correction_diagnostics(batch, sequence=True)
    b = correction_diagnostics(packed, sequence=True)
    assert all(abs(a[k].item() - b[k].item()) < EXACT for k in a)


def test_no_behavior_logprob_no_diagnostics():
    batch = make_batch([[1]], [[4, 5]], rewards=[1.0], old=[[-0.5, -0.2]])
    m = _metrics(batch, NoCorrection())
    assert "is_ess" not in m and "is_chi2" not in m


def test_sums_add_over_parts_and_round_trip_through_floats():
    # two parts of one step (as two data-parallel ranks): summed sums give the whole's values
    whole = correction_diagnostics(_batch(), sequence=True)
    first = make_batch([[1], [2]], [[4, 5, 6], [7, 8]], rewards=[1.0, 0.0], old=OLD[:2],
                       behavior=BEHAVIOR[:2])
    second = make_batch([[3]], [[9]], rewards=[2.0], old=OLD[2:], behavior=BEHAVIOR[2:])
    a, b = batch_weight_sums(first, sequence=True), batch_weight_sums(second, sequence=True)
    step = diagnostics_from_sums({k: a[k] + b[k] for k in a})
    assert set(step) == set(whole)
    assert all(abs(step[k] - whole[k].item()) < EXACT for k in whole)


def test_neutral_without_tokens_and_bounds():
    ess, chi2 = ess_and_chi2(0.0, 0.0, 0.0)
    assert ess.item() == 1.0 and chi2.item() == 0.0
    # one huge weight among many: ESS/n -> 1/n; equal weights: ESS/n = 1, χ² = 0
    log_w = torch.tensor([15.0] + [0.0] * 99, dtype=torch.float64)
    ess, _ = ess_and_chi2(*weight_sums(log_w, torch.ones(100, dtype=torch.bool)))
    big = math.exp(15.0)
    assert ess.item() == pytest.approx((big + 99) ** 2 / (100 * (big ** 2 + 99)), rel=EXACT)
    assert 1 / 100 < ess.item() < 1 / 100 * (1 + 1e-4)
    ess, chi2 = ess_and_chi2(*weight_sums(torch.zeros(5, dtype=torch.float64),
                                          torch.ones(5, dtype=torch.bool)))
    assert ess.item() == 1.0 and chi2.item() == 0.0
    with pytest.raises(ValueError, match="mask"):
        weight_sums(log_w, torch.ones(3, dtype=torch.bool))


def test_float32_near_one_keeps_the_small_chi2():
    # |log w| ~ 1e-4 (bf16-like mismatch): χ² ~ 1e-8. mean(w²) − 1 in float32 loses it to
    # rounding (errors ~ 1e-7); the expm1 form keeps it. Reference: the float64 definition.
    gen = torch.Generator().manual_seed(0)
    log_w64 = 1e-4 * torch.randn(4000, generator=gen, dtype=torch.float64)
    log_w32 = log_w64.float()
    mask = torch.ones(4000, dtype=torch.bool)
    _, ref = ess_and_chi2(*weight_sums(log_w32.double(), mask))
    w64 = log_w32.double().exp()
    assert abs(ref.item() - float((w64 ** 2).mean() - 1)) < 1e-15
    _, got = ess_and_chi2(*weight_sums(log_w32, mask))
    assert abs(got.item() - ref.item()) < FLOAT32_TOL
    naive = float((log_w32.exp() ** 2).mean() - 1)
    assert abs(naive - ref.item()) > 10 * FLOAT32_TOL          # what the expm1 form avoids


@pytest.fixture(scope="module")
def world():
    mdp = TokenMDP(3, 3, RandomTable(seed=4))
    old = TabularPolicy(mdp, generator=torch.Generator().manual_seed(2), init_std=1.0)
    mu = inference_copy(old, rounding=3, noise_std=0.3, generator=torch.Generator().manual_seed(5))
    return mdp, old, mu


def test_exact_chi_square_by_direct_sums(world):
    mdp, old, mu = world
    p, q = sequence_probs(mdp, old).detach(), sequence_probs(mdp, mu).detach()
    prompt = mdp.terminal_prompt_index
    by_prompt = [float((p[prompt == x] ** 2 / q[prompt == x]).sum())
                 for x in range(mdp.num_prompts)]
    for G in (1, 2, 3):
        direct = sum(float(mdp.prompt_probs[x]) * s ** G for x, s in enumerate(by_prompt)) - 1
        assert abs(chi_square(mdp, old, mu, group_size=G).item() - direct) < EXACT
    # token level: the pooled Σ_y μ(y) Σ_t (w_t² − 1) / E_μ|y| over the enumerated responses
    enum = mdp.enumerate()
    with torch.no_grad():
        log_w = torch.where(enum.loss_mask, old.token_logprobs(enum) - mu.token_logprobs(enum),
                            0.0)
    weight = mdp.prompt_probs[prompt] * q
    excess = torch.where(enum.loss_mask, (2 * log_w).exp() - 1, 0.0).sum(1)
    pooled = float((weight * excess).sum() / (weight * enum.length).sum())
    assert abs(chi_square(mdp, old, mu, level="token").item() - pooled) < EXACT
    assert chi_square(mdp, old, old).abs().item() < EXACT


def test_monte_carlo_metrics_approach_the_exact_chi_square(world):
    mdp, old, mu = world
    gen = torch.Generator().manual_seed(11)
    token, seq = [], []
    for _ in range(8):
        batch = sample(mdp, mu, 4000, generator=gen)
        with torch.no_grad():
            batch = batch.replace(old_logprob=old.token_logprobs(batch))
        m = correction_diagnostics(batch, sequence=True)
        token.append(m["is_chi2"].item())
        seq.append(m["is_seq_chi2"].item())
    for values, level in ((token, "token"), (seq, "sequence")):
        values = torch.tensor(values, dtype=torch.float64)
        mean, se = values.mean().item(), (values.std() / len(values) ** 0.5).item()
        exact = chi_square(mdp, old, mu, level=level).item()
        assert exact > 0.01                       # a real mismatch, not a trivial zero
        assert abs(mean - exact) < Z_TOL * se, (level, mean, exact, se)


def test_chi_square_rejects_bad_arguments(world):
    mdp, old, mu = world
    with pytest.raises(ValueError, match="level"):
        chi_square(mdp, old, mu, level="tokens")
    with pytest.raises(ValueError, match="group_size"):
        chi_square(mdp, old, mu, group_size=0)
    with pytest.raises(ValueError, match="group_size"):
        chi_square(mdp, old, mu, level="token", group_size=2)
