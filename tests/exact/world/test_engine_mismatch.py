"""Issue 31, the engine mismatch modes in the exact worlds: the keyed draws are standard normal and
uniform and a function of the context alone; each mode's formula on a fixed logit vector; the
enumerable MDP's and the lattice's engine copies apply it at every state, keyed by the state's
tokens; bad input is refused naming the argument."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmdp.exact import EngineMismatch, TabularPolicy, TokenMDP, inference_copy
from tokenmdp.exact import lattice as L
from tokenmdp.exact.world.behavior import round_logits
from tokenmdp.exact.world.engine_mismatch import (
    DETERMINISTIC_MODES,
    apply_direction,
    context_keys,
    key_start,
    key_step,
    mismatch_direction,
    perturb_logits,
)
from tokenmdp.exact.world.rewards import TokenCount

#: float64 arithmetic on the same numbers
EXACT = 1e-12
#: |sample mean - expectation| below this many standard errors (a 4-sigma band: a false alarm
#: about once in 16000 runs of one check)
SE_BAND = 4.0


def _keys(n=20000, k=5, seed=0):
    tokens = torch.randint(0, 30, (n, k), generator=torch.Generator().manual_seed(seed))
    return context_keys(tokens, seed)


# ------------------------------------------------------------------ keys and draws
def test_a_context_key_is_its_chain_of_steps_and_depends_on_every_token_and_the_seed():
    tokens = torch.tensor([[3, 1, 4, 1, 5], [3, 1, 4, 1, 6], [1, 3, 4, 1, 5], [3, 1, 4, 1, 5]])
    keys = context_keys(tokens, 7)
    chained = key_start(7, 4)
    for j in range(5):
        chained = key_step(chained, tokens[:, j])
    assert torch.equal(keys, chained)
    assert keys[0] == keys[3] and len(set(keys[:3].tolist())) == 3   # last token, order
    assert context_keys(tokens[:1], 8) != keys[0]                     # the seed
    assert context_keys(tokens[:1, :4], 7) != keys[0]                 # the length
    assert bool(((keys >= 0) & (keys < 2 ** 31)).all())


def test_the_gaussian_pattern_is_standard_normal_and_uncorrelated_across_tokens():
    d = mismatch_direction(_keys(), 8, EngineMismatch("fixed", 1.0))      # [N, V] float64
    n = d.numel()
    assert abs(float(d.mean())) < SE_BAND / math.sqrt(n)
    assert abs(float(d.var()) - 1) < SE_BAND * math.sqrt(2 / n)
    assert abs(float((d.abs() > 1.96).double().mean()) - 0.05) < SE_BAND * math.sqrt(
        0.05 * 0.95 / n)
    corr = torch.corrcoef(d.T)                                          # token v vs token w
    off = corr[~torch.eye(8, dtype=torch.bool)]
    assert float(off.abs().max()) < SE_BAND / math.sqrt(d.shape[0])


@pytest.mark.parametrize("fraction", [0.01, 0.2])
def test_heavy_perturbs_the_fraction_by_plus_or_minus_one(fraction):
    d = mismatch_direction(_keys(seed=1), 8, EngineMismatch("heavy", 3.0, fraction))
    hit = d != 0
    n = d.numel()
    assert abs(float(hit.double().mean()) - fraction) < SE_BAND * math.sqrt(
        fraction * (1 - fraction) / n)
    assert set(d[hit].tolist()) == {-1.0, 1.0}
    assert abs(float(d[hit].mean())) < SE_BAND / math.sqrt(int(hit.sum()))


def test_fraction_thins_fixed_on_the_same_pairs_as_heavy():
    keys = _keys(2000, seed=2)
    fixed = mismatch_direction(keys, 6, EngineMismatch("fixed", 1.0, 0.3))
    heavy = mismatch_direction(keys, 6, EngineMismatch("heavy", 1.0, 0.3))
    full = mismatch_direction(keys, 6, EngineMismatch("fixed", 1.0))
    assert torch.equal(fixed != 0, heavy != 0)
    assert torch.equal(fixed, torch.where(fixed != 0, full, 0.0))
    assert torch.equal(heavy[heavy != 0], torch.sign(full)[heavy != 0])


# ------------------------------------------------------------------ each mode on a logit vector
LOGITS = torch.tensor([[2.0, -1.0, 0.5, 0.0, -3.0], [0.1, 0.2, 0.3, 0.4, 0.5]],
                      dtype=torch.float64)
KEYS = context_keys(torch.tensor([[1, 2, 3], [4, 5, 6]]), 0)


@pytest.mark.parametrize("mode", DETERMINISTIC_MODES)
def test_each_mode_is_its_formula_on_a_fixed_logit_vector(mode):
    m = EngineMismatch(mode, 0.7, 0.5 if mode == "heavy" else 1.0, seed=3)
    z = mismatch_direction(KEYS, 5, EngineMismatch("fixed", 1.0, seed=3))   # the Gaussian stream
    got = perturb_logits(LOGITS, m, keys_N=KEYS)
    if mode == "fixed":
        want = LOGITS + 0.7 * z
    elif mode == "heavy":
        mask = mismatch_direction(KEYS, 5, m) != 0
        want = LOGITS + 0.7 * torch.sign(z) * mask
    else:
        want = LOGITS + 0.7 * (LOGITS - LOGITS.mean(-1, keepdim=True)).abs() * z
    torch.testing.assert_close(got, want, rtol=EXACT, atol=EXACT)
    # a function of (context, token): the same rows in another order and batch
    again = perturb_logits(LOGITS.flip(0), m, keys_N=KEYS.flip(0)).flip(0)
    assert torch.equal(got, again)
    assert torch.equal(perturb_logits(LOGITS[1:], m, keys_N=KEYS[1:]), got[1:])


def test_growing_ignores_a_shift_and_grows_with_the_logits_spread():
    m = EngineMismatch("growing", 0.3)
    base = perturb_logits(LOGITS, m, keys_N=KEYS) - LOGITS
    shifted = perturb_logits(LOGITS + 5.0, m, keys_N=KEYS) - (LOGITS + 5.0)
    torch.testing.assert_close(shifted, base, rtol=1e-12, atol=1e-12)
    doubled = perturb_logits(2 * LOGITS, m, keys_N=KEYS) - 2 * LOGITS
    torch.testing.assert_close(doubled, 2 * base, rtol=1e-12, atol=1e-12)

    def kl(logits):
        mu = torch.log_softmax(perturb_logits(logits, m, keys_N=KEYS), -1)
        pi = torch.log_softmax(logits, -1)
        return (mu.exp() * (mu - pi)).sum(-1)

    assert bool((kl(2 * LOGITS) > kl(LOGITS)).all())   # a sharper policy, a larger mismatch


def test_fresh_draws_from_the_generator_and_zero_scale_is_the_identity():
    m = EngineMismatch("fresh", 0.5)
    got = perturb_logits(LOGITS.float(), m, generator=torch.Generator().manual_seed(3))
    noise = torch.randn(LOGITS.shape, generator=torch.Generator().manual_seed(3))
    assert torch.equal(got, LOGITS.float() + 0.5 * noise)
    for mode in ("fixed", "heavy", "growing", "fresh"):
        assert perturb_logits(LOGITS, EngineMismatch(mode, 0.0)) is LOGITS
    assert perturb_logits(LOGITS, None) is LOGITS


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("kwargs, error, name", [
    (dict(mode="fixd"), ValueError, "mode"),
    (dict(mode=None), ValueError, "mode"),
    (dict(mode="fixed", scale=-1.0), ValueError, "scale"),
    (dict(mode="fixed", scale=float("nan")), ValueError, "scale"),
    (dict(mode="fixed", scale=float("inf")), ValueError, "scale"),
    (dict(mode="fixed", scale=True), TypeError, "scale"),
    (dict(mode="fixed", scale="1"), TypeError, "scale"),
    (dict(mode="heavy", scale=1.0, fraction=0.0), ValueError, "fraction"),
    (dict(mode="heavy", scale=1.0, fraction=1.5), ValueError, "fraction"),
    (dict(mode="heavy", scale=1.0, fraction=float("nan")), ValueError, "fraction"),
    (dict(mode="fresh", scale=1.0, fraction=0.5), ValueError, "fraction"),
    (dict(mode="none", scale=1.0), ValueError, "scale"),
    (dict(mode="fixed", scale=1.0, seed=-1), ValueError, "seed"),
    (dict(mode="fixed", scale=1.0, seed=2 ** 31), ValueError, "seed"),
    (dict(mode="fixed", scale=1.0, seed=1.0), TypeError, "seed"),
    (dict(mode="fixed", scale=1.0, seed=True), TypeError, "seed"),
])
def test_bad_settings_are_refused_naming_the_field(kwargs, error, name):
    with pytest.raises(error, match=f"^{name}:"):
        EngineMismatch(**kwargs)


def test_bad_calls_are_refused_naming_the_argument():
    with pytest.raises(ValueError, match="^keys_N:"):
        perturb_logits(LOGITS, EngineMismatch("fixed", 1.0))
    with pytest.raises(ValueError, match="^keys_N:"):
        perturb_logits(LOGITS, EngineMismatch("fixed", 1.0), keys_N=KEYS[:1])
    with pytest.raises(TypeError, match="^generator:"):
        perturb_logits(LOGITS, EngineMismatch("fresh", 1.0))
    with pytest.raises(TypeError, match="^mismatch:"):
        perturb_logits(LOGITS, "fixed", keys_N=KEYS)
    with pytest.raises(ValueError, match="^mismatch:"):
        mismatch_direction(KEYS, 5, EngineMismatch("fresh", 1.0))
    with pytest.raises(TypeError, match="^tokens_NK:"):
        context_keys(torch.zeros(2, 3), 0)
    with pytest.raises(ValueError, match="^tokens_NK:"):
        context_keys(torch.tensor([[-1, 2]]), 0)
    with pytest.raises(ValueError, match="^tokens_NK:"):
        context_keys(torch.tensor([1, 2]), 0)


# ------------------------------------------------------------------ the engine copies
def _mdp_policy():
    mdp = TokenMDP(vocab_size=4, max_len=3, reward=TokenCount(0), prompts=[(0,), (1, 2)])
    return mdp, TabularPolicy(mdp, generator=torch.Generator().manual_seed(0), init_std=1.5)


@pytest.mark.parametrize("mode", DETERMINISTIC_MODES)
@pytest.mark.parametrize("rounding", [None, "bf16"])
def test_the_mdp_copy_perturbs_each_state_keyed_by_its_tokens(mode, rounding):
    mdp, pi = _mdp_policy()
    m = EngineMismatch(mode, 0.8, 0.3 if mode == "heavy" else 1.0, seed=11)
    mu = inference_copy(pi, mismatch=m, rounding=rounding, temperature=0.7)
    for k in range(mdp.max_len):
        prompt_index, prefix = mdp.level_prefixes(k)
        tokens = [list(mdp.prompts[p]) + prefix[i].tolist() for i, p in
                  enumerate(prompt_index.tolist())]
        keys = torch.cat([context_keys(torch.tensor([t]), 11) for t in tokens])
        with torch.no_grad():
            base = round_logits(pi.level_logits(k), rounding)
            want = perturb_logits(base, m, keys_N=keys) / 0.7
            torch.testing.assert_close(mu.level_logits(k), want, rtol=EXACT, atol=EXACT)
            torch.testing.assert_close(mu.logits(prompt_index, prefix), want, rtol=EXACT,
                                       atol=EXACT)
            assert float((want - base / 0.7).abs().max()) > 0.1     # it does perturb


def test_the_mdp_copy_refuses_fresh_a_second_noise_and_a_wrong_type():
    _, pi = _mdp_policy()
    with pytest.raises(ValueError, match="^mismatch: mode 'fresh'"):
        inference_copy(pi, mismatch=EngineMismatch("fresh", 1.0))
    with pytest.raises(ValueError, match="^noise_std, mismatch:"):
        inference_copy(pi, noise_std=0.5, generator=torch.Generator(),
                       mismatch=EngineMismatch("fixed", 1.0))
    with pytest.raises(TypeError, match="^mismatch:"):
        inference_copy(pi, mismatch="fixed")
    # the old spelling still works, and an inactive mode changes nothing
    same = inference_copy(pi, mismatch=EngineMismatch("fixed", 0.0))
    with torch.no_grad():
        torch.testing.assert_close(same.level_logits(1), pi.level_logits(1), rtol=0, atol=0)
    inference_copy(pi, noise_std=0.5, generator=torch.Generator().manual_seed(0))


def _lattice_policy():
    mdp = L.LatticeMDP(L.token_count(0, 3, modulus=2), 4, length_reward=-0.1)
    return L.LatticePolicy(mdp, generator=torch.Generator().manual_seed(0), init_std=2.0)


@pytest.mark.parametrize("mode", DETERMINISTIC_MODES)
def test_the_lattice_copy_perturbs_each_node_keyed_by_t_and_z(mode):
    pi = _lattice_policy()
    m = EngineMismatch(mode, 0.6, 0.25 if mode == "heavy" else 1.0, seed=4)
    mu = L.inference_copy(pi, mismatch=m, rounding="fp16", temperature=1.3)
    logits = round_logits(pi.logits.detach(), "fp16")
    T, K, V = logits.shape
    for t in range(T):
        for z in range(K):
            key = context_keys(torch.tensor([[t, z]]), 4)
            want = perturb_logits(logits[t, z][None], m, keys_N=key)[0] / 1.3
            torch.testing.assert_close(mu.logits[t, z], want, rtol=EXACT, atol=EXACT)
    assert not mu.logits.requires_grad
    assert float((mu.logits - logits / 1.3).abs().max()) > 0.1


def test_the_lattice_copy_refuses_fresh_and_a_second_noise():
    pi = _lattice_policy()
    with pytest.raises(ValueError, match="^mismatch: mode 'fresh'"):
        L.inference_copy(pi, mismatch=EngineMismatch("fresh", 1.0))
    with pytest.raises(ValueError, match="^noise_std, mismatch:"):
        L.inference_copy(pi, noise_std=0.5, generator=torch.Generator(),
                         mismatch=EngineMismatch("heavy", 1.0, 0.1))
    with pytest.raises(TypeError, match="^mismatch:"):
        L.inference_copy(pi, mismatch=0.5)


def test_apply_direction_leaves_non_finite_logits_alone():
    logits = torch.tensor([[1.0, -math.inf, 0.0]], dtype=torch.float64)
    out = apply_direction(logits, torch.ones(1, 3, dtype=torch.float64),
                          EngineMismatch("growing", 1.0))
    assert out[0, 1] == -math.inf and torch.isfinite(out[0, [0, 2]]).all()
    torch.testing.assert_close(out[0, [0, 2]], torch.tensor([1.5, 0.5], dtype=torch.float64))
