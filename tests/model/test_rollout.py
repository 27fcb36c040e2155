"""The rollout engine (KV cache, stopping, its own numerics) and routing replay R2 / R3."""

import dataclasses
import math

import pytest
import torch

from tests.model.models import TINY, make_model
from tokenmdp.model import ModelConfig
from tokenmdp.packing import pack_first_fit_decreasing
from tokenmdp.rl import (
    ENGINE_ROUTING,
    OLD_ROUTING,
    RolloutEngine,
    RoutingReplay,
    compute_old_logprobs,
    replay_routing,
    routing_mismatch_counts,
    routing_mismatch_rate,
    simulate_fp8,
    training_inference_kl,
)

#: fp32 KV-cache decoding vs a full fp32 recompute: same math, different summation order.
KV_CACHE_ATOL = 1e-5
#: KL of two fp32 engines that compute the same distribution up to rounding.
ROUNDING_KL = 1e-9

EOS = TINY.vocab_size - 1
PROMPTS = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 1], [2, 2], [3]]

# Routing flips need close router scores: a wider model with more experts and a larger batch.
ROUTED = ModelConfig(vocab_size=16, d_model=32, n_heads=2, n_experts=8, top_k=2, expert_hidden=32,
                     init_std=0.1)


def _generate(engine, prompts=PROMPTS, seed=1, **kwargs):
    kwargs.setdefault("max_new_tokens", 8)
    return engine.generate(prompts, eos_id=kwargs.pop("eos_id", EOS),
                           generator=torch.Generator().manual_seed(seed), **kwargs)


def _routed_prompts(n=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, ROUTED.vocab_size - 1, (4,), generator=gen).tolist() for _ in range(n)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kv_cache_logprobs_equal_a_full_recompute(model32, temperature):
    engine = RolloutEngine(model32)
    batch = _generate(engine, temperature=temperature)
    # the distribution actually sampled from: softmax(logits / T) of the trainer's fp32 model
    lp_RCV = torch.log_softmax(model32.next_token_logprobs(batch).detach() / temperature, -1)
    expected = lp_RCV.gather(-1, batch.tokens[..., None]).squeeze(-1) * batch.loss_mask
    torch.testing.assert_close(batch.behavior_logprob, expected, rtol=0, atol=KV_CACHE_ATOL)
    uncached = _generate(engine, temperature=temperature, use_cache=False)
    assert torch.equal(uncached.tokens, batch.tokens)
    torch.testing.assert_close(uncached.behavior_logprob, batch.behavior_logprob, rtol=0,
                               atol=KV_CACHE_ATOL)


def test_generation_stops_at_eos_or_max_tokens_and_never_routes_the_last_token(model32):
    batch = _generate(RolloutEngine(model32), prompts=PROMPTS * 4, max_new_tokens=6)
    routed = (batch.token_extras[ENGINE_ROUTING] >= 0).flatten(2).all(-1)
    hit_eos = hit_max = 0
    for s, (prompt, response) in enumerate(batch.sequences()):
        assert prompt == (PROMPTS * 4)[s] and 1 <= len(response) <= 6
        assert EOS not in response[:-1]
        hit_eos += response[-1] == EOS
        hit_max += len(response) == 6 and response[-1] != EOS
        row = routed[batch.sequence_id == s]
        assert bool(row[:-1].all()) and not bool(row[-1])  # every token but the last is routed
    assert hit_eos and hit_max  # both stopping rules were exercised
    assert not bool(routed[batch.sequence_id < 0].any())


