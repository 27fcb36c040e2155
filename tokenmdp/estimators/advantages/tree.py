"""Tree advantages: credit from the node values of a branching rollout (:mod:`tokenmdp.trees`).

A tree batch is the expanded batch of one or more response trees: one sequence per leaf, and
``token_extras['tree_node']`` naming the node of every real token (the tokens of a shared prefix
carry one id). The Monte Carlo value of the prefix ending at node ``n`` is the mean return of
the leaves below it, ``V̂(n) = (1/|L(n)|) Σ_{i ∈ L(n)} R_i`` (:func:`tokenmdp.trees.node_mean`;
TreeRL, arXiv 2506.11902, Sec. 3.2). For token ``t`` of sequence ``i``, ``n_t`` is its node,
``s_t`` the prefix *before* it (the parent node ``p(n_t)``; the last prompt token for the first
response token, whose value is the mean over the tree's leaves) and ``s_{t+1}`` the prefix
ending with it (``n_t``). The parts:

* :class:`TreeLeaves` — a per-sequence group advantage over the tree's leaves (GRPO, RLOO);
* :class:`NodeValueDifference` — ``A_t = V̂(n_t) - V̂(p(n_t))``;
* :class:`ReturnMinusNodeValue` — ``A_t = R_i - V̂(p(n_t))``;
* :class:`~tokenmdp.estimators.advantages.tree_credit.TreeRLAdvantage` and
  :class:`~tokenmdp.estimators.advantages.tree_credit.VinePPOTree` (their own module).

Every tree part refuses a batch without node ids (``ValueError`` naming
``token_extras['tree_node']``) and a KL-in-reward penalty (the values are of the environment
reward; put a KL in the loss). On a plain group built as a tree (no shared response prefix: every
response node has one leaf) they reduce to the familiar advantages, which the tests check: the
node-value difference telescopes to ``R_i - mean_g`` at the first response token and 0 after it,
and the return minus the node value is ``R_i - mean_g`` at the first token and 0 after it.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import NamedTuple

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators._common import take, to_tokens
from tokenmdp.estimators.advantages.group import Advantage, GroupNormalized, _check
from tokenmdp.estimators.advantages.token import TokenAdvantage
from tokenmdp.trees import TREE_NODE, TreeStructure, node_mean, tree_structure

__all__ = ["NodeValueDifference", "ReturnMinusNodeValue", "TreeAdvantage", "TreeLeaves",
           "TreeValues", "tree_values"]


class TreeValues(NamedTuple):
    """The node values of a tree batch at its tokens (:func:`tree_values`).

    Parameters
    ----------
    structure : TreeStructure
        ``tokenmdp.trees.tree_structure(batch)``.
    value_N : Tensor ``[N]``
        ``V̂(n)`` of every node.
    node_RC, parent_RC : LongTensor ``[R, C]``
        Each token's node ``n_t`` and the node before it ``p(n_t)`` (the node itself at
        position 0, which has no parent; 0 on padding).
    """

    structure: TreeStructure
    value_N: torch.Tensor
    node_RC: torch.Tensor
    parent_RC: torch.Tensor


def _tree_structure(batch: TokenBatch, who: str) -> TreeStructure:
    if TREE_NODE not in batch.token_extras:
        raise ValueError(f"batch: {who} needs a tree batch, with token_extras[{TREE_NODE!r}] "
                         "naming each token's tree node (tokenmdp.trees.batch_from_trees, or "
                         "a tree rollout); this batch has none")
    return tree_structure(batch)


def tree_values(batch: TokenBatch, reward_S: torch.Tensor, *, who: str = "a tree advantage"
                ) -> TreeValues:
    """``V̂(n) = mean_{i ∈ L(n)} R_i`` of every node, with each token's node and parent node.

    Parameters
    ----------
    batch : TokenBatch
        A tree batch (``token_extras['tree_node']``), any layout.
    reward_S : Tensor ``[S]``
        One return per sequence (leaf).
    who : str
        Named in the error for a batch without node ids.

    Returns
    -------
    TreeValues

    Raises
    ------
    ValueError
        No ``token_extras['tree_node']``, or ids that are not a tree
        (:func:`tokenmdp.trees.tree_structure`).
    """
    _check(reward_S)
    structure = _tree_structure(batch, who)
    value_N = node_mean(reward_S, batch, structure)
    node_RC = structure.node_RC.clamp(min=0)
    parent_N = structure.parent_N
    own = torch.arange(structure.num_nodes, device=parent_N.device)
    parent_N = torch.where(parent_N >= 0, parent_N, own)
    return TreeValues(structure, value_N, node_RC, take(parent_N, node_RC))


def _check_penalty(penalty_RC: torch.Tensor, batch: TokenBatch, who: str) -> None:
    if penalty_RC.shape != batch.tokens.shape:
        raise ValueError(f"penalty_RC: expected shape {tuple(batch.tokens.shape)}, got "
                         f"{tuple(penalty_RC.shape)}")
    if bool((penalty_RC != 0).any()):
        raise ValueError(f"estimator: {who} takes node values of the environment reward; a "
                         "KL-in-reward penalty is not defined on a tree (use a KL in the loss)")


class TreeAdvantage(TokenAdvantage, metaclass=abc.ABCMeta):
    """Base of the token-level tree parts (abstract): ``needs_tree``; whole trees, no batch
    statistic; a subclass defines ``tree_advantages``.

    ``group_local``: a token's advantage depends on its own tree only, so any holder of whole
    trees computes it. ``couples_sequences``: it depends on the other leaves through the tree's
    shape (which leaves share a node), not only through their rewards and token counts.
    """

    needs_tree = True
    """The part reads ``token_extras['tree_node']``: a registry-wide test over plain batches
    skips estimators with it (:func:`tokenmdp.estimators.names` ``(trees=...)``)."""
    group_local = True
    couples_sequences = True

    def token_advantages(self, batch, reward_S, penalty_RC, step_S=None):  # numpydoc ignore=PR01,RT01
        """``A_{i,t}`` of every token (see the class docstring; ``[R, C]``)."""
        who = f"{type(self).__name__}"
        _check_penalty(penalty_RC, batch, who)
        return self.tree_advantages(batch, tree_values(batch, reward_S, who=who), reward_S)

    @abc.abstractmethod
    def tree_advantages(self, batch: TokenBatch, values: TreeValues,
                        reward_S: torch.Tensor) -> torch.Tensor:
        """The advantage of every token from the node values.

        Parameters
        ----------
        batch : TokenBatch
            The tree batch.
        values : TreeValues
            :func:`tree_values` of ``batch``.
        reward_S : Tensor ``[S]``
            The return of each sequence.

        Returns
        -------
        Tensor ``[R, C]``
            ``A_{i,t}`` (``prepare`` zeroes the tokens off the loss mask).
        """
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class NodeValueDifference(TreeAdvantage):
    """``A_{i,t} = V̂(s_{t+1}) - V̂(s_t) = V̂(n_t) - V̂(p(n_t))``: the change of the Monte Carlo
    value that token t makes, the values from the leaves below each node.

    Nonzero only where a token starts a new branch (a child of a fork); along a path it telescopes
    to ``Σ_t A_{i,t} = V̂(leaf_i) - V̂(root) = R_i - mean_{tree} R``. A shared token has one
    advantage in all its paths. The temporal difference of a Monte Carlo value with ``γ = λ = 1``
    and the reward at the end (Schulman et al., arXiv 1506.02438, Eq. 10); the values per prefix
    as TreeRL's local advantage (Hou et al., arXiv 2506.11902, Eq. 3) at the token level.
    """

    def tree_advantages(self, batch, values, reward_S):  # numpydoc ignore=PR01,RT01
        """``V̂(n_t) - V̂(p(n_t))`` (``[R, C]``)."""
        return take(values.value_N, values.node_RC) - take(values.value_N, values.parent_RC)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            ``"V(s_t+1) - V(s_t), node values from the tree's leaves"``.
        """
        return "V(s_t+1) - V(s_t), node values from the tree's leaves"


