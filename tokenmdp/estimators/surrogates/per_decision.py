"""Per-decision importance sampling: token t weighted by the cumulative ratio ``Π_{s<=t} ρ_s``.

Sequence IS weights every token of ``y`` by the whole product ``ρ(y) = Π_s ρ_s``; token IS by
its own ``ρ_t`` only, ignoring that the prefix ``y_<t`` was drawn from the wrong policy.
Per-decision IS (Precup, Sutton & Singh 2000, ICML, "Eligibility traces for off-policy policy
evaluation") weights the score of token t by the ratio of its prefix and itself,
``ρ_{1:t} = Π_{s<=t} ρ_s``: CTPO (Zhang et al., arXiv 2605.07331) shows that under the
token-level policy-gradient formulation this corrects each token's prefix distribution exactly,
with a variance below the full sequence ratio's, and adds a position-adaptive clip of
``log ρ_{1:t}`` (not implemented here: this is the unclipped estimator).

What it estimates, exactly (``tests/estimators/surrogates/test_per_decision.py`` checks both on an
enumerable MDP): the expectation of ``Σ_t ρ_{1:t} R ∇log π_t`` over ``y ~ μ`` is
``Σ_t E_{π_θ}[∇log π_t(y_t|y_<t) Q^μ(y_<t, y_t)]`` — every decision's gradient at ``π_θ``'s
own state distribution, with the continuation after ``t`` valued under ``μ``. That is ``∇J``
when the policies agree after the first decision (in particular in a bandit, and on-policy);
otherwise the terminal reward of a longer response still carries ``μ``'s continuation, which
only the whole product (sequence IS) re-weights.

The cumulative sums run over each sequence's loss tokens in position order through a dense
``[S, max position + 1]`` view (one ``index_put``, one ``cumsum``, one gather), so every layout
computes the same numbers in the same order.
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators._common import MAX_LOG_RATIO, capped_exp, require, with_derivative
from tokenmdp.estimators.surrogates.token import Surrogate, SurrogateTerms

__all__ = ["PerDecisionRatio", "cumulative_log_ratio", "per_decision_term"]


def cumulative_log_ratio(log_ratio_RC: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    """``Σ_{s<=t} log ρ_s`` over the loss tokens ``s`` of token t's sequence up to its position.

    Parameters
    ----------
    log_ratio_RC : Tensor ``[R, C]``
        ``log ρ_t`` of each token (read on the loss tokens only; not differentiated).
    batch : TokenBatch
        The batch the tokens belong to (its ``sequence_id``, ``position`` and ``loss_mask``).

    Returns
    -------
    Tensor ``[R, C]``
        The cumulative log-ratio on the loss tokens, 0 elsewhere (detached).
    """
    with torch.no_grad():
        values = torch.where(batch.loss_mask, log_ratio_RC, 0.0)
        if batch.num_sequences == 0 or values.numel() == 0:
            return torch.zeros_like(values)
        sid = batch.sequence_id.clamp(min=0)
        pos = batch.position
        dense = values.new_zeros(batch.num_sequences, int(pos.max()) + 1)
        # padding adds its 0 to a cell of sequence 0 (accumulate): each real cell is one token
        dense.index_put_((sid, pos), values, accumulate=True)
        return torch.where(batch.loss_mask, dense.cumsum(1)[sid, pos], 0.0)


def per_decision_term(logprobs_RC: torch.Tensor, sampling_logprobs_RC: torch.Tensor,
                      advantages_RC: torch.Tensor, batch: TokenBatch) -> SurrogateTerms:
    """``ρ_{1:t} Â`` on token t with the gradient ``ρ_{1:t} Â ∇log π_t`` (per-decision IS;
    Precup et al. 2000; the unclipped CTPO ratio, arXiv 2605.07331), ``ρ_s = π_θ(y_s)/q(y_s)``
    against the sampling log-probs ``q`` given.

    Only token t's own score carries the gradient (the prefix ratio enters as a weight, as in
    the token-level policy-gradient formulation): its value and gradient are those of
    ``sg(ρ_{1:t-1}) ρ_t Â``. On-policy this is REINFORCE; with one token per response it is
    sequence IS. ``clipped_RC`` marks tokens whose cumulative log-ratio exceeds the ``e^20`` cap
    (held constant there, no gradient).

    Parameters
    ----------
    logprobs_RC : Tensor ``[R, C]``
        ``log π_θ`` of each token (differentiable).
    sampling_logprobs_RC : Tensor ``[R, C]``
        ``log q`` of each token: ``log μ`` for the full off-policy ratio, or ``log π_old``.
    advantages_RC : Tensor ``[R, C]``
        ``Â`` of each token.
    batch : TokenBatch
        The batch the tokens belong to (its ``sequence_id``, ``position`` and ``loss_mask``).

    Returns
    -------
    SurrogateTerms
        The term and the capped tokens; no ratio.
    """
    with torch.no_grad():
        cum = cumulative_log_ratio(logprobs_RC - sampling_logprobs_RC, batch)
        value = capped_exp(cum) * advantages_RC
        capped = (cum > MAX_LOG_RATIO) & batch.loss_mask
        derivative = torch.where(capped, 0.0, value)
    return SurrogateTerms(with_derivative(logprobs_RC, value, derivative), capped)


@dataclasses.dataclass(frozen=True)
class PerDecisionRatio(Surrogate):
    """Per-decision IS (:func:`per_decision_term`).

    Parameters
    ----------
    against : {'behavior', 'old'}, default 'behavior'
        The ratio's denominator: ``μ`` (``behavior_logprob``; the whole off-policy ratio
        ``π_θ/μ`` at once, so use it with no correction) or ``π_old`` (``old_logprob``).
        A separate correction part cannot make the training–inference factor cumulative.
    """

    against: str = "behavior"

    def __post_init__(self):
        if self.against not in ("behavior", "old"):
            raise ValueError(f"against: expected 'behavior' or 'old', got {self.against!r}")

    @property
    def requires(self) -> tuple[str, ...]:  # numpydoc ignore=RT01
        """``behavior_logprob`` or ``old_logprob``, as ``against`` says."""
        return ("behavior_logprob",) if self.against == "behavior" else ("old_logprob",)

    def __call__(self, logprobs_RC, batch):
        sampling = require(batch, self.requires[0], f"surrogate {self.describe()}")
        return per_decision_term(logprobs_RC, sampling, batch.advantage, batch)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            For example ``"rho_1:t A (per-decision IS, vs mu)"``.
        """
        ref = "mu" if self.against == "behavior" else "pi_old"
        return f"rho_1:t A (per-decision IS, vs {ref})"
