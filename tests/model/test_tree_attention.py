"""The MoE transformer over a packed tree: the ancestor mask (SDPA on the CPU; FlexAttention's
mask_mod checked densely and, forward only, through the CPU's eager FlexAttention), log-probs
and routing equal to the expanded paths' in any layout, routing replay per node, and the loss
and gradient of registry estimators equal to the expanded ones to 1e-12 in float64."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.model.models import TINY, make_model
from tokenmdp import estimators
from tokenmdp.model import tree_attention_mask
from tokenmdp.packing import flat_layout, pack_first_fit_decreasing, select_sequences
from tokenmdp.tree_packing import pack_tree
from tokenmdp.tree_training import packed_tree_logprobs, packed_tree_outputs, tree_micro_batches
from tokenmdp.trees import ResponseTree, batch_from_trees

TOL = 1e-12
TREES = [ResponseTree([1, 2], [3, 4, 5, 6, 7, 8, 9], [-1, 0, 1, 1, 0, 4, 4], reward=[1., 0, 1, 0]),
         ResponseTree([5], [1, 2, 3, 4], [-1, -1, 1, 2], reward=[0.0, 1.0]),
         ResponseTree([7, 7, 7], [10, 0, 1], [-1, 0, 0], reward=[1.0, 1.0])]


def _batch():
    batch = batch_from_trees(TREES, behavior_logprobs=[[-0.5] * len(t.tokens) for t in TREES])
    return batch.replace(ref_logprob=batch.behavior_logprob * 1.1)


def _layouts(batch):
    return [batch, flat_layout(batch), pack_first_fit_decreasing(batch, 9),
            select_sequences(batch, torch.randperm(batch.num_sequences,
                                                   generator=torch.Generator().manual_seed(0)))]


def test_the_flex_mask_mod_is_the_sdpa_mask():
    from tokenmdp.model.flex import tree_mask_mod
    packed = pack_tree(batch_from_trees(TREES), 16)
    end = packed.tree_end_RC
    R, C = end.shape
    b = torch.arange(R)[:, None, None]
    q = torch.arange(C)[None, :, None]
    k = torch.arange(C)[None, None, :]
    dense = tree_mask_mod(end)(b, None, q, k)
    assert torch.equal(dense, tree_attention_mask(end)[:, 0])
    assert bool(dense.any(-1).all())               # no empty row (padding sees itself)


@pytest.mark.parametrize("entropy", [False, True])
def test_packed_logprobs_routing_and_entropy_equal_the_expanded_ones_in_any_layout(model64,
                                                                                   entropy):
    for layout in _layouts(_batch()):
        ref = model64.token_outputs(layout, entropy=entropy, aux=False)
        for capacity in (None, 30):
            out = packed_tree_outputs(model64, layout, pack_tree(layout, capacity),
                                      entropy=entropy, aux=False)
            torch.testing.assert_close(out.logprob_RC, ref.logprob_RC, rtol=0, atol=TOL)
            assert torch.equal(out.routing.experts, ref.routing.experts)
            if entropy:
                torch.testing.assert_close(out.entropy_RC, ref.entropy_RC, rtol=0, atol=TOL)


def test_routing_is_replayed_per_node(model64):
    batch = _batch()
    packed = pack_tree(batch)
    other = make_model(seed=5, dtype=torch.float64)    # another router: other experts
    _, trace = packed_tree_logprobs(other, batch, packed, record_routing=True)
    ref = model64.token_logprobs(batch, routing=trace)
    lp, used = packed_tree_logprobs(model64, batch, packed, routing=trace, record_routing=True)
    torch.testing.assert_close(lp, ref, rtol=0, atol=TOL)
    assert torch.equal(used.experts, trace.experts)
    bad = trace.experts.clone()
    bad[1, 3] = bad[1, 3].flip(-1)      # one copy of a shared node routed otherwise
    with pytest.raises(ValueError, match="routing: the copies of tree node"):
        packed_tree_logprobs(model64, batch, packed, routing=bad)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_flex_tree_attention_matches_sdpa_on_cpu(model64):
    flex = dataclasses.replace(TINY, attention="flex")
    flex_model = make_model(flex, dtype=torch.float64)
    flex_model.load_state_dict(model64.state_dict())
    batch = _batch()
    packed = pack_tree(batch, 30)
    with torch.no_grad():   # FlexAttention has no backward on the CPU
        lp = packed_tree_logprobs(model64, batch, packed)
        lp_flex = packed_tree_logprobs(flex_model, batch, packed)
    torch.testing.assert_close(lp_flex, lp, rtol=0, atol=TOL)


@pytest.mark.parametrize("name", ["grpo", "ppo", "dapo", "gspo", "tree_grpo"])
def test_loss_and_gradient_through_the_packed_tree_equal_the_expanded_ones(model64, name):
    est = estimators.get(name)
    params = list(model64.parameters())
    batch = _batch()
    with torch.no_grad():   # old log-probs at the current weights, off by a per-node shift
        old = packed_tree_logprobs(model64, batch) - 0.05 * batch.response_mask
    step = estimators.prepare(batch.replace(old_logprob=old), est, max_len=8)
    ref = estimators.loss(model64.token_logprobs(step), step, est)[0]
    ref_grad = torch.autograd.grad(ref, params)
    assert max(float(g.abs().max()) for g in ref_grad) > 1e-6
    for parts in ([(step, None)], [(mb.batch, mb.packed) for mb in tree_micro_batches(step, 3)]):
        value = sum(estimators.loss(packed_tree_logprobs(model64, b, p), b, est)[0]
                    for b, p in parts)
        grad = torch.autograd.grad(value, params)
        assert abs(float((value - ref).detach())) <= TOL
        assert max(float((a - b).abs().max()) for a, b in zip(grad, ref_grad)) <= TOL


def test_bad_packed_inputs_are_named(model64):
    batch = _batch()
    packed = pack_tree(batch)
    with pytest.raises(ValueError, match="packed: packed from another batch"):
        packed_tree_outputs(model64, flat_layout(batch), packed)
    with pytest.raises(ValueError, match="tree_end_RC"):
        model64.tree_token_outputs(packed.tokens_RC, packed.position_RC,
                                   packed.tree_end_RC[:, :2], packed.parent_RC, packed.valid_RC)
    with pytest.raises(ValueError, match="routing: expected experts"):
        packed_tree_outputs(model64, batch, packed, routing=torch.zeros(2, 2, dtype=torch.long))
