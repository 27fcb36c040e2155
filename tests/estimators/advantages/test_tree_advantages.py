"""Tree advantages (issue 28) against a plain-Python loop over each ResponseTree's paths, their
identities on plain groups, and their refusals."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmdp import estimators as E
from tokenmdp.trees import TREE_NODE, ResponseTree, batch_from_trees

SETTINGS = settings(max_examples=60, deadline=None, database=None)
REWARDS = st.sampled_from([0.0, 1.0, 0.5, -1.0, 2.5])


@st.composite
def trees(draw, *, max_nodes: int = 8) -> ResponseTree:
    """A random response tree: node i's parent drawn from the prompt (-1) or nodes before it."""
    n = draw(st.integers(1, max_nodes))
    parent = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(1, 5), min_size=n, max_size=n))
    prompt = draw(st.lists(st.integers(1, 5), min_size=1, max_size=2))
    probe = ResponseTree(prompt=prompt, tokens=tokens, parent=parent)
    reward = draw(st.lists(REWARDS, min_size=len(probe.leaves), max_size=len(probe.leaves)))
    return ResponseTree(prompt=prompt, tokens=tokens, parent=parent, reward=reward)


forests = st.lists(trees(), min_size=1, max_size=3)


def plain_group(rewards, lengths) -> ResponseTree:
    """A group without shared response prefixes: each response its own chain under the prompt."""
    tokens, parent = [], []
    for length in lengths:
        for k in range(length):
            parent.append(-1 if k == 0 else len(tokens) - 1)
            tokens.append(1 + k % 3)
    return ResponseTree(prompt=(7, 8), tokens=tokens, parent=parent, reward=rewards)


# ------------------------------------------------------------------------------ the reference
def reference(tree: ResponseTree, kind: str) -> list[list[float]]:
    """Per leaf, the advantage of each response token, by a loop over the tree's paths."""
    paths = [tree.path(leaf) for leaf in tree.leaves]
    reward = dict(zip(range(len(paths)), tree.reward))
    below = {v: [j for j, path in enumerate(paths) if v in path] for v in range(len(tree.tokens))}
    root = sum(tree.reward) / len(paths)

    def value(v, leave_out=None):
        if v == -1:
            others = [j for j in range(len(paths)) if j != leave_out]
        else:
            others = [j for j in below[v] if j != leave_out]
        if not others:                      # the path is the only leaf below v
            return reward[leave_out]
        return sum(reward[j] for j in others) / len(others)

    def segment_parent(v):
        while tree.parent[v] != -1 and len(below[tree.parent[v]]) == len(below[v]):
            v = tree.parent[v]
        return tree.parent[v]

    out = []
    for i, path in enumerate(paths):
        row = []
        for v in path:
            p = tree.parent[v]
            if kind == "value_diff":
                a = value(v) - value(p)
            elif kind == "return_minus_value":
                a = reward[i] - value(p)
            elif kind == "treerl":
                a = ((value(v) - root) + (value(v) - value(segment_parent(v)))) \
                    / math.sqrt(len(below[v]))
            elif kind == "vineppo":
                a = value(v, leave_out=i) - value(p, leave_out=i)
            else:
                raise AssertionError(kind)
            row.append(a)
        out.append(row)
    return out


PARTS = {"value_diff": E.NodeValueDifference(), "return_minus_value": E.ReturnMinusNodeValue(),
         "treerl": E.TreeRLAdvantage(), "vineppo": E.VinePPOTree()}


def advantages(batch, part) -> torch.Tensor:
    zero = torch.zeros(batch.tokens.shape, dtype=batch.dtype)
    return part.token_advantages(batch, batch.reward, zero)


