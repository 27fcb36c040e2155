"""One optimizer update of the trainer: the training pass, the mini-batch loss and weights.

A step's prepared batch (advantages of whole groups, :func:`tokenmdp.estimators.prepare`) is
shuffled into ``minibatches`` parts (:func:`split_minibatches`); each part gets the loss weights
of its own counts, summed over data-parallel ranks (:func:`prepare_minibatch`), and one optimizer
update on :func:`minibatch_loss`: ``log pi_theta`` under the replayed routing, the estimator's
loss and, optionally, the MoE load-balancing term. :class:`TrainingPass` is the module DDP wraps.
:func:`without_zero_variance_groups` drops a step's groups of equal rewards first when the trainer
skips them. :func:`tokenmdp.rl.trainer.train` runs the loop around these.
"""

from __future__ import annotations

import math

import torch

from tokenmdp import estimators
from tokenmdp.batch import TokenBatch
from tokenmdp.distributed import all_reduce_floats, global_counts
from tokenmdp.estimators import Estimator
from tokenmdp.model import MoETransformer
from tokenmdp.packing import pack_first_fit_decreasing, select_sequences
from tokenmdp.rl.mismatch import RoutingReplay, replay_routing
from tokenmdp.tree_training import packed_tree_outputs
from tokenmdp.trees import TREE_NODE

__all__ = ["LOW_PROBABILITY", "TrainingPass", "blame_stats", "blame_sums", "minibatch_loss",
           "prepare_minibatch", "split_minibatches", "without_zero_variance_groups"]


class TrainingPass(torch.nn.Module):
    """``forward(batch, routing)`` = ``(log-probs, load-balancing loss)`` of
    ``model.token_outputs(batch, routing)``: the module DDP wraps, so that the training pass goes
    through DDP's ``forward`` (which prepares the gradient all-reduce).

    A tree batch (``token_extras["tree_node"]``, :mod:`tokenmdp.trees`) runs packed by default:
    each node once (:func:`tokenmdp.tree_training.packed_tree_outputs`), the log-probs gathered
    back to the batch's layout, so the loss and gradient are the expanded paths' (the
    load-balancing loss counts each node once).

    Parameters
    ----------
    model : MoETransformer
        The trained model (a submodule: its parameters are this module's).
    tree_forward : {"packed", "expanded"}, default "packed"
        How a tree batch runs (a batch without node ids always runs as it is laid out).
    """

    def __init__(self, model: MoETransformer, tree_forward: str = "packed") -> None:
        super().__init__()
        if tree_forward not in ("packed", "expanded"):
            raise ValueError(f"tree_forward: expected packed or expanded, got {tree_forward!r}")
        self.model = model
        self.tree_forward = tree_forward

    def forward(self, batch: TokenBatch, routing=None) -> tuple[torch.Tensor, torch.Tensor]:
        """One training forward pass of the model.

        Parameters
        ----------
        batch : TokenBatch
            The mini-batch.
        routing : RoutingTrace or LongTensor ``[R, C, L, K]``, optional
            Experts to replay (:func:`~tokenmdp.rl.mismatch.replay_routing`).

        Returns
        -------
        (Tensor ``[R, C]``, Tensor ``[]``)
            The log-probs of the response tokens and the load-balancing loss.
        """
        if self.tree_forward == "packed" and TREE_NODE in batch.token_extras \
                and batch.num_sequences > 0:
            out = packed_tree_outputs(self.model, batch, routing=routing)
        else:
            out = self.model.token_outputs(batch, routing=routing)
        return out.logprob_RC, out.load_balancing_loss