def test_engine_only_differing_in_selection_r3_gives_pi_old_equal_mu():
    model = make_model(ROUTED)
    engine = RolloutEngine(model, selection_noise=0.1, generator=torch.Generator().manual_seed(5))
    batch = _generate(engine, prompts=_routed_prompts(), max_new_tokens=12)
    plain = compute_old_logprobs(model, batch, RoutingReplay.NONE)
    assert routing_mismatch_rate(plain.token_extras[OLD_ROUTING], batch.token_extras[ENGINE_ROUTING]) > 0.05
    assert training_inference_kl(plain) > 1e3 * ROUNDING_KL
    r3 = compute_old_logprobs(model, batch, RoutingReplay.R3)
    assert routing_mismatch_rate(r3.token_extras[OLD_ROUTING], batch.token_extras[ENGINE_ROUTING]) == 0
    torch.testing.assert_close(r3.old_logprob, batch.behavior_logprob, rtol=0, atol=KV_CACHE_ATOL)
    assert training_inference_kl(r3) < ROUNDING_KL
    assert abs(training_inference_kl(r3, kind="k1")) < 1e-6


def test_bf16_engine_has_positive_kl_and_r3_removes_mismatch_and_lowers_kl():
    model = make_model(ROUTED)
    batch = _generate(RolloutEngine(model, precision="bf16"), prompts=_routed_prompts(),
                      max_new_tokens=12)
    plain = compute_old_logprobs(model, batch, "none")
    r3 = compute_old_logprobs(model, batch, "r3")
    assert routing_mismatch_rate(plain.token_extras[OLD_ROUTING], batch.token_extras[ENGINE_ROUTING]) > 0
    assert routing_mismatch_rate(r3.token_extras[OLD_ROUTING], batch.token_extras[ENGINE_ROUTING]) == 0
    kl_plain, kl_r3 = training_inference_kl(plain), training_inference_kl(r3)
    assert kl_plain > 0 and 0 < kl_r3 < kl_plain


def test_r2_on_the_first_mini_batch_is_a_no_op(model32):
    batch = _generate(RolloutEngine(model32, precision="bf16"))
    step = compute_old_logprobs(model32, batch, "r2")
    lp = model32.token_logprobs(step, routing=replay_routing(step, "r2")).to(step.dtype)
    assert torch.equal(lp, step.old_logprob)
    # a packed mini-batch: the record travels with its tokens and the routing is reproduced
    packed = pack_first_fit_decreasing(step, 2 * step.capacity)
    lp_p, trace = model32.token_logprobs(packed, routing=replay_routing(packed, "r2"),
                                         record_routing=True)
    real = packed.sequence_id >= 0
    assert torch.equal(trace.experts[real], packed.token_extras[OLD_ROUTING][real])
    torch.testing.assert_close(packed.sequence_sum(lp_p.detach()), step.sequence_sum(step.old_logprob),
                               rtol=0, atol=KV_CACHE_ATOL)


#: float64 entropy from one pass vs from the full next-token distributions (summation order).
ENTROPY_ATOL = 1e-12


@pytest.mark.parametrize("replay", ["none", "r3"])
def test_old_logprob_pass_returns_the_entropy_of_pi_old_from_the_same_forward(model64, replay):
    batch = _generate(RolloutEngine(model64), dtype=torch.float64)
    step = compute_old_logprobs(model64, batch, replay)
    fused, ent_RC = compute_old_logprobs(model64, batch, replay, entropy=True)
    assert torch.equal(fused.old_logprob, step.old_logprob)
    assert torch.equal(fused.token_extras[OLD_ROUTING], step.token_extras[OLD_ROUTING])
    # independently: H = -sum_v p log p over the [R, C, V] distributions, token by token
    lp_RCV = model64.next_token_logprobs(batch, routing=replay_routing(batch, replay)).detach()
    expected = [-(lp.exp() * lp).sum() if bool(batch.response_mask[r, c]) else lp.new_zeros(())
                for (r, c), lp in zip(torch.cartesian_prod(torch.arange(lp_RCV.shape[0]),
                                                           torch.arange(lp_RCV.shape[1])).tolist(),
                                      lp_RCV.reshape(-1, lp_RCV.shape[-1]))]
    torch.testing.assert_close(ent_RC, torch.stack(expected).reshape(ent_RC.shape), rtol=0,
                               atol=ENTROPY_ATOL)
    assert ent_RC.dtype == torch.float64 and not ent_RC.requires_grad


