"""Once per optimizer step: :func:`prepare` fills ``advantage`` and ``loss_weight``.

:func:`prepare` runs once for the whole optimizer step, before any split into micro-batches: a
KL-in-reward penalty enters the reward, group statistics give ``advantage`` (they need whole
groups), and the step's counts give ``loss_weight``. :func:`~tokenmdp.estimators.loss` (in
:mod:`~tokenmdp.estimators.token_loss`) then runs on any micro-batch, on any rank: it reads
``advantage`` and ``loss_weight`` and never recomputes them, so the micro-batch losses sum to the
full-step loss.
"""

from __future__ import annotations

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators._common import to_tokens
from tokenmdp.estimators.aggregation import count_step, loss_weights
from tokenmdp.estimators.estimator import Estimator
from tokenmdp.estimators.registry.lookup import resolve

__all__ = ["advantage_rewards", "counted_mask", "prepare", "step_counts", "token_reward_penalty"]


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
        The sequences ``S`` counts (``estimator.sequence_count``): all of them, or those with at
        least one counted token.
    """
    estimator = resolve(estimator)
    estimator._check(batch, "prepare")
    return count_step(batch, counted_mask(batch, estimator), sequences=estimator.sequence_count)


def prepare(batch: TokenBatch, estimator: Estimator, *, num_tokens: int | None = None,
            num_sequences: int | None = None, max_len: float | None = None,
            step: torch.Tensor | None = None,
            advantage_S: torch.Tensor | None = None,
            num_groups: int | None = None) -> TokenBatch:
    """Fill ``advantage`` and ``loss_weight`` once for the whole optimizer step.

    1. a KL-in-reward penalty ``β Σ_t k_t`` (from ``old_logprob`` and ``ref_logprob``) is
       subtracted from ``reward`` (the returned batch keeps the environment reward);
    2. ``advantage`` = the estimator's advantage of each sequence on its loss tokens, 0 elsewhere
       (``batch`` must hold whole groups); a token-level advantage part
       (:class:`~tokenmdp.estimators.advantages.token.TokenAdvantage`) instead gets the
       environment reward and the per-token penalty (:func:`token_reward_penalty`) and fills
       each token itself;
    3. ``loss_weight`` = :func:`~tokenmdp.estimators.loss_weights` of the estimator's
       aggregation, with ``num_tokens``, ``num_sequences`` (default: this batch's, see
       :func:`step_counts`) and ``max_len`` (``L_max``, needed by ``Aggregation.CONSTANT``);
    4. the surrogate's, then the correction's ``prepare_step`` (a no-op unless the part needs a
       statistic of the whole step, see :meth:`~tokenmdp.estimators.Surrogate.prepare_step`).

    ``step`` (LongTensor ``[S]``, optional) stacks several independent optimizer steps in one
    batch: counts and batch-wide statistics are then each step's own (see
    :func:`~tokenmdp.estimators.loss_weights`); the exact lab prepares thousands of group draws
    in one call this way.

    ``advantage_S`` (float ``[S]``, optional) replaces steps 1-2: per-sequence advantages the
    caller computed with :func:`advantage_rewards` and the estimator's advantage part over more
    than this batch (a data-parallel rank's share of a step whose advantage is batch-wide);
    refused (``ValueError``) for a token-level advantage part.

    Parameters
    ----------
    batch : TokenBatch
        Whole groups of the step, with ``reward`` and the fields the estimator reads.
    estimator : Estimator or str
        The estimator, or a registry name (``"grpo"``).
    num_tokens, num_sequences : int, optional
        ``N_tokens`` and ``S`` of the whole step (default: this batch's, :func:`step_counts`).
    max_len : int or float, optional
        ``L_max`` of ``Aggregation.CONSTANT`` (required there): the response-length budget or
        any positive constant normalizer.
    step : LongTensor ``[S]``, optional
        Optimizer-step id of each sequence, for several independent steps in one batch.
    advantage_S : Tensor ``[S]``, optional
        Per-sequence advantages computed by the caller (in ``batch.dtype``).
    num_groups : int, optional
        ``P``, the groups of the whole step, for ``Aggregation.PROMPT_MEAN_TOKEN_MEAN`` over
        several batches (default: this batch's).

    Returns
    -------
    TokenBatch
        A copy of ``batch`` with ``advantage`` and ``loss_weight`` filled (``reward`` unchanged).
    """
    estimator = resolve(estimator)
    estimator._check(batch, "prepare")
    part = estimator.advantage
    if part.token_level:
        if advantage_S is not None:
            raise ValueError(f"advantage_S: the advantage part {part.describe()!r} of estimator "
                             f"{estimator.name!r} is token-level; it has no per-sequence form, "
                             "so prepare must compute it from the whole step")
        advantage_RC = part.token_advantages(batch, batch.reward,
                                             token_reward_penalty(batch, estimator), step)
    else:
        if advantage_S is None:
            advantage_S = part.from_batch(batch, advantage_rewards(batch, estimator), step)
        elif not isinstance(advantage_S, torch.Tensor) or \
                advantage_S.shape != batch.reward.shape or advantage_S.dtype != batch.dtype:
            raise ValueError(f"advantage_S: expected a {batch.dtype} tensor of shape "
                             f"{tuple(batch.reward.shape)}")
        advantage_RC = to_tokens(advantage_S, batch)
    advantage_RC = torch.where(batch.loss_mask, advantage_RC, 0.0)
    weights = loss_weights(batch, estimator.aggregation, num_tokens=num_tokens,
                           num_sequences=num_sequences, max_len=max_len,
                           mask=counted_mask(batch, estimator), step=step,
                           sequences=estimator.sequence_count, num_groups=num_groups)
    prepared = batch.replace(advantage=advantage_RC, loss_weight=weights)
    for part in (estimator.surrogate, estimator.correction):
        prepared = part.prepare_step(prepared, step)
    return prepared


def token_reward_penalty(batch: TokenBatch, estimator: Estimator) -> torch.Tensor:
    """Float ``[R, C]``: the per-token KL-in-reward penalty ``β k(log π_old, log π_ref)`` on the
    loss tokens (0 elsewhere, and everywhere without a penalty in the reward), what a token-level
    advantage part (:class:`~tokenmdp.estimators.advantages.token.TokenAdvantage`) distributes.
    Its sequence sums are the penalty :func:`advantage_rewards` subtracts.

    Parameters
    ----------
    batch : TokenBatch
        The batch, with ``old_logprob`` and ``ref_logprob`` when the penalty is in the reward.
    estimator : Estimator or str
        The estimator, or a registry name.

    Returns
    -------
    Tensor ``[R, C]``
        ``β k_t`` of each loss token.
    """
    estimator = resolve(estimator)
    estimator._check(batch, "prepare")
    kl = estimator.kl
    if kl is None or not kl.in_reward:
        return torch.zeros_like(batch.advantage)
    k = kl.estimator(batch.old_logprob, batch.ref_logprob)
    return torch.where(batch.loss_mask, kl.coef * k, 0.0)


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
