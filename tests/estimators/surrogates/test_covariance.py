"""Clip-Cov and KL-Cov: the covariance against a loop, hand-worked selections, the gradient
identities, per-step selection, reproducible draws, layout and micro-batch invariance (and the
split dependence of verl's per-micro-batch selection), exact moments against brute force."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tests.estimators.estimator_helpers import make_batch
from tokenmdp import estimators as E
from tokenmdp import testing
from tokenmdp.batch import TokenBatch
from tokenmdp.estimators import ClipCov, KLCov, token_covariance
from tokenmdp.estimators.surrogates.covariance import CLIP_COV_SCALE, KL_COV_SELECTED
from tokenmdp.exact import TabularPolicy, TokenMDP, sequence_probs, stale_copy
from tokenmdp.exact.lab.moments import moments
from tokenmdp.exact.world.rewards import RandomTable
from tokenmdp.packing import select_sequences

EXACT = 1e-12
BRUTE = 1e-10


def _est(surrogate, aggregation=E.Aggregation.TOKEN_SUM):
    return E.Estimator(surrogate=surrogate, advantage=E.RewardAsAdvantage(),
                       aggregation=aggregation)


def _two_sequences():
    # A = R = +1, -1; log π_old = -0.1, -2.1 in both: means 0 and -1.1, so
    # cov = +1, -1 (sequence 0) and -1, +1 (sequence 1)
    old = [[-0.1, -2.1], [-0.1, -2.1]]
    return make_batch([[5], [6]], [[1, 2], [3, 4]], rewards=[1.0, -1.0], groups=[0, 1],
                      old=old, behavior=old)


def _tokens(batch, values):
    return [[float(values[(batch.sequence_id == s) & batch.loss_mask][t])
             for t in range(int(((batch.sequence_id == s) & batch.loss_mask).sum()))]
            for s in range(batch.num_sequences)]


def test_covariance_hand_worked_and_against_a_loop():
    batch = E.prepare(_two_sequences(), _est(ClipCov()))
    for got, want in zip(_tokens(batch, token_covariance(batch)), [[1, -1], [-1, 1]], strict=True):
        assert got == pytest.approx(want, abs=EXACT)
    g = torch.Generator().manual_seed(0)
    lengths = [3, 1, 4, 2]
    old = [(-torch.rand(n, generator=g, dtype=torch.float64) * 3).tolist() for n in lengths]
    b = E.prepare(make_batch([[1]] * 4, [[2] * n for n in lengths], rewards=[0.3, -1.0, 2.0, 0.5],
                             groups=[0, 0, 1, 1], old=old, behavior=old),
                  E.Estimator(surrogate=ClipCov(), advantage=E.GroupNormalized()))
    a = [[float(b.advantage[(b.sequence_id == s) & b.loss_mask][0])] * n
         for s, n in enumerate(lengths)]
    flat_a = [x for row in a for x in row]
    flat_l = [x for row in old for x in row]
    ma, ml = sum(flat_a) / len(flat_a), sum(flat_l) / len(flat_l)
    loop = [[(x - ma) * (y - ml) for x, y in zip(ra, rl, strict=True)]
            for ra, rl in zip(a, old, strict=True)]
    for got, want in zip(_tokens(b, token_covariance(b)), loop, strict=True):
        assert got == pytest.approx(want, abs=EXACT)


def test_clip_cov_detaches_one_of_the_two_candidates_reproducibly():
    batch = _two_sequences()
    chosen = set()
    for seed in range(12):
        part = ClipCov(ratio=0.25, cov_low=0.5, cov_high=5.0, seed=seed)   # budget ⌊0.25·4⌋ = 1
        scale = E.prepare(batch, _est(part)).token_extras[CLIP_COV_SCALE]
        got = _tokens(batch, scale)
        assert got in ([[0.0, 1.0], [1.0, 1.0]], [[1.0, 1.0], [1.0, 0.0]]), got
        chosen.add(got[0][0])
        again = E.prepare(batch, _est(part)).token_extras[CLIP_COV_SCALE]
        assert torch.equal(again, scale)
        # the same token in another order of the sequences (the draw hashes content)
        swapped = select_sequences(batch, torch.tensor([1, 0]))
        other = E.prepare(swapped, _est(part)).token_extras[CLIP_COV_SCALE]
        assert _tokens(swapped, other) == [got[1], got[0]]
    assert chosen == {0.0, 1.0}                       # both candidates drawn over the seeds
    expected = ClipCov(ratio=0.25, cov_low=0.5, cov_high=5.0, selection="expected")
    scale = E.prepare(batch, _est(expected)).token_extras[CLIP_COV_SCALE]
    assert _tokens(batch, scale) == [[0.5, 1.0], [1.0, 0.5]]   # kept with probability 1 - 1/2
    # the band is strict and the budget at least one token
    none = ClipCov(ratio=1e-4, cov_low=1.5, cov_high=5.0)
    assert torch.equal(E.prepare(batch, _est(none)).token_extras[CLIP_COV_SCALE],
                       torch.ones_like(batch.advantage))


def test_identical_tokens_at_the_cut_share_the_places():
    old = [[-0.1, -2.1], [-0.1, -2.1], [-0.1, -2.1]]
    batch = make_batch([[5]] * 3, [[1, 2]] * 3, rewards=[1.0, 1.0, -2.0], groups=[0, 0, 1],
                       old=old, behavior=old)
    # sequences 0 and 1 are identical: cov = +1, -1 there and -2, +2 in sequence 2
    # Clip-Cov, band (0.5, 1.5), budget ⌊0.2·6⌋ = 1: the two identical first tokens tie
    part = ClipCov(ratio=0.2, cov_low=0.5, cov_high=1.5)
    got = _tokens(batch, E.prepare(batch, _est(part)).token_extras[CLIP_COV_SCALE])
    assert got == [[0.5, 1.0], [0.5, 1.0], [1.0, 1.0]]
    # KL-Cov, budget ⌊0.34·6⌋ = 2: cov 2 first, then the tie shares the last place
    selected = E.prepare(batch, _est(KLCov(ratio=0.34))).token_extras[KL_COV_SELECTED]
    assert _tokens(batch, selected) == [[0.5, 0.0], [0.5, 0.0], [0.0, 1.0]]


def test_clip_cov_gradient_is_the_ppo_gradient_times_the_scale():
    batch = _two_sequences()
    part = ClipCov(ratio=0.5, cov_low=-5.0, cov_high=5.0, seed=3)
    step = E.prepare(batch, _est(part))
    lp = (batch.old_logprob + 0.3 * torch.randn(batch.tokens.shape, dtype=torch.float64,
                                                generator=torch.Generator().manual_seed(1))
          ).requires_grad_(True)
    (g,) = torch.autograd.grad(E.loss(lp, step, _est(part))[0], lp)
    ppo = _est(E.PPOClip(eps_low=0.2, eps_high=0.2))
    (g_ppo,) = torch.autograd.grad(E.loss(lp, E.prepare(batch, ppo), ppo)[0], lp)
    torch.testing.assert_close(g, g_ppo * step.token_extras[CLIP_COV_SCALE], rtol=0, atol=EXACT)
    assert int((step.token_extras[CLIP_COV_SCALE][batch.loss_mask] == 0).sum()) == 2
    _, metrics = E.loss(lp, step, _est(part))
    assert metrics["clip_fraction"] >= 0.5


def test_the_expected_selection_is_the_average_over_every_draw():
    # a uniform draw of k of the n candidates: averaging the loss over all C(n, k) draws gives
    # the 'expected' estimator (each candidate kept with probability 1 - k/n)
    batch = _random_step(5)
    lp = (batch.old_logprob + 0.2 * torch.randn(batch.tokens.shape, dtype=torch.float64,
                                                generator=torch.Generator().manual_seed(6))
          ).requires_grad_(True)
    part = ClipCov(ratio=0.2, cov_low=0.0, cov_high=3.0, selection="expected")
    est = E.Estimator(surrogate=part, advantage=E.GroupNormalized())
    step = E.prepare(batch, est)
    scale = step.token_extras[CLIP_COV_SCALE]
    cells = (scale < 1).nonzero().tolist()
    n, k = len(cells), int(0.2 * int(batch.loss_mask.sum()))
    assert n > k >= 2 and float(scale[cells[0][0], cells[0][1]]) == pytest.approx(1 - k / n)
    draws = list(itertools.combinations(range(n), k))
    total = 0.0
    for draw in draws:
        drawn = torch.ones_like(scale)
        for i in draw:
            drawn[cells[i][0], cells[i][1]] = 0.0
        fixed = step.replace(token_extras={CLIP_COV_SCALE: drawn})
        total = total + E.loss(lp, fixed, est)[0]
    mean = total / len(draws)
    value = E.loss(lp, step, est)[0]
    assert float(value.detach()) == pytest.approx(float(mean.detach()), abs=EXACT)
    torch.testing.assert_close(torch.autograd.grad(value, lp)[0],
                               torch.autograd.grad(mean, lp)[0], rtol=0, atol=EXACT)


def _loop_kl_cov(batch, ratio):
    """KL-Cov's selection written out: the ⌊k N⌋ (at least 1) largest covariances."""
    cov = token_covariance(batch)[batch.loss_mask].tolist()
    k = max(int(ratio * len(cov)), 1)
    top = sorted(range(len(cov)), key=lambda i: -cov[i])[:k]
    out = [0.0] * len(cov)
    for i in top:
        out[i] = 1.0
    return out