def test_entropy_of_a_uniform_policy_is_log_v(model64):
    with torch.no_grad():
        model64.lm_head.zero_()  # every next-token distribution is uniform
    batch = _generate(RolloutEngine(model64), dtype=torch.float64)
    _, ent_RC = compute_old_logprobs(model64, batch, "none", entropy=True)
    uniform = torch.full_like(ent_RC, math.log(TINY.vocab_size))
    torch.testing.assert_close(ent_RC, torch.where(batch.response_mask, uniform, 0.0), rtol=0,
                               atol=ENTROPY_ATOL)
    with pytest.raises(TypeError, match="entropy"):
        compute_old_logprobs(model64, batch, "none", entropy=1)


def test_replay_routing_picks_the_record_of_each_mode(model32):
    batch = _generate(RolloutEngine(model32))
    assert replay_routing(batch, "none") is None
    assert replay_routing(batch, "r3") is batch.token_extras[ENGINE_ROUTING]
    with pytest.raises(ValueError, match="old_routing"):
        replay_routing(batch, "r2")
    step = compute_old_logprobs(model32, batch, "r3")
    assert replay_routing(step, RoutingReplay.R2) is step.token_extras[OLD_ROUTING]


def test_sync_copies_weights_in_the_engine_precision(model32):
    engine = RolloutEngine(model32, precision="fp8")
    w = engine.model.blocks[0].mlp.w_up
    assert torch.equal(simulate_fp8(w), w)  # already on the fp8 grid
    with torch.no_grad():
        model32.blocks[0].mlp.w_up.mul_(2.0)
    engine.sync(model32)
    torch.testing.assert_close(engine.model.blocks[0].mlp.w_up, simulate_fp8(model32.blocks[0].mlp.w_up))
    bf16 = RolloutEngine(model32, precision="bf16")
    assert all(p.dtype == torch.bfloat16 for p in bf16.model.parameters())
    assert not any(p.requires_grad for p in bf16.model.parameters())


@pytest.mark.parametrize("kwargs, match", [
    ({"precision": "int4"}, "precision"), ({"selection_noise": -1.0}, "selection_noise"),
    ({"selection_noise": 0.1}, "generator"),
])
def test_engine_rejects_bad_options(model32, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        RolloutEngine(model32, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": 0.0}, "temperature"), ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"eos_id": TINY.vocab_size}, "eos_id"), ({"prompts": [[]]}, "prompts"),
])
def test_generate_rejects_bad_arguments(model32, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _generate(RolloutEngine(model32), **kwargs)


def test_dense_model_has_empty_traces_and_samples():
    model = make_model(dataclasses.replace(TINY, dense=True))
    batch = _generate(RolloutEngine(model, precision="fp16"))
    assert batch.token_extras[ENGINE_ROUTING].shape[2] == 0
    step = compute_old_logprobs(model, batch, "r3")
    assert training_inference_kl(step) >= 0


def test_routing_mismatch_counts_compare_expert_sets_where_both_recorded():
    # [R=1, C=4, L=1, K=2]: same set in another order | different sets | unrecorded in a (-1) |
    # different sets. Compared: 3 pairs; differing: 2.
    a = torch.tensor([[[[0, 1]], [[0, 2]], [[-1, -1]], [[3, 1]]]])
    b = torch.tensor([[[[1, 0]], [[0, 1]], [[2, 3]], [[2, 0]]]])
    assert routing_mismatch_counts(a, b) == (2, 3)
    assert routing_mismatch_rate(a, b) == pytest.approx(2 / 3)
    assert routing_mismatch_counts(a[:, 2:3], b[:, 2:3]) == (0, 0)
    assert routing_mismatch_rate(a[:, 2:3], b[:, 2:3]) == 0.0
