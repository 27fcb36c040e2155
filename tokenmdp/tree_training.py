"""Training on packed trees: the model's pass over a :class:`~tokenmdp.tree_packing.PackedTree`,
returned in the expanded batch's layout, and micro-batches of whole trees.

The trainer's loss step on a tree batch, with any registry estimator::

    from tokenmdp import estimators
    from tokenmdp.tree_training import packed_tree_outputs, tree_micro_batches

    step = estimators.prepare(batch, est, max_len=L)        # expanded batch, whole step
    for mb in tree_micro_batches(step, max_nodes=4096):     # whole trees per micro-batch
        out = packed_tree_outputs(model, mb.batch, mb.packed, routing=replayed)
        value, metrics = estimators.loss(out.logprob_RC, mb.batch, est)
        value.backward()                                    # gradients accumulate (sum)

``out`` is laid out like :meth:`~tokenmdp.model.MoETransformer.token_outputs` on the expanded
batch (log-probs on response tokens, routing ``-1`` on padding), but the forward pass ran over
each node once; the loss is computed on the expanded batch, so its value and gradient are those
of the expanded paths (:mod:`tokenmdp.tree_packing`). ``routing`` is an expanded
``[R, C, L, K]`` record (e.g. ``token_extras[ENGINE_ROUTING]`` under R3): it is packed per node
(checked equal on every copy) and replayed there.

The model is duck-typed: any object with ``tree_token_outputs`` (the
:class:`~tokenmdp.model.MoETransformer`); this module imports no model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.packing import select_sequences
from tokenmdp.placement import _check_int
from tokenmdp.tree_packing import PackedTree, pack_tree

__all__ = ["TreeMicroBatch", "packed_tree_logprobs", "packed_tree_outputs", "tree_micro_batches"]


def _checked_packed(batch: TokenBatch, packed: PackedTree | None) -> PackedTree:
    if not isinstance(batch, TokenBatch):
        raise TypeError(f"batch: expected a TokenBatch, got {type(batch).__name__}")
    if packed is None:
        return pack_tree(batch)
    if not isinstance(packed, PackedTree):
        raise TypeError(f"packed: expected a PackedTree, got {type(packed).__name__}")
    if tuple(packed.gather_index_RC.shape) != tuple(batch.tokens.shape) or \
            packed.tree_S.shape[0] != batch.num_sequences:
        raise ValueError(f"packed: packed from another batch (its expanded grid is "
                         f"{tuple(packed.gather_index_RC.shape)} with "
                         f"{packed.tree_S.shape[0]} sequences, the batch's "
                         f"{tuple(batch.tokens.shape)} with {batch.num_sequences})")
    return packed


def packed_tree_outputs(model, batch: TokenBatch, packed: PackedTree | None = None, *,
                        routing=None, entropy: bool = False, aux: bool = True):
    """``model.token_outputs(batch, routing, entropy=..., aux=...)``, computed over the packed
    tree: each node once, gathered back to ``batch``'s layout.

    Parameters
    ----------
    model : MoETransformer or any object with ``tree_token_outputs``
        The policy.
    batch : TokenBatch
        The expanded tree batch (a prepared step or a micro-batch of whole trees).
    packed : PackedTree, optional
        ``pack_tree(batch)`` when already built (default: built here).
    routing : RoutingTrace or LongTensor ``[R, C, L, K]``, optional
        Experts to replay, on the *expanded* grid; every copy of a node must hold the same
        record (``ValueError`` naming ``routing`` otherwise).
    entropy : bool, default False
        Also the per-token entropy.
    aux : bool, default True
        Compute the load-balancing loss (over the packed nodes, each once).

    Returns
    -------
    TokenOutputs
        ``logprob_RC`` (response tokens, 0 elsewhere), ``routing`` (``-1`` on padding) and
        ``entropy_RC`` on ``batch``'s grid; the packed pass's load-balancing loss.
    """
    packed = _checked_packed(batch, packed)
    packed_routing = None
    if routing is not None:
        experts = getattr(routing, "experts", routing)
        if not isinstance(experts, torch.Tensor) or experts.dim() != 4:
            raise ValueError(f"routing: expected experts [R, C, L, K] on the expanded grid, got "
                             f"{getattr(experts, 'shape', type(experts).__name__)}")
        packed_routing = packed.scatter(experts, "routing")
    out = model.tree_token_outputs(packed.tokens_RC, packed.position_RC, packed.tree_end_RC,
                                   packed.parent_RC, packed.valid_RC, routing=packed_routing,
                                   entropy=entropy, aux=aux)
    response = batch.response_mask
    logprob_RC = torch.where(response, packed.gather(out.logprob_RC), 0.0)
    entropy_RC = None
    if out.entropy_RC is not None:
        entropy_RC = torch.where(response, packed.gather(out.entropy_RC), 0.0)
    trace = type(out.routing)(packed.gather(out.routing.experts, fill=-1))
    return dataclasses.replace(out, logprob_RC=logprob_RC, routing=trace, entropy_RC=entropy_RC)


def packed_tree_logprobs(model, batch: TokenBatch, packed: PackedTree | None = None,
                         routing=None, record_routing: bool = False):
    """``model.token_logprobs(batch, routing, record_routing)`` over the packed tree.

    Parameters
    ----------
    model, batch, packed, routing
        As in :func:`packed_tree_outputs`.
    record_routing : bool, default False
        Also return the routing used (expanded layout).

    Returns
    -------
    Tensor ``[R, C]`` or (Tensor ``[R, C]``, RoutingTrace)
        The response tokens' log-probs on ``batch``'s grid (and the routing).
    """
    out = packed_tree_outputs(model, batch, packed, routing=routing, aux=False)
    return (out.logprob_RC, out.routing) if record_routing else out.logprob_RC


class TreeMicroBatch(NamedTuple):
    """One micro-batch of whole trees (:func:`tree_micro_batches`).

    Parameters
    ----------
    batch : TokenBatch
        The expanded sequences of its trees (fields as prepared for the step), renumbered.
    packed : PackedTree
        ``pack_tree(batch, capacity)``.
    sequence_index : LongTensor ``[S']``
        The step's id of each of its sequences.
    """

    batch: TokenBatch
    packed: PackedTree
    sequence_index: torch.Tensor


def _cuts(sizes: np.ndarray, num_micro_batches: int | None, max_nodes: int | None) -> list[int]:
    """Tree indices where micro-batches start (and the end), trees kept in order."""
    T = sizes.size
    if num_micro_batches is not None:
        k = _check_int("num_micro_batches", num_micro_batches, 1)
        if k > T:
            raise ValueError(f"num_micro_batches={k} exceeds the number of trees ({T}); a tree "
                             "is never split across micro-batches")
        starts = np.cumsum(sizes) - sizes
        cuts = [0]
        for j in range(1, k):   # the first tree starting at or after j/k of the nodes
            target = int(np.searchsorted(starts, starts[-1] * j / k if T else 0, "left"))
            cuts.append(min(max(target, cuts[-1] + 1), T - (k - j)))
        return [*cuts, T]
    limit = _check_int("max_nodes", max_nodes, 1)
    if T and int(sizes.max()) > limit:
        raise ValueError(f"max_nodes={limit} is smaller than tree {int(np.argmax(sizes))} "
                         f"({int(sizes.max())} nodes); a tree is never split")
    cuts, used = [0], 0
    for t, n in enumerate(sizes.tolist()):
        if used + n > limit:
            cuts.append(t)
            used = 0
        used += n
    return [*cuts, T]


def tree_micro_batches(batch: TokenBatch, num_micro_batches: int | None = None, *,
                       max_nodes: int | None = None, capacity: int | None = None,
                       extras: Sequence[str] = (), atol: float = 0.0) -> list[TreeMicroBatch]:
    """Split a step's expanded tree batch into micro-batches of whole trees, each packed.

    Trees are taken in their packing order (``PackedTree.tree_S``). Prepare the step first
    (:func:`tokenmdp.estimators.prepare`: advantages of whole groups, the step's loss weights):
    the micro-batches' losses then sum to the step's loss, value and gradient.

    Parameters
    ----------
    batch : TokenBatch
        The step's expanded tree batch.
    num_micro_batches : int, optional
        Cut the trees, in order, into this many runs of about equal node counts (each at least
        one tree; at most the number of trees).
    max_nodes : int, optional (keyword)
        Instead: runs of at most this many packed nodes (at least the largest tree). Give
        exactly one of the two.
    capacity : int, optional
        Packed row capacity of each micro-batch (default: its largest tree).
    extras, atol
        The node records to pack and the tolerance between the copies of a node
        (:func:`~tokenmdp.tree_packing.pack_tree`).

    Returns
    -------
    list of TreeMicroBatch
        Together they hold every sequence of ``batch`` once.
    """
    if (num_micro_batches is None) == (max_nodes is None):
        raise ValueError("num_micro_batches, max_nodes: give exactly one of them")
    whole = pack_tree(batch, extras=extras, atol=atol)
    cuts = _cuts(whole.tree_sizes_T.cpu().numpy(), num_micro_batches, max_nodes)
    out = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        index = torch.nonzero((whole.tree_S >= a) & (whole.tree_S < b))[:, 0]
        part = select_sequences(batch, index)
        out.append(TreeMicroBatch(part, pack_tree(part, capacity, extras=extras, atol=atol), index))
    return out
