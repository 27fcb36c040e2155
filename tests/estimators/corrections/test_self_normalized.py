"""Self-normalized IS: hand-worked factors at each level (padded and packed, with a cap and with
stacked steps), the factors filled by ``prepare`` and read by every micro-batch, Owen's form
``Σ w f / Σ w`` of the loss and its gradient, and the exact ties: biased but consistent (the
exact bias times G tends to the delta-method constant), G = 1 is the uncorrected estimator,
sequence IS stays unbiased."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.estimators.estimator_helpers import make_batch, per_token_values, weighted_batch
from tests.testing.cases import MAX_RESPONSE_LEN, steps
from tokenmdp import testing
from tokenmdp.estimators import (
    SNIS_FACTOR,
    Aggregation,
    Estimator,
    ImportanceSampling,
    Level,
    NoCorrection,
    Reinforce,
    RewardAsAdvantage,
    SelfNormalizedIS,
    SequenceRatio,
    TokenRatio,
    loss,
    prepare,
    self_normalized_weight,
)
from tokenmdp.exact import TabularPolicy, TokenMDP, inference_copy
from tokenmdp.exact import sequence_probs as exact_sequence_probs
from tokenmdp.exact.lab.moments import moments
from tokenmdp.exact.world import rewards
from tokenmdp.packing import pack_first_fit_decreasing, split_micro_batches

EXACT = 1e-12  # float64 closed forms of a few terms
TIE = 1e-12    # float64 enumeration sums
e = math.exp

# log w = log π_old - log μ: seq 0 [0.5, -1.0, 1.2] (Σ 0.7), seq 1 [0.1, 0.2] (Σ 0.3)
W_TOKEN = [e(0.5), e(-1.0), e(1.2), e(0.1), e(0.2)]


def _batch(packed=False):
    return weighted_batch([1.0, -0.5], packed_order=[1, 0] if packed else None)


_per_token = per_token_values


def _token_case():
    mean = sum(W_TOKEN) / 5
    return [w / mean for w in W_TOKEN]


def _sequence_case(a, b):
    mean = (a + b) / 2
    return [a / mean] * 3 + [b / mean] * 2


CASES = [
    (SelfNormalizedIS(), _token_case()),
    (SelfNormalizedIS(level="sequence"), _sequence_case(e(0.7), e(0.3))),
    (SelfNormalizedIS(level=Level.GEOMETRIC), _sequence_case(e(0.7 / 3), e(0.15))),
    # a cap of 1.5 truncates e^0.5, e^1.2 (tokens) and W_0 = e^0.7 (sequences) first
    (SelfNormalizedIS(cap=1.5), [w / ((1.5 + e(-1) + 1.5 + e(0.1) + e(0.2)) / 5)
                                 for w in [1.5, e(-1), 1.5, e(0.1), e(0.2)]]),
    (SelfNormalizedIS(level="sequence", cap=1.5), _sequence_case(1.5, e(0.3))),
]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize(("part", "factor"), CASES, ids=[c.describe() for c, _ in CASES])
def test_hand_worked_factors(part, factor, packed):
    batch = _batch(packed)
    out = part(batch)                      # not prepared: the batch is the whole step
    assert out.keep_RC is None
    assert _per_token(batch, out.factor_RC) == pytest.approx(factor, abs=EXACT)
    est = Estimator(surrogate=Reinforce(), correction=part)
    prepared = prepare(batch, est)
    assert torch.equal(prepared.token_extras[SNIS_FACTOR], out.factor_RC)
    assert torch.equal(part(prepared).factor_RC, out.factor_RC)


def test_each_stacked_step_is_normalized_by_its_own_mean():
    batch = _batch(packed=True)
    step = torch.tensor([1, 0])
    log_w = (batch.old_logprob - batch.behavior_logprob) * batch.loss_mask
    token = self_normalized_weight(log_w, batch, Level.TOKEN, step=step)
    m0, m1 = sum(W_TOKEN[:3]) / 3, sum(W_TOKEN[3:]) / 2
    assert _per_token(batch, token) == pytest.approx(
        [w / m0 for w in W_TOKEN[:3]] + [w / m1 for w in W_TOKEN[3:]], abs=EXACT)
    est = Estimator(surrogate=Reinforce(), correction=SelfNormalizedIS(level="sequence"))
    prepared = prepare(batch, est, step=step)   # one sequence per step: factor 1
    assert _per_token(batch, prepared.token_extras[SNIS_FACTOR]) == pytest.approx([1.0] * 5,
                                                                                  abs=EXACT)


def _random_step(seed, n=6):
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 1, 4, 2, 5, 2][:n]
    old = [(-torch.rand(k, generator=g, dtype=torch.float64) - 0.2).tolist() for k in lengths]
    behavior = [[o - 0.6 * float(torch.randn(1, generator=g, dtype=torch.float64)) for o in os_]
                for os_ in old]
    batch = make_batch([[9]] * n, [[1 + i % 3] * k for i, k in enumerate(lengths)],
                       rewards=torch.rand(n, generator=g, dtype=torch.float64).tolist(),
                       groups=[i // 2 for i in range(n)], old=old, behavior=behavior)
    lp = (batch.old_logprob + 0.1 * torch.randn(batch.tokens.shape, generator=g,
                                                dtype=torch.float64)) * batch.loss_mask
    return batch, lp


def _verl_batch_normalized(log_ratio, mask, level, cap):
    """A transcription of verl's ``rollout_is_batch_normalize`` on padded rows: the weights
    (token, or exp of the row's sum) truncated at ``cap``, divided by their mean over the valid
    tokens (token) or over the rows' per-row means (sequence)."""
    m = mask.to(log_ratio.dtype)
    if level == "token":
        w = torch.exp(log_ratio.clamp(-20.0, 20.0))
    else:
        w = torch.exp((log_ratio * m).sum(-1, keepdim=True).clamp(-20.0, 20.0)).expand_as(m)
    w = (w * m).clamp(max=cap)
    if level == "token":
        mean = (w * m).sum() / m.sum()
    else:
        per_row = (w * m).sum(-1) / m.sum(-1)
        mean = per_row[m.sum(-1) > 0].mean()
    return w / mean


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_agrees_with_a_transcription_of_verls_batch_normalization(level):
    batch, _ = _random_step(8)
    log_w = (batch.old_logprob - batch.behavior_logprob) * batch.loss_mask
    rows, mask = [], []
    for s in range(batch.num_sequences):
        here = (batch.sequence_id == s) & batch.loss_mask
        order = torch.argsort(batch.position[here])
        rows.append(log_w[here][order])
    width = max(len(r) for r in rows)
    padded = torch.zeros(len(rows), width, dtype=torch.float64)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for s, r in enumerate(rows):
        padded[s, :len(r)], mask[s, :len(r)] = r, True
    expected = _verl_batch_normalized(padded, mask, level, cap=2.0)[mask]
    factor = SelfNormalizedIS(level=level, cap=2.0)(batch).factor_RC
    assert _per_token(batch, factor) == pytest.approx(expected.tolist(), abs=EXACT)
    assert not torch.allclose(factor, SelfNormalizedIS(level=level)(batch).factor_RC)  # capped


@pytest.mark.parametrize("level", list(Level), ids=[lv.value for lv in Level])
def test_micro_batches_read_the_step_factors_and_sum_to_the_step_loss(level):
    batch, lp = _random_step(3)
    est = Estimator(surrogate=TokenRatio(), correction=SelfNormalizedIS(level=level),
                    aggregation=Aggregation.TOKEN_MEAN)
    packed = pack_first_fit_decreasing(batch.replace(), capacity=8)
    lp_packed = pack_first_fit_decreasing(batch.replace(old_logprob=lp), capacity=8).old_logprob
    step = prepare(packed, est)
    full_lp = lp_packed.clone().requires_grad_(True)
    full, _ = loss(full_lp, step, est)
    (g_full,) = torch.autograd.grad(full, full_lp)
    total, grads = 0.0, torch.zeros_like(g_full)
    for mb in split_micro_batches(step, num_micro_batches=step.num_rows):
        part_lp = full_lp.detach()[mb.row_index].clone().requires_grad_(True)
        value, _ = loss(part_lp, mb.batch, est)
        total = total + value.detach()
        grads[mb.row_index] = torch.autograd.grad(value, part_lp)[0]
        own = SelfNormalizedIS(level=level)(mb.batch.replace(token_extras={})).factor_RC
        if mb.batch.num_sequences > 1 and level is Level.TOKEN:  # its own mean would differ
            assert not torch.allclose(own, mb.batch.token_extras[SNIS_FACTOR])
    assert float(total) == pytest.approx(float(full.detach()), abs=EXACT)
    torch.testing.assert_close(grads, g_full, rtol=0, atol=EXACT)


@pytest.mark.parametrize("level", [Level.TOKEN, Level.SEQUENCE], ids=["token", "sequence"])
def test_loss_is_owens_self_normalized_average_and_so_is_its_gradient(level):
    # token weights with the token mean: -loss = Σ_t w_t r_t A_t / Σ_t w_t; sequence weights
    # with the sequence mean of token sums: -loss = Σ_i W_i Σ_t r_it A_i / Σ_i W_i
    batch, lp = _random_step(5)
    aggregation = (Aggregation.TOKEN_MEAN if level is Level.TOKEN
                   else Aggregation.SEQUENCE_MEAN_TOKEN_SUM)
    est = Estimator(surrogate=TokenRatio(), advantage=RewardAsAdvantage(),
                    correction=SelfNormalizedIS(level=level), aggregation=aggregation)
    x = lp.clone().requires_grad_(True)
    value, _ = loss(x, prepare(batch, est), est)
    mask = batch.loss_mask
    log_w = (batch.old_logprob - batch.behavior_logprob) * mask
    if level is Level.SEQUENCE:
        sums = torch.zeros(batch.num_sequences, dtype=torch.float64).index_add_(
            0, batch.sequence_id[mask], log_w[mask])
        w = torch.where(mask, sums.exp()[batch.sequence_id.clamp(min=0)], 0.0)
        norm = sums.exp().sum()
    else:
        w = torch.where(mask, log_w.exp(), 0.0)
        norm = w.sum()
    y = lp.clone().requires_grad_(True)
    adv = torch.where(mask, batch.reward[batch.sequence_id.clamp(min=0)], 0.0)
    r = torch.where(mask, (y - batch.old_logprob).exp(), 0.0)
    expected = -(w * r * adv).sum() / norm
    assert float(value.detach()) == pytest.approx(float(expected.detach()), abs=EXACT)
    torch.testing.assert_close(torch.autograd.grad(value, x)[0],
                               torch.autograd.grad(expected, y)[0], rtol=0, atol=EXACT)


SNIS_ESTIMATORS = [
    Estimator(name="token_snis", surrogate=TokenRatio(), correction=SelfNormalizedIS(),
              aggregation=Aggregation.TOKEN_MEAN),
    Estimator(name="sequence_snis", surrogate=SequenceRatio(),
              correction=SelfNormalizedIS(level="sequence"),
              aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM),
    Estimator(name="geometric_snis_capped", surrogate=TokenRatio(),
              correction=SelfNormalizedIS(level="geometric", cap=1.5),
              aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_MEAN),
]


@pytest.mark.parametrize("est", SNIS_ESTIMATORS, ids=lambda e: e.name)
def test_layout_and_micro_batch_invariant(est):
    # tokenmdp.testing's checks: the step's factors are decided in prepare, so any layout and
    # any split into micro-batches give the step's loss and gradient
    scales = []

    @settings(max_examples=10, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(steps(estimators=st.just(est)), st.lists(testing.layouts(), min_size=2, max_size=2),
           st.lists(testing.micro_batch_splits(max_micro_batches=4), min_size=2, max_size=2))
    def prop(step, layouts, splits):
        batch, estimator, model = step
        loss_fn = testing.estimator_loss(estimator)
        prepare_fn = testing.estimator_prepare(estimator, max_len=MAX_RESPONSE_LEN)
        for report in (testing.check_layout_invariance(loss_fn, batch, layouts,
                                                       prepare=prepare_fn, model=model),
                       testing.check_micro_batch_invariance(loss_fn, batch, splits,
                                                            prepare=prepare_fn, model=model)):
            report.assert_ok()
            scales.append(report.gradient_scale)
    prop()
    assert any(s > 0 for s in scales)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(cap=0.0), ValueError, "cap"), (dict(cap=-2.0), ValueError, "cap"),
    (dict(cap=math.inf), ValueError, "cap"), (dict(cap="2"), TypeError, "cap"),
    (dict(level="row"), ValueError, "level"), (dict(level=3), TypeError, "level"),
])
def test_bad_hyperparameters_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        SelfNormalizedIS(**kwargs)


