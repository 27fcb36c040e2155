"""TRL's ``GRPOTrainer`` training with any registry estimator: :class:`TokenMDPGRPOTrainer`.

Install the extra (``pip install "tokenmdp[trl]"``); tested with trl 1.16.x only, and any other
version is refused at import. The subclass replaces one method of TRL's trainer, the micro-batch
loss (``_compute_loss``): TRL still generates, scores, computes its advantages and log-probs of
``π_old`` and ``π_ref``, splits and accumulates; tokenmdp computes the loss from them.

TRL's micro-batch (a dict of padded tensors) becomes a padded :class:`~tokenmdp.TokenBatch` over
the completion columns, one row per completion, so column ``c`` of every ``[B, T]`` tensor is
column ``c`` of the batch:

* ``completion_ids`` → ``tokens``; the columns up to the last one ``completion_mask`` keeps are
  the sequence (at least one), the rest padding; the prompt is left out (no estimator reads it);
* ``completion_mask`` × ``tool_mask`` → ``loss_mask``;
* the trainer's log-probs of the completion (TRL's own forward pass, with its temperature) →
  ``logprobs_RC`` of :func:`~tokenmdp.estimators.loss`;
* ``old_per_token_logps`` (absent: the detached current ones, as TRL does) → ``old_logprob``;
* ``sampling_per_token_logps`` (vLLM's; absent: ``old_logprob``, the sampler is the trainer's
  own model) → ``behavior_logprob``; ``ref_per_token_logps`` (``beta != 0``) → ``ref_logprob``;
* ``advantages`` ``[B]`` → ``prepare(advantage_S=...)``: TRL's advantages (its
  ``scale_rewards``) replace the estimator's advantage part, whose rewards TRL does not pass on;
* the step's counts: ``S`` = completions per micro-batch × gradient-accumulation steps, the token
  normalizer TRL's own (``num_items_in_batch`` rescaled as TRL rescales it), ``L_max`` =
  ``max_completion_length``.

Refused, in one line at construction: token-level advantage parts, a KL penalty in the reward
(both need the rewards), the prompt-mean aggregation (TRL shuffles groups apart).
"""

from __future__ import annotations

import math

import torch

try:
    import trl
    from trl import GRPOTrainer
except ImportError as err:  # pragma: no cover - exercised without the extra
    raise ImportError('tokenmdp.integrations.trl_trainer needs TRL: pip install "tokenmdp[trl]"'
                      ) from err

from tokenmdp.estimators import Aggregation, Estimator, loss, prepare
from tokenmdp.estimators import get as get_estimator
from tokenmdp.integrations.common import batch_from_padded

TESTED_TRL = "1.16"
"""The TRL release line this hook was written and tested against (``_compute_loss``'s inputs)."""

if ".".join(trl.__version__.split(".")[:2]) != TESTED_TRL:
    raise ImportError(f"tokenmdp.integrations.trl_trainer was tested with trl {TESTED_TRL}.x; "
                      f"trl {trl.__version__} is installed (pip install \"tokenmdp[trl]\")")

__all__ = ["TESTED_TRL", "TokenMDPGRPOTrainer", "batch_from_trl"]

#: Multimodal inputs TRL passes through to its forward pass, when the batch has them.
_MODEL_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
               "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids",
               "image_position_ids")


def _resolve(estimator) -> Estimator:
    est = get_estimator(estimator) if isinstance(estimator, str) else estimator
    if not isinstance(est, Estimator):
        raise TypeError(f"estimator: expected a registry name or an Estimator, got {estimator!r}")
    if est.advantage.token_level:
        raise ValueError(f"estimator {est.name!r}: its advantage part is token-level; TRL "
                         "passes per-sequence advantages, not the rewards it needs")
    if est.kl is not None and est.kl.in_reward:
        raise ValueError(f"estimator {est.name!r}: a KL penalty in the reward needs the rewards, "
                         "which TRL does not pass to the loss; put the KL in the loss")
    if est.aggregation is Aggregation.PROMPT_MEAN_TOKEN_MEAN:
        raise ValueError(f"estimator {est.name!r}: the prompt-mean aggregation needs whole "
                         "groups, and TRL shuffles a group's completions across micro-batches")
    return est


