"""The MoE transformer: configuration, layouts, the policy protocol, routing record and replay,
and the exact world's ∇J (tokenmdp.exact) on a tiny MDP."""

import dataclasses

import pytest
import torch

from tests.model.models import TINY, make_model
from tokenmdp.batch import TokenBatch
from tokenmdp.exact import TokenMDP, check_policy, gradient, objective, sequence_logprobs
from tokenmdp.exact.world.rewards import RandomTable
from tokenmdp.model import RoutingTrace, load_balancing_loss
from tokenmdp.packing import flat_layout, pack_first_fit_decreasing, padded_layout
from tokenmdp.testing import check_layout_invariance
from tokenmdp.testing.strategies import Layout

#: float64 forward passes on different layouts differ only in summation order.
FLOAT64_TOL = 1e-12
#: ∇J by the exact recursion vs the REINFORCE loss on the full enumeration (float64).
GRADIENT_RTOL = 1e-9

PROMPTS = [[1, 2], [3], [4, 5, 6], [7]]
RESPONSES = [[1, 2, 3], [6], [0, 0], [9, 8, 7, 6]]


def _batch(dtype=torch.float64) -> TokenBatch:
    return TokenBatch.from_sequences(PROMPTS, RESPONSES, dtype=dtype)


def _with_routing(batch: TokenBatch, trace: RoutingTrace) -> TokenBatch:
    return dataclasses.replace(batch, token_extras={"routing": trace.experts})


@pytest.mark.parametrize("field, value, error", [
    ("d_model", 0, ValueError), ("n_heads", 3, ValueError), ("top_k", 5, ValueError),
    ("vocab_size", 2.0, TypeError), ("init_std", -1.0, ValueError), ("dense", 1, TypeError),
    ("expert_capacity_factor", 0.0, ValueError), ("attention", "cuda", ValueError),
])
def test_config_rejects_bad_fields_naming_them(field, value, error):
    with pytest.raises(error, match=field):
        dataclasses.replace(TINY, **{field: value})


def test_logprobs_are_zero_off_response_tokens_and_normalized_on_them(model64):
    batch = _batch()
    lp_RC = model64.token_logprobs(batch)
    lp_RCV = model64.next_token_logprobs(batch)
    resp = batch.response_mask
    assert bool((lp_RC[~resp] == 0).all()) and bool((lp_RCV[~resp] == 0).all())
    assert bool((lp_RC[resp] < 0).all())
    torch.testing.assert_close(lp_RCV[resp].logsumexp(-1), torch.zeros(int(resp.sum()),
                               dtype=torch.float64), rtol=0, atol=FLOAT64_TOL)
    torch.testing.assert_close(lp_RCV.gather(-1, batch.tokens[..., None]).squeeze(-1), lp_RC)


def test_packed_and_padded_forward_agree_and_traces_follow_their_tokens(model64):
    padded = _batch()
    lp, trace = model64.token_logprobs(padded, record_routing=True)
    for layout in (pack_first_fit_decreasing(_with_routing(padded, trace), 8),
                   flat_layout(_with_routing(padded, trace))):
        lp2, trace2 = model64.token_logprobs(layout, record_routing=True)
        torch.testing.assert_close(layout.sequence_sum(lp2), padded.sequence_sum(lp), rtol=0,
                                   atol=FLOAT64_TOL)
        real = layout.sequence_id >= 0
        assert torch.equal(trace2.experts[real], layout.token_extras["routing"][real])
        # and back: the packed record, moved to the padded layout, is the padded record
        back = padded_layout(dataclasses.replace(layout, token_extras={"routing": trace2.experts}))
        assert torch.equal(back.token_extras["routing"][padded.sequence_id >= 0],
                           trace.experts[padded.sequence_id >= 0])


@pytest.mark.parametrize("dense", [False, True])
def test_model_passes_the_layout_invariance_check(dense):
    model = make_model(dataclasses.replace(TINY, dense=dense), dtype=torch.float64)
    gen = torch.Generator().manual_seed(3)
    batch = _batch()
    batch = batch.replace(advantage=torch.randn(batch.tokens.shape, generator=gen,
                                                dtype=torch.float64) * batch.loss_mask)

    def loss_fn(logprobs_RC, b):
        return -(b.loss_weight * b.advantage * logprobs_RC).sum()

    layouts = [Layout("padded", 2), Layout("flat"), Layout("first_fit_decreasing", 1, 7),
               Layout("in_order", 3, 11)]
    check_layout_invariance(loss_fn, batch, layouts, model=model, raise_on_failure=True)


def test_policy_conformance_float64_only():
    mdp = TokenMDP(4, 2, RandomTable(0), prompts=[(0,), (1, 2)])
    config = dataclasses.replace(TINY, vocab_size=4)
    check_policy(mdp, make_model(config, dtype=torch.float64))
    with pytest.raises(TypeError, match="float64"):
        check_policy(mdp, make_model(config))