def test_describe():
    assert SelfNormalizedIS().describe() == "SNIS (token)"
    assert SelfNormalizedIS(level="sequence", cap=2.0).describe() == "SNIS C=2 (sequence)"


# ------------------------------------------------------------------ exact: biased, consistent
@pytest.fixture(scope="module")
def world():
    """Two prompts, 4 responses each; π_old = π and μ a noisy copy (χ² well above 0)."""
    mdp = TokenMDP(2, 3, rewards.RandomTable(seed=4), prompts=[(0,), (1,)],
                   prompt_probs=[0.3, 0.7])
    pi = TabularPolicy(mdp, generator=torch.Generator().manual_seed(2))
    mu = inference_copy(pi, noise_std=0.8, generator=torch.Generator().manual_seed(3))
    return mdp, pi, mu


def _sequence_estimator(correction):
    return Estimator(surrogate=Reinforce(), advantage=RewardAsAdvantage(), correction=correction,
                     aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM)


def _first_order_bias(mdp, pi, mu):
    """The delta method's ``b_1`` with ``bias(G) = b_1 / G + O(G^-2)``: per prompt, with
    ``g = R(y) ∇log π(y|x)`` and ``W = π/μ``, ``b_1 = E[W g] E[W²] - E[W² g]`` (``E_μ[W] = 1``),
    weighted by ``D(x)``; every expectation summed over the enumeration."""
    batch = mdp.enumerate()
    lp = pi.token_logprobs(batch)
    with torch.no_grad():
        W = ((lp - mu.token_logprobs(batch)) * batch.loss_mask).sum(1).exp()
        q = exact_sequence_probs(mdp, mu)
    params = list(pi.parameters())
    scores = (lp * batch.loss_mask).sum(1) * mdp.rewards
    b1 = None
    for x in range(mdp.num_prompts):
        rows = (batch.prompt_index == x).nonzero().flatten().tolist()
        e_wg, e_w2g, e_w2 = 0.0, 0.0, 0.0
        for i in rows:
            grads = torch.autograd.grad(scores[i], params, retain_graph=True, allow_unused=True)
            g = torch.cat([(torch.zeros_like(p) if gi is None else gi).reshape(-1)
                           for p, gi in zip(params, grads, strict=True)])
            e_wg = e_wg + q[i] * W[i] * g
            e_w2g = e_w2g + q[i] * W[i] ** 2 * g
            e_w2 = e_w2 + float(q[i] * W[i] ** 2)
        term = float(mdp.prompt_probs[x]) * (e_wg * e_w2 - e_w2g)
        b1 = term if b1 is None else b1 + term
    return b1


