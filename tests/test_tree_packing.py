"""The packed tree (tokenmdp.tree_packing) and its micro-batches (tokenmdp.tree_training):
preorder intervals are the ancestors, the maps between the packed and the expanded grids, and
bad input named."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from tokenmdp import testing
from tokenmdp.packing import flat_layout, pack_first_fit_decreasing, select_sequences
from tokenmdp.tree_packing import pack_tree
from tokenmdp.tree_training import tree_micro_batches
from tokenmdp.trees import TREE_NODE, ResponseTree, batch_from_trees, tree_structure

FEW = settings(max_examples=25, deadline=None, database=None,
               suppress_health_check=[HealthCheck.too_slow])

#: prompt [1, 2]; 3 -> 4 -> {5, 6}, 3 -> 7 -> 8: three leaves
FORK = ResponseTree([1, 2], [3, 4, 5, 6, 7, 8], [-1, 0, 1, 1, 0, 4], reward=[1.0, 0.0, 1.0])
#: prompt [5]; two first tokens: 1 and 2 -> 3
ROOT_FORK = ResponseTree([5], [1, 2, 3], [-1, -1, 1], reward=[0.0, 1.0])


def _batch():
    return batch_from_trees([FORK, ROOT_FORK],
                            behavior_logprobs=[[-0.1, -0.2, -0.3, -0.4, -0.5, -0.6],
                                               [-1.0, -2.0, -3.0]])


def _ancestors(packed):
    """Bool [R, C, C]: key k is q or an ancestor of q, by walking the parent columns."""
    R, C = packed.tokens_RC.shape
    out = torch.zeros(R, C, C, dtype=torch.bool)
    for r in range(R):
        for q in range(C):
            out[r, q, q] = True
            if packed.node_RC[r, q] < 0:
                continue
            k = int(packed.parent_RC[r, q])
            while k >= 0:
                out[r, q, k] = True
                k = int(packed.parent_RC[r, k])
    return out


def test_each_node_once_in_preorder_and_the_intervals_are_the_ancestors():
    packed = pack_tree(_batch())
    assert packed.num_nodes == 2 + 6 + 1 + 3 and packed.num_expanded_tokens == 3 * 5 + 2 + 3
    assert packed.num_trees == 2 and packed.tree_sizes_T.tolist() == [8, 4]
    # the first tree fills its row in preorder: prompt, 3, 4, 5, 6, 7, 8
    assert packed.tokens_RC[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert packed.position_RC[0].tolist() == [0, 1, 2, 3, 4, 4, 3, 4]
    assert packed.parent_RC[0].tolist() == [-1, 0, 1, 2, 3, 3, 2, 6]
    col = packed.tree_start_RC[:, None, :]
    q = torch.arange(packed.capacity)[None, :, None]
    by_interval = (col <= q) & (q < packed.tree_end_RC[:, None, :])
    assert torch.equal(by_interval, _ancestors(packed))
    assert packed.tree_S.tolist() == [0, 0, 0, 1, 1]


@FEW
@given(testing.tree_batches(max_trees=4, max_nodes=10), testing.layouts())
def test_gather_rebuilds_the_expanded_batch_in_any_layout(batch, layout):
    laid = layout(batch)
    extra = int(laid.capacity)   # room for several trees per row
    packed = pack_tree(laid, int(pack_tree(laid).tree_sizes_T.max()) + extra % 7)
    real = laid.sequence_id >= 0
    assert torch.equal(packed.gather(packed.tokens_RC)[real], laid.tokens[real])
    assert torch.equal(packed.gather(packed.position_RC)[real], laid.position[real])
    assert torch.equal(packed.gather(packed.fields["behavior_logprob"]), laid.behavior_logprob)
    assert bool((packed.gather(packed.tokens_RC, fill=-1)[~real] == -1).all())
    # every node once; intervals nest as the ancestors do; parents sit before their children
    assert packed.num_nodes == tree_structure(laid).num_nodes
    col = packed.tree_start_RC[:, None, :]
    q = torch.arange(packed.capacity)[None, :, None]
    assert torch.equal((col <= q) & (q < packed.tree_end_RC[:, None, :]), _ancestors(packed))
    # the weight of a node is the sum of its copies' weights
    w = torch.rand(laid.tokens.shape, dtype=torch.float64) * real
    assert torch.allclose(packed.node_weights(w).sum(), w.sum())
    torch.testing.assert_close(packed.node_weights(torch.ones_like(w) * real),
                               packed.leaves_RC.double())


def test_gather_backward_sums_a_shared_token_over_its_leaves():
    packed = pack_tree(_batch())
    values = torch.zeros(packed.tokens_RC.shape, dtype=torch.float64, requires_grad=True)
    packed.gather(values).sum().backward()
    assert torch.equal(values.grad, packed.leaves_RC.double())


def test_several_trees_share_a_row_and_none_is_split():
    batch = batch_from_trees([FORK, ROOT_FORK, ROOT_FORK])
    packed = pack_tree(batch, 12)
    assert packed.num_rows == 2 and packed.capacity == 12
    assert pack_tree(batch, 100).num_rows == 1
    for r in range(packed.num_rows):   # each row: whole trees, back to back
        ends = packed.tree_end_RC[r][packed.valid_RC[r]]
        assert int(ends.max()) <= 12


def test_routing_records_and_node_fields_are_packed_once():
    batch = _batch()
    node = batch.token_extras[TREE_NODE].clamp(min=0)
    record = torch.stack([node, node + 1], -1)[:, :, None, :]          # [R, C, 1, 2]
    batch = batch.replace(token_extras={**batch.token_extras, "engine_routing": record})
    packed = pack_tree(pack_first_fit_decreasing(batch, 9), extras=["engine_routing"])
    assert set(packed.token_extras) == {"engine_routing"}
    assert pack_tree(batch).token_extras == {}   # per-copy statistics are not packed
    assert torch.equal(packed.token_extras["engine_routing"][..., 0, 0][packed.valid_RC],
                       packed.node_RC[packed.valid_RC])


def test_tree_micro_batches_hold_whole_trees_and_every_sequence_once():
    batch = batch_from_trees([FORK, ROOT_FORK, FORK, ROOT_FORK])
    for parts in (tree_micro_batches(batch, 3), tree_micro_batches(batch, max_nodes=12)):
        seen = torch.cat([mb.sequence_index for mb in parts]).sort().values
        assert seen.tolist() == list(range(batch.num_sequences))
        for mb in parts:
            groups = set(mb.batch.group.tolist())
            assert all(int((batch.group == g).sum()) == int((mb.batch.group == g).sum())
                       for g in groups)
    assert len(tree_micro_batches(batch, 3)) == 3
    assert [mb.packed.num_nodes for mb in tree_micro_batches(batch, max_nodes=12)] == [12, 12]


# ------------------------------------------------------------------------------ bad input
def test_copies_that_differ_in_a_node_field_are_named():
    batch = _batch()
    old = batch.behavior_logprob.clone()
    old[1, 2] += 1e-3   # node "3" of the first tree, second path only
    with pytest.raises(ValueError, match="old_logprob.*tree node"):
        pack_tree(batch.replace(old_logprob=old))
    pack_tree(batch.replace(old_logprob=old), atol=1e-2)     # within the tolerance
    node = batch.token_extras[TREE_NODE].clamp(min=0)
    record = node[:, :, None, None].expand(-1, -1, 1, 2).clone()
    record[2, 2, 0, 0] = 99   # node "3", shared by the three paths
    with_record = batch.replace(token_extras={**batch.token_extras, "engine_routing": record})
    with pytest.raises(ValueError, match="token_extras\\['engine_routing'\\]"):
        pack_tree(with_record, extras=["engine_routing"])
    pack_tree(with_record)   # not a node record unless named
    with pytest.raises(ValueError, match="extras: 'routing'"):
        pack_tree(with_record, extras=["routing"])


def test_inconsistent_node_ids_and_small_capacities_are_named():
    batch = _batch()
    ids = batch.token_extras[TREE_NODE].clone()
    ids[1, 4] = ids[0, 4]   # a different token under one id
    with pytest.raises(ValueError, match="tree_node"):
        pack_tree(batch.replace(token_extras={TREE_NODE: ids}))
    with pytest.raises(ValueError, match="capacity=7 .*tree 0"):
        pack_tree(batch, 7)
    with pytest.raises(ValueError, match="tree_node"):
        pack_tree(dataclasses.replace(batch, token_extras={}))
    with pytest.raises(ValueError, match="atol"):
        pack_tree(batch, atol=-1.0)


def test_maps_refuse_values_of_the_wrong_grid():
    batch = _batch()
    packed = pack_tree(batch)
    with pytest.raises(ValueError, match="values_RC"):
        packed.gather(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="routing"):
        packed.scatter(torch.zeros(2, 2), "routing")
    with pytest.raises(ValueError, match="weight_RC"):
        packed.node_weights(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="max_nodes=5 .*tree"):
        tree_micro_batches(batch, max_nodes=5)
    with pytest.raises(ValueError, match="num_micro_batches=3 exceeds"):
        tree_micro_batches(batch, 3)
    with pytest.raises(ValueError, match="give exactly one"):
        tree_micro_batches(batch)


def test_a_batch_of_one_sequence_per_tree_packs_like_the_sequences():
    batch = batch_from_trees([ResponseTree([4], [1, 2, 3], [-1, 0, 1])] * 3)
    packed = pack_tree(flat_layout(select_sequences(batch, [2, 0, 1])))
    assert packed.num_nodes == packed.num_expanded_tokens == 12
    assert sorted(packed.tree_sizes_T.tolist()) == [4, 4, 4]
