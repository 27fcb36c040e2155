"""One optimizer update of the trainer: the training pass, the mini-batch loss and weights.

A step's prepared batch (advantages of whole groups, :func:`tokenmdp.estimators.prepare`) is
shuffled into ``minibatches`` parts (:func:`split_minibatches`); each part gets the loss weights
of its own counts, summed over data-parallel ranks (:func:`prepare_minibatch`), and one optimizer
update on :func:`minibatch_loss`: ``log pi_theta`` under the replayed routing, the estimator's
loss and, optionally, the MoE load-balancing term. :class:`TrainingPass` is the module DDP wraps.
:func:`tokenmdp.rl.trainer.train` runs the loop around these.
"""

from __future__ import annotations

import torch

from tokenmdp import estimators
from tokenmdp.batch import TokenBatch
from tokenmdp.distributed import all_reduce_floats, global_counts
from tokenmdp.estimators import Estimator
from tokenmdp.model import MoETransformer
from tokenmdp.packing import pack_first_fit_decreasing, select_sequences
from tokenmdp.rl.rollout import RoutingReplay, replay_routing

__all__ = ["TrainingPass", "minibatch_loss", "prepare_minibatch", "split_minibatches"]


class TrainingPass(torch.nn.Module):
    """``forward(batch, routing)`` = ``(log-probs, load-balancing loss)`` of
    ``model.token_outputs(batch, routing)``: the module DDP wraps, so that the training pass goes
    through DDP's ``forward`` (which prepares the gradient all-reduce).

    Parameters
    ----------
    model : MoETransformer
        The trained model (a submodule: its parameters are this module's).
    """

    def __init__(self, model: MoETransformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: TokenBatch, routing=None) -> tuple[torch.Tensor, torch.Tensor]:
        """One training forward pass of the model.

        Parameters
        ----------
        batch : TokenBatch
            The mini-batch.
        routing : RoutingTrace or LongTensor ``[R, C, L, K]``, optional
            Experts to replay (:func:`~tokenmdp.rl.rollout.replay_routing`).

        Returns
        -------
        (Tensor ``[R, C]``, Tensor ``[]``)
            The log-probs of the response tokens and the load-balancing loss.
        """
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
        The routing the pass replays (:func:`~tokenmdp.rl.rollout.replay_routing`).
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
