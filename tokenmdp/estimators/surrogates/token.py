"""Token-level surrogates: the per-token term whose weighted sum is the (negated) loss.

Notation (docs: Concepts › Estimators): ``r_t = π_θ/π_old`` (staleness ratio, the one every clip
uses), ``Â`` the token's advantage, ``sg`` stop-gradient, ``M_t`` the PPO mask. Each function
takes the per-token tensors ``[R, C]`` and returns :class:`SurrogateTerms`: the term (a function
of ``logprobs_RC`` for autograd) and, detached, where a clip or mask was active. Ratios are
``exp(min(log r, MAX_LOG_RATIO))`` (see :data:`~tokenmdp.estimators._common.MAX_LOG_RATIO`):
beyond ``e^20`` a ratio is held constant and its token gets no gradient through it.

The training–inference factor ``π_old/μ`` is not a surrogate's business: a
:mod:`~tokenmdp.estimators.corrections.factor` part multiplies the term by it, so ``token IS`` (Qwen,
arXiv 2512.01374 Eq. 3: ``ρ_t Â`` with ``ρ_t = π_θ/μ``) is :class:`TokenRatio` times
:class:`~tokenmdp.estimators.ImportanceSampling`. This module holds the protocol
(:class:`Surrogate`, :class:`SurrogateTerms`), REINFORCE and the token ratio; the clipped ones
(PPO, CISPO, MiniRL) are in :mod:`~tokenmdp.estimators.surrogates.clipped`, the sequence-level
ones in :mod:`~tokenmdp.estimators.surrogates.sequence`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators._common import (
    MAX_LOG_RATIO,
    capped_exp,
    check_nonnegative,
    require,
    with_derivative,
)

__all__ = ["Reinforce", "Surrogate", "SurrogateTerms", "TokenRatio", "reinforce_term",
           "token_ratio_term"]


class SurrogateTerms(NamedTuple):
    """A surrogate's output: the per-token term ``[R, C]``; detached, the bool ``[R, C]`` where a
    clip or mask was active (None when the surrogate has none) and, when the surrogate computed
    it, the ratio ``r_t = π_θ/π_old`` (capped; the loss's metrics reuse it).

    Parameters
    ----------
    term_RC : Tensor ``[R, C]``
        The per-token term, differentiable in ``logprobs_RC``.
    clipped_RC : BoolTensor ``[R, C]`` or None
        Detached: where a clip or mask was active; None when the surrogate has none.
    ratio_RC : Tensor ``[R, C]`` or None, default None
        Detached ``r_t = exp(min(log r_t, MAX_LOG_RATIO))``, when the surrogate computed it.
    """

    term_RC: torch.Tensor
    clipped_RC: torch.Tensor | None
    ratio_RC: torch.Tensor | None = None


def _check_eps(eps_low: float, eps_high: float) -> None:
    check_nonnegative("eps_low", eps_low)
    check_nonnegative("eps_high", eps_high)


def reinforce_term(logprobs_RC: torch.Tensor, advantages_RC: torch.Tensor) -> SurrogateTerms:
    """``Â log π_θ`` (REINFORCE / weighted NLL; Williams 1992). Gradient ``Â ∇log π_θ``.

    Parameters
    ----------
    logprobs_RC : Tensor ``[R, C]``
        ``log π_θ`` of each token (differentiable).
    advantages_RC : Tensor ``[R, C]``
        ``Â`` of each token.

    Returns
    -------
    SurrogateTerms
        The term; no clip mask, no ratio.
    """
    return SurrogateTerms(advantages_RC * logprobs_RC, None)


def token_ratio_term(logprobs_RC: torch.Tensor, old_logprobs_RC: torch.Tensor,
                     advantages_RC: torch.Tensor) -> SurrogateTerms:
    """``r_t Â``: the unclipped surrogate of CPI (Kakade & Langford 2002) and TRPO (1502.05477).

    Gradient ``r_t Â ∇log π_θ``; with an IS correction the token weight is ``ρ_t`` and this is
    Qwen's token-level IS objective (arXiv 2512.01374, Eq. 3), the gradient of ``L_μ(π_θ)``.

    Parameters
    ----------
    logprobs_RC : Tensor ``[R, C]``
        ``log π_θ`` of each token (differentiable).
    old_logprobs_RC : Tensor ``[R, C]``
        ``log π_old`` of each token.
    advantages_RC : Tensor ``[R, C]``
        ``Â`` of each token.

    Returns
    -------
    SurrogateTerms
        The term and the capped ratio; no clip mask.
    """
    with torch.no_grad():  # value r Â, derivative r Â below the cap (see with_derivative)
        log_ratio = logprobs_RC - old_logprobs_RC
        ratio = capped_exp(log_ratio)
        value = ratio * advantages_RC
        derivative = torch.where(log_ratio <= MAX_LOG_RATIO, value, 0.0)
    return SurrogateTerms(with_derivative(logprobs_RC, value, derivative), None, ratio)


# ---------------------------------------------------------------------- composable parts
class Surrogate:
    """Base of the surrogate parts: ``part(logprobs_RC, batch) -> SurrogateTerms``.

    ``requires`` names the batch fields the part reads besides ``advantage``.
    """

    requires: tuple[str, ...] = ("old_logprob",)

    def __call__(self, logprobs_RC: torch.Tensor, batch: TokenBatch) -> SurrogateTerms:
        raise NotImplementedError

    def describe(self) -> str:
        """Short label for tables."""
        raise NotImplementedError

    def prepare_step(self, batch: TokenBatch, step: torch.Tensor | None) -> TokenBatch:
        """Step-wide preparation, called once by :func:`~tokenmdp.estimators.prepare` after
        ``advantage`` and ``loss_weight`` are filled; the default returns ``batch`` unchanged.

        A part whose loss needs a statistic of the whole optimizer step (a selection of tokens,
        a self-normalizing sum) computes it here from the detached fields (``old_logprob``,
        ``behavior_logprob``, ``advantage``, ``loss_weight``) and stores it in ``loss_weight`` or
        ``token_extras``, so that :func:`~tokenmdp.estimators.loss` on any micro-batch reads it.

        Parameters
        ----------
        batch : TokenBatch
            The batch of the step(s), ``advantage`` and ``loss_weight`` filled.
        step : LongTensor ``[S]`` or None
            The optimizer-step id of each sequence when several steps are stacked (statistics
            must then be each step's own), None for one step.

        Returns
        -------
        TokenBatch
            ``batch``, or a copy with the part's step-wide quantities.
        """
        return batch

    def _old(self, batch: TokenBatch) -> torch.Tensor:
        return require(batch, "old_logprob", f"surrogate {self.describe()}")


@dataclasses.dataclass(frozen=True)
class Reinforce(Surrogate):
    """``Â log π_θ`` (:func:`reinforce_term`); reads no old log-probs."""

    requires = ()

    def __call__(self, logprobs_RC, batch):
        return reinforce_term(logprobs_RC, batch.advantage)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            ``"A log pi (REINFORCE)"``.
        """
        return "A log pi (REINFORCE)"


@dataclasses.dataclass(frozen=True)
class TokenRatio(Surrogate):
    """``r_t Â`` (:func:`token_ratio_term`)."""

    def __call__(self, logprobs_RC, batch):
        return token_ratio_term(logprobs_RC, self._old(batch), batch.advantage)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            ``"r A (token ratio)"``.
        """
        return "r A (token ratio)"
