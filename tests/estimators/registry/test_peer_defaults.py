"""The peers' defaults as registry entries: verl's always-on dual clip at 3 (``*_verl``), Tinker's
CISPO band [0, 4] with its plain sum (``cispo_tinker``), TRL's default sequence-mask correction at
3 (``*_trl_mis``); each equal to its base where the default does not bind and different by the
hand-computed amounts where it does, and the aliases of the bases name the difference."""

from __future__ import annotations

import math

import pytest
import torch

from tests.estimators.estimator_helpers import make_batch, response_values
from tokenmdp import estimators
from tokenmdp.estimators import Level, MaskedIS, loss, prepare

EXACT = 1e-12


def _batch(log_r, rewards, *, seed=0):
    """Two groups of two; ``log_r[s]`` the per-token ``log π_θ - log π_old`` of sequence s."""
    g = torch.Generator().manual_seed(seed)
    old = [(-0.2 - torch.rand(len(r), generator=g, dtype=torch.float64)).tolist() for r in log_r]
    batch = make_batch([[9]] * len(log_r), [[1 + i] * len(r) for i, r in enumerate(log_r)],
                       rewards=rewards, groups=[i // 2 for i in range(len(log_r))], old=old,
                       behavior=old, ref=old)
    lp = (batch.old_logprob + response_values(batch, log_r)).requires_grad_(True)
    return batch, lp


def _loss_and_grad(name, batch, lp):
    est = estimators.get(name)
    step = prepare(batch, est, max_len=4)
    value, _ = loss(lp, step, est)
    return value.detach(), torch.autograd.grad(value, lp)[0], step


@pytest.mark.parametrize("base", ["ppo", "grpo", "dapo"])
def test_verl_dual_clip_is_the_base_when_no_negative_advantage_token_has_r_above_3(base):
    log_r = [[0.9, 1.5, 0.3], [0.1, -0.2], [2.0], [-0.4, 0.05]]   # r up to e^2 = 7.4 ...
    batch, lp = _batch(log_r, rewards=[1.0, 0.0, 1.0, 0.0])       # ... but only where Â > 0
    v0, g0, _ = _loss_and_grad(base, batch, lp)
    v1, g1, _ = _loss_and_grad(f"{base}_verl", batch, lp)
    assert torch.equal(v0, v1) and torch.equal(g0, g1)


@pytest.mark.parametrize("base", ["ppo", "grpo", "dapo"])
def test_verl_dual_clip_differs_by_the_hand_computed_amounts(base):
    # sequence 1 (Â < 0) has a token with r = 4 > 3: the base's term A·max(r, clip(r)) = 4A
    # becomes 3A with no gradient; loss moves by -w (3A - 4A) = w A, the gradient by w·4A
    log_r = [[0.1, -0.2], [math.log(4.0), 0.05], [0.3], [-0.1, 0.2]]
    batch, lp = _batch(log_r, rewards=[1.0, 0.0, 1.0, 0.0])
    v0, g0, step = _loss_and_grad(base, batch, lp)
    v1, g1, _ = _loss_and_grad(f"{base}_verl", batch, lp)
    hit = (batch.sequence_id == 1) & (batch.position == 1)   # the r = 4 token (after the prompt)
    w, a = float(step.loss_weight[hit]), float(step.advantage[hit])
    assert a < 0
    assert float(v1 - v0) == pytest.approx(w * a, abs=EXACT)
    assert float((g1 - g0)[hit]) == pytest.approx(w * 4.0 * a, abs=EXACT)
    assert torch.equal(g1[~hit], g0[~hit])


def test_verl_entries_keep_everything_but_the_dual_clip():
    for base in ("ppo", "grpo", "dapo"):
        b, v = estimators.get(base), estimators.get(f"{base}_verl")
        assert v.surrogate.dual_clip == 3.0 and b.surrogate.dual_clip is None
        assert v.replace(surrogate=b.surrogate, name=base) == b


def test_cispo_tinker_is_tinkers_documented_loss():
    # Tinker: ratio = exp(target - sampling), clamp to [0, 4], loss = -Σ sg(ratio) logp A
    log_r = [[0.1, math.log(3.0)], [math.log(5.0), -0.3], [0.2], [math.log(0.5), 0.0]]
    batch, lp = _batch(log_r, rewards=[1.0, 0.0, 0.5, 0.0])
    value, grad, step = _loss_and_grad("cispo_tinker", batch, lp)
    mask = batch.loss_mask
    y = lp.detach().clone().requires_grad_(True)
    ratio = torch.exp(y.detach() - batch.old_logprob).clamp(0.0, 4.0)
    expected = -(torch.where(mask, ratio * y * step.advantage, 0.0)).sum()
    assert float(value) == pytest.approx(float(expected.detach()), abs=EXACT)
    torch.testing.assert_close(grad, torch.autograd.grad(expected, y)[0], rtol=0, atol=EXACT)
    # against the registered cispo (cap 1.2, token mean): the r = 3 and r = 5 tokens differ
    _, g_cispo, s_cispo = _loss_and_grad("cispo", batch, lp)
    n = int(mask.sum())
    for s, t, weight in ((0, 1, 3.0), (1, 0, 4.0)):
        hit = (batch.sequence_id == s) & (batch.position == 1 + t)     # prompt of length 1
        assert float(grad[hit]) == pytest.approx(-weight * float(step.advantage[hit]), abs=EXACT)
        assert float(g_cispo[hit]) == pytest.approx(-1.2 * float(s_cispo.advantage[hit]) / n,
                                                    abs=EXACT)


def test_trl_default_correction_is_trls_sequence_mask():
    # TRL: per sequence exp(Σ_t (old - sampling)), zeroed above vllm_importance_sampling_cap 3
    log_w = [[0.5, 0.7], [0.2, -0.1], [1.3], [0.0, 0.4]]             # W = 3.3, 1.1, 3.7, 1.5
    old = [[-1.0, -0.5], [-0.7, -0.2], [-0.4], [-0.9, -0.6]]
    behavior = [[o - w for o, w in zip(os_, ws, strict=True)]
                for os_, ws in zip(old, log_w, strict=True)]
    batch = make_batch([[9]] * 4, [[1, 2], [3, 4], [5], [6, 7]], rewards=[1.0, 0.0, 1.0, 0.0],
                       groups=[0, 0, 1, 1], old=old, behavior=behavior, ref=old)
    for name in ("grpo_trl_mis", "dapo_trl_mis"):
        est = estimators.get(name)
        assert est.correction == MaskedIS(high=3.0, level=Level.SEQUENCE,
                                          masked_in_normalizer=True)
        factor = est.correction(batch).factor_RC
        W = [math.exp(sum(w)) for w in log_w]
        expected = [[x if x <= 3.0 else 0.0] * len(ws) for x, ws in zip(W, log_w, strict=True)]
        got = [[float(factor[(batch.sequence_id == s) & (batch.position == 1 + t)])
                for t in range(len(ws))] for s, ws in enumerate(log_w)]
        assert got == [pytest.approx(row, abs=EXACT) for row in expected]
        base = estimators.get(name.removesuffix("_trl_mis"))
        assert torch.equal(prepare(batch, est).loss_weight, prepare(batch, base).loss_weight)


@pytest.mark.parametrize(("name", "phrases"), [
    ("ppo", ["clip_ratio_c", "ppo_verl", "summed over tokens"]),
    ("grpo", ["dual clip", "grpo_verl", "sequence_mask", "grpo_trl_mis"]),
    ("dapo", ["dual clip", "dapo_verl", "dapo_trl_mis"]),
    ("dr_grpo", ["dual clip"]),
    ("cispo", ["[0, 4]", "cispo_tinker"]),
    ("grpo_tis", ["token_truncate", "'sequence_mask' and 3"]),
    # issue 32, found by the transcriptions (tests/estimators/registry/test_*_peers.py,
    # test_verl_*.py): the peers' settings under which the claimed equality holds
    ("grpo", ["R/(1 + 1e-6) in verl, is refused here"]),
    ("rloo", ["keeps its reward there, is refused here", "beta=0.0, on-policy",
              "init_kl_coef=0", "S/N_tokens"]),
    ("dppo_tv", ["ActorConfig's clip_ratio_c = 3.0", "DPPO(cap=3.0)"]),
    ("dppo_kl", ["ActorConfig's clip_ratio_c = 3.0"]),
    ("grpo_opsm", ["vllm_importance_sampling_correction=False"]),
    ("grpo_rs_seq", ["the sequence count S is the whole mini-batch"]),
    ("reinforce_pp_baseline", ["init_kl_coef × the token mean of k"]),
])
def test_aliases_state_where_the_peers_differ(name, phrases):
    aliases = estimators.describe(name).split("Other names:")[1]
    for phrase in phrases:
        assert phrase in aliases, (name, phrase)