def test_replaying_own_routing_is_bitwise_no_op(model32):
    batch = _batch(torch.float32)
    lp, trace = model32.token_logprobs(batch, record_routing=True)
    lp2, trace2 = model32.token_logprobs(batch, routing=trace, record_routing=True)
    assert torch.equal(lp, lp2) and torch.equal(trace.experts, trace2.experts)


def test_replay_changes_the_forward_pass_when_the_trace_differs(model32):
    batch = _batch(torch.float32)
    lp, trace = model32.token_logprobs(batch, record_routing=True)
    other = torch.where(trace.experts >= 0, (trace.experts + 1) % TINY.n_experts, -1)
    lp2, trace2 = model32.token_logprobs(batch, routing=other, record_routing=True)
    assert torch.equal(trace2.experts, other)
    assert float((lp2 - lp).detach().abs().max()) > 1e-3


@pytest.mark.parametrize("top_k", [1, 2])
def test_router_gradient_under_replay_is_nonzero_iff_k_at_least_2(top_k):
    model = make_model(dataclasses.replace(TINY, top_k=top_k), dtype=torch.float64)
    batch = _batch()
    _, trace = model.token_logprobs(batch, record_routing=True)
    # replay another engine's choice (every expert shifted by one), as R3 does
    other = torch.where(trace.experts >= 0, (trace.experts + 1) % TINY.n_experts, -1)
    lp = model.token_logprobs(batch, routing=other)
    routers = [block.mlp.router for block in model.blocks]
    grads = torch.autograd.grad(lp.sum(), routers)
    norm = float(sum(g.norm() for g in grads))
    if top_k == 1:
        assert norm == 0.0  # renormalized gate over one expert is identically 1
    else:
        assert norm > 1e-6


def test_load_balancing_loss_is_one_under_uniform_scores_and_counts_valid_tokens():
    scores_NE = torch.zeros(4, 3)
    chosen_NK = torch.tensor([[0], [1], [2], [0]])
    valid_N = torch.tensor([True, True, True, False])
    # f = (1/3, 1/3, 1/3), P = (1/3, 1/3, 1/3): E Σ f P = 3 * 3 * 1/9 = 1
    assert float(load_balancing_loss(scores_NE, chosen_NK, valid_N)) == pytest.approx(1.0)
    # all valid tokens on expert 0 with P_0 = 1 gives E = 3
    peaked = torch.tensor([[50.0, 0, 0]]).expand(4, 3)
    assert float(load_balancing_loss(peaked, torch.zeros(4, 1, dtype=torch.long), valid_N)) \
        == pytest.approx(3.0)


#: a near-uniform router (init std 0.01) gives a load-balancing loss of ~1 per routed layer.
NEAR_UNIFORM_ATOL = 0.05


def test_forward_sums_the_load_balancing_loss_of_the_routed_layers():
    model = make_model(dataclasses.replace(TINY, init_std=0.01), dtype=torch.float64)
    out = model(_batch())
    assert out.load_balancing_loss.requires_grad
    assert abs(float(out.load_balancing_loss.detach()) - TINY.routed_layers) < NEAR_UNIFORM_ATOL
    dense = make_model(dataclasses.replace(TINY, dense=True), dtype=torch.float64)
    assert float(dense(_batch()).load_balancing_loss) == 0.0


def test_bad_tokens_and_traces_raise_naming_the_argument(model64):
    with pytest.raises(ValueError, match="vocab_size"):
        model64.token_logprobs(TokenBatch.from_sequences([[1]], [[TINY.vocab_size]]))
    batch = _batch()
    with pytest.raises(ValueError, match="routing"):
        model64.token_logprobs(batch, routing=torch.zeros(*batch.tokens.shape, 1, 2, dtype=torch.long))
    shape = (*batch.tokens.shape, TINY.routed_layers, TINY.top_k)
    with pytest.raises(ValueError, match="routing"):
        model64.token_logprobs(batch, routing=torch.full(shape, TINY.n_experts))
    _, own = model64.token_logprobs(batch, record_routing=True)
    valid = batch.sequence_id >= 0
    for mend, why in ((lambda e: e.fill_(-2), "below -1"),
                      (lambda e: e[..., 1].copy_(e[..., 0]), "an expert twice"),
                      (lambda e: e[..., 0].fill_(-1), "a partial record")):
        experts = own.experts.clone()
        mended = experts[valid].clone()
        mend(mended)
        experts[valid] = mended
        with pytest.raises(ValueError, match="distinct expert ids"):
            model64.token_logprobs(batch, routing=experts)
            pytest.fail(f"a record with {why} was accepted")
    # a float or unsigned trace would be truncated or could not hold -1: rejected, not coerced
    with pytest.raises(TypeError, match="signed integer"):
        model64.token_logprobs(batch, routing=own.experts.double() + 0.7)
    with pytest.raises(TypeError, match="signed integer"):
        RoutingTrace(own.experts.clamp(min=0).to(torch.uint8))
    # padding's record is ignored (packing fills it with 0, a repeated id)
    padded = torch.where(valid[..., None, None], own.experts, 0)
    torch.testing.assert_close(model64.token_logprobs(batch, routing=padded),
                               model64.token_logprobs(batch), rtol=0, atol=0)


