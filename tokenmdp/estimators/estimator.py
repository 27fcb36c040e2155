"""An estimator is a frozen composition of parts; ``prepare`` once per step, ``loss`` per batch.

* :func:`prepare` runs once for the whole optimizer step, before any split into micro-batches:
  a KL-in-reward penalty enters the reward, group statistics give ``advantage`` (they need whole
  groups), and the step's counts give ``loss_weight``.
* :func:`loss` runs on any micro-batch, on any rank: it reads ``advantage`` and ``loss_weight``
  and never recomputes them, so the micro-batch losses sum to the full-step loss.

``loss = -Σ_{loss tokens} loss_weight · term``, where
``term = c · surrogate - β k`` (``c`` the detached correction factor ``π_old/μ``, ``β k`` a
KL-in-loss penalty).
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators._common import (
    MAX_LOG_RATIO,
    check_like_tokens,
    require,
    to_tokens,
)
from tokenmdp.estimators.advantages import Advantage, RewardAsAdvantage
from tokenmdp.estimators.aggregation import Aggregation, count_step, loss_weights
from tokenmdp.estimators.corrections import Correction, Level, NoCorrection
from tokenmdp.estimators.kl import KLPenalty
from tokenmdp.estimators.surrogates import Surrogate
from tokenmdp.estimators.weight_diagnostics import correction_diagnostics

__all__ = ["Estimator", "advantage_rewards", "counted_mask", "loss",
           "per_micro_batch_token_mean_loss", "prepare", "step_counts"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Estimator:
    """A policy-gradient estimator as five independent parts (docs: Concepts › Estimators).

    All parameters are keyword-only.

    Parameters
    ----------
    surrogate : Surrogate
        Per-token term and its ratio (:mod:`~tokenmdp.estimators.surrogates`).
    advantage : Advantage, default ``RewardAsAdvantage()``
        Rewards and groups → per-sequence advantage (:mod:`~tokenmdp.estimators.advantages`).
    correction : Correction, default ``NoCorrection()``
        The training–inference factor ``π_old/μ`` (:mod:`~tokenmdp.estimators.corrections`).
    aggregation : Aggregation, default ``Aggregation.TOKEN_MEAN``
        The loss-weight rule (:mod:`~tokenmdp.estimators.aggregation`).
    kl : KLPenalty, optional
        KL penalty to a reference policy, or None (default; :mod:`~tokenmdp.estimators.kl`).
    name : str, default ``"custom"``
        Registry name, used in messages and tables.
    """

    surrogate: Surrogate
    advantage: Advantage = RewardAsAdvantage()
    correction: Correction = NoCorrection()
    aggregation: Aggregation = Aggregation.TOKEN_MEAN
    kl: KLPenalty | None = None
    name: str = "custom"

    def __post_init__(self):
        for field, kind in (("surrogate", Surrogate), ("advantage", Advantage),
                            ("correction", Correction), ("aggregation", Aggregation)):
            value = getattr(self, field)
            if not isinstance(value, kind):
                raise TypeError(f"Estimator.{field}: expected a {kind.__name__}, got "
                                f"{type(value).__name__} {value!r}")
        if self.kl is not None and not isinstance(self.kl, KLPenalty):
            raise TypeError(f"Estimator.kl: expected a KLPenalty or None, got {self.kl!r}")

    def replace(self, **changes) -> Estimator:
        """A copy with some parts replaced.

        Parameters
        ----------
        **changes
            New values of fields, by name (``surrogate=PPOClip(eps_high=0.28)``).

        Returns
        -------
        Estimator
            The copy, validated like a new estimator.
        """
        return dataclasses.replace(self, **changes)

    def requires(self, stage: str) -> tuple[str, ...]:
        """Batch fields read by ``prepare`` (``stage='prepare'``) or ``loss`` (``'loss'``).

        Parameters
        ----------
        stage : {'prepare', 'loss'}
            The call whose needs are asked for.

        Returns
        -------
        tuple of str
            The optional :class:`~tokenmdp.TokenBatch` fields the stage reads (such as
            ``old_logprob``), each once.
        """
        needs = list(self.correction.requires)
        if stage == "loss":
            needs += self.surrogate.requires
        if self.kl is not None and self.kl.in_reward == (stage == "prepare"):
            needs += self.kl.requires
        return tuple(dict.fromkeys(needs))

    def _check(self, batch: TokenBatch, stage: str) -> None:
        if not isinstance(batch, TokenBatch):
            raise TypeError(f"batch: expected a TokenBatch, got {type(batch).__name__}")
        if batch.dtype in HALF_DTYPES:
            raise TypeError(f"batch: {batch.dtype} float fields; the losses need float32 or "
                            "float64 (ratios up to e^20 and their metrics overflow in half "
                            "precision): use batch.to(dtype=torch.float32) and float32 log-probs")
        for field in self.requires(stage):
            require(batch, field, f"estimator {self.name!r} ({stage})")


HALF_DTYPES = (torch.float16, torch.bfloat16)
"""Refused by :func:`prepare` and :func:`loss`: the ratio cap ``e^MAX_LOG_RATIO`` overflows."""


def resolve(estimator: Estimator | str) -> Estimator:
    """``estimator``, or the registry's estimator of that name.

    Raises
    ------
    TypeError
        ``estimator``: neither an Estimator nor a str.
    ValueError
        ``estimator``: an unknown registry name.
    """
    if isinstance(estimator, Estimator):
        return estimator
    if isinstance(estimator, str):
        from tokenmdp.estimators.registry import get

        return get(estimator)
    raise TypeError(f"estimator: expected an Estimator or a registry name, got "
                    f"{type(estimator).__name__}")


def counted_mask(batch: TokenBatch, estimator: Estimator) -> torch.Tensor:
    """Bool ``[R, C]``: the loss tokens that count in the normalizer (masked-IS rejects leave it
    only when the correction says so).

    Parameters
    ----------
    batch : TokenBatch
        The batch (with the fields the estimator's correction reads).
    estimator : Estimator
        The estimator whose correction may reject tokens.

    Returns
    -------
    BoolTensor ``[R, C]``
        ``batch.loss_mask``, minus the rejected tokens when they leave the normalizer.
    """
    keep = estimator.correction(batch).keep_RC
    if keep is None or estimator.correction.masked_in_normalizer:
        return batch.loss_mask
    return batch.loss_mask & keep


def step_counts(batch: TokenBatch, estimator: Estimator) -> tuple[int, int]:
    """``(num_tokens, num_sequences)`` that :func:`prepare` counts in ``batch`` by default.

    For a step spread over several batches or ranks, sum these (all-reduce) and pass the sums to
    :func:`prepare` of each part.

    Parameters
    ----------
    batch : TokenBatch
        The batch (all or part of one optimizer step).
    estimator : Estimator or str
        The estimator, or a registry name.

    Returns
    -------
    num_tokens : int
        The counted loss tokens (:func:`counted_mask`).
    num_sequences : int
        The sequences with at least one counted token.
    """
    estimator = resolve(estimator)
    estimator._check(batch, "prepare")
    return count_step(batch, counted_mask(batch, estimator))


def prepare(batch: TokenBatch, estimator: Estimator, *, num_tokens: int | None = None,
            num_sequences: int | None = None, max_len: int | None = None,
            step: torch.Tensor | None = None,
            advantage_S: torch.Tensor | None = None) -> TokenBatch:
    """Fill ``advantage`` and ``loss_weight`` once for the whole optimizer step.

    1. a KL-in-reward penalty ``β Σ_t k_t`` (from ``old_logprob`` and ``ref_logprob``) is
       subtracted from ``reward`` (the returned batch keeps the environment reward);
    2. ``advantage`` = the estimator's advantage of each sequence on its loss tokens, 0 elsewhere
       (``batch`` must hold whole groups);
    3. ``loss_weight`` = :func:`~tokenmdp.estimators.loss_weights` of the estimator's
       aggregation, with ``num_tokens``, ``num_sequences`` (default: this batch's, see
       :func:`step_counts`) and ``max_len`` (``L_max``, needed by ``Aggregation.CONSTANT``).

    ``step`` (LongTensor ``[S]``, optional) stacks several independent optimizer steps in one
    batch: counts and batch-wide statistics are then each step's own (see
    :func:`~tokenmdp.estimators.loss_weights`); the exact lab prepares thousands of group draws
    in one call this way.

    ``advantage_S`` (float ``[S]``, optional) replaces steps 1-2: per-sequence advantages the
    caller computed with :func:`advantage_rewards` and the estimator's advantage part over more
    than this batch (a data-parallel rank's share of a step whose advantage is batch-wide).

    Parameters
    ----------
    batch : TokenBatch
        Whole groups of the step, with ``reward`` and the fields the estimator reads.
    estimator : Estimator or str
        The estimator, or a registry name (``"grpo"``).
    num_tokens, num_sequences : int, optional
        ``N_tokens`` and ``S`` of the whole step (default: this batch's, :func:`step_counts`).
    max_len : int, optional
        ``L_max``, the response-length budget (required by ``Aggregation.CONSTANT``).
    step : LongTensor ``[S]``, optional
        Optimizer-step id of each sequence, for several independent steps in one batch.
    advantage_S : Tensor ``[S]``, optional
        Per-sequence advantages computed by the caller (in ``batch.dtype``).

    Returns
    -------
    TokenBatch
        A copy of ``batch`` with ``advantage`` and ``loss_weight`` filled (``reward`` unchanged).
    """
    estimator = resolve(estimator)
    estimator._check(batch, "prepare")
    if advantage_S is None:
        advantage_S = estimator.advantage(advantage_rewards(batch, estimator), batch.group, step)
    elif not isinstance(advantage_S, torch.Tensor) or advantage_S.shape != batch.reward.shape \
            or advantage_S.dtype != batch.dtype:
        raise ValueError(f"advantage_S: expected a {batch.dtype} tensor of shape "
                         f"{tuple(batch.reward.shape)}")
    advantage_RC = torch.where(batch.loss_mask, to_tokens(advantage_S, batch), 0.0)
    weights = loss_weights(batch, estimator.aggregation, num_tokens=num_tokens,
                           num_sequences=num_sequences, max_len=max_len,
                           mask=counted_mask(batch, estimator), step=step)
    return batch.replace(advantage=advantage_RC, loss_weight=weights)


def advantage_rewards(batch: TokenBatch, estimator: Estimator) -> torch.Tensor:
    """Float ``[S]``: the rewards the estimator's advantage part sees (the environment reward,
    minus a KL-in-reward penalty ``β Σ_t k_t`` when the estimator has one).

    Parameters
    ----------
    batch : TokenBatch
        The batch, with ``old_logprob`` and ``ref_logprob`` when the penalty is in the reward.
    estimator : Estimator or str
        The estimator, or a registry name.

    Returns
    -------
    Tensor ``[S]``
        One reward per sequence.
    """
    estimator = resolve(estimator)
    estimator._check(batch, "prepare")
    if estimator.kl is not None and estimator.kl.in_reward:
        return batch.reward - estimator.kl.reward_penalty(batch)
    return batch.reward


def loss(logprobs_RC: torch.Tensor, batch: TokenBatch, estimator: Estimator
         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``loss = -Σ_{loss tokens} loss_weight · (c · surrogate - β k)`` and metrics.

    Parameters
    ----------
    logprobs_RC : Tensor ``[R, C]``
        ``log π_θ`` of each token given its prefix (differentiable), aligned with
        ``batch.tokens``; values off ``loss_mask`` are ignored (replaced by 0 before use).
    batch : TokenBatch
        A prepared batch (:func:`prepare`) or a part of one; ``advantage`` and ``loss_weight``
        are read as they are.
    estimator : Estimator

    Returns
    -------
    loss : scalar tensor
    metrics : dict of detached scalar tensors, computed under ``no_grad``
        ``tokens`` (loss tokens of this batch); ``clip_fraction`` (where the surrogate's clip or
        mask was active) and ``masked_fraction`` (rejected by masked IS); when ``old_logprob`` is
        present ``r_min/r_mean/r_max`` (``r = π_θ/π_old``), when ``behavior_logprob`` is present
        ``rho_min/rho_mean/rho_max`` (``ρ = π_θ/μ``), with both ``train_infer_kl_k1/k3``
        (``KL(μ ‖ π_old)`` per token, k1 and k3 forms) and ``is_ess``/``is_chi2`` (the
        normalized effective sample size and χ² estimate of the token weights ``π_old/μ``;
        ``is_seq_ess``/``is_seq_chi2`` of the sequence weights too when the correction acts per
        sequence or geometric mean; :mod:`~tokenmdp.estimators.weight_diagnostics`), and with
        a KL-in-loss penalty ``kl_ref`` (mean of its estimator ``k(π_θ, π_ref)``). Over zero
        loss tokens fractions, KLs and χ² are 0 and ratio statistics and ESS 1 (neutral
        values, no NaN); an empty batch (no sequences) gives loss 0, these neutral metrics and
        a zero gradient.

    ``estimator`` may also be a registry name (``"grpo"``). Half-precision batches are refused
    (``TypeError``): the ratio cap ``e^20`` and the metrics overflow in float16.
    """
    estimator = resolve(estimator)
    estimator._check(batch, "loss")
    check_like_tokens("logprobs_RC", logprobs_RC, batch.advantage)
    mask = batch.loss_mask
    logprobs_RC = torch.where(mask, logprobs_RC, 0.0)
    terms = estimator.surrogate(logprobs_RC, batch)
    factor = estimator.correction(batch)
    # Detached per-token weights, 0 off the loss tokens: loss_weight, times the correction factor
    # for the surrogate. Folding the constant factor into the weight keeps it off the autograd
    # graph; the terms are finite off the loss tokens (log-probs 0 there, ratios capped), so
    # their zero weight removes them.
    weight_RC = torch.where(mask, batch.loss_weight, 0.0)
    surrogate_weight_RC = weight_RC if factor.factor_RC is None else weight_RC * factor.factor_RC
    total = -_weighted_sum(surrogate_weight_RC, terms.term_RC)
    k_RC = None
    if estimator.kl is not None and not estimator.kl.in_reward:
        k_RC, is_weight_RC = estimator.kl.loss_penalty(logprobs_RC, batch)
        kl_weight_RC = weight_RC if is_weight_RC is None else weight_RC * is_weight_RC
        total = total + estimator.kl.coef * _weighted_sum(kl_weight_RC, k_RC)
    if logprobs_RC.requires_grad and not total.requires_grad:  # an empty batch: a zero
        total = total + logprobs_RC.sum()                      # gradient, not a graph error
    with torch.no_grad():
        metrics = _metrics(logprobs_RC, batch, terms, factor.keep_RC, k_RC)
        if batch.old_logprob is not None and batch.behavior_logprob is not None:
            level = getattr(estimator.correction, "level", Level.TOKEN)
            metrics.update(correction_diagnostics(batch, sequence=level is not Level.TOKEN))
    return total, metrics


def _weighted_sum(weight_RC: torch.Tensor, values_RC: torch.Tensor) -> torch.Tensor:
    """``Σ weight · values`` as one dot product: no ``[R, C]`` temporary, and a backward pass of
    one product (``weight`` is detached)."""
    return torch.dot(weight_RC.reshape(-1), values_RC.reshape(-1))


def _metrics(logprobs_RC, batch, terms, keep_RC, k_RC) -> dict[str, torch.Tensor]:
    """The diagnostics of :func:`loss` (under ``no_grad``). Sums over the loss tokens are dot
    products with the 0/1 mask (every tensor summed is finite off the loss tokens) and
    temporaries are updated in place: on a large step these passes are bound by memory."""
    mask = batch.loss_mask
    mask_f = mask.to(batch.dtype)
    count = mask_f.sum()
    has = count > 0
    denominator = count.clamp(min=1)

    def mean(values_RC, empty: float):
        return torch.where(has, _weighted_sum(mask_f, values_RC) / denominator, empty)

    out = {"tokens": count}
    zero = count.new_zeros(())
    clipped_RC = terms.clipped_RC
    out["clip_fraction"] = zero if clipped_RC is None else (clipped_RC & mask).sum() / denominator
    out["masked_fraction"] = zero if keep_RC is None else (mask & ~keep_RC).sum() / denominator
    # Off the loss tokens, ratios are filled with the value at the first loss token (one of the
    # values over the loss tokens), so one aminmax gives their min and max.
    ratios = [(key, ref) for key, ref in (("r", batch.old_logprob), ("rho", batch.behavior_logprob))
              if ref is not None]
    if ratios and mask.numel() == 0:  # an empty batch: neutral ratio statistics
        one = count.new_ones(())
        for key, _ in ratios:
            out.update({f"{key}_min": one, f"{key}_mean": one, f"{key}_max": one})
        ratios = []
    if ratios:
        off = ~mask
        first = mask.reshape(-1).to(torch.uint8).argmax()
    for key, ref in ratios:
        if key == "r" and terms.ratio_RC is not None:
            ratio = terms.ratio_RC.clone()  # the surrogate's capped r
        else:
            ratio = (logprobs_RC - ref).clamp_(max=MAX_LOG_RATIO).exp_()
        ratio.masked_fill_(off, ratio.reshape(-1)[first])
        lo, hi = torch.aminmax(ratio)
        out[f"{key}_min"] = torch.where(has, lo, 1.0)
        out[f"{key}_mean"] = mean(ratio, 1.0)
        out[f"{key}_max"] = torch.where(has, hi, 1.0)
    if batch.old_logprob is not None and batch.behavior_logprob is not None:
        log_q = batch.old_logprob - batch.behavior_logprob  # log(π_old/μ), tokens drawn from μ
        out["train_infer_kl_k1"] = 0.0 - mean(log_q, 0.0)
        k3 = log_q.clamp(max=MAX_LOG_RATIO).expm1_().sub_(log_q)  # expm1: k3 >= 0 near r = 1
        out["train_infer_kl_k3"] = mean(k3, 0.0)
    if k_RC is not None:  # the estimate k of KL(π_θ ‖ π_ref) of a KL-in-loss penalty
        out["kl_ref"] = mean(k_RC, 0.0)
    return out


def per_micro_batch_token_mean_loss(logprobs_RC: torch.Tensor, batch: TokenBatch,
                                    estimator: Estimator
                                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """COUNTER-EXAMPLE, do not train with it: :func:`loss` with token-mean weights recomputed from
    this micro-batch's own token count, ignoring ``batch.loss_weight``.

    This is the per-micro-batch normalization many frameworks shipped (TRL's ``bnpo``; gradient
    accumulation over micro-batch means): the estimator then depends on how the step is split, so
    it fails the layout and micro-batch invariance checks that :func:`loss` passes.

    Parameters
    ----------
    logprobs_RC : Tensor ``[R, C]``
        ``log π_θ`` of each token (differentiable), as for :func:`loss`.
    batch : TokenBatch
        A prepared micro-batch; its ``loss_weight`` is replaced.
    estimator : Estimator or str
        The estimator, or a registry name; its aggregation is ignored.

    Returns
    -------
    loss : scalar tensor
        The micro-batch token-mean loss.
    metrics : dict of detached scalar tensors
        As :func:`loss` returns them.
    """
    own = loss_weights(batch, Aggregation.TOKEN_MEAN)
    return loss(logprobs_RC, batch.replace(loss_weight=own), estimator)
