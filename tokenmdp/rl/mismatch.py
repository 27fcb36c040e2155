"""The training–inference mismatch on the trainer's side: routing replay and its measures.

Routing replay (docs: Concepts › The trainer world):

* ``NONE`` — every pass routes by itself;
* ``R2`` — the ``old_logprob`` pass records the training engine's routing (``OLD_ROUTING``)
  and every mini-batch update of the step replays it (no change on the first mini-batch);
* ``R3`` — the ``old_logprob`` pass and the updates replay the rollout engine's routing
  (``ENGINE_ROUTING``), which makes ``pi_old = mu`` when the engines differ only in routing.

:func:`compute_old_logprobs` runs the ``old_logprob`` pass (recording or replaying the routing),
:func:`replay_routing` gives the routing an update replays, and :func:`training_inference_kl`,
:func:`routing_mismatch_counts` and :func:`routing_mismatch_rate` measure how far the engine's
``mu`` and routing are from the trainer's.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.model import MoETransformer

__all__ = ["ENGINE_ROUTING", "OLD_ROUTING", "RoutingReplay", "compute_old_logprobs",
           "replay_routing", "routing_mismatch_counts", "routing_mismatch_rate",
           "training_inference_kl"]

ENGINE_ROUTING = "engine_routing"
"""``token_extras`` key of the rollout engine's routing ``[R, C, L, K]`` (``-1``: not routed)."""
OLD_ROUTING = "old_routing"
"""``token_extras`` key of the training engine's routing recorded in the ``old_logprob`` pass."""


# PR01 would ask for the parameters of Enum's functional API (names, module, qualname, ...).
class RoutingReplay(str, enum.Enum):  # numpydoc ignore=PR01
    """Which routing the training passes replay (see the module docstring).

    Parameters
    ----------
    value : str
        A member's value: ``RoutingReplay("r3")`` is ``RoutingReplay.R3``.
    """

    NONE = "none"
    """Every pass routes by itself."""
    R2 = "r2"
    """The updates replay the ``old_logprob`` pass's routing (``OLD_ROUTING``)."""
    R3 = "r3"
    """The ``old_logprob`` pass and the updates replay the rollout engine's (``ENGINE_ROUTING``)."""


def replay_routing(batch: TokenBatch, replay: RoutingReplay | str) -> torch.Tensor | None:
    """The routing an update pass replays: ``None`` (NONE), the ``old_logprob`` pass's record
    (R2, needs :func:`compute_old_logprobs` first) or the rollout engine's trace (R3).

    Parameters
    ----------
    batch : TokenBatch
        The step's batch, with the record in ``token_extras`` (``OLD_ROUTING`` or
        ``ENGINE_ROUTING``).
    replay : RoutingReplay or str
        ``none``, ``r2`` or ``r3``.

    Returns
    -------
    LongTensor ``[R, C, L, K]`` or None
        The expert ids to replay (``-1``: routed by the pass itself), None for NONE.
    """
    replay = RoutingReplay(replay)
    if replay is RoutingReplay.NONE:
        return None
    key = OLD_ROUTING if replay is RoutingReplay.R2 else ENGINE_ROUTING
    if key not in batch.token_extras:
        raise ValueError(f"batch: token_extras has no {key!r} record, needed by {replay.name}")
    return batch.token_extras[key]