def minibatch_loss(model: MoETransformer | torch.nn.Module, batch: TokenBatch, estimator: Estimator,
                   replay: RoutingReplay | str = RoutingReplay.NONE, *,
                   load_balancing_coef: float = 0.0, world_size: int = 1
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one update: ``log π_θ`` under the replayed routing, then
    :func:`~tokenmdp.estimators.loss` with the batch's own ``advantage`` and ``loss_weight``,
    plus ``load_balancing_coef`` times the MoE load-balancing loss (Switch Transformer's
    auxiliary loss, Fedus et al. 2021, summed over the routed layers). With ``world_size``
    data-parallel ranks each rank adds ``1 / world_size`` of its own tokens' loss, so the term
    is the mean over the ranks (not the loss of the whole batch). The metrics gain
    ``load_balancing`` (without the coefficient) when the model reports it.

    ``model`` is the MoE transformer, or a module called as ``model(batch, routing=...)`` that
    returns the log-probs ``[R, C]`` or ``(log-probs, load-balancing loss)`` (the DDP-wrapped
    :class:`TrainingPass` of the trainer).

    Parameters
    ----------
    model : MoETransformer or nn.Module
        The model, or the module wrapping it.
    batch : TokenBatch
        The mini-batch, prepared (``advantage`` and ``loss_weight`` set).
    estimator : Estimator
        The estimator whose loss is computed.
    replay : RoutingReplay or str, default RoutingReplay.NONE
        The routing the pass replays (:func:`~tokenmdp.rl.mismatch.replay_routing`).
    load_balancing_coef : float, default 0.0
        Coefficient of the load-balancing term (0: left out; a ``ValueError`` when positive and
        the model reports no load-balancing loss).
    world_size : int, default 1
        Data-parallel ranks (the term is divided by it).

    Returns
    -------
    loss : Tensor ``[]``
        The loss to differentiate, in the batch's dtype.
    metrics : dict of str to Tensor
        The estimator's metrics, with ``load_balancing`` when the model reports it.
    """
    if isinstance(model, MoETransformer):
        model = TrainingPass(model)
    out = model(batch, routing=replay_routing(batch, replay))
    logprobs_RC, balance = out if isinstance(out, tuple) else (out, None)
    loss, metrics = estimators.loss(logprobs_RC.to(batch.dtype), batch, estimator)
    if balance is not None:
        metrics["load_balancing"] = balance.detach()
    if load_balancing_coef:
        if balance is None:
            raise ValueError("load_balancing_coef: the model returned no load-balancing loss")
        loss = loss + (load_balancing_coef / world_size) * balance.to(loss.dtype)
    return loss, metrics


def prepare_minibatch(batch: TokenBatch, estimator: Estimator, *, max_len: int) -> TokenBatch:
    """Loss weights of a mini-batch that is its own optimizer step: the aggregation with the
    mini-batch's counts (summed over ranks); ``advantage`` is kept as the step computed it.

    A collective under data parallelism (:func:`~tokenmdp.distributed.global_counts`): every rank
    must call it.

    Parameters
    ----------
    batch : TokenBatch
        The mini-batch (one part of :func:`split_minibatches`).
    estimator : Estimator
        Its aggregation and counted tokens give the weights.
    max_len : int
        ``L_max`` of the length-normalized aggregations (the engine's ``max_new_tokens``).

    Returns
    -------
    TokenBatch
        ``batch`` with the new ``loss_weight``.
    """
    mask = estimators.counted_mask(batch, estimator)
    counts = global_counts(batch, mask=mask, sequences=estimator.sequence_count.value)
    num_groups = None
    if estimator.aggregation is estimators.Aggregation.PROMPT_MEAN_TOKEN_MEAN:
        # each rank samples its own prompts, so the ranks' groups are disjoint and P sums
        local = estimators.count_groups(batch, mask, sequences=estimator.sequence_count)
        num_groups = int(all_reduce_floats([float(local)], device=batch.device)[0])
    weights = estimators.loss_weights(batch, estimator.aggregation, num_tokens=counts.num_loss_tokens,
                                      num_sequences=counts.num_sequences, max_len=max_len,
                                      mask=mask, sequences=estimator.sequence_count,
                                      num_groups=num_groups)
    return batch.replace(loss_weight=weights)


def split_minibatches(batch: TokenBatch, n: int, *, generator: torch.Generator,
                      capacity: int) -> list[TokenBatch]:
    """Shuffle the sequences (``generator``, CPU) into ``n`` parts of sizes differing by at most
    one, each packed again (first-fit decreasing, rows of ``capacity``).

    Parameters
    ----------
    batch : TokenBatch
        The step's prepared batch.
    n : int
        Number of parts (at most the number of sequences, or some parts are empty).
    generator : torch.Generator
        A CPU generator: the shuffle's only randomness.
    capacity : int
        Row capacity of each part's packing (at least the longest sequence).

    Returns
    -------
    list of TokenBatch
        The ``n`` parts; each sequence is in exactly one, in its original order within it.
    """
    order = torch.randperm(batch.num_sequences, generator=generator)
    return [pack_first_fit_decreasing(select_sequences(batch, part.sort().values.to(batch.device)),
                                      capacity) for part in order.tensor_split(n)]


def without_zero_variance_groups(batch: TokenBatch, capacity: int) -> TokenBatch:
    """``batch`` without the groups whose rewards are all equal (all wrong or all right: zero
    advantage under a group baseline), packed again; ``batch`` itself when there is none. The
    trainer's ``zero_variance_groups="skip"``, before ``prepare`` (so the advantages, counts and
    normalizers are those of the groups left, as after verl's ``filter_groups``).

    Parameters
    ----------
    batch : TokenBatch
        The step's batch (``reward`` and ``group`` per sequence).
    capacity : int
        Row capacity of the packing (at least the longest sequence).

    Returns
    -------
    TokenBatch
        The sequences of the groups whose rewards differ, in their order; possibly none.
    """
    reward_S = batch.reward.double()
    _, group_of_S = torch.unique(batch.group, return_inverse=True)
    n = int(group_of_S.max()) + 1 if batch.num_sequences else 0
    high = torch.full((n,), -math.inf, dtype=torch.float64, device=batch.device)
    low = torch.full((n,), math.inf, dtype=torch.float64, device=batch.device)
    high.scatter_reduce_(0, group_of_S, reward_S, reduce="amax")
    low.scatter_reduce_(0, group_of_S, reward_S, reduce="amin")
    index_S = torch.nonzero((high > low)[group_of_S]).flatten()
    if index_S.numel() == batch.num_sequences:
        return batch
    return pack_first_fit_decreasing(select_sequences(batch, index_S), capacity)


LOW_PROBABILITY = 0.5
"""A sampled token is *low* when ``π_old`` gives it less than this (so it is not ``π_old``'s argmax,
and every non-argmax token of a distribution whose top token has at least this much is low)."""


def blame_sums(batch: TokenBatch, estimator: Estimator) -> dict[str, float]:
    """Where the step's update at ``θ = θ_old`` pushes, split between low and high tokens.

    A diagnostic of the training-inference correction that leaves training unchanged. With
    ``φ_t = -∂ loss / ∂ log π_t`` at ``log π = old_logprob`` (the estimator's own coefficient:
    advantage, correction weight, aggregation; the first update of an on-policy step exactly),
    the push on token ``t``'s logits is ``|φ_t| · ‖e_{a_t} − π_old‖``, between ``|φ_t| (1 − p_t)``
    and ``√2 |φ_t| (1 − p_t)`` (``p_t = π_old(a_t)``); its lower end is summed. A token is *low*
    when ``p_t <`` :data:`LOW_PROBABILITY`. Sums over this rank, to be reduced over the ranks and
    read by :func:`blame_stats`.

    Parameters
    ----------
    batch : TokenBatch
        The step's prepared batch (``advantage``, ``loss_weight``, ``old_logprob`` and
        ``behavior_logprob`` set).
    estimator : Estimator
        The estimator whose loss gives ``φ``.

    Returns
    -------
    dict of str to float
        ``blame_*`` sums (float64): token counts, sums of ``π_old/μ`` and of its log at low and
        high tokens, the pushes of negative- and positive-advantage tokens, low and high, the
        sequence log-weights' sum and square sum, and the failed (reward <= 0: a 0/1 task's wrong
        answers) and passed responses, each with the number holding at least one low token.
    """
    if batch.old_logprob is None or batch.behavior_logprob is None:
        raise ValueError("batch: blame_sums needs old_logprob and behavior_logprob")
    with torch.enable_grad():
        lp = batch.old_logprob.detach().clone().requires_grad_(True)
        loss, _ = estimators.loss(lp, batch, estimator, metrics=False)
        (grad,) = torch.autograd.grad(loss, lp, allow_unused=True)
    mask = batch.loss_mask
    phi = torch.zeros_like(lp) if grad is None else -grad.detach()
    old = batch.old_logprob.double()
    log_w = old - batch.behavior_logprob.double()
    p = old.exp()
    push = torch.where(mask, phi.double().abs() * (1.0 - p), 0.0)
    low, high = mask & (p < LOW_PROBABILITY), mask & (p >= LOW_PROBABILITY)
    neg, pos = batch.advantage < 0, batch.advantage > 0
    w = log_w.clamp(max=20.0).exp()
    seq_log_w = batch.sequence_sum(torch.where(mask, log_w, 0.0))
    seq_low = batch.sequence_sum(low.double()) > 0
    reward = batch.reward.double()
    failed = reward <= 0
    out = {"n_low": low.sum(), "n_high": high.sum(), "w_low": w[low].sum(), "w_high": w[high].sum(),
           "logw_low": log_w[low].sum(), "logw_high": log_w[high].sum(),
           "neg_low": push[neg & low].sum(), "neg_high": push[neg & high].sum(),
           "pos_low": push[pos & low].sum(), "pos_high": push[pos & high].sum(),
           "seqs": torch.tensor(float(batch.num_sequences)), "seq_logw": seq_log_w.sum(),
           "seq_logw_sq": (seq_log_w ** 2).sum(), "failed": failed.sum(),
           "failed_low": (failed & seq_low).sum(), "passed": (~failed).sum(),
           "passed_low": (~failed & seq_low).sum()}
    return {f"blame_{k}": float(v) for k, v in out.items()}


def blame_stats(sums: dict[str, float]) -> dict[str, float]:
    """The step statistics of :func:`blame_sums`' sums (over every rank).

    Parameters
    ----------
    sums : dict of str to float
        The reduced ``blame_*`` sums.

    Returns
    -------
    dict of str to float
        ``low_token_fraction``; ``w_low_mean`` / ``w_high_mean`` (mean ``π_old/μ`` at low and
        high tokens) and ``w_low_geomean`` / ``w_high_geomean``; ``neg_push_low_share`` and
        ``pos_push_low_share`` (the share of the negative- and positive-advantage push on low
        tokens); ``seq_logw_mean`` / ``seq_logw_std`` (``log Π_t π_old/μ`` per response);
        ``failed_low_fraction`` / ``passed_low_fraction`` (responses holding a low token). A
        statistic over nothing is None (JSON null: nothing to measure that step).
    """
    def ratio(a, b):
        return a / b if b > 0 else None

    s = {k.removeprefix("blame_"): v for k, v in sums.items() if k.startswith("blame_")}
    n = s["n_low"] + s["n_high"]
    mean = ratio(s["seq_logw"], s["seqs"])
    std = None if mean is None else math.sqrt(max(s["seq_logw_sq"] / s["seqs"] - mean ** 2, 0.0))
    return {"low_token_fraction": ratio(s["n_low"], n),
            "w_low_mean": ratio(s["w_low"], s["n_low"]),
            "w_high_mean": ratio(s["w_high"], s["n_high"]),
            "w_low_geomean": math.exp(s["logw_low"] / s["n_low"]) if s["n_low"] else None,
            "w_high_geomean": math.exp(s["logw_high"] / s["n_high"]) if s["n_high"] else None,
            "neg_push_low_share": ratio(s["neg_low"], s["neg_low"] + s["neg_high"]),
            "pos_push_low_share": ratio(s["pos_low"], s["pos_low"] + s["pos_high"]),
            "seq_logw_mean": mean, "seq_logw_std": std,
            "failed_low_fraction": ratio(s["failed_low"], s["failed"]),
            "passed_low_fraction": ratio(s["passed_low"], s["passed"])}