def test_snis_is_biased_but_consistent_exactly(world):
    mdp, pi, mu = world
    kw = dict(behavior=mu, old=pi, method="enumeration")
    snis = _sequence_estimator(SelfNormalizedIS(level="sequence"))
    plain = _sequence_estimator(ImportanceSampling(level="sequence"))
    b1 = _first_order_bias(mdp, pi, mu)
    gaps, biases = [], []
    for G in (2, 4, 8, 16):
        m = moments(mdp, pi, snis, group_size=G, **kw)
        biases.append(float(m.bias.norm()))
        gaps.append(float((G * m.bias - b1).norm()))   # O(1/G)
        unbiased = moments(mdp, pi, plain, group_size=G, **kw)
        assert float(unbiased.bias.norm()) < 1e-10     # sequence IS: unbiased at every G
    grad_norm = float(m.true_gradient.norm())
    assert biases[0] > 0.02 * grad_norm                 # clearly biased at G = 2
    assert all(b2 < b1_ for b1_, b2 in zip(biases, biases[1:]))            # shrinking with G
    assert all(g2 < 0.7 * g1 for g1, g2 in zip(gaps, gaps[1:]))            # G·bias -> b_1
    assert gaps[-1] < 0.1 * float(b1.norm())


def test_one_sample_per_step_is_the_uncorrected_estimator(world):
    # G = 1: W_1 / W̄ = 1, so SNIS is REINFORCE under μ without any correction
    mdp, pi, mu = world
    kw = dict(group_size=1, behavior=mu, old=pi, method="enumeration")
    snis = moments(mdp, pi, _sequence_estimator(SelfNormalizedIS(level="sequence")), **kw)
    none = moments(mdp, pi, _sequence_estimator(NoCorrection()), **kw)
    torch.testing.assert_close(snis.mean, none.mean, rtol=0, atol=TIE)
    assert snis.total_variance == pytest.approx(none.total_variance, abs=1e-10)