def compute_old_logprobs(model: MoETransformer, batch: TokenBatch,
                         replay: RoutingReplay | str, *, entropy: bool = False):
    """The ``old_logprob`` pass: ``log pi_old`` of every token (replaying the engine's routing
    under R3) and the routing used, stored as ``token_extras[OLD_ROUTING]`` (R2 replays it).

    With ``entropy=True`` it returns ``(batch, entropy_RC)``: the same batch and, from the same
    forward pass, the entropy of ``pi_old`` at every response token (``[R, C]`` in the batch's
    dtype, 0 elsewhere; see :meth:`MoETransformer.token_outputs`).

    Parameters
    ----------
    model : MoETransformer
        The trainer's model at the rollout weights (run without gradient).
    batch : TokenBatch
        The rollout (with ``token_extras[ENGINE_ROUTING]`` under R3).
    replay : RoutingReplay or str
        ``none``, ``r2`` or ``r3`` (only R3 replays in this pass).
    entropy : bool, default False
        Also return the entropy of ``pi_old``.

    Returns
    -------
    TokenBatch or (TokenBatch, Tensor ``[R, C]``)
        The batch with ``old_logprob`` (in its dtype) and ``token_extras[OLD_ROUTING]``, and
        with ``entropy`` the per-token entropy.
    """
    replay = RoutingReplay(replay)
    if not isinstance(entropy, bool):
        raise TypeError(f"entropy: expected a bool, got {type(entropy).__name__}")
    routing = replay_routing(batch, replay) if replay is RoutingReplay.R3 else None
    with torch.no_grad():
        res = model.token_outputs(batch, routing=routing, entropy=entropy, aux=False)
    extras = {**batch.token_extras, OLD_ROUTING: res.routing.experts}
    out = dataclasses.replace(batch, old_logprob=res.logprob_RC.to(batch.dtype),
                              token_extras=extras)
    return (out, res.entropy_RC.to(batch.dtype)) if entropy else out


def training_inference_kl(batch: TokenBatch, *, kind: str = "k3") -> float:
    """Per-loss-token estimate of ``KL(mu || pi_old)`` from tokens sampled by ``mu``.

    With ``log r = log pi_old - log mu``: ``k1 = -log r`` (unbiased, can be negative on a finite
    sample) or ``k3 = (r - 1) - log r`` (unbiased and non-negative term by term; Schulman 2020).

    Parameters
    ----------
    batch : TokenBatch
        Tokens sampled by ``mu``, with ``behavior_logprob`` and ``old_logprob``.
    kind : {"k3", "k1"}
        The estimator of each term.

    Returns
    -------
    float
        The mean of the terms over the loss tokens (in float64; 0 without loss tokens).
    """
    if batch.behavior_logprob is None or batch.old_logprob is None:
        raise ValueError("batch: needs behavior_logprob and old_logprob")
    if kind not in ("k1", "k3"):
        raise ValueError(f"kind: expected 'k1' or 'k3', got {kind!r}")
    log_r = (batch.old_logprob - batch.behavior_logprob).double()[batch.loss_mask]
    terms = -log_r if kind == "k1" else torch.expm1(log_r) - log_r
    return float(terms.mean()) if terms.numel() else 0.0


def routing_mismatch_counts(experts_a: torch.Tensor, experts_b: torch.Tensor) -> tuple[int, int]:
    """``(differing, compared)``: the (token, layer) pairs recorded in both (``>= 0``), and those
    of them whose *sets* of experts differ. Both ``[R, C, L, K]`` on the same layout. Counts, so
    that they can be summed over batches or ranks before dividing.

    Parameters
    ----------
    experts_a, experts_b : LongTensor ``[R, C, L, K]``
        Two routing records of the same tokens (``-1``: not recorded).

    Returns
    -------
    (int, int)
        The number of differing pairs and the number of pairs recorded in both.
    """
    if experts_a.shape != experts_b.shape:
        raise ValueError(f"experts_b: shape {tuple(experts_b.shape)} differs from experts_a's "
                         f"{tuple(experts_a.shape)}")
    both_RCL = (experts_a >= 0).all(-1) & (experts_b >= 0).all(-1)
    differ_RCL = (experts_a.sort(-1).values != experts_b.sort(-1).values).any(-1)
    return int((differ_RCL & both_RCL).sum()), int(both_RCL.sum())


def routing_mismatch_rate(experts_a: torch.Tensor, experts_b: torch.Tensor) -> float:
    """Fraction of (token, layer) pairs, among those recorded in both (``>= 0``), whose *sets* of
    experts differ (:func:`routing_mismatch_counts`); 0 when none is recorded in both.

    Parameters
    ----------
    experts_a, experts_b : LongTensor ``[R, C, L, K]``
        Two routing records of the same tokens (``-1``: not recorded).

    Returns
    -------
    float
        ``differing / compared``, in ``[0, 1]``.
    """
    differing, compared = routing_mismatch_counts(experts_a, experts_b)
    return differing / compared if compared else 0.0