def batch_from_trl(inputs: dict, logprobs_BT: torch.Tensor):
    """The :class:`~tokenmdp.TokenBatch` of a TRL micro-batch (module docstring), unprepared.

    Parameters
    ----------
    inputs : dict
        The dict ``GRPOTrainer._compute_loss`` receives.
    logprobs_BT : Tensor ``[B, T]``
        The trainer's log-probs of the completion tokens (used for ``old_logprob`` when TRL
        skipped computing them).

    Returns
    -------
    TokenBatch
        Row ``b`` = completion ``b``, columns those of ``completion_ids``, dtype of
        ``logprobs_BT``.
    """
    old = inputs.get("old_per_token_logps")
    old = logprobs_BT.detach() if old is None else old
    return batch_from_padded(inputs["completion_mask"], old, dtype=logprobs_BT.dtype,
                             tokens_BT=inputs["completion_ids"], loss_BT=inputs.get("tool_mask"),
                             behavior_logprob_BT=inputs.get("sampling_per_token_logps", old),
                             ref_logprob_BT=inputs.get("ref_per_token_logps"))


class TokenMDPGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` whose loss is a tokenmdp estimator's.

    Parameters
    ----------
    *args, **kwargs
        Those of ``trl.GRPOTrainer``.
    estimator : str or Estimator, optional
        A registry name (``"minirl"``) or an :class:`~tokenmdp.estimators.Estimator`. Default:
        the estimator ``args`` computes (:func:`~tokenmdp.integrations.estimator_from_trl`),
        so the hooked trainer reproduces TRL's own loss where one is mapped.
    """

    def __init__(self, *args, estimator: str | Estimator | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if estimator is None:
            from tokenmdp.integrations.trl import estimator_from_trl

            estimator = estimator_from_trl(self.args).estimator
        self.estimator = _resolve(estimator)
        for name, default in (("top_entropy_quantile", 1.0), ("entropy_coef", 0.0),
                              ("use_adaptive_entropy", False)):
            if getattr(self.args, name, default) not in (default, None):
                raise ValueError(f"{name}={getattr(self.args, name)!r}: TRL's entropy terms are "
                                 "not part of a tokenmdp estimator; leave it at its default")

    def _step_counts(self, inputs: dict, local_tokens: int, mode: str):
        """(``num_sequences``, TRL's token normalizer) of the optimizer step."""
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        num_sequences = inputs["completion_ids"].shape[0] * accumulation
        tokens = float(inputs["num_items_in_batch"]) / self.accelerator.num_processes
        if mode == "train":
            tokens *= accumulation / self.args.steps_per_generation
        return num_sequences, max(tokens, float(local_tokens), 1.0)

    def _compute_loss(self, model, inputs):
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        logprobs_BT, _, aux_loss = self._get_per_token_logps_and_entropies(
            model, torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
            torch.cat([inputs["prompt_mask"], completion_mask], dim=1), completion_ids.size(1),
            compute_entropy=False, compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in _MODEL_KEYS})
        mode = "train" if self.model.training else "eval"
        est = self.estimator
        batch = batch_from_trl(inputs, logprobs_BT)
        local_tokens = int(batch.loss_mask.sum())
        num_sequences, tokens = self._step_counts(inputs, local_tokens, mode)
        whole = tokens == math.floor(tokens)
        step = prepare(batch, est, num_sequences=num_sequences,
                       num_tokens=int(tokens) if whole else None,
                       max_len=self.args.max_completion_length,
                       advantage_S=inputs["advantages"].reshape(-1).to(batch.dtype))
        if not whole and est.aggregation is Aggregation.TOKEN_MEAN and local_tokens:
            step = step.replace(loss_weight=step.loss_weight * (local_tokens / tokens))
        value, metrics = loss(logprobs_BT, step, est)
        if self.aux_loss_enabled:
            scale = self.current_gradient_accumulation_steps if mode == "train" else 1
            value = value + self.router_aux_loss_coef * aux_loss / scale
        for name, metric in metrics.items():
            gathered = self.accelerator.gather(metric.detach().reshape(1).float())
            self._metrics[mode][f"tokenmdp/{name}"].append(gathered.nanmean().item())
        return value