def test_kl_cov_selection_and_gradient_against_the_formula():
    g = torch.Generator().manual_seed(4)
    lengths = [3, 2, 4, 1, 2]
    old = [(-torch.rand(n, generator=g, dtype=torch.float64) * 3).tolist() for n in lengths]
    batch = make_batch([[1]] * 5, [[2 + i] * n for i, n in enumerate(lengths)],
                       rewards=[0.5, -1.0, 2.0, 0.1, -0.7], groups=[0, 1, 2, 3, 4], old=old,
                       behavior=old)
    part = KLCov(ratio=0.25, coef=0.7)
    est = _est(part)
    step = E.prepare(batch, est)
    sel = step.token_extras[KL_COV_SELECTED]
    assert sel[batch.loss_mask].tolist() == _loop_kl_cov(step, 0.25)   # ⌊0.25·12⌋ = 3 tokens
    lp = (batch.old_logprob + 0.2 * torch.randn(batch.tokens.shape, dtype=torch.float64,
                                                generator=g)).requires_grad_(True)
    (grad,) = torch.autograd.grad(-E.loss(lp, step, est)[0], lp)
    log_r = (lp - batch.old_logprob).detach()
    formula = torch.exp(log_r) * step.advantage - 0.7 * sel * torch.sign(log_r)
    torch.testing.assert_close(grad, torch.where(batch.loss_mask, formula, 0.0), rtol=0,
                               atol=EXACT)
    # at π_θ = π_old the penalty changes nothing: the plain ratio gradient
    lp0 = batch.old_logprob.clone().requires_grad_(True)
    (g0,) = torch.autograd.grad(-E.loss(lp0, step, est)[0], lp0)
    assert torch.equal(g0, step.advantage)