def test_exact_gradient_equals_reinforce_loss_gradient_on_full_enumeration():
    mdp = TokenMDP(3, 3, RandomTable(1), prompts=[(0,), (1, 2)], prompt_probs=[0.3, 0.7])
    model = make_model(dataclasses.replace(TINY, vocab_size=3, init_std=0.5), seed=2,
                       dtype=torch.float64)
    true_grad = gradient(mdp, model)

    # Independent route: REINFORCE on every response, weighted by its exact probability.
    batch = mdp.enumerate()
    seq_lp_N = batch.sequence_sum(model.token_logprobs(batch))
    torch.testing.assert_close(seq_lp_N, sequence_logprobs(mdp, model), rtol=0, atol=FLOAT64_TOL)
    weight_N = (mdp.prompt_probs[batch.prompt_index] * seq_lp_N.exp()).detach()  # d/dθ p = p ∇log p
    loss = -(weight_N * batch.reward * seq_lp_N).sum()
    params = list(model.parameters())
    reinforce = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])
    assert float(true_grad.norm()) > 1e-4
    torch.testing.assert_close(-reinforce, true_grad, rtol=GRADIENT_RTOL,
                               atol=GRADIENT_RTOL * float(true_grad.abs().max()))
    torch.testing.assert_close(objective(mdp, model), (weight_N * batch.reward).sum())
    # the router is part of it: its block of ∇J is not zero (K = 2, gates from router scores)
    router_grad = torch.autograd.grad(objective(mdp, model), model.blocks[0].mlp.router)[0]
    assert float(router_grad.norm()) > 1e-8


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_flex_attention_path_matches_sdpa_on_cpu():
    # FlexAttention's eager reference implementation on the CPU: same mask, same results
    sdpa = make_model(dtype=torch.float64)
    flex = make_model(dataclasses.replace(TINY, attention="flex"), dtype=torch.float64)
    batch = pack_first_fit_decreasing(_batch(), 8)
    with torch.no_grad():  # FlexAttention has no backward on the CPU
        lp, trace = sdpa.token_logprobs(batch, record_routing=True)
        lp2, trace2 = flex.token_logprobs(batch, record_routing=True)
    torch.testing.assert_close(lp2, lp, rtol=0, atol=FLOAT64_TOL)
    assert torch.equal(trace.experts, trace2.experts)


def test_cpu_import_does_not_load_flex_attention():
    import subprocess
    import sys
    code = ("import sys, tokenmdp.model, tokenmdp.rl; "
            "sys.exit(int('torch.nn.attention.flex_attention' in sys.modules "
            "or 'tokenmdp.model.flex' in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_exact_moments_of_rloo_on_the_moe_policy_are_unbiased():
    from tokenmdp import estimators
    from tokenmdp.exact import moments

    mdp = TokenMDP(3, 2, RandomTable(4), prompts=[(0,), (1,)])
    model = make_model(dataclasses.replace(TINY, vocab_size=3, init_std=0.5), seed=1,
                       dtype=torch.float64)
    m = moments(mdp, model, estimators.get("rloo"), group_size=2)
    # RLOO with a sequence-sum aggregation is unbiased for ∇J up to its 1/S scale
    assert m.cosine == pytest.approx(1.0, abs=1e-9)
    assert m.directional_bias < 1e-9


def test_token_dropping_capacity_is_the_counter_example_to_layout_invariance():
    # a tight capacity drops tokens depending on their row-major order, hence on the layout
    def loss_fn(logprobs_RC, b):
        return -(b.loss_weight * logprobs_RC).sum()

    layouts = [Layout("first_fit_decreasing", 1, 7), Layout("flat", 0, 3)]
    dropping = make_model(dataclasses.replace(TINY, expert_capacity_factor=0.5), dtype=torch.float64)
    report = check_layout_invariance(loss_fn, _batch(), layouts, model=dropping)
    assert not report.ok
    dropless = make_model(dtype=torch.float64)
    assert check_layout_invariance(loss_fn, _batch(), layouts, model=dropless).ok


#: float32 normalization error of a log-softmax over a tiny vocabulary.
NORMALIZATION_ATOL = 1e-5


def test_half_precision_models_normalize_their_logits_in_float32():
    batch = _batch(torch.float32)
    for dtype in (torch.bfloat16, torch.float16):
        model = make_model(dtype=dtype)
        lp_RCV = model.next_token_logprobs(batch).detach()
        assert lp_RCV.dtype == torch.float32 and model.token_logprobs(batch).dtype == torch.float32
        # each response token's distribution sums to 1 to float32 accuracy (bf16 would be ~1e-2)
        total = torch.logsumexp(lp_RCV[batch.response_mask], dim=-1)
        torch.testing.assert_close(total, torch.zeros_like(total), rtol=0, atol=NORMALIZATION_ATOL)
