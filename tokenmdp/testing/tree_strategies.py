"""Hypothesis strategies for branching rollouts: response trees, their expanded batches, tree
packings and micro-batch splits of whole trees.

Like :mod:`tokenmdp.testing.strategies`, everything shrinks (towards one small tree, a chain,
one micro-batch) and the packings and splits are small frozen dataclasses with readable reprs.
A drawn tree batch gives every node one behaviour, old and reference log-prob (a node is one
transition), so :func:`~tokenmdp.tree_packing.pack_tree` accepts it; the loss mask and the
advantage may differ between the copies of a node (they belong to the leaf).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from hypothesis import strategies as st

from tokenmdp.batch import TokenBatch
from tokenmdp.testing.strategies import Layout, _check_int, layouts
from tokenmdp.tree_packing import PackedTree, pack_tree
from tokenmdp.tree_training import tree_micro_batches
from tokenmdp.trees import TREE_NODE, ResponseTree, batch_from_trees

__all__ = ["TreePacking", "TreeSplit", "response_trees", "tree_batches", "tree_packings",
           "tree_splits"]


# ------------------------------------------------------------------------------ trees
@st.composite
def response_trees(draw, *, max_nodes: int = 8, min_leaves: int = 2, max_prompt_len: int = 3,
                   vocab_size: int = 5, prompt: tuple[int, ...] | None = None,
                   rewards: bool = True) -> ResponseTree:
    """Random :class:`~tokenmdp.trees.ResponseTree`: node ``i``'s parent is drawn among the
    prompt (``-1``) and the nodes before it, most often node ``i - 1`` (chains with forks).

    Parameters
    ----------
    max_nodes : int
        Up to ``max_nodes`` response nodes drawn freely; more are added (as new children of
        the prompt or of an inner node) until the tree has ``min_leaves`` leaves.
    min_leaves : int, default 2
        At least this many leaves: a tree is a group, and group baselines (a std, a
        leave-one-out mean) need two responses.
    max_prompt_len : int
        Prompts of 1 to ``max_prompt_len`` tokens (unless ``prompt`` is given).
    vocab_size : int
        Token ids in ``[0, vocab_size)``.
    prompt : tuple of int, optional
        A fixed prompt.
    rewards : bool, default True
        Give every leaf a reward (0/1 or Gaussian, drawn).

    Returns
    -------
    ResponseTree
    """
    _check_int("max_nodes", max_nodes, 1)
    _check_int("min_leaves", min_leaves, 1)
    _check_int("max_prompt_len", max_prompt_len, 1)
    _check_int("vocab_size", vocab_size, 1)
    token = st.integers(0, vocab_size - 1)
    if prompt is None:
        prompt = tuple(draw(st.lists(token, min_size=1, max_size=max_prompt_len)))
    n = draw(st.integers(1, max_nodes))
    parent = [-1]
    for i in range(1, n):
        chain = draw(st.booleans())
        parent.append(i - 1 if chain else draw(st.integers(-1, i - 1)))
    while len(set(range(len(parent))) - set(parent)) < min_leaves:   # fork: one more leaf
        parent.append(draw(st.sampled_from(sorted({-1, *parent}))))
    n = len(parent)
    tokens = draw(st.lists(token, min_size=n, max_size=n))
    tree = ResponseTree(prompt, tokens, parent)
    if not rewards:
        return tree
    num_leaves = len(tree.leaves)
    if draw(st.booleans()):
        reward = draw(st.lists(st.sampled_from((0.0, 1.0)), min_size=num_leaves,
                               max_size=num_leaves))
    else:
        reward = draw(st.lists(st.floats(-2, 2, allow_nan=False), min_size=num_leaves,
                               max_size=num_leaves))
    return dataclasses.replace(tree, reward=tuple(reward), depth=None)


@st.composite
def tree_batches(draw, *, dtype: torch.dtype = torch.float64, max_trees: int = 3,
                 max_nodes: int = 8, min_leaves: int = 2, num_prompts: int = 3,
                 max_prompt_len: int = 3,
                 vocab_size: int = 5, with_logprobs: bool = True,
                 partial_loss_mask: bool = True) -> TokenBatch:
    """Expanded batches of 1 to ``max_trees`` random trees, one group per tree.

    Parameters
    ----------
    dtype : torch.dtype
        Of the float fields.
    max_trees, max_nodes, min_leaves, max_prompt_len, vocab_size
        Trees (see :func:`response_trees`).
    num_prompts : int
        Each tree answers one of ``num_prompts`` prompts (two trees may share one).
    with_logprobs : bool, default True
        Set ``behavior_logprob``, ``old_logprob`` and ``ref_logprob``, one value per node
        (every registered estimator can run).
    partial_loss_mask : bool, default True
        Sometimes clear ``loss_mask`` on some response tokens, copy by copy.

    Returns
    -------
    TokenBatch
        Padded, with ``token_extras[TREE_NODE]``; ``advantage`` random on loss tokens,
        ``loss_weight`` 1 there.
    """
    _check_int("max_trees", max_trees, 1)
    _check_int("num_prompts", num_prompts, 1)
    token = st.integers(0, vocab_size - 1)
    table = draw(st.lists(st.lists(token, min_size=1, max_size=max_prompt_len).map(tuple),
                          min_size=num_prompts, max_size=num_prompts))
    index = draw(st.lists(st.integers(0, num_prompts - 1), min_size=1, max_size=max_trees))
    trees = [draw(response_trees(max_nodes=max_nodes, min_leaves=min_leaves,
                                 vocab_size=vocab_size, prompt=table[p])) for p in index]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    mus = [np.minimum(-rng.exponential(1.0, len(t.tokens)), 0.0).tolist() for t in trees]
    batch = batch_from_trees(trees, prompt_index=index,
                             behavior_logprobs=mus if with_logprobs else None, dtype=dtype)
    mask = batch.loss_mask
    if partial_loss_mask and draw(st.booleans()):
        mask = mask & torch.as_tensor(rng.random(mask.shape) < 0.7)
    changes = {"loss_mask": mask, "loss_weight": mask.to(dtype),
               "advantage": torch.where(mask, torch.as_tensor(rng.normal(size=mask.shape),
                                                              dtype=dtype), 0.0)}
    if with_logprobs:
        node = batch.token_extras[TREE_NODE].clamp(min=0)
        num = int(node.max()) + 1
        response = batch.response_mask
        for name in ("old_logprob", "ref_logprob"):
            shift = torch.as_tensor(rng.normal(scale=0.3, size=num), dtype=dtype)
            changes[name] = torch.where(response, (batch.behavior_logprob + shift[node])
                                        .clamp(max=0.0), 0.0)
    return batch.replace(**changes)


# ------------------------------------------------------------------------------ packings
@dataclasses.dataclass(frozen=True)
class TreePacking:
    """``batch -> (batch', PackedTree)``: re-lay the expanded batch out, then pack its trees.

    Parameters
    ----------
    layout : Layout or None, default None
        The expanded batch's re-layout first (its layout is memory too).
    extra_capacity : int, default 0
        Packed row capacity beyond the largest tree (room for several trees per row).
    """

    layout: Layout | None = None
    extra_capacity: int = 0

    def __post_init__(self) -> None:
        if self.layout is not None and not isinstance(self.layout, Layout):
            raise TypeError(f"layout: expected a Layout or None, got {type(self.layout).__name__}")
        _check_int("extra_capacity", self.extra_capacity, 0)

    def __call__(self, batch: TokenBatch) -> tuple[TokenBatch, PackedTree]:
        if not isinstance(batch, TokenBatch):
            raise TypeError(f"batch: expected a TokenBatch, got {type(batch).__name__}")
        laid = self.layout(batch) if self.layout is not None else batch
        largest = int(pack_tree(laid).tree_sizes_T.max())
        return laid, pack_tree(laid, largest + self.extra_capacity)


@st.composite
def tree_packings(draw, *, max_extra_capacity: int = 12) -> TreePacking:
    """Random :class:`TreePacking`: any expanded layout (or none), any spare capacity."""
    _check_int("max_extra_capacity", max_extra_capacity, 0)
    return TreePacking(draw(st.none() | layouts()), draw(st.integers(0, max_extra_capacity)))


@dataclasses.dataclass(frozen=True)
class TreeSplit:
    """``batch -> [(part, PackedTree), ...]``: micro-batches of whole trees, each packed
    (:func:`~tokenmdp.tree_training.tree_micro_batches`).

    Parameters
    ----------
    num_micro_batches : int
        Requested count, capped at the number of trees.
    extra_capacity : int, default 0
        Packed row capacity beyond each part's largest tree.
    """

    num_micro_batches: int
    extra_capacity: int = 0

    def __post_init__(self) -> None:
        _check_int("num_micro_batches", self.num_micro_batches, 1)
        _check_int("extra_capacity", self.extra_capacity, 0)

    def __call__(self, batch: TokenBatch) -> list[tuple[TokenBatch, PackedTree]]:
        if not isinstance(batch, TokenBatch):
            raise TypeError(f"batch: expected a TokenBatch, got {type(batch).__name__}")
        k = min(self.num_micro_batches, pack_tree(batch).num_trees)
        out = []
        for mb in tree_micro_batches(batch, k):
            largest = int(mb.packed.tree_sizes_T.max())
            out.append((mb.batch, pack_tree(mb.batch, largest + self.extra_capacity)))
        return out


@st.composite
def tree_splits(draw, *, max_micro_batches: int = 3, max_extra_capacity: int = 8) -> TreeSplit:
    """Random :class:`TreeSplit` into 1 to ``max_micro_batches`` parts of whole trees."""
    _check_int("max_micro_batches", max_micro_batches, 1)
    _check_int("max_extra_capacity", max_extra_capacity, 0)
    return TreeSplit(draw(st.integers(1, max_micro_batches)),
                     draw(st.integers(0, max_extra_capacity)))