@pytest.mark.parametrize("part", [ClipCov(ratio=0.3, cov_low=0.0, cov_high=3.0, seed=1),
                                  ClipCov(ratio=0.3, cov_low=0.0, selection="expected"),
                                  KLCov(ratio=0.3, coef=0.5)])
def test_stacked_steps_select_each_on_their_own(part):
    a = _random_step(1)
    b = _random_step(2)
    b = b.replace(old_logprob=b.old_logprob - 2.0)          # another mean of log π_old
    both = TokenBatch.from_sequences([p for p, _ in a.sequences() + b.sequences()],
                                     [r for _, r in a.sequences() + b.sequences()],
                                     rewards=torch.cat([a.reward, b.reward]),
                                     groups=torch.cat([a.group, b.group + 10]))
    both = both.replace(old_logprob=torch.cat([a.old_logprob, b.old_logprob]),
                        behavior_logprob=torch.cat([a.old_logprob, b.old_logprob]))
    est = E.Estimator(surrogate=part, advantage=E.GroupNormalized())
    step = torch.tensor([0] * a.num_sequences + [1] * b.num_sequences)
    stacked = E.prepare(both, est, step=step)
    (key,) = set(stacked.token_extras)
    rows = a.num_rows
    torch.testing.assert_close(stacked.token_extras[key][:rows],
                               E.prepare(a, est).token_extras[key], rtol=0, atol=EXACT)
    torch.testing.assert_close(stacked.token_extras[key][rows:],
                               E.prepare(b, est).token_extras[key], rtol=0, atol=EXACT)
    one = E.prepare(both, est).token_extras[key]
    assert not torch.equal(one, stacked.token_extras[key])        # not a no-op


