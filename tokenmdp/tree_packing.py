"""A tree packed once: every node of a batch's response trees in one slot of a packed grid.

The *expanded* batch of a tree rollout (:mod:`tokenmdp.trees`) holds one sequence per leaf, so a
prefix shared by ``k`` leaves is computed ``k`` times. :func:`pack_tree` lays each node out
once: the nodes of a tree in depth-first preorder, so that node ``i``'s ancestors are exactly
the nodes ``j`` whose interval ``[tree_start_j, tree_end_j)`` (``j``'s column and the end of
its subtree) holds ``i``'s column. The tree attention mask is then one comparison per pair::

    query q sees key k   iff   k <= q < tree_end[k]      (same row)

(:func:`tokenmdp.model.tree_attention_mask` on the CPU, a FlexAttention ``mask_mod`` on CUDA).
Several trees may share a row (first fit by tree size); a tree never crosses rows. Every packed
token keeps its position in its sequences, so RoPE sees the expanded path's positions.

**Loss and gradient are the expanded ones.** :meth:`PackedTree.gather` maps per-slot values to
the expanded ``[R, C]`` grid (``gather_index``). Compute any estimator's loss on the *expanded*
batch with the gathered log-probs: the value is the expanded one, and autograd's backward of the
gather sums the gradient of a shared token over its leaves, i.e. a shared token's weight in the
packed tree is the sum of its leaves' weights (:meth:`PackedTree.node_weights`). So the packed
tree's loss and gradient equal those of the expanded paths for every estimator, whatever its
advantages, aggregation or ratios: tree layout is memory, never meaning.

Per-token facts of a transition (behaviour, old and reference log-probs, the routing traces
named in ``extras``) are the same on every copy of a node, or the node is not one transition:
:func:`pack_tree` checks it and packs one value per node. Facts of a *copy* stay on the
expanded batch, where the loss reads them: the advantage, the loss mask and weight, and the
per-token step statistics ``prepare`` may write into ``token_extras`` (a self-normalized IS
factor, a Clip-Cov selection): they belong to the leaf.

Reading order: :class:`PackedTree` (the grid and its maps), :func:`pack_tree`;
:mod:`tokenmdp.tree_training` runs the model over it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.placement import _check_int, place_first_fit_decreasing
from tokenmdp.trees import TREE_NODE, TreeStructure, tree_structure

__all__ = ["NODE_FIELDS", "PackedTree", "pack_tree"]

NODE_FIELDS = ("behavior_logprob", "old_logprob", "ref_logprob")
"""Per-token float fields that belong to the transition, hence to the node: packed once."""


@dataclasses.dataclass(frozen=True, eq=False)
class PackedTree:
    """The nodes of a batch's trees, each once, on a ``[R', C']`` grid (:func:`pack_tree`).

    Slot ``(r, c)`` holds one node, or padding. Flat slot indices are ``r * C' + c``.

    Parameters
    ----------
    tokens_RC : LongTensor ``[R', C']``
        The node's token (0 on padding).
    position_RC : LongTensor ``[R', C']``
        The node's position in each of its sequences (0 on padding): the RoPE angle.
    tree_end_RC : LongTensor ``[R', C']``
        One past the last column of the node's subtree: the node's descendants are the columns
        ``c + 1 .. tree_end - 1`` of its row (``c + 1`` on padding).
    parent_RC : LongTensor ``[R', C']``
        The column of the node's parent (the token before it), ``-1`` at a root (position 0)
        and on padding.
    node_RC : LongTensor ``[R', C']``
        The node id of :func:`~tokenmdp.trees.tree_structure` (``0 .. N-1``), ``-1`` on padding.
    leaves_RC : LongTensor ``[R', C']``
        The sequences of the expanded batch through the node (its copies there), 0 on padding.
    gather_index_RC : LongTensor ``[R, C]``
        For every token of the *expanded* batch its flat packed slot, ``-1`` on its padding.
    tree_S : LongTensor ``[S]``
        The tree (``0 .. T-1``, in packing order of their roots) of each expanded sequence.
    root_slot_T : LongTensor ``[T]``
        The flat slot of each tree's root (its first prompt token).
    fields : dict of str to Tensor ``[R', C']``
        The expanded batch's :data:`NODE_FIELDS` that are set, one value per node (0 on
        padding).
    token_extras : dict of str to Tensor ``[R', C', ...]``
        The expanded batch's ``token_extras`` named in :func:`pack_tree`'s ``extras``, one
        record per node (0 on padding).
    """

    tokens_RC: torch.Tensor
    position_RC: torch.Tensor
    tree_end_RC: torch.Tensor
    parent_RC: torch.Tensor
    node_RC: torch.Tensor
    leaves_RC: torch.Tensor
    gather_index_RC: torch.Tensor
    tree_S: torch.Tensor
    root_slot_T: torch.Tensor
    fields: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    token_extras: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    # ------------------------------------------------------------------ shape facts
    @property
    def num_rows(self) -> int:
        """``R'``, the packed rows."""
        return self.tokens_RC.shape[0]

    @property
    def capacity(self) -> int:
        """``C'``, the packed row capacity."""
        return self.tokens_RC.shape[1]

    @property
    def num_nodes(self) -> int:
        """``N``: tokens of the packed tree (each node once)."""
        return int((self.node_RC >= 0).sum())

    @property
    def num_expanded_tokens(self) -> int:
        """Real tokens of the expanded batch (each node once per leaf below it)."""
        return int(self.leaves_RC.sum())

    @property
    def num_trees(self) -> int:
        """``T``, the trees."""
        return int(self.root_slot_T.numel())

    @property
    def tree_sizes_T(self) -> torch.Tensor:
        """LongTensor ``[T]``: the nodes of each tree (prompt included)."""
        end = self.tree_end_RC.reshape(-1)[self.root_slot_T]
        return end - self.root_slot_T % self.capacity

    @property
    def valid_RC(self) -> torch.Tensor:
        """Bool ``[R', C']``: slots that hold a node."""
        return self.node_RC >= 0

    @property
    def tree_start_RC(self) -> torch.Tensor:
        """LongTensor ``[R', C']``: the first column of each slot's subtree, its own column."""
        cols = torch.arange(self.capacity, device=self.tokens_RC.device)
        return cols.expand(self.num_rows, -1)

    # ------------------------------------------------------------------ maps
    def gather(self, values_RC: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        """Per-slot values ``[R', C', ...]`` → the expanded batch's ``[R, C, ...]``.

        Every copy of a node gets the node's value; the expanded padding gets ``fill``.
        Differentiable: the backward pass sums the gradient of a node over its copies.

        Parameters
        ----------
        values_RC : Tensor ``[R', C', ...]``
            One value (or record) per packed slot.
        fill : float or int, default 0
            The value on the expanded batch's padding (``-1`` for routing records).

        Returns
        -------
        Tensor ``[R, C, ...]``
        """
        if tuple(values_RC.shape[:2]) != tuple(self.tokens_RC.shape):
            raise ValueError(f"values_RC: shape {tuple(values_RC.shape)} does not start with the "
                             f"packed tree's [R', C'] = {tuple(self.tokens_RC.shape)}")
        rest = tuple(values_RC.shape[2:])
        index = self.gather_index_RC
        out = values_RC.reshape(-1, *rest).index_select(0, index.clamp(min=0).reshape(-1))
        out = out.view(*index.shape, *rest)
        real = (index >= 0).view(*index.shape, *([1] * len(rest)))
        return torch.where(real, out, torch.full((), fill, dtype=out.dtype, device=out.device))

    def scatter(self, values_RC: torch.Tensor, name: str = "values_RC", *,
                atol: float = 0.0) -> torch.Tensor:
        """Expanded per-token values ``[R, C, ...]`` → one value per slot ``[R', C', ...]``.

        Parameters
        ----------
        values_RC : Tensor ``[R, C, ...]``
            On the expanded batch's grid; every copy of a node must hold the same value.
        name : str
            The field's name in error messages.
        atol : float, default 0.0
            Largest difference allowed between copies (float values).

        Returns
        -------
        Tensor ``[R', C', ...]``
            The node's value in its slot, 0 on padding.

        Raises
        ------
        ValueError
            Wrong shape, or copies of one node that differ (naming ``name`` and the node).
        """
        index = self.gather_index_RC
        if tuple(values_RC.shape[:2]) != tuple(index.shape):
            raise ValueError(f"{name}: shape {tuple(values_RC.shape)} does not start with the "
                             f"expanded batch's [R, C] = {tuple(index.shape)}")
        rest = tuple(values_RC.shape[2:])
        real = index >= 0
        slot, vals = index[real], values_RC[real]
        out = values_RC.new_zeros((self.num_rows * self.capacity, *rest))
        out[slot] = vals
        stored = out[slot]
        diff = (vals != stored) if not vals.dtype.is_floating_point else \
            (vals - stored).abs() > atol
        if vals.numel() and bool(diff.any()):
            bad = int(diff.reshape(diff.shape[0], -1).any(-1).nonzero()[0])
            node = int(self.node_RC.reshape(-1)[slot[bad]])
            raise ValueError(f"{name}: the copies of tree node {node} differ (e.g. "
                             f"{vals[bad].reshape(-1)[:4].tolist()} vs "
                             f"{stored[bad].reshape(-1)[:4].tolist()}); a node is one "
                             "transition, so its per-token facts must be the same on every "
                             "path through it")
        return out.view(self.num_rows, self.capacity, *rest)

    def node_weights(self, weight_RC: torch.Tensor) -> torch.Tensor:
        """The weight of each packed token: the sum of its copies' weights ``[R', C']``.

        A loss ``Σ_{expanded tokens} w · f(log π)`` that is linear in the per-token terms is
        ``Σ_{nodes} (Σ_{copies} w) · f(log π)`` on the packed tree; the gradient of any loss
        on the gathered log-probs carries exactly these sums.

        Parameters
        ----------
        weight_RC : Tensor ``[R, C]``
            Per-token weights of the expanded batch (for example ``loss_weight * advantage``).

        Returns
        -------
        Tensor ``[R', C']``
        """
        index = self.gather_index_RC
        if tuple(weight_RC.shape) != tuple(index.shape):
            raise ValueError(f"weight_RC: expected the expanded batch's shape "
                             f"{tuple(index.shape)}, got {tuple(weight_RC.shape)}")
        real = index >= 0
        out = weight_RC.new_zeros(self.num_rows * self.capacity)
        return out.index_add(0, index[real], weight_RC[real]).view(self.num_rows, self.capacity)


# ------------------------------------------------------------------------------ packing
def _preorder(batch: TokenBatch, structure: TreeStructure) -> tuple[np.ndarray, ...]:
    """Depth-first preorder of every node (trees by root id, children by node id).

    The expanded paths sorted lexicographically by their node ids put the leaves of every
    subtree next to each other; listing each path's nodes not on the path before it then visits
    every subtree as one contiguous block (a preorder), and a node's subtree ends where the last
    path through it does.

    Returns ``pre_N`` (preorder rank), ``end_N`` (rank one past the subtree), ``root_N`` (the
    root's node id) and the per-sequence path roots ``root_S``.
    """
    real = (batch.sequence_id >= 0).cpu()
    sid = batch.sequence_id.cpu()[real].numpy()
    pos = batch.position.cpu()[real].numpy()
    node = structure.node_RC.cpu()[real].numpy()
    num_seq, num_nodes = batch.num_sequences, structure.num_nodes
    paths = np.full((num_seq, int(pos.max()) + 1 if pos.size else 1), -1, dtype=np.int64)
    paths[sid, pos] = node
    order = np.lexsort(paths.T[::-1])                   # column 0 the primary key
    sorted_paths = paths[order]
    new = sorted_paths >= 0
    new[1:] &= sorted_paths[1:] != sorted_paths[:-1]    # not on the previous path
    k, p = np.nonzero(new)                              # row-major: paths, then positions
    nodes = sorted_paths[k, p]
    if nodes.size != num_nodes:                         # tree_structure's checks prevent it
        raise ValueError(f"token_extras[{TREE_NODE!r}]: node ids do not form trees")
    pre = np.empty(num_nodes, dtype=np.int64)
    pre[nodes] = np.arange(num_nodes)
    last = np.full(num_nodes, -1, dtype=np.int64)
    kk = np.broadcast_to(np.arange(num_seq)[:, None], sorted_paths.shape)
    np.maximum.at(last, sorted_paths[sorted_paths >= 0], kk[sorted_paths >= 0])
    before = np.concatenate([[0], np.cumsum(new.sum(1))])
    end = before[last + 1]
    root_of_rank = np.maximum.accumulate(np.where(p == 0, np.arange(num_nodes), 0))
    root = np.empty(num_nodes, dtype=np.int64)
    root[nodes] = nodes[root_of_rank]
    return pre, end, root, paths[:, 0]


def pack_tree(batch: TokenBatch, capacity: int | None = None, *,
              extras: Sequence[str] = (), atol: float = 0.0) -> PackedTree:
    """Pack every node of ``batch``'s trees once (depth-first preorder, first fit by tree size).

    Parameters
    ----------
    batch : TokenBatch
        An expanded tree batch (any layout) with ``token_extras[TREE_NODE]``
        (:func:`~tokenmdp.trees.batch_from_trees`, or a tree rollout).
    capacity : int, optional
        Packed row capacity ``C'``, at least the largest tree's node count (default: that
        count). Trees are placed by first-fit decreasing
        (:func:`tokenmdp.placement.place_first_fit_decreasing`).
    extras : sequence of str, default ()
        Keys of ``batch.token_extras`` that are facts of the node (routing traces such as
        ``"engine_routing"``), packed once per node and checked equal on every copy.
    atol : float, default 0.0
        Largest difference allowed between the copies of a node in the float fields
        :data:`NODE_FIELDS` and float ``extras`` (for example old log-probs computed on the
        expanded paths in float32).

    Returns
    -------
    PackedTree

    Raises
    ------
    ValueError
        Node ids that are not trees (:func:`~tokenmdp.trees.tree_structure`), a ``capacity``
        smaller than a tree, an unknown key in ``extras``, or a per-node field that differs
        between copies of a node (naming the field).
    """
    structure = tree_structure(batch)
    if isinstance(atol, bool) or not isinstance(atol, (int, float)) or not atol >= 0:
        raise ValueError(f"atol: expected a number >= 0, got {atol!r}")
    if isinstance(extras, str) or not isinstance(extras, Sequence):
        raise TypeError(f"extras: expected a sequence of token_extras keys, got "
                        f"{type(extras).__name__}")
    for name in extras:
        if name not in batch.token_extras or name == TREE_NODE:
            raise ValueError(f"extras: {name!r} is not a record of batch.token_extras "
                             f"(it has {sorted(k for k in batch.token_extras if k != TREE_NODE)})")
    device = batch.device
    pre, end, root, root_S = _preorder(batch, structure)
    roots = np.flatnonzero(root == np.arange(root.size))
    roots = roots[np.argsort(pre[roots])]               # trees in preorder
    tree_of_root = np.empty(root.size, dtype=np.int64)
    tree_of_root[roots] = np.arange(roots.size)
    sizes = end[roots] - pre[roots]
    largest = int(sizes.max()) if sizes.size else 1
    if capacity is None:
        capacity = largest
    capacity = _check_int("capacity", capacity, 1)
    if capacity < largest:
        k = int(np.argmax(sizes))
        raise ValueError(f"capacity={capacity} is smaller than tree {k} ({largest} nodes); a "
                         "tree is never split across rows")
    placement = place_first_fit_decreasing(sizes, capacity)
    tree = tree_of_root[root]
    col = placement.offset_S.numpy()[tree] + pre - pre[root]
    row = placement.row_S.numpy()[tree]
    slot_N = torch.as_tensor(row * capacity + col, device=device)
    grid = placement.num_rows * capacity

    def packed(values_N: torch.Tensor, fill: int) -> torch.Tensor:
        out = values_N.new_full((grid,), fill)
        out[slot_N] = values_N
        return out.view(placement.num_rows, capacity)

    end_col = torch.as_tensor(placement.offset_S.numpy()[tree] + end - pre[root], device=device)
    tree_end = packed(end_col, 0).view(-1)
    pad = tree_end == 0
    tree_end[pad] = torch.arange(grid, device=device)[pad] % capacity + 1
    parent_N = structure.parent_N
    parent_col = torch.where(parent_N >= 0, slot_N[parent_N.clamp(min=0)] % capacity, -1)
    real = batch.sequence_id >= 0
    gather_index = torch.full_like(batch.sequence_id, -1, dtype=torch.long)
    gather_index[real] = slot_N[structure.node_RC[real]]
    packed_tree = PackedTree(
        tokens_RC=packed(structure.token_N, 0), position_RC=packed(structure.position_N, 0),
        tree_end_RC=tree_end.view(placement.num_rows, capacity),
        parent_RC=packed(parent_col, -1),
        node_RC=packed(torch.arange(structure.num_nodes, device=device), -1),
        leaves_RC=packed(structure.leaves_N, 0), gather_index_RC=gather_index,
        tree_S=torch.as_tensor(tree_of_root[root_S], dtype=torch.long, device=device),
        root_slot_T=slot_N[torch.as_tensor(roots, dtype=torch.long, device=device)])
    for name in NODE_FIELDS:
        value = getattr(batch, name)
        if value is not None:
            packed_tree.fields[name] = packed_tree.scatter(value, name, atol=atol)
    for name in extras:
        packed_tree.token_extras[name] = packed_tree.scatter(
            batch.token_extras[name], f"token_extras[{name!r}]", atol=atol)
    return packed_tree