@pytest.mark.parametrize("kind", list(PARTS))
def test_each_part_matches_a_loop_over_the_paths(kind):
    @SETTINGS
    @given(forests)
    def prop(forest):
        batch = batch_from_trees(forest)
        got = advantages(batch, PARTS[kind])
        row = 0
        for tree in forest:
            for expected in reference(tree, kind):
                start = len(tree.prompt)
                torch.testing.assert_close(
                    got[row, start:start + len(expected)],
                    torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
                row += 1
    prop()


@SETTINGS
@given(forests)
def test_the_value_difference_telescopes_along_every_path(forest):
    batch = batch_from_trees(forest)
    got = E.prepare(batch, "tree_value_diff").advantage.sum(1)
    means = torch.tensor([sum(t.reward) / len(t.leaves) for t in forest for _ in t.leaves],
                         dtype=torch.float64)
    torch.testing.assert_close(got, batch.reward - means, rtol=1e-12, atol=1e-12)


@SETTINGS
@given(forests)
def test_a_shared_token_has_one_advantage_in_all_its_paths(forest):
    batch = batch_from_trees(forest)
    node = batch.token_extras[TREE_NODE]
    for name in ("tree_value_diff", "treerl"):          # node quantities: one value per node
        adv = E.prepare(batch, name).advantage
        real = batch.loss_mask
        for n in node[real].unique():
            values = adv[(node == n) & real]
            assert torch.allclose(values, values[0].expand_as(values), atol=1e-12)


# ------------------------------------------------------------------------------ plain groups
@settings(max_examples=40, deadline=None, database=None)
@given(st.lists(REWARDS, min_size=2, max_size=6), st.data())
def test_on_a_plain_group_the_parts_reduce_to_group_advantages(rewards, data):
    lengths = data.draw(st.lists(st.integers(1, 4), min_size=len(rewards), max_size=len(rewards)))
    batch = batch_from_trees([plain_group(rewards, lengths)])
    r = torch.tensor(rewards, dtype=torch.float64)
    centred = r - r.mean()
    loo = E.leave_one_out_advantage(r, torch.zeros(len(rewards), dtype=torch.long))
    first = batch.loss_mask & (batch.position == 2)
    later = batch.loss_mask & (batch.position > 2)
    cases = {"tree_value_diff": centred, "tree_return_minus_value": centred,
             "vineppo_tree": loo, "treerl": 2 * centred}
    for name, at_first in cases.items():
        adv = E.prepare(batch, name).advantage
        torch.testing.assert_close(adv[first], at_first, rtol=1e-12, atol=1e-12)
        if name == "treerl":     # every token of a chain is in the same one-leaf segment
            torch.testing.assert_close(adv[later], (2 * centred)[batch.sequence_id[later]])
        else:
            assert bool((adv[later] == 0).all()), name
    grpo = E.prepare(batch, "tree_grpo").advantage
    plain = E.prepare(batch.replace(token_extras={}), "grpo").advantage
    torch.testing.assert_close(grpo, plain)


def test_treerl_without_reweighting_is_global_plus_local():
    tree = ResponseTree(prompt=(1,), tokens=(1, 2, 3, 4), parent=(-1, 0, 0, 1),
                        reward=(1.0, 0.0))                          # leaves 2, 3
    batch = batch_from_trees([tree])
    plain = advantages(batch, E.TreeRLAdvantage(reweight=False))
    # V(0) = 0.5 = root; V(1) = V(3) = 0 (segment 1-3 hangs from node 0); V(2) = 1
    assert plain[0, 1:3].tolist() == [0.0, 1.0] and plain[1, 1:4].tolist() == [0.0, -1.0, -1.0]
    weighted = advantages(batch, E.TreeRLAdvantage())
    torch.testing.assert_close(weighted, plain)                     # |L| = 1 below the fork
    with pytest.raises(TypeError, match="reweight"):
        E.TreeRLAdvantage(reweight=1)


# ------------------------------------------------------------------------------ refusals, flags
@pytest.mark.parametrize("name", E.names(trees=True))
def test_a_batch_without_node_ids_is_refused_naming_them(name):
    batch = batch_from_trees([plain_group([1.0, 0.0], [2, 1])])
    with pytest.raises(ValueError, match=r"token_extras\['tree_node'\]"):
        E.prepare(batch.replace(token_extras={}), name)


def test_a_kl_in_the_reward_is_refused():
    batch = batch_from_trees([plain_group([1.0, 0.0], [2, 1])])
    batch = batch.replace(old_logprob=torch.full(batch.tokens.shape, -1.0, dtype=torch.float64),
                          ref_logprob=torch.full(batch.tokens.shape, -2.0, dtype=torch.float64))
    est = E.get("treerl").replace(kl=E.KLPenalty(coef=0.1, in_reward=True, estimator=E.kl_k1))
    with pytest.raises(ValueError, match="KL-in-reward"):
        E.prepare(batch, est)


def test_the_parts_declare_what_they_need():
    for part in PARTS.values():
        assert part.token_level and part.group_local and part.couples_sequences
        assert part.needs_tree
        with pytest.raises(TypeError, match="token-level"):
            part(torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.long))
    leaves = E.TreeLeaves(E.GroupNormalized())
    assert leaves.needs_tree and not leaves.token_level and leaves.group_local
    assert not E.TreeLeaves(E.BatchNormalized()).group_local
    with pytest.raises(TypeError, match="inner"):
        E.TreeLeaves(E.NodeValueDifference())
    assert "tree's leaves" in leaves.describe()