def _random_step(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 1, 4, 2, 2, 5]
    old = [(-torch.rand(n, generator=g, dtype=torch.float64) * 3).tolist() for n in lengths]
    return make_batch([[7]] * 6, [[1 + ((i + seed) % 3)] * n for i, n in enumerate(lengths)],
                      rewards=torch.rand(6, generator=g, dtype=torch.float64).tolist(),
                      groups=[0, 0, 0, 1, 1, 1], old=old, behavior=old)


LAYOUTS = [testing.Layout("padded", permutation_seed=1), testing.Layout("flat", 2),
           testing.Layout("first_fit_decreasing", 1, permutation_seed=7)]
SPLITS = [testing.MicroBatchSplit(2), testing.MicroBatchSplit(3, by_rows=False, seed=5,
                                                              layout=LAYOUTS[2])]
BITING = [ClipCov(ratio=0.3, cov_low=-3.0, cov_high=3.0, seed=2),
          ClipCov(ratio=0.3, cov_low=-3.0, selection="expected"), KLCov(ratio=0.3, coef=0.5)]


@pytest.mark.parametrize("surrogate", BITING + [E.get("clip_cov").surrogate,
                                                E.get("kl_cov").surrogate])
def test_layout_and_micro_batch_invariant(surrogate):
    est = E.Estimator(surrogate=surrogate, advantage=E.GroupNormalized())
    batch = _random_step(3)
    prep = testing.estimator_prepare(est)
    loss_fn = testing.estimator_loss(est)
    testing.check_layout_invariance(loss_fn, batch, LAYOUTS, prepare=prep).assert_ok()
    report = testing.check_micro_batch_invariance(loss_fn, batch, SPLITS, prepare=prep)
    report.assert_ok()
    assert report.gradient_scale > 0


@pytest.mark.parametrize("surrogate", BITING)
def test_a_selection_per_micro_batch_depends_on_the_split(surrogate):
    # verl selects inside the loss of each micro-batch (micro-batch means and counts): the sum
    # over micro-batches is then not the step's loss
    est = E.Estimator(surrogate=surrogate, advantage=E.GroupNormalized())

    def per_micro_batch(logprobs_RC, micro):
        return E.loss(logprobs_RC, surrogate.prepare_step(micro, None), est)[0]
    report = testing.check_micro_batch_invariance(per_micro_batch, _random_step(3), SPLITS,
                                                  prepare=testing.estimator_prepare(est))
    assert not report.ok


