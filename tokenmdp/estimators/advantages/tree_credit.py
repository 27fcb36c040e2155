"""Tree credit assignment as the papers define it: TreeRL's process reward and VinePPO's values.

Both read the node values ``V̂(n) = mean_{i ∈ L(n)} R_i`` of a tree batch
(:func:`~tokenmdp.estimators.advantages.tree.tree_values`); notation as in
:mod:`~tokenmdp.estimators.advantages.tree`.

* :class:`TreeRLAdvantage` — TreeRL's global plus local advantage of the *segment* holding a
  token (a segment: the tokens between two forks, which share one set of leaves), divided by
  ``sqrt(|L(n)|)``;
* :class:`VinePPOTree` — ``V̂(s_{t+1}) - V̂(s_t)`` with each value from the *other* leaves below
  the prefix: continuations that are not the trained path, as VinePPO's are.
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmdp.estimators._common import take, to_tokens
from tokenmdp.estimators.advantages.tree import TreeAdvantage, TreeValues

__all__ = ["TreeRLAdvantage", "VinePPOTree", "segment_parent"]


def segment_parent(values: TreeValues) -> torch.Tensor:
    """LongTensor ``[N]``: the node a node's segment hangs from.

    A segment is a maximal chain of nodes with one leaf set (no fork inside it). The parent of
    node ``n``'s segment is its deepest ancestor with more leaves (the fork the segment starts
    after); for the tokens above the first fork it is the tree's first prompt token (whose value,
    the mean over the tree's leaves, they all share). Computed by pointer jumping: ``O(log depth)``
    gathers over the nodes.

    Parameters
    ----------
    values : TreeValues
        :func:`~tokenmdp.estimators.advantages.tree.tree_values` of a tree batch.

    Returns
    -------
    LongTensor ``[N]``
        The segment parent of every node.
    """
    parent = values.structure.parent_N
    leaves = values.structure.leaves_N
    own = torch.arange(parent.numel(), device=parent.device)
    has_parent = parent >= 0
    up = torch.where(has_parent, parent, own)
    resolved = ~has_parent | (take(leaves, up) > leaves)   # a root, or the first node after a fork
    anchor = up                                             # its parent (a root: itself)
    pointer = torch.where(resolved, own, up)
    while True:                                             # to the first resolved ancestor
        nxt = take(pointer, pointer)
        if torch.equal(nxt, pointer):
            return take(anchor, pointer)
        pointer = nxt


@dataclasses.dataclass(frozen=True)
class TreeRLAdvantage(TreeAdvantage):
    """TreeRL's process reward of the segment holding each token (Hou et al., arXiv 2506.11902,
    Eqs. 2-4, and the paper's leaf-count reweighting):

    ``A_{i,t} = [GA(n_t) + LA(n_t)] / sqrt(|L(n_t)|)``, ``GA(n) = V̂(n) - V̂(root)``,
    ``LA(n) = V̂(n) - V̂(parent segment of n)``

    with ``V̂(root)`` the mean over the tree's leaves. TreeRL's nodes are *segments* (the tokens
    between two branching points); here every token is a node, and a token's segment is its
    chain of nodes with the same leaves, so the local advantage is taken against the fork above
    the segment (:func:`segment_parent`), as the paper's parent node. A token in ``|L(n)|``
    paths appears ``|L(n)|`` times in the expanded batch; the ``1/sqrt(|L(n)|)`` factor damps
    that repetition (total weight ``sqrt(|L(n)|)`` instead of ``|L(n)|``).

    On a plain group (no shared response prefix) every token gets ``2 (R_i - mean_tree R)``.

    Parameters
    ----------
    reweight : bool, default True
        Divide by ``sqrt(|L(n)|)`` (the paper); False keeps ``GA + LA``.
    """

    reweight: bool = True

    def __post_init__(self):
        if not isinstance(self.reweight, bool):
            raise TypeError(f"reweight: expected a bool, got {type(self.reweight).__name__}")

    def tree_advantages(self, batch, values, reward_S):  # numpydoc ignore=PR01,RT01
        """``(GA + LA)/sqrt(|L|)`` of each token's node (``[R, C]``)."""
        value = values.value_N
        structure = values.structure
        first = (batch.position == 0) & (batch.sequence_id >= 0)
        root_S = value.new_zeros(batch.num_sequences)
        root_S[batch.sequence_id[first]] = take(value, values.node_RC)[first]
        node_N = 2.0 * value - take(value, segment_parent(values))  # V(n) + [V(n) - V(seg. parent)]
        if self.reweight:
            node_N = node_N / structure.leaves_N.to(value.dtype).sqrt()
        scale_RC = take(structure.leaves_N.to(value.dtype).sqrt(), values.node_RC) \
            if self.reweight else 1.0
        return take(node_N, values.node_RC) - to_tokens(root_S, batch) / scale_RC

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            ``"(GA + LA)/sqrt|L(n)|, segment values from the tree's leaves"``.
        """
        scale = "/sqrt|L(n)|" if self.reweight else ""
        return f"(GA + LA){scale}, segment values from the tree's leaves"


@dataclasses.dataclass(frozen=True)
class VinePPOTree(TreeAdvantage):
    """VinePPO's advantage with Monte Carlo values from a tree's other leaves (Kazemnejad et al.,
    arXiv 2410.01679, Sec. 4):

    ``A_{i,t} = V̂_{-i}(s_{t+1}) - V̂_{-i}(s_t)``, ``V̂_{-i}(n) = mean_{j ∈ L(n), j ≠ i} R_j``

    with ``V̂_{-i}(n) = R_i`` where path ``i`` is the only leaf below ``n`` (no other continuation:
    the path's own return). VinePPO estimates ``V̂(s_t)`` from K extra continuations sampled at
    ``s_t`` and does not train on them; on a tree the continuations below a node are the other
    leaves, which are trained on too, and a state past the last fork of a path has none. The
    values leave the trained path out, so the advantage telescopes along a path to
    ``R_i - mean_{j ≠ i} R_j``: on a plain group, RLOO's advantage at the first response token
    and 0 after it.
    """

    def tree_advantages(self, batch, values, reward_S):  # numpydoc ignore=PR01,RT01
        """``V̂_{-i}(n_t) - V̂_{-i}(p(n_t))`` (``[R, C]``)."""
        leaves = values.structure.leaves_N.to(values.value_N.dtype)
        total = values.value_N * leaves
        own = to_tokens(reward_S, batch)

        def leave_out(node_RC):
            n = take(leaves, node_RC)
            others = (take(total, node_RC) - own) / (n - 1).clamp(min=1)
            return torch.where(n > 1, others, own)
        return leave_out(values.node_RC) - leave_out(values.parent_RC)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            ``"V_-i(s_t+1) - V_-i(s_t), values from the tree's other leaves"``.
        """
        return "V_-i(s_t+1) - V_-i(s_t), values from the tree's other leaves"