# ------------------------------------------------------------------ edges
def _two(dtype=torch.float64, log_w=0.1):
    b = make_batch([[1, 2]] * 2, [[3, 4]] * 2, rewards=[1.0, 0.0], groups=[0, 0],
                   old=[[-0.1, -0.1]] * 2, behavior=[[-0.1 - log_w, -0.1]] * 2)
    return b.to(dtype=dtype)


@pytest.mark.parametrize("level", list(Level), ids=[lv.value for lv in Level])
def test_empty_and_all_masked_batches_give_zero_loss(level):
    from tokenmdp.packing import select_sequences

    est = Estimator(surrogate=TokenRatio(), correction=SelfNormalizedIS(level=level))
    full = _two()
    for batch in (select_sequences(full, torch.tensor([], dtype=torch.long)),
                  full.replace(loss_mask=torch.zeros_like(full.loss_mask))):
        lp = torch.zeros_like(batch.advantage, requires_grad=True)
        value, metrics = loss(lp, prepare(batch, est), est)
        value.backward()
        assert float(value.detach()) == 0.0 and torch.equal(lp.grad, torch.zeros_like(lp))
        assert all(math.isfinite(float(v)) for v in metrics.values())


@pytest.mark.parametrize("level", list(Level), ids=[lv.value for lv in Level])
def test_extreme_weights_stay_finite_in_float32(level):
    # log w = ±60: the weights are held at e^±20 before normalizing, the factors stay finite
    batch = _two(torch.float32, log_w=60.0)
    batch = batch.replace(behavior_logprob=torch.where(
        (batch.sequence_id == 1) & batch.loss_mask, batch.old_logprob + 60.0,
        batch.behavior_logprob))
    factor = SelfNormalizedIS(level=level)(batch).factor_RC
    assert torch.isfinite(factor).all() and bool((factor[batch.loss_mask] >= 0).all())
    mean = (factor[batch.loss_mask].mean() if level is Level.TOKEN
            else factor[batch.loss_mask & (batch.position == 2)].mean())
    assert float(mean) == pytest.approx(1.0, rel=1e-6)


