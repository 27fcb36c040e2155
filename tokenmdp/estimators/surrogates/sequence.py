"""Sequence-level surrogates: a ratio per sequence, reduced through ``sequence_id``.

Each sequence ratio is one ``index_add`` of the token log-ratios over ``sequence_id`` (loss
tokens only) and one gather back to the tokens, so any layout works. ``|y_i|`` is the number of
loss tokens of sequence i. All ratios are formed in log space and held at ``e^20`` (see
:data:`~tokenmdp.estimators._common.MAX_LOG_RATIO`): a product of 4096 token ratios stays finite.

How a sequence term is spread over its tokens, so that on-policy every surrogate has
REINFORCE's gradient under every aggregation:

* sequence IS gives each token ``ρ(y) Â / |y|``: the tokens of a sequence sum to ``ρ(y) Â``;
* GSPO gives each token ``s_i Â`` with ``s_i`` the geometric mean, whose gradient already
  carries the ``1/|y|`` (``∇ s_i = s_i mean_t ∇log π_t``), as in the paper's
  ``1/G Σ_i`` objective under sequence-mean-token-mean weights.
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators._common import (
    MAX_LOG_RATIO,
    capped_exp,
    loss_token_counts,
    sequence_sum,
    to_tokens,
)
from tokenmdp.estimators.surrogates.clipped import ppo_keep_mask
from tokenmdp.estimators.surrogates.token import Surrogate, SurrogateTerms, _check_eps

__all__ = ["GSPO", "GSPOToken", "SequenceRatio", "gspo_term", "gspo_token_term",
           "sequence_log_ratio", "sequence_ratio_term"]


def sequence_log_ratio(logprobs_RC: torch.Tensor, old_logprobs_RC: torch.Tensor,
                       batch: TokenBatch, *, geometric: bool) -> torch.Tensor:
    """Float ``[S]``: ``Σ_t log r_t`` over the loss tokens of each sequence, or, with
    ``geometric``, its mean ``(1/|y|) Σ_t log r_t``. Differentiable in ``logprobs_RC``.

    Parameters
    ----------
    logprobs_RC : Tensor ``[R, C]``
        ``log π_θ`` of each token (differentiable).
    old_logprobs_RC : Tensor ``[R, C]``
        ``log π_old`` of each token.
    batch : TokenBatch
        The batch the tokens belong to (its ``sequence_id`` and ``loss_mask``).
    geometric : bool
        True: the mean over the loss tokens; False: the sum.

    Returns
    -------
    Tensor ``[S]``
        ``log ρ(y)`` (sum) or ``log s_i`` (mean) of each sequence.
    """
    log_r = logprobs_RC - old_logprobs_RC
    log_r = torch.where(batch.loss_mask, log_r, 0.0)
    total = sequence_sum(log_r, batch)
    return total / loss_token_counts(batch).clamp(min=1) if geometric else total


def sequence_ratio_term(logprobs_RC: torch.Tensor, old_logprobs_RC: torch.Tensor,
                        advantages_RC: torch.Tensor, batch: TokenBatch) -> SurrogateTerms:
    """``ρ(y) Â / |y|`` on each token, ``ρ(y) = exp(Σ_t log r_t)`` (sequence-level IS; Precup et
    al. 2000; per-sequence ratios for LLMs, arXiv 2512.01374). The tokens of a sequence sum to
    ``ρ(y) Â``, whose gradient ``ρ(y) Â Σ_t ∇log π_t`` is unbiased for ``∇J`` off-policy (with a
    sequence-level IS correction for ``π_old ≠ μ``); variance grows like ``(1+χ²)^T``.
    ``clipped_RC`` marks sequences whose ratio hit the ``e^20`` cap (no gradient there).

    Parameters
    ----------
    logprobs_RC : Tensor ``[R, C]``
        ``log π_θ`` of each token (differentiable).
    old_logprobs_RC : Tensor ``[R, C]``
        ``log π_old`` of each token.
    advantages_RC : Tensor ``[R, C]``
        ``Â`` of each token.
    batch : TokenBatch
        The batch the tokens belong to (its ``sequence_id`` and ``loss_mask``).

    Returns
    -------
    SurrogateTerms
        The term and the loss tokens of sequences whose ratio hit the cap; no ratio.
    """
    log_rho = sequence_log_ratio(logprobs_RC, old_logprobs_RC, batch, geometric=False)
    per_token = capped_exp(log_rho) / loss_token_counts(batch).clamp(min=1)
    with torch.no_grad():
        capped = to_tokens(log_rho > MAX_LOG_RATIO, batch) & batch.loss_mask
    return SurrogateTerms(to_tokens(per_token, batch) * advantages_RC, capped)


def _clipped_min(ratio_RC: torch.Tensor, advantages_RC: torch.Tensor, eps_low: float,
                 eps_high: float) -> SurrogateTerms:
    term = torch.minimum(ratio_RC * advantages_RC,
                         ratio_RC.clamp(1 - eps_low, 1 + eps_high) * advantages_RC)
    with torch.no_grad():
        clipped = ~ppo_keep_mask(ratio_RC, advantages_RC, eps_low=eps_low, eps_high=eps_high)
    return SurrogateTerms(term, clipped)


def gspo_term(logprobs_RC: torch.Tensor, old_logprobs_RC: torch.Tensor,
              advantages_RC: torch.Tensor, batch: TokenBatch, *, eps_low: float,
              eps_high: float) -> SurrogateTerms:
    """``min(s_i Â, clip(s_i, 1-ε_low, 1+ε_high) Â)``, ``s_i = exp((1/|y_i|) Σ_t log r_{i,t})``
    (GSPO, Zheng et al., arXiv 2507.18071; the paper's ranges are ε_low=3e-4, ε_high=4e-4).

    Parameters
    ----------
    logprobs_RC : Tensor ``[R, C]``
        ``log π_θ`` of each token (differentiable).
    old_logprobs_RC : Tensor ``[R, C]``
        ``log π_old`` of each token.
    advantages_RC : Tensor ``[R, C]``
        ``Â`` of each token.
    batch : TokenBatch
        The batch the tokens belong to (its ``sequence_id`` and ``loss_mask``).
    eps_low, eps_high : float
        The clip band ``[1 - ε_low, 1 + ε_high]`` of ``s_i`` (each >= 0).

    Returns
    -------
    SurrogateTerms
        The term and where the clip was active; no ratio.
    """
    _check_eps(eps_low, eps_high)
    log_s = sequence_log_ratio(logprobs_RC, old_logprobs_RC, batch, geometric=True)
    return _clipped_min(to_tokens(capped_exp(log_s), batch), advantages_RC, eps_low, eps_high)


def gspo_token_term(logprobs_RC: torch.Tensor, old_logprobs_RC: torch.Tensor,
                    advantages_RC: torch.Tensor, batch: TokenBatch, *, eps_low: float,
                    eps_high: float) -> SurrogateTerms:
    """GSPO-token (arXiv 2507.18071): ``min(s_{i,t} Â_{i,t}, clip(s_{i,t}) Â_{i,t})`` with
    ``s_{i,t} = sg[s_i] · π_θ(y_t)/sg[π_θ(y_t)]``. Same value as GSPO; the gradient of token t is
    ``s_i Â_{i,t} ∇log π_t``, so it equals GSPO's when ``Â`` is constant within each sequence
    and allows per-token advantages otherwise.

    Parameters
    ----------
    logprobs_RC : Tensor ``[R, C]``
        ``log π_θ`` of each token (differentiable).
    old_logprobs_RC : Tensor ``[R, C]``
        ``log π_old`` of each token.
    advantages_RC : Tensor ``[R, C]``
        ``Â_{i,t}`` of each token.
    batch : TokenBatch
        The batch the tokens belong to (its ``sequence_id`` and ``loss_mask``).
    eps_low, eps_high : float
        The clip band ``[1 - ε_low, 1 + ε_high]`` of ``s_{i,t}`` (each >= 0).

    Returns
    -------
    SurrogateTerms
        The term and where the clip was active; no ratio.
    """
    _check_eps(eps_low, eps_high)
    # sg[s_i]: the sequence ratio enters as a value; each token's gradient comes only through its
    # own factor π/sg[π] (value 1, gradient ∇log π_t), GSPO-token's ∇s_{i,t} = s_i ∇log π_t.
    log_s = sequence_log_ratio(logprobs_RC.detach(), old_logprobs_RC, batch, geometric=True)
    own = torch.exp(logprobs_RC - logprobs_RC.detach())
    return _clipped_min(to_tokens(capped_exp(log_s), batch) * own, advantages_RC, eps_low, eps_high)


# ---------------------------------------------------------------------- composable parts
@dataclasses.dataclass(frozen=True)
class SequenceRatio(Surrogate):
    """``ρ(y) Â / |y|`` per token (:func:`sequence_ratio_term`); ``ρ`` against ``π_old``."""

    def __call__(self, logprobs_RC, batch):
        return sequence_ratio_term(logprobs_RC, self._old(batch), batch.advantage, batch)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            ``"rho(y) A / |y| (sequence ratio)"``.
        """
        return "rho(y) A / |y| (sequence ratio)"


@dataclasses.dataclass(frozen=True)
class GSPO(Surrogate):
    """Clipped geometric-mean sequence ratio (:func:`gspo_term`).

    Parameters
    ----------
    eps_low : float, default 3e-4
        ε_low (GSPO 3e-4).
    eps_high : float, default 4e-4
        ε_high (GSPO 4e-4).
    """

    eps_low: float = 3e-4
    eps_high: float = 4e-4

    def __post_init__(self):
        _check_eps(self.eps_low, self.eps_high)

    def __call__(self, logprobs_RC, batch):
        return gspo_term(logprobs_RC, self._old(batch), batch.advantage, batch,
                         eps_low=self.eps_low, eps_high=self.eps_high)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            For example ``"GSPO clip(s_i) [1-0.0003, 1+0.0004]"``.
        """
        return f"GSPO clip(s_i) [1-{self.eps_low:g}, 1+{self.eps_high:g}]"


@dataclasses.dataclass(frozen=True)
class GSPOToken(Surrogate):
    """GSPO-token (:func:`gspo_token_term`).

    Parameters
    ----------
    eps_low : float, default 3e-4
        ε_low (GSPO 3e-4).
    eps_high : float, default 4e-4
        ε_high (GSPO 4e-4).
    """

    eps_low: float = 3e-4
    eps_high: float = 4e-4

    def __post_init__(self):
        _check_eps(self.eps_low, self.eps_high)

    def __call__(self, logprobs_RC, batch):
        return gspo_token_term(logprobs_RC, self._old(batch), batch.advantage, batch,
                               eps_low=self.eps_low, eps_high=self.eps_high)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            For example ``"GSPO-token clip(s_it) [1-0.0003, 1+0.0004]"``.
        """
        return f"GSPO-token clip(s_it) [1-{self.eps_low:g}, 1+{self.eps_high:g}]"
