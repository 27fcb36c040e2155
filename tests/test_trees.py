"""Response trees in the batch (``tokenmdp.trees``): validation, the expanded batch, and node
structure and values against a plain-Python walk over the trees, in every layout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmdp.packing import flat_layout, pack_first_fit_decreasing, padded_layout
from tokenmdp.trees import (
    TREE_NODE,
    ResponseTree,
    batch_from_trees,
    node_mean,
    tree_depths,
    tree_structure,
)

TOL = 1e-12


@st.composite
def trees(draw, max_nodes: int = 12):
    """A random tree: node i's parent is -1 or an earlier node (so no cycles), random tokens."""
    n = draw(st.integers(1, max_nodes))
    parent = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(1, 5), min_size=n, max_size=n))
    prompt = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    tree = ResponseTree(prompt=prompt, tokens=tokens, parent=parent)
    reward = draw(st.lists(st.floats(-2, 2), min_size=len(tree.leaves),
                           max_size=len(tree.leaves)))
    return ResponseTree(prompt=prompt, tokens=tokens, parent=parent, reward=reward)


def test_a_small_tree():
    tree = ResponseTree(prompt=[7, 8], tokens=[1, 2, 3, 4, 2], parent=[-1, 0, 0, 2, -1],
                        reward=[1.0, 0.0, 1.0])
    assert tree.leaves == (1, 3, 4) and tree.depth == (1, 2, 2, 3, 1)
    assert tree.responses() == [[1, 2], [1, 3, 4], [2]]
    assert tree.generated_tokens == 5 and tree.expanded_tokens == 6
    batch = batch_from_trees([tree])
    assert batch.sequences() == [([7, 8], [1, 2]), ([7, 8], [1, 3, 4]), ([7, 8], [2])]
    ids = batch.token_extras[TREE_NODE]
    assert ids[:, :2].tolist() == [[0, 1]] * 3          # the prompt is one pair of nodes
    assert ids[0, 2] == ids[1, 2] != ids[2, 2]          # node 0 is shared by leaves 1 and 3
    structure = tree_structure(batch)
    assert structure.num_nodes == 7 and structure.leaves_N.tolist() == [3, 3, 2, 1, 1, 1, 1]
    # V̂: the prompt's value is the group mean, node 0's the mean of its leaves 1 and 3
    values = node_mean(batch.reward, batch, structure)
    assert values[:3].tolist() == pytest.approx([2 / 3, 2 / 3, 0.5], abs=TOL)


@pytest.mark.parametrize("parent, match", [
    ([1, 0], "cycle through nodes"),
    ([-1, 2, 1], "cycle through nodes"),
    ([-1, 1], "its own parent"),
    ([-1, 5], r"parent\[1\] = 5"),
    ([-2], r"parent\[0\] = -2"),
])
def test_bad_parents_are_named(parent, match):
    with pytest.raises(ValueError, match=match):
        ResponseTree(prompt=[1], tokens=[1] * len(parent), parent=parent)


def test_a_depth_that_skips_a_level_is_named():
    with pytest.raises(ValueError, match=r"depth\[2\] = 4.*skips 1 level"):
        ResponseTree(prompt=[1], tokens=[1, 2, 3], parent=[-1, 0, 1], depth=[1, 2, 4])
    ResponseTree(prompt=[1], tokens=[1, 2, 3], parent=[-1, 0, 1], depth=[1, 2, 3])


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt=[], tokens=[1], parent=[-1]), "prompt"),
    (dict(prompt=[1], tokens=[], parent=[]), "tokens"),
    (dict(prompt=[1], tokens=[1, 2], parent=[-1]), "parent"),
    (dict(prompt=[1], tokens=[1, 2], parent=[-1, 0], reward=[1.0, 2.0]), "reward"),
])
def test_bad_trees_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ResponseTree(**kwargs)


def test_non_integer_input_is_a_type_error():
    with pytest.raises(TypeError, match="parent"):
        tree_depths([0.5])
    with pytest.raises(TypeError, match="trees"):
        batch_from_trees(ResponseTree(prompt=[1], tokens=[1], parent=[-1]))


def test_one_id_on_two_different_transitions_is_refused():
    tree = ResponseTree(prompt=[1], tokens=[2, 3, 4], parent=[-1, 0, 0])
    batch = batch_from_trees([tree])
    ids = batch.token_extras[TREE_NODE].clone()
    ids[1, 2] = ids[0, 2]                      # leaf 2's token under leaf 1's node id
    bad = batch.replace(token_extras={TREE_NODE: ids})
    with pytest.raises(ValueError, match=r"token_extras\['tree_node'\].*different tokens"):
        tree_structure(bad)
    with pytest.raises(ValueError, match="no token_extras"):
        tree_structure(batch.replace(token_extras={}))


def _walk(forest: list[ResponseTree]) -> list[list[tuple[int, float]]]:
    """Per sequence and response token: (leaves below the node, mean reward of those leaves),
    by a plain walk over each tree's paths."""
    out = []
    for tree in forest:
        paths = [tree.path(leaf) for leaf in tree.leaves]
        for path in paths:
            row = []
            for node in path:
                below = [j for j, p in enumerate(paths) if node in p]
                row.append((len(below), sum(tree.reward[j] for j in below) / len(below)))
            out.append(row)
    return out


@settings(max_examples=40, deadline=None)
@given(forest=st.lists(trees(), min_size=1, max_size=3), layout=st.sampled_from(
    ["padded", "ffd", "flat"]))
def test_structure_and_node_values_match_a_walk_in_every_layout(forest, layout):
    batch = batch_from_trees(forest, behavior_logprobs=[
        [-0.1 * (i + 1) for i in range(len(t.tokens))] for t in forest])
    batch = {"padded": padded_layout, "ffd": lambda b: pack_first_fit_decreasing(b, 40),
             "flat": flat_layout}[layout](batch)
    structure = tree_structure(batch)
    values = node_mean(batch.reward, batch, structure)
    want = _walk(forest)
    response = batch.response_mask
    for s, row in enumerate(want):
        at = (batch.sequence_id == s) & response
        order = batch.position[at].argsort()
        nodes = structure.node_RC[at][order]
        assert structure.leaves_N[nodes].tolist() == [n for n, _ in row]
        assert values[nodes].tolist() == pytest.approx([v for _, v in row], abs=TOL)
    # parents are the previous token's node; a node's μ is the same on every leaf through it
    real = batch.sequence_id >= 0
    assert bool((structure.position_N[structure.parent_N[structure.parent_N >= 0]]
                 == structure.position_N[structure.parent_N >= 0] - 1).all())
    mu = torch.zeros(structure.num_nodes, dtype=batch.dtype)
    mu[structure.node_RC[real]] = batch.behavior_logprob[real]
    assert torch.equal(mu[structure.node_RC[real]], batch.behavior_logprob[real])
    assert sum(t.generated_tokens for t in forest) == int(
        (structure.position_N >= torch.tensor([len(t.prompt) for t in forest])[
            structure.group_N]).sum())
