"""Branching rollouts inside the one batch type: response trees.

A *tree rollout* samples one prompt's responses so that they share prefixes by construction:
generate a prefix once, fork it into several continuations, fork those again. Its leaves are the
group's responses. In a :class:`~tokenmdp.batch.TokenBatch` a tree is **meaning carried as
data**, not a new layout:

* each root-to-leaf path is one sequence of the batch (prompt, then response), as for an
  independent group; this *expanded* batch is what every estimator reads;
* ``token_extras[TREE_NODE]`` (integer ``[R, C]``) names the tree node of every real token
  (prompt tokens included; padding is ignored: ``-1`` when built here, 0 after a relayout).
  Tokens of different sequences with the same node id are *one* transition: the same token at
  the same position after the same prefix.

Because shared tokens carry one id, a trainer can pack each node once (``tokenmdp.model``'s tree
attention: every token attends to its ancestors only) and gather the node log-probs back to the
expanded layout, so the packed tree's loss and gradient are those of its expanded paths; tree
estimators read node values (the mean reward of the leaves below a node) through the same ids.

Reading order: :class:`ResponseTree` (one prompt's tree, validated: parents, depths, leaves);
:func:`batch_from_trees` (trees → the expanded batch with node ids); :func:`tree_structure`
(batch → nodes, parents, leaf counts, validated); :func:`node_mean` (a per-sequence value
averaged over the leaves below each node).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import torch

from tokenmdp.batch import TokenBatch

__all__ = ["TREE_NODE", "ResponseTree", "TreeStructure", "batch_from_trees", "node_mean",
           "tree_depths", "tree_structure"]

TREE_NODE = "tree_node"
"""Key of the per-token node ids in ``TokenBatch.token_extras``."""


def _int_tuple(name: str, values: object) -> tuple[int, ...]:
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dim() != 1:
            raise TypeError(f"{name}: expected a 1-d integer sequence, got a tensor of dtype "
                            f"{values.dtype} and shape {tuple(values.shape)}")
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name}: expected a sequence of ints, got {type(values).__name__}")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name}[{i}]: expected an int, got {type(v).__name__}")
        out.append(int(v))
    return tuple(out)


def tree_depths(parent: Sequence[int], *, name: str = "parent") -> tuple[int, ...]:
    """Depth of every node of a parent-pointer array (1 for a child of the prompt), validated.

    Parameters
    ----------
    parent : sequence of int
        ``parent[i]`` is node ``i``'s parent, ``-1`` for a child of the prompt.
    name : str
        The argument's name in error messages.

    Returns
    -------
    tuple of int
        ``depth[i] = depth[parent[i]] + 1``, ``depth = 1`` at ``parent = -1``.

    Raises
    ------
    ValueError
        A parent out of ``[-1, n)``, a node its own parent, or a cycle (naming its nodes).
    """
    parent = _int_tuple(name, parent)
    n = len(parent)
    for i, p in enumerate(parent):
        if not -1 <= p < n:
            raise ValueError(f"{name}[{i}] = {p}: a parent is -1 (the prompt) or in [0, {n})")
        if p == i:
            raise ValueError(f"{name}[{i}] = {i}: a node cannot be its own parent")
    depth = [0] * n
    for start in range(n):
        path, node = [], start
        while node != -1 and depth[node] == 0:
            if node in path:
                cycle = path[path.index(node):]
                raise ValueError(f"{name}: the parent pointers form a cycle through nodes "
                                 f"{cycle}; a tree's parents lead to the prompt (-1)")
            path.append(node)
            node = parent[node]
        base = 0 if node == -1 else depth[node]
        for k, v in enumerate(reversed(path)):
            depth[v] = base + k + 1
    return tuple(depth)


@dataclasses.dataclass(frozen=True)
class ResponseTree:
    """One prompt's branching rollout: response tokens as nodes with parent pointers.

    Parameters
    ----------
    prompt : sequence of int
        The prompt's tokens (shared by every leaf; at least one).
    tokens : sequence of int
        The token of each node.
    parent : sequence of int
        Each node's parent node, ``-1`` for a first response token.
    depth : sequence of int, optional
        Each node's response position plus one, when the caller records it: checked against the
        parents (a node whose depth is not its parent's plus one *skips a level*).
    reward : sequence of float, optional
        The reward of each leaf, in :attr:`leaves` order.

    Raises
    ------
    ValueError
        Parent pointers that form a cycle or leave ``[-1, n)``; a depth that skips a level; an
        empty prompt or tree; rewards not one per leaf.
    """

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    parent: tuple[int, ...]
    depth: tuple[int, ...] | None = None
    reward: tuple[float, ...] | None = None

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "prompt", _int_tuple("prompt", self.prompt))
        set_(self, "tokens", _int_tuple("tokens", self.tokens))
        set_(self, "parent", _int_tuple("parent", self.parent))
        for name, what in (("prompt", "prompt token"), ("tokens", "response node")):
            if not getattr(self, name):
                raise ValueError(f"{name}: a tree needs at least one {what}")
        if len(self.parent) != len(self.tokens):
            raise ValueError(f"parent: {len(self.parent)} entries for {len(self.tokens)} nodes")
        depths = tree_depths(self.parent)
        if self.depth is not None:
            given = _int_tuple("depth", self.depth)
            if len(given) != len(depths):
                raise ValueError(f"depth: {len(given)} entries for {len(depths)} nodes")
            for i, (d, want) in enumerate(zip(given, depths)):
                if d != want:
                    raise ValueError(
                        f"depth[{i}] = {d}, but its parent {self.parent[i]} is at depth "
                        f"{want - 1}: a node sits one level below its parent (this one skips "
                        f"{d - want} level(s))")
        set_(self, "depth", depths)
        if self.reward is not None:
            reward = tuple(float(r) for r in self.reward)
            if len(reward) != len(self.leaves):
                raise ValueError(f"reward: {len(reward)} values for {len(self.leaves)} leaves")
            set_(self, "reward", reward)

    @property
    def leaves(self) -> tuple[int, ...]:
        """Nodes without children, in increasing order: one response each."""
        has_child = set(self.parent)
        return tuple(i for i in range(len(self.tokens)) if i not in has_child)

    def path(self, leaf: int) -> tuple[int, ...]:
        """The nodes from the first response token to ``leaf`` (a leaf, or any node).

        Parameters
        ----------
        leaf : int
            The last node.

        Returns
        -------
        tuple of int
        """
        out, node = [], leaf
        while node != -1:
            out.append(node)
            node = self.parent[node]
        return tuple(reversed(out))

    def responses(self) -> list[list[int]]:
        """The token ids of each leaf's response, in :attr:`leaves` order.

        Returns
        -------
        list of list of int
        """
        return [[self.tokens[v] for v in self.path(leaf)] for leaf in self.leaves]

    @property
    def generated_tokens(self) -> int:
        """Tokens the engine generates for the tree: one per node."""
        return len(self.tokens)

    @property
    def expanded_tokens(self) -> int:
        """Response tokens of the expanded paths: what independent samples of the same
        responses would have generated."""
        return sum(self.depth[leaf] for leaf in self.leaves)


def batch_from_trees(trees: Sequence[ResponseTree], *, groups: Sequence[int] | None = None,
                     prompt_index: Sequence[int] | None = None,
                     behavior_logprobs: Sequence[Sequence[float]] | None = None,
                     dtype: torch.dtype = torch.float64,
                     device: torch.device | str | None = None) -> TokenBatch:
    """The expanded batch of ``trees``: one sequence per leaf, the node ids in
    ``token_extras[TREE_NODE]``.

    Parameters
    ----------
    trees : sequence of ResponseTree
        One tree per group; its leaves' rewards (if given) become the sequences' rewards.
    groups, prompt_index : sequence of int, optional
        Per tree (default: the tree's index).
    behavior_logprobs : sequence of sequences of float, optional
        Per tree, the engine's log-prob of each node's token (one per node).
    dtype, device
        Of the batch's float fields and of every tensor.

    Returns
    -------
    TokenBatch
        Padded, sequences in tree order and, within a tree, leaf order; prompt tokens of tree
        ``k`` share node ids, response node ``i`` of tree ``k`` gets one id in every path.
    """
    if isinstance(trees, ResponseTree) or not isinstance(trees, Sequence):
        raise TypeError("trees: expected a sequence of ResponseTree")
    for k, t in enumerate(trees):
        if not isinstance(t, ResponseTree):
            raise TypeError(f"trees[{k}]: expected a ResponseTree, got {type(t).__name__}")
    n = len(trees)
    groups = list(range(n)) if groups is None else list(_int_tuple("groups", groups))
    prompt_index = groups if prompt_index is None else list(_int_tuple("prompt_index",
                                                                       prompt_index))
    for name, values in (("groups", groups), ("prompt_index", prompt_index),
                         ("behavior_logprobs", behavior_logprobs or [None] * n)):
        if len(values) != n:
            raise ValueError(f"{name}: {len(values)} entries for {n} trees")
    prompts, responses, rewards, seq_groups, seq_prompts, nodes, mus = [], [], [], [], [], [], []
    offset = 0
    for k, tree in enumerate(trees):
        mu = None
        if behavior_logprobs is not None:
            mu = [float(v) for v in behavior_logprobs[k]]
            if len(mu) != len(tree.tokens):
                raise ValueError(f"behavior_logprobs[{k}]: {len(mu)} values for "
                                 f"{len(tree.tokens)} nodes")
        prompt_ids = list(range(offset, offset + len(tree.prompt)))
        offset += len(tree.prompt)
        for j, leaf in enumerate(tree.leaves):
            path = tree.path(leaf)
            prompts.append(list(tree.prompt))
            responses.append([tree.tokens[v] for v in path])
            rewards.append(0.0 if tree.reward is None else tree.reward[j])
            seq_groups.append(groups[k])
            seq_prompts.append(prompt_index[k])
            nodes.append(prompt_ids + [offset + v for v in path])
            if mu is not None:
                mus.append([mu[v] for v in path])
        offset += len(tree.tokens)
    batch = TokenBatch.from_sequences(prompts, responses, rewards=rewards, groups=seq_groups,
                                      prompt_index=seq_prompts,
                                      behavior_logprobs=mus if behavior_logprobs is not None
                                      else None, dtype=dtype, device=device)
    node_RC = torch.full(batch.tokens.shape, -1, dtype=torch.long, device=batch.device)
    for s, ids in enumerate(nodes):
        node_RC[s, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    return batch.replace(token_extras={**batch.token_extras, TREE_NODE: node_RC})


class TreeStructure(NamedTuple):
    """The nodes of a batch's trees (:func:`tree_structure`), numbered from 0 to N − 1.

    Parameters
    ----------
    node_RC : LongTensor ``[R, C]``
        Each real token's node, ``-1`` on padding.
    token_N, position_N : LongTensor ``[N]``
        Each node's token and position (in its sequences).
    parent_N : LongTensor ``[N]``
        The node of the previous token, ``-1`` at position 0.
    leaves_N : LongTensor ``[N]``
        How many sequences pass through the node (its leaves, when sequences are leaves).
    group_N : LongTensor ``[N]``
        The group of the node's sequences.
    """

    node_RC: torch.Tensor
    token_N: torch.Tensor
    position_N: torch.Tensor
    parent_N: torch.Tensor
    leaves_N: torch.Tensor
    group_N: torch.Tensor

    @property
    def num_nodes(self) -> int:
        """``N``: tokens of the packed tree (each node once)."""
        return int(self.token_N.numel())


def _node_constant(name: str, node: torch.Tensor, values: torch.Tensor, num: int,
                   what: str) -> torch.Tensor:
    """``values`` per node, checked to be the same at every token of a node."""
    lo = torch.full((num,), torch.iinfo(torch.long).max, dtype=torch.long, device=node.device)
    hi = torch.full((num,), torch.iinfo(torch.long).min, dtype=torch.long, device=node.device)
    lo = lo.scatter_reduce(0, node, values, "amin")
    hi = hi.scatter_reduce(0, node, values, "amax")
    bad = (lo != hi).nonzero()
    if bad.numel():
        raise ValueError(f"token_extras[{name!r}]: node {int(bad[0])} is given to tokens with "
                         f"different {what} ({int(lo[bad[0]])} and {int(hi[bad[0]])}); tokens "
                         "share a node only when they are the same transition")
    return lo


def tree_structure(batch: TokenBatch) -> TreeStructure:
    """The trees of ``batch`` from ``token_extras[TREE_NODE]``, validated.

    Parameters
    ----------
    batch : TokenBatch
        Any layout; ``token_extras[TREE_NODE]`` holds a node id ``>= 0`` on every real token.

    Returns
    -------
    TreeStructure

    Raises
    ------
    ValueError
        No node ids, ids of the wrong shape or sign, or one id on tokens that are not one
        transition (other tokens, positions, previous nodes or groups).
    """
    if not isinstance(batch, TokenBatch):
        raise TypeError(f"batch: expected a TokenBatch, got {type(batch).__name__}")
    ids = batch.token_extras.get(TREE_NODE)
    if ids is None:
        raise ValueError(f"batch: no token_extras[{TREE_NODE!r}] (batch_from_trees writes it)")
    if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"token_extras[{TREE_NODE!r}]: expected an integer tensor [R, C], got "
                         f"{ids.dtype} {tuple(ids.shape)}")
    real = batch.sequence_id >= 0
    if bool((ids[real] < 0).any()):
        raise ValueError(f"token_extras[{TREE_NODE!r}]: every real token needs a node id >= 0 "
                         "(padding is ignored)")
    unique, inverse = torch.unique(ids[real], return_inverse=True)
    num = int(unique.numel())
    node_RC = torch.full_like(ids, -1, dtype=torch.long)
    node_RC[real] = inverse
    # the node of each token's predecessor in its sequence (a sequence is one span of one row)
    prev_RC = torch.full_like(node_RC, -1)
    prev_RC[:, 1:] = node_RC[:, :-1]
    prev_RC[batch.position == 0] = -1
    flat = node_RC[real]
    token_N = _node_constant(TREE_NODE, flat, batch.tokens[real].long(), num, "tokens")
    position_N = _node_constant(TREE_NODE, flat, batch.position[real].long(), num, "positions")
    parent_N = _node_constant(TREE_NODE, flat, prev_RC[real], num, "previous nodes")
    group_N = _node_constant(TREE_NODE, flat, batch.group[batch.sequence_id[real]].long(), num,
                             "groups")
    leaves_N = torch.zeros(num, dtype=torch.long, device=ids.device).index_add_(
        0, flat, torch.ones_like(flat))
    return TreeStructure(node_RC, token_N, position_N, parent_N, leaves_N, group_N)


def node_mean(values_S: torch.Tensor, batch: TokenBatch,
              structure: TreeStructure | None = None) -> torch.Tensor:
    """The mean of a per-sequence value over the sequences through each node.

    ``V̂(n) = (1/|L(n)|) Σ_{i ∈ L(n)} values_i`` with ``L(n)`` the sequences (leaves) whose
    path holds node ``n``: with rewards, the Monte Carlo value of the prefix ending at ``n``
    from the leaves below it (TreeRL, arXiv 2506.11902, Sec. 3.2).

    Parameters
    ----------
    values_S : Tensor ``[S]``
        One value per sequence.
    batch : TokenBatch
        With ``token_extras[TREE_NODE]``.
    structure : TreeStructure, optional
        ``tree_structure(batch)``, when already computed.

    Returns
    -------
    Tensor ``[N]``
        One value per node.
    """
    structure = tree_structure(batch) if structure is None else structure
    if values_S.shape != (batch.num_sequences,):
        raise ValueError(f"values_S: expected shape [{batch.num_sequences}], got "
                         f"{tuple(values_S.shape)}")
    real = batch.sequence_id >= 0
    node = structure.node_RC[real]
    sums = values_S.new_zeros(structure.num_nodes).index_add_(
        0, node, values_S[batch.sequence_id[real]])
    return sums / structure.leaves_N.to(values_S.dtype)