def test_exact_moments_are_a_brute_force_average_over_ordered_groups():
    mdp = TokenMDP(3, 2, RandomTable(seed=1), prompts=[(0,)])        # 7 responses
    pi = TabularPolicy(mdp, generator=torch.Generator().manual_seed(2))
    old = stale_copy(mdp, pi, distance=0.7)
    G = 3
    est = E.Estimator(surrogate=ClipCov(ratio=0.3, cov_low=-1.0, cov_high=1.0, seed=4),
                      advantage=E.GroupMean(), aggregation=E.Aggregation.TOKEN_MEAN)
    exact = moments(mdp, pi, est, group_size=G, behavior=old, method="enumeration")
    params = list(pi.parameters())
    probs = sequence_probs(mdp, old).detach()
    pairs = mdp.responses()
    mean, second, detached = 0.0, 0.0, 0
    for group in itertools.product(range(len(pairs)), repeat=G):
        batch = TokenBatch.from_sequences([pairs[i][0] for i in group],
                                          [pairs[i][1] for i in group],
                                          rewards=mdp.rewards[list(group)], groups=[0] * G)
        with torch.no_grad():
            lp_old = old.token_logprobs(batch)
        batch = E.prepare(batch.replace(old_logprob=lp_old, behavior_logprob=lp_old), est)
        detached += int((batch.token_extras[CLIP_COV_SCALE] < 1).any())
        value = E.loss(pi.token_logprobs(batch), batch, est)[0]
        g = torch.cat([x.reshape(-1) for x in torch.autograd.grad(-value, params)])
        p = torch.prod(probs[list(group)])
        mean = mean + p * g
        second = second + p * (g @ g)
    assert detached > 100                                  # the selection bites in most groups
    torch.testing.assert_close(exact.mean, mean, rtol=0, atol=BRUTE)
    assert exact.total_variance == pytest.approx(float(second - mean @ mean), abs=BRUTE)
    plain = moments(mdp, pi, est.replace(surrogate=E.PPOClip()), group_size=G, behavior=old,
                    method="enumeration")
    assert float((plain.mean - exact.mean).norm()) > 1e-4


def test_without_a_prepared_selection_the_loss_refuses():
    batch = E.prepare(_two_sequences(), _est(E.PPOClip()))
    lp = batch.old_logprob.clone()
    for part, key in ((ClipCov(), CLIP_COV_SCALE), (KLCov(), KL_COV_SELECTED)):
        with pytest.raises(ValueError, match=f"token_extras has no '{key}'"):
            E.loss(lp, batch, _est(part))


@pytest.mark.parametrize(("make", "error", "match"), [
    (lambda: ClipCov(ratio=0.0), ValueError, "ratio"),
    (lambda: ClipCov(ratio=1.5), ValueError, "ratio"),
    (lambda: ClipCov(cov_low=5.0, cov_high=1.0), ValueError, "cov_low, cov_high"),
    (lambda: ClipCov(cov_low=math.inf), ValueError, "cov_low"),
    (lambda: ClipCov(selection="topk"), ValueError, "selection"),
    (lambda: ClipCov(seed=-1), ValueError, "seed"),
    (lambda: ClipCov(seed=1.5), ValueError, "seed"),
    (lambda: ClipCov(eps_low=-0.1), ValueError, "eps_low"),
    (lambda: KLCov(ratio=-1e-4), ValueError, "ratio"),
    (lambda: KLCov(coef=-1.0), ValueError, "coef"),
    (lambda: KLCov(coef="1"), TypeError, "coef"),
])
def test_bad_hyperparameters_raise_naming_them(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_describe_names_the_hyperparameters():
    assert "r=0.001" in ClipCov(ratio=1e-3).describe() and "seed" not in ClipCov().describe()
    assert "random 7" in ClipCov(seed=7).describe()
    assert "expected" in ClipCov(selection="expected").describe()
    assert "0.5 |log r|" in KLCov(coef=0.5).describe()
