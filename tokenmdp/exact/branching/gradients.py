"""Per-tree estimator gradients: the lab's :class:`~tokenmdp.exact.lab.step_gradients.StepGradients`
on tree batches.

A tree's expanded batch is its leaves' responses — rows of ``mdp.enumerate()`` — plus the node
id of every token (``token_extras["tree_node"]``, :mod:`tokenmdp.trees`). So a tree draw is
stored as the rows of its ``n`` leaves and each leaf's response node ids (``[n, L]``, ``-1``
past its end), packed into one row ``[n + n * L]`` (:func:`pack`); trees are grouped by their
number of leaves, each class one :class:`TreeStepGradients` with ``group_size = n`` (one tree is
one group of one step). :class:`TreeStepGradients` is ``StepGradients`` with the node ids laid
onto the stacked batch before ``prepare``: the estimator code is the library's own, so a leaf-level
estimator (``grpo``, ``rloo``, ...) reads the leaves as a group and a tree estimator reads the
node ids.
"""

from __future__ import annotations

import torch

from tokenmdp.estimators._common import take
from tokenmdp.exact.branching.process import Grown
from tokenmdp.exact.lab.step_gradients import StepGradients
from tokenmdp.trees import TREE_NODE

__all__ = ["TreeStepGradients", "pack"]


def pack(trees, max_len: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Trees as packed rows, by number of leaves.

    Parameters
    ----------
    trees : sequence of Grown
        The trees (law representatives or samples).
    max_len : int
        The MDP's ``L``.

    Returns
    -------
    dict of int to (LongTensor ``[D_n, n + n * L]``, LongTensor ``[D_n]``)
        Per leaf count ``n``: each tree's leaf rows then leaf node ids, and the tree's index in
        ``trees``.
    """
    out: dict[int, tuple[list, list]] = {}
    for i, tree in enumerate(trees):
        if not isinstance(tree, Grown):
            raise TypeError(f"trees[{i}]: expected a Grown tree, got {type(tree).__name__}")
        leaves = tree.leaves()
        rows = [tree.leaf_row[v] for v in leaves]
        nodes = []
        for v in leaves:
            path = tree.path(v)
            nodes += path + [-1] * (max_len - len(path))
        packed, index = out.setdefault(len(leaves), ([], []))
        packed.append(rows + nodes)
        index.append(i)
    return {n: (torch.tensor(p, dtype=torch.long), torch.tensor(ix, dtype=torch.long))
            for n, (p, ix) in sorted(out.items())}


class TreeStepGradients(StepGradients):
    """``ĝ`` of an estimator on tree draws of ``n`` leaves (packed by :func:`pack`).

    Parameters
    ----------
    mdp, policy, estimator, fields
        As for :class:`~tokenmdp.exact.lab.step_gradients.StepGradients`.
    leaves : int
        ``n``: the leaves of every tree of this class (the group size).
    tables : PolicyTables, optional
        Shared estimator-independent tables.

    Notes
    -----
    Every method of ``StepGradients`` takes the packed rows in place of ``ids``; within a stacked
    block, tree ``d``'s node ids are offset by ``d`` times the ids one tree can use, so no two
    trees share a node.
    """

    def __init__(self, mdp, policy, estimator, fields, leaves: int, *, tables=None) -> None:
        super().__init__(mdp, policy, estimator, fields, leaves, tables=tables)
        self._rpos = self.enum.response_position                 # [N, C], -1 off the response
        self._prompt_width = max(len(p) for p in mdp.prompts)
        self._nodes: torch.Tensor | None = None

    def coefficients(self, packed: torch.Tensor, **kwargs):
        """:meth:`StepGradients.coefficients` of packed tree rows ``[D, n + n * L]``.

        Parameters
        ----------
        packed : LongTensor ``[D, n + n * L]``
            Per tree draw, its ``n`` leaves' response indices, then each leaf's ``L`` node ids.
        **kwargs
            Passed on to :meth:`StepGradients.coefficients`.

        Returns
        -------
        Tensor
            What :meth:`StepGradients.coefficients` returns for the leaves.
        """
        n, L = self.group_size, self.mdp.max_len
        if packed.dim() != 2 or packed.shape[1] != n * (1 + L):
            raise ValueError(f"packed: expected [D, {n * (1 + L)}] rows of {n}-leaf trees, got "
                             f"{tuple(packed.shape)}")
        self._nodes = packed[:, n:].reshape(-1, L)                # [D * n, L], one per sequence
        try:
            return super().coefficients(packed[:, :n], **kwargs)
        finally:
            self._nodes = None

    def _stacked(self, ids: torch.Tensor):
        batch, step = super()._stacked(ids)
        rows = ids.reshape(-1)
        rpos = take(self._rpos, rows)                              # [S, C]
        real = batch.sequence_id >= 0
        response_node = self._nodes.gather(1, rpos.clamp(min=0).clamp(max=self.mdp.max_len - 1))
        width = self._prompt_width + self.group_size * self.mdp.max_len
        local = torch.where(rpos >= 0, self._prompt_width + response_node, batch.position)
        node = torch.where(real, step[:, None] * width + local, -1)
        # the stacked batch is built without validation, field by field (lab._stacked); its
        # node ids are set the same way: one tree's prompt tokens share ids, response nodes too
        object.__setattr__(batch, "token_extras", {TREE_NODE: node})
        return batch, step
