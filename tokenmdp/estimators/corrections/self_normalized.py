"""Self-normalized importance sampling: the weights ``w = π_old/μ`` over their step mean.

Owen 2013 (*Monte Carlo theory, methods and examples*, §9.2, "self-normalized importance
sampling"): for samples ``x_i ~ q`` and weights ``w_i = p(x_i)/q(x_i)``, the self-normalized
estimate of ``E_p[f]`` is ``Σ_i w_i f(x_i) / Σ_i w_i``. It needs ``p`` and ``q`` only up to
constants, and its weights average to one; it is biased at finite ``n`` and consistent: by the
delta method the bias is ``(μ_f Var_q(w) - Cov_q(w, w f)) / n + O(n^-2)`` (with ``E_q[w] = 1``),
so ``n · bias`` tends to that constant (``tests/estimators/corrections/test_self_normalized.py`` computes
it exactly on an enumerable MDP).

Here the samples are those of one optimizer step and the factor of every loss token is

* ``level="token"``: ``w_t / w̄``, ``w̄ = Σ_t w_t / N`` over the step's ``N`` loss tokens;
* ``level="sequence"`` (``W_i = Π_t w_it``) or ``"geometric"`` (``exp(mean_t log w_it)``):
  ``W_i / W̄``, ``W̄ = Σ_i W_i / S`` over the step's ``S`` sequences with a loss token.

With the token-mean aggregation and token weights, ``-loss = Σ_t w_t term_t / Σ_t w_t``;
with the sequence-mean aggregations and sequence weights, ``-loss = Σ_i W_i g_i / Σ_i W_i``:
Owen's estimator, the samples being tokens or sequences. An optional ``cap`` first truncates
the weights (``min(w, C)``, then normalized), as verl's
``algorithm.rollout_correction.rollout_is_batch_normalize=True`` does after its
``rollout_is_threshold`` truncation (verl normalizes token weights over the tokens, sequence
weights over the sequences, as here).

The step mean is a statistic of the whole step, so :meth:`SelfNormalizedIS.prepare_step`
computes the factors (each step's own when :func:`~tokenmdp.estimators.prepare` stacks several)
and stores them in ``token_extras[SNIS_FACTOR]``; :func:`~tokenmdp.estimators.loss` on any
micro-batch reads them. A batch that did not go through ``prepare`` is taken as one whole step.
For a step spread over data-parallel ranks, prepare the whole step before sharding it (the
mean is not reduced across ranks here).

Exact moments: each sample's term depends on the other samples' weights, which the
exchangeability method of :func:`tokenmdp.exact.moments` does not see (it reduces the others to
their reward and counted tokens), so pass ``method="enumeration"`` for an estimator with this
part; :meth:`SelfNormalizedIS.exchangeable_type` is the per-sequence value that, added to those
types, makes the reduction exact.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators._common import (
    check_positive,
    loss_token_counts,
    sequence_sum,
    to_tokens,
)
from tokenmdp.estimators.corrections.factor import (
    Correction,
    CorrectionFactor,
    Level,
    _coerce_level,
    importance_weight,
)

__all__ = ["SNIS_FACTOR", "SelfNormalizedIS", "self_normalized_weight"]

SNIS_FACTOR = "correction/snis_factor"
"""``token_extras`` key of the self-normalized factors filled by ``prepare``."""


def self_normalized_weight(log_w_RC: torch.Tensor, batch: TokenBatch, level: Level, *,
                           cap: float | None = None,
                           step: torch.Tensor | None = None) -> torch.Tensor:
    """``w / w̄`` on each loss token, ``w̄`` the mean weight of its step (see the module).

    Parameters
    ----------
    log_w_RC : Tensor ``[R, C]``
        ``log w`` at ``level`` (:func:`~tokenmdp.estimators.level_log_weight`), on the loss
        tokens.
    batch : TokenBatch
        The step (or stacked steps).
    level : Level
        Token: the mean is over the loss tokens; sequence or geometric: over the sequences
        with a loss token (one weight each).
    cap : float, optional
        Truncate ``w`` at ``C > 0`` before normalizing (default: no cap).
    step : LongTensor ``[S]``, optional
        The step of each sequence; each step is normalized by its own mean.

    Returns
    -------
    Tensor ``[R, C]``
        The factors on the loss tokens (their mean over each step's tokens, or sequences, is
        1), 0 elsewhere; detached.
    """
    if not isinstance(level, Level):
        raise TypeError(f"level: expected a Level, got {type(level).__name__}")
    if cap is not None:
        check_positive("cap", cap)
    with torch.no_grad():
        mask = batch.loss_mask
        log_w = log_w_RC if cap is None else log_w_RC.clamp(max=math.log(cap))
        w = torch.where(mask, importance_weight(log_w), 0.0)
        steps_S = (torch.zeros(batch.num_sequences, dtype=torch.long, device=batch.device)
                   if step is None else step)
        num_steps = int(steps_S.max()) + 1 if steps_S.numel() else 1
        step_RC = to_tokens(steps_S, batch) if batch.num_sequences else torch.zeros_like(
            batch.position)
        if level is Level.TOKEN:
            index, values, counts = step_RC[mask], w[mask], mask.to(w.dtype)[mask]
        else:
            has = loss_token_counts(batch) > 0
            # each sequence's weight once: its loss tokens all hold it
            w_S = w.new_zeros(batch.num_sequences).scatter_reduce(
                0, batch.sequence_id[mask], w[mask], reduce="amax", include_self=False)
            index, values, counts = steps_S[has], w_S[has], has.to(w.dtype)[has]
        totals = w.new_zeros(num_steps).index_add_(0, index, values)
        number = w.new_zeros(num_steps).index_add_(0, index, counts)
        mean = torch.where(number > 0, totals / number.clamp(min=1), 1.0)
        return torch.where(mask, w / mean[step_RC], 0.0)


@dataclasses.dataclass(frozen=True)
class SelfNormalizedIS(Correction):
    """Multiply by ``w / w̄``: the weights ``π_old/μ`` at ``level`` over their mean over the
    step (:func:`self_normalized_weight`; Owen 2013, §9.2). Biased, consistent.

    Parameters
    ----------
    level : Level or str, default ``Level.TOKEN``
        Token weights normalized over the step's loss tokens, or sequence / geometric-mean
        weights normalized over its sequences.
    cap : float, optional
        Truncate at ``C`` before normalizing (verl's ``rollout_is_threshold`` with
        ``rollout_is_batch_normalize=True``); default None, no truncation.
    """

    level: Level = Level.TOKEN
    cap: float | None = None

    def __post_init__(self):
        _coerce_level(self)
        if self.cap is not None:
            check_positive("cap", self.cap)

    def _factor(self, batch: TokenBatch, step: torch.Tensor | None) -> torch.Tensor:
        return self_normalized_weight(self._log_w(batch), batch, self.level, cap=self.cap,
                                      step=step)

    def prepare_step(self, batch: TokenBatch, step: torch.Tensor | None) -> TokenBatch:
        """Store each step's normalized factors in ``token_extras[SNIS_FACTOR]``.

        Parameters
        ----------
        batch : TokenBatch
            The whole step (or stacked steps), with ``old_logprob`` and ``behavior_logprob``.
        step : LongTensor ``[S]`` or None
            The step of each sequence (None: one step).

        Returns
        -------
        TokenBatch
            A copy of ``batch`` with the factors.
        """
        extras = dict(batch.token_extras)
        extras[SNIS_FACTOR] = self._factor(batch, step)
        return batch.replace(token_extras=extras)

    def exchangeable_type(self, batch: TokenBatch) -> torch.Tensor:
        """What one sequence contributes to the other sequences' factors: its weight sum.

        Another sequence's loss depends on this one only through its reward, its counted tokens
        and this value, so an exact method that reduces the other samples of a group to types
        must add it to them (see the module docstring on exact moments).

        Parameters
        ----------
        batch : TokenBatch
            With ``old_logprob`` and ``behavior_logprob``.

        Returns
        -------
        Tensor ``[S]``
            ``Σ_t w_t`` over the sequence's loss tokens (token level) or ``W_i`` (sequence,
            geometric), capped as the factors are.
        """
        log_w = self._log_w(batch)
        if self.cap is not None:
            log_w = log_w.clamp(max=math.log(self.cap))
        w = torch.where(batch.loss_mask, importance_weight(log_w), 0.0)
        total = sequence_sum(w, batch)
        if self.level is Level.TOKEN:
            return total
        return total / loss_token_counts(batch).clamp(min=1)

    def __call__(self, batch):
        factor = batch.token_extras.get(SNIS_FACTOR)
        if factor is None:  # not prepared: this batch is the whole step
            factor = self._factor(batch, None)
        return CorrectionFactor(factor, None)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            For example ``"SNIS (sequence)"`` or ``"SNIS C=2 (token)"``.
        """
        cap = "" if self.cap is None else f" C={self.cap:g}"
        return f"SNIS{cap} ({self.level.value})"