# ------------------------------------------------------------------ exchangeable types
@pytest.mark.parametrize("part", [SelfNormalizedIS(), SelfNormalizedIS(level="sequence"),
                                  SelfNormalizedIS(level="geometric", cap=1.5)],
                         ids=lambda p: p.describe())
def test_the_exchangeable_type_is_all_another_sequence_contributes(part):
    # sequence 2 is replaced by one with the same reward, length and weight sum but other
    # tokens and token weights (its two log-weights swapped): sequence 0's own gradient terms
    # do not change, while a change of the weight sum does change them
    def step(log_w_2):
        old = [[-0.5, -1.0], [-0.7], [-0.4, -0.9]]
        log_w = [[0.3, -0.2], [0.5], log_w_2]
        behavior = [[o - lw for o, lw in zip(os_, ws, strict=True)]
                    for os_, ws in zip(old, log_w, strict=True)]
        return make_batch([[9]] * 3, [[1, 2], [3], [4 + int(log_w_2[0] > 0), 2]],
                          rewards=[1.0, 0.0, 0.5], groups=[0, 0, 0], old=old, behavior=behavior)

    est = Estimator(surrogate=TokenRatio(), correction=part, advantage=RewardAsAdvantage(),
                    aggregation=Aggregation.TOKEN_MEAN)

    def first_terms(batch):
        lp = batch.old_logprob.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(loss(lp, prepare(batch, est), est)[0], lp)
        return g[(batch.sequence_id == 0) & batch.loss_mask], part.exchangeable_type(batch)

    a, b, c = step([0.1, 0.6]), step([0.6, 0.1]), step([0.1, 0.9])
    (g_a, t_a), (g_b, t_b), (g_c, t_c) = first_terms(a), first_terms(b), first_terms(c)
    if part.level is Level.TOKEN:
        assert float(t_a[2]) == pytest.approx(e(0.1) + e(0.6), abs=EXACT)
    assert torch.allclose(t_a, t_b, rtol=0, atol=EXACT) and not torch.allclose(t_a, t_c)
    torch.testing.assert_close(g_a, g_b, rtol=0, atol=EXACT)
    assert not torch.allclose(g_a, g_c)
