"""Token-level surrogates: hand-worked fixtures and gradient identities (float64)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tokenmdp.estimators import (
    MAX_LOG_RATIO,
    PPOClip,
    cispo_term,
    minirl_term,
    ppo_clip_term,
    ppo_keep_mask,
    reinforce_term,
    token_ratio_term,
)

EXACT = 1e-12  # float64 closed forms, a handful of roundings

# One row of six tokens; old log-prob log 0.25 everywhere, ratios r chosen by hand:
#   token   r     Â    ε_low=0.2, ε_high=0.28 (clip range [0.8, 1.28]); dual clip c = 3
#   t0     1.5   +1    min(1.5, 1.28) = 1.28           clipped (Â>0, r>1.28)
#   t1     0.5   +1    min(0.5, 0.8)  = 0.5            kept (Â>0 and r low: no clip)
#   t2     1.1   +1    min(1.1, 1.1)  = 1.1            kept (inside the range)
#   t3     0.7   -1    min(-0.7, -0.8) = -0.8          clipped (Â<0, r<0.8)
#   t4     1.5   -1    min(-1.5, -1.28) = -1.5         kept; dual max(-1.5, -3) = -1.5
#   t5     4.0   -2    min(-8, -2.56) = -8             kept without dual clip;
#                      dual: max(-8, 3 * -2 = -6) = -6 clipped (Â<0, r>c)
RATIOS = [1.5, 0.5, 1.1, 0.7, 1.5, 4.0]
ADVS = [1.0, 1.0, 1.0, -1.0, -1.0, -2.0]
OLD = math.log(0.25)


def _tensors(ratios=RATIOS, advs=ADVS):
    old = torch.full((1, len(ratios)), OLD, dtype=torch.float64)
    logprobs = (old + torch.tensor([ratios], dtype=torch.float64).log()).requires_grad_(True)
    return logprobs, old, torch.tensor([advs], dtype=torch.float64)


def _grad(term, logprobs):
    (g,) = torch.autograd.grad(term.sum(), logprobs)
    return g[0].tolist()


def test_ppo_clip_hand_worked_values_mask_and_gradient():
    lp, old, adv = _tensors()
    out = ppo_clip_term(lp, old, adv, eps_low=0.2, eps_high=0.28)
    assert out.term_RC[0].tolist() == pytest.approx([1.28, 0.5, 1.1, -0.8, -1.5, -8.0], abs=EXACT)
    assert out.clipped_RC[0].tolist() == [True, False, False, True, False, False]
    # d term / d log π = M r Â: 0, 0.5, 1.1, 0, -1.5, -8
    assert _grad(out.term_RC, lp) == pytest.approx([0.0, 0.5, 1.1, 0.0, -1.5, -8.0], abs=EXACT)


def test_ppo_dual_clip_bounds_negative_advantage_terms():
    lp, old, adv = _tensors()
    out = ppo_clip_term(lp, old, adv, eps_low=0.2, eps_high=0.28, dual_clip=3.0)
    assert out.term_RC[0].tolist() == pytest.approx([1.28, 0.5, 1.1, -0.8, -1.5, -6.0], abs=EXACT)
    assert out.clipped_RC[0].tolist() == [True, False, False, True, False, True]
    assert _grad(out.term_RC, lp) == pytest.approx([0.0, 0.5, 1.1, 0.0, -1.5, 0.0], abs=EXACT)


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_ppo_clip_gradient_is_mask_times_ratio_times_advantage_in_every_case(dual_clip):
    # Every sign of Â crossed with ratios below, inside and above [1-ε_low, 1+ε_high] = [0.8, 1.28]
    # and above the dual-clip constant; none sits exactly on a boundary.
    ratios = [0.3, 0.79, 0.81, 1.0, 1.27, 1.29, 2.0, 3.5]
    advs = [-1.5, 0.0, 2.0]
    cases = list(itertools.product(ratios, advs))
    lp, old, adv = _tensors([r for r, _ in cases], [a for _, a in cases])
    out = ppo_clip_term(lp, old, adv, eps_low=0.2, eps_high=0.28, dual_clip=dual_clip)
    expected = []
    for r, a in cases:  # M from the definition, independently of ppo_keep_mask
        dropped = (a > 0 and r > 1.28) or (a < 0 and r < 0.8)
        if dual_clip is not None:
            dropped = dropped or (a < 0 and r > dual_clip)
        expected.append(0.0 if dropped else r * a)
    assert _grad(out.term_RC, lp) == pytest.approx(expected, abs=EXACT)
    keep = ppo_keep_mask(lp.detach().exp() / math.exp(OLD), adv, eps_low=0.2, eps_high=0.28,
                         dual_clip=dual_clip)
    assert (~keep == out.clipped_RC).all()


def test_cispo_keeps_gradient_on_clipped_tokens_where_ppo_has_none():
    lp, old, adv = _tensors()
    ppo_grad = _grad(ppo_clip_term(lp, old, adv, eps_low=0.2, eps_high=0.28).term_RC, lp)
    cispo = cispo_term(lp, old, adv, eps_low=0.2, eps_high=0.28)
    # d term / d log π = clip(r, 0.8, 1.28) Â: 1.28, 0.8, 1.1, -0.8, -1.28, -2.56
    cispo_grad = _grad(cispo.term_RC, lp)
    assert cispo_grad == pytest.approx([1.28, 0.8, 1.1, -0.8, -1.28, -2.56], abs=EXACT)
    for t in (0, 3):  # the tokens PPO clips
        assert ppo_grad[t] == 0.0 and abs(cispo_grad[t]) > 0.5
    # clipped marks tokens whose weight was clipped (r outside [0.8, 1.28])
    assert cispo.clipped_RC[0].tolist() == [True, True, False, True, True, True]


def test_cispo_unified_form_applies_the_ppo_mask():
    lp, old, adv = _tensors()
    out = cispo_term(lp, old, adv, eps_low=0.2, eps_high=0.28, mask_eps_low=0.2,
                     mask_eps_high=0.28)
    # the PPO mask drops t0 and t3; the others keep clip(r) Â
    assert _grad(out.term_RC, lp) == pytest.approx([0.0, 0.8, 1.1, 0.0, -1.28, -2.56], abs=EXACT)


def test_minirl_has_the_ppo_clip_gradient_but_a_reinforce_value():
    lp, old, adv = _tensors()
    mini = minirl_term(lp, old, adv, eps_low=0.2, eps_high=0.28)
    ppo = ppo_clip_term(lp, old, adv, eps_low=0.2, eps_high=0.28)
    assert _grad(mini.term_RC, lp) == pytest.approx(_grad(ppo.term_RC, lp), abs=EXACT)
    # value M sg(r) Â log π: t1 = 0.5 * 1 * log(0.5 * 0.25)
    assert mini.term_RC[0, 1].item() == pytest.approx(0.5 * math.log(0.125), abs=EXACT)
    assert (mini.clipped_RC == ppo.clipped_RC).all()


def test_token_ratio_and_reinforce_gradients():
    lp, old, adv = _tensors()
    assert _grad(token_ratio_term(lp, old, adv).term_RC, lp) == pytest.approx(
        [r * a for r, a in zip(RATIOS, ADVS, strict=True)], abs=EXACT)
    assert _grad(reinforce_term(lp, adv).term_RC, lp) == pytest.approx(ADVS, abs=EXACT)


def test_extreme_ratios_are_held_at_the_cap_without_gradient():
    # log r = 1000 would overflow exp; the ratio is held at e^20 and carries no gradient.
    lp = torch.tensor([[1000.0, -1000.0]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    adv = torch.tensor([[-1.0, 1.0]], dtype=torch.float64)
    term = token_ratio_term(lp, old, adv).term_RC
    assert term[0].tolist() == pytest.approx([-math.exp(MAX_LOG_RATIO), 0.0], rel=EXACT)
    ppo = ppo_clip_term(lp, old, adv, eps_low=0.2, eps_high=0.2).term_RC
    assert torch.isfinite(ppo).all()
    (g,) = torch.autograd.grad(term.sum() + ppo.sum(), lp)
    assert torch.isfinite(g).all() and g[0, 0] == 0.0


@pytest.mark.parametrize(("kwargs", "bad"), [(dict(eps_low=-0.1, eps_high=0.2), "eps_low"),
                                           (dict(eps_low=0.2, eps_high=-1e-3), "eps_high"),
                                           (dict(eps_low=0.2, eps_high=0.2, dual_clip=0.5),
                                            "dual_clip")])
def test_invalid_clip_parameters_raise_naming_the_argument(kwargs, bad):
    lp, old, adv = _tensors()
    with pytest.raises(ValueError, match=bad):
        ppo_clip_term(lp, old, adv, **kwargs)
    with pytest.raises(ValueError, match=bad):
        PPOClip(**kwargs)


def test_cispo_mask_needs_both_bounds():
    lp, old, adv = _tensors()
    with pytest.raises(ValueError, match="mask_eps"):
        cispo_term(lp, old, adv, eps_low=0.2, eps_high=0.2, mask_eps_low=0.2)


def _ppo_clip_by_autograd(lp, old, adv, eps_low, eps_high, dual_clip):
    """The PPO-clip formula as plain tensor ops (a second implementation, differentiated by
    autograd), to check the fused function's value and hand-written backward."""
    ratio = torch.exp((lp - old).clamp(max=MAX_LOG_RATIO))
    term = torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    if dual_clip is not None:
        term = torch.where(adv < 0, torch.maximum(term, dual_clip * adv), term)
    return term


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_fused_ppo_clip_equals_the_formula_under_autograd(dtype, dual_clip):
    gen = torch.Generator().manual_seed(7)
    n = 4000  # log-ratios from far below to beyond the cap, every sign of Â, some Â = 0
    log_r = torch.cat([torch.randn(n - 4, generator=gen, dtype=torch.float64) * 1.5,
                       torch.tensor([25.0, -30.0, MAX_LOG_RATIO + 1, 0.0], dtype=torch.float64)])
    adv = torch.randn(n, generator=gen, dtype=torch.float64) * (torch.rand(n, generator=gen) > 0.1)
    old = -torch.rand(n, generator=gen, dtype=torch.float64) * 3
    lp = (old + log_r).to(dtype).reshape(40, -1)
    old, adv = old.to(dtype).reshape(40, -1), adv.to(dtype).reshape(40, -1)
    lp_a, lp_b = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    weights = torch.rand(lp.shape, generator=gen, dtype=torch.float64).to(dtype)
    fused = ppo_clip_term(lp_a, old, adv, eps_low=0.2, eps_high=0.28, dual_clip=dual_clip)
    reference = _ppo_clip_by_autograd(lp_b, old, adv, 0.2, 0.28, dual_clip)
    torch.testing.assert_close(fused.term_RC, reference, rtol=0, atol=0)  # the same roundings
    (g_a,) = torch.autograd.grad((weights * fused.term_RC).sum(), lp_a)
    (g_b,) = torch.autograd.grad((weights * reference).sum(), lp_b)
    torch.testing.assert_close(g_a, g_b, rtol=EXACT if dtype == torch.float64 else 1e-6, atol=0)
    assert bool((g_a == 0).any()) and bool((g_a != 0).any())  # clipped and kept tokens both occur
    ratio = torch.exp((lp - old).clamp(max=MAX_LOG_RATIO))
    torch.testing.assert_close(fused.ratio_RC, ratio, rtol=0, atol=0)


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_fused_ppo_clip_gradient_matches_finite_differences(dual_clip):
    # Away from the kinks (the clip bounds, the dual clip, the cap) the term is smooth, and
    # torch.autograd.gradcheck compares the hand-written backward with central differences.
    ratios = torch.tensor([0.3, 0.95, 1.1, 1.6, 2.0, 4.0, 0.5, 1.05], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0, 0.5, 1.5, -1.0, -0.7, -0.3, 2.5], dtype=torch.float64)
    old = torch.full((8,), -1.2, dtype=torch.float64)
    lp = (old + ratios.log()).requires_grad_(True)

    def term(x):
        return ppo_clip_term(x, old, adv, eps_low=0.2, eps_high=0.28, dual_clip=dual_clip).term_RC
    assert torch.autograd.gradcheck(term, (lp,), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_token_ratio_value_and_gradient_equal_the_formula_under_autograd():
    gen = torch.Generator().manual_seed(5)
    log_r = torch.cat([torch.randn(497, generator=gen, dtype=torch.float64) * 2,
                       torch.tensor([25.0, -40.0, MAX_LOG_RATIO], dtype=torch.float64)])
    old = -torch.rand(500, generator=gen, dtype=torch.float64) * 3
    adv = torch.randn(500, generator=gen, dtype=torch.float64)
    a, b = (old + log_r).requires_grad_(True), (old + log_r).requires_grad_(True)
    fused = token_ratio_term(a, old, adv)
    formula = torch.exp((b - old).clamp(max=MAX_LOG_RATIO)) * adv
    torch.testing.assert_close(fused.term_RC, formula, rtol=0, atol=0)
    (g_a,) = torch.autograd.grad(fused.term_RC.sum(), a)
    (g_b,) = torch.autograd.grad(formula.sum(), b)
    torch.testing.assert_close(g_a, g_b, rtol=EXACT, atol=0)
