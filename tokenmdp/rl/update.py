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
from tokenmdp.distributed import global_counts
from tokenmdp.estimators import Estimator
from tokenmdp.model import MoETransformer
from tokenmdp.packing import pack_first_fit_decreasing, select_sequences
from tokenmdp.rl.rollout import RoutingReplay, replay_routing

__all__ = ["TrainingPass", "minibatch_loss", "prepare_minibatch", "split_minibatches"]


class TrainingPass(torch.nn.Module):
    """``forward(batch, routing)`` = ``(log-probs, load-balancing loss)`` of
    ``model.token_outputs(batch, routing)``: the module DDP wraps, so that the training pass goes
    through DDP's ``forward`` (which prepares the gradient all-reduce)."""

    def __init__(self, model: MoETransformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: TokenBatch, routing=None) -> tuple[torch.Tensor, torch.Tensor]:
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
    :class:`TrainingPass` of the trainer)."""
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
    mini-batch's counts (summed over ranks); ``advantage`` is kept as the step computed it."""
    mask = estimators.counted_mask(batch, estimator)
    counts = global_counts(batch, mask=mask)
    weights = estimators.loss_weights(batch, estimator.aggregation, num_tokens=counts.num_loss_tokens,
                                      num_sequences=counts.num_sequences, max_len=max_len,
                                      mask=mask)
    return batch.replace(loss_weight=weights)


def split_minibatches(batch: TokenBatch, n: int, *, generator: torch.Generator,
                      capacity: int) -> list[TokenBatch]:
    """Shuffle the sequences (``generator``, CPU) into ``n`` parts of sizes differing by at most
    one, each packed again (first-fit decreasing, rows of ``capacity``)."""
    order = torch.randperm(batch.num_sequences, generator=generator)
    return [pack_first_fit_decreasing(select_sequences(batch, part.sort().values.to(batch.device)),
                                      capacity) for part in order.tensor_split(n)]