@dataclasses.dataclass(frozen=True)
class ReturnMinusNodeValue(TreeAdvantage):
    """``A_{i,t} = R_i - V̂(s_t) = R_i - V̂(p(n_t))``: the return against the value of the prefix
    before token t (a state-dependent baseline from the leaves below that prefix).

    At the first response token ``V̂(s_1)`` is the tree's mean return, so ``A_{i,1} = R_i -
    mean_tree R``, GRPO's unnormalized (Dr. GRPO) advantage; deeper, the baseline is the mean
    over the leaves that share the prefix. The baseline includes ``R_i`` itself (as the group
    mean does). REINFORCE with a state-value baseline (Williams 1992, Machine Learning 8:229;
    Sutton & Barto 2018, Sec. 13.4), the value estimated on the tree as in TreeRL
    (arXiv 2506.11902, Sec. 3.2).
    """

    def tree_advantages(self, batch, values, reward_S):  # numpydoc ignore=PR01,RT01
        """``R_i - V̂(p(n_t))`` (``[R, C]``)."""
        return to_tokens(reward_S, batch) - take(values.value_N, values.parent_RC)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            ``"R - V(s_t), node values from the tree's leaves"``.
        """
        return "R - V(s_t), node values from the tree's leaves"


@dataclasses.dataclass(frozen=True)
class TreeLeaves(Advantage):
    """A per-sequence group advantage (``inner``) over the leaves of each tree, on a tree batch.

    The leaves of one tree are one group (``batch_from_trees`` gives each tree its group id), so
    ``inner`` sees them as a group of G responses: ``TreeLeaves(GroupNormalized())`` is GRPO over
    the leaves, ``TreeLeaves(LeaveOneOut())`` RLOO. What differs from ``inner`` on an independent
    group is the data: the leaves share prefixes, so a shared token's advantages (one per leaf)
    are summed by the aggregation and the leaves' rewards are correlated. This part checks the
    tree (``ValueError`` on a batch without ``token_extras['tree_node']``) and delegates.

    Parameters
    ----------
    inner : Advantage, default ``GroupNormalized()``
        A per-sequence advantage part (not token-level); by default GRPO's.
    """

    inner: Advantage = GroupNormalized()
    needs_tree = True

    def __post_init__(self):
        if not isinstance(self.inner, Advantage) or self.inner.token_level:
            raise TypeError(f"inner: expected a per-sequence Advantage, got {self.inner!r}")

    @property
    def group_local(self) -> bool:  # numpydoc ignore=RT01
        """That of ``inner``."""
        return self.inner.group_local

    @property
    def couples_sequences(self) -> bool:  # numpydoc ignore=RT01
        """That of ``inner``."""
        return self.inner.couples_sequences

    def __call__(self, reward_S, group_S, step_S=None):
        return self.inner(reward_S, group_S, step_S)

    def from_batch(self, batch, reward_S, step_S=None):  # numpydoc ignore=PR01,RT01
        """``inner``'s advantages of the leaves, after checking that ``batch`` is a tree."""
        _tree_structure(batch, f"TreeLeaves({type(self.inner).__name__})")
        return self.inner.from_batch(batch, reward_S, step_S)

    def per_sequence(self, reward_S, group_S, length_S, step_S=None):  # numpydoc ignore=PR01,RT01
        """That of ``inner`` (a data-parallel caller's gathered rewards of the leaves)."""
        return self.inner.per_sequence(reward_S, group_S, length_S, step_S)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            ``inner``'s label, over a tree's leaves.
        """
        return f"{self.inner.describe()}, over a tree's leaves"
