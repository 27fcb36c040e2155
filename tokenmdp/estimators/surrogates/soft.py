"""Soft and geometric surrogates: SAPO's temperature gate, GMPO's geometric mean, an entropy bonus.

Notation as in :mod:`~tokenmdp.estimators.surrogates.token`: ``r_t = π_θ/π_old``, ``Â`` the token's
advantage, ``sg`` stop-gradient. Ratios are formed in log space and held at ``e^20``
(:data:`~tokenmdp.estimators._common.MAX_LOG_RATIO`). On-policy (``r = 1``) each surrogate's
gradient is REINFORCE's ``Â ∇log π`` (the entropy bonus adds its own term).
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators._common import (
    MAX_LOG_RATIO,
    capped_exp,
    check_nonnegative,
    check_positive,
    loss_token_counts,
    sequence_sum,
    to_tokens,
    with_derivative,
)
from tokenmdp.estimators.surrogates.token import Surrogate, SurrogateTerms, _check_eps

__all__ = ["GMPO", "SAPO", "EntropyBonus", "entropy_bonus_term", "gmpo_term", "sapo_term"]


def sapo_term(logprobs_RC: torch.Tensor, old_logprobs_RC: torch.Tensor,
              advantages_RC: torch.Tensor, *, tau_pos: float, tau_neg: float) -> SurrogateTerms:
    """``f_τ(r_t) Â`` with the soft gate ``f_τ(r) = (4/τ) σ(τ (r - 1))`` (SAPO, Gao et al.,
    arXiv 2511.20347, Eq. 4-5); ``τ = τ_pos`` where ``Â > 0``, ``τ_neg`` elsewhere.

    Gradient ``w_t Â ∇log π_t`` with ``w_t = 4 σ(1 - σ) r_t``, ``σ = σ(τ (r_t - 1))``: 1 at
    ``r = 1`` (REINFORCE on-policy), decaying smoothly away from it instead of PPO's hard zero.

    Parameters
    ----------
    logprobs_RC : Tensor ``[R, C]``
        ``log π_θ`` of each token (differentiable).
    old_logprobs_RC : Tensor ``[R, C]``
        ``log π_old`` of each token.
    advantages_RC : Tensor ``[R, C]``
        ``Â`` of each token.
    tau_pos, tau_neg : float
        The gate temperatures (> 0) for positive and for non-positive advantages.

    Returns
    -------
    SurrogateTerms
        The term and the capped ratio; no clip mask (the gate is never a hard clip).
    """
    check_positive("tau_pos", tau_pos)
    check_positive("tau_neg", tau_neg)
    with torch.no_grad():
        log_ratio = logprobs_RC - old_logprobs_RC
        ratio = capped_exp(log_ratio)
        tau = torch.where(advantages_RC > 0, ratio.new_tensor(tau_pos), ratio.new_tensor(tau_neg))
        gate = torch.sigmoid(tau * (ratio - 1))
        value = (4 / tau) * gate * advantages_RC
        weight = 4 * gate * (1 - gate) * ratio
        derivative = torch.where(log_ratio <= MAX_LOG_RATIO, weight * advantages_RC, 0.0)
    return SurrogateTerms(with_derivative(logprobs_RC, value, derivative), None, ratio)


def gmpo_term(logprobs_RC: torch.Tensor, old_logprobs_RC: torch.Tensor,
              advantages_RC: torch.Tensor, batch: TokenBatch, *, eps_low: float,
              eps_high: float) -> SurrogateTerms:
    """``g_i Â`` on each token, ``g_i = exp((1/|y_i|) Σ_t ℓ_t)`` the geometric mean of the
    token ratios clipped in log space (GMPO, Zhao et al., arXiv 2507.20673, Eq. 6-7):
    ``ℓ_t = sgn(Â) min(sgn(Â) log r_t, sgn(Â) clip(log r_t, -ε_low, ε_high))``, i.e. ``log r_t``
    capped at ``ε_high`` where ``Â > 0`` and floored at ``-ε_low`` where ``Â < 0``.

    Under sequence-mean-token-mean weights the tokens of sequence i sum to ``g_i Â / S``, the
    paper's ``1/G Σ_i`` objective; its gradient ``g_i Â mean_t 1[ℓ_t unclipped] ∇log π_t`` is
    REINFORCE's per-token mean on-policy. ``clipped_RC`` marks the clipped tokens.

    Parameters
    ----------
    logprobs_RC : Tensor ``[R, C]``
        ``log π_θ`` of each token (differentiable).
    old_logprobs_RC : Tensor ``[R, C]``
        ``log π_old`` of each token.
    advantages_RC : Tensor ``[R, C]``
        ``Â`` of each token (constant within a sequence, as the paper's).
    batch : TokenBatch
        The batch the tokens belong to (its ``sequence_id`` and ``loss_mask``).
    eps_low, eps_high : float
        The log-space clip band ``[-ε_low, ε_high]`` (each >= 0; the paper's ``(e^-0.4, e^0.4)``
        is 0.4, 0.4).

    Returns
    -------
    SurrogateTerms
        The term and the clipped tokens; no ratio.
    """
    _check_eps(eps_low, eps_high)
    log_r = torch.where(batch.loss_mask, logprobs_RC - old_logprobs_RC, 0.0)
    with torch.no_grad():
        pos, neg = advantages_RC > 0, advantages_RC < 0
        clipped = ((pos & (log_r > eps_high)) | (neg & (log_r < -eps_low))) & batch.loss_mask
        bound = torch.where(pos, log_r.new_tensor(eps_high), log_r.new_tensor(-eps_low))
    clipped_log_r = torch.where(clipped, bound, log_r)      # constant where clipped: no gradient
    log_g = sequence_sum(clipped_log_r, batch) / loss_token_counts(batch).clamp(min=1)
    return SurrogateTerms(to_tokens(capped_exp(log_g), batch) * advantages_RC, clipped)


def entropy_bonus_term(logprobs_RC: torch.Tensor,
                       old_logprobs_RC: torch.Tensor | None = None) -> torch.Tensor:
    """The sampled-token entropy term ``ĥ_t = -r_t log π_θ(y_t)`` (``r_t = 1`` without
    ``old_logprobs_RC``), whose gradient coefficient is ``-r_t log π_θ(y_t)``.

    Over ``y_t ~ π_old`` the value is an unbiased estimate of the entropy ``H(π_θ(·|s_t))`` and
    the gradient one of ``∇_θ H(π_θ(·|s_t))`` at the visited state (the score-function form
    ``-E[log π ∇log π]``; the derivative's ``-r_t`` part, of mean ``-E_θ[∇log π] = 0``, is
    dropped). This is the per-position entropy bonus of PPO (arXiv 1707.06347, Eq. 9) and of
    verl's ``entropy_coeff``, which differentiate the full distribution's entropy at each
    visited position; here only the sampled token's log-probability is available, so its
    estimator stands in. Neither differentiates the visitation of the states.

    Parameters
    ----------
    logprobs_RC : Tensor ``[R, C]``
        ``log π_θ`` of each token (differentiable).
    old_logprobs_RC : Tensor ``[R, C]``, optional
        ``log π_old`` of each token (the sampling policy of the step); None: on-policy.

    Returns
    -------
    Tensor ``[R, C]``
        ``ĥ_t``, differentiable in ``logprobs_RC``.
    """
    with torch.no_grad():
        neg_logp = -logprobs_RC
        if old_logprobs_RC is not None:
            log_ratio = logprobs_RC - old_logprobs_RC
            ratio = capped_exp(log_ratio)
            value = ratio * neg_logp
            derivative = torch.where(log_ratio <= MAX_LOG_RATIO, value, 0.0)
        else:
            value = derivative = neg_logp
    return with_derivative(logprobs_RC, value, derivative)


# ---------------------------------------------------------------------- composable parts
@dataclasses.dataclass(frozen=True)
class SAPO(Surrogate):
    """Soft adaptive policy optimization (:func:`sapo_term`).

    Parameters
    ----------
    tau_pos : float, default 1.0
        Gate temperature where ``Â > 0`` (paper 1.0).
    tau_neg : float, default 1.05
        Gate temperature where ``Â <= 0`` (paper 1.05: negative tokens decay faster).
    """

    tau_pos: float = 1.0
    tau_neg: float = 1.05

    def __post_init__(self):
        check_positive("tau_pos", self.tau_pos)
        check_positive("tau_neg", self.tau_neg)

    def __call__(self, logprobs_RC, batch):
        return sapo_term(logprobs_RC, self._old(batch), batch.advantage, tau_pos=self.tau_pos,
                         tau_neg=self.tau_neg)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            For example ``"SAPO gate (4/tau) sig(tau (r-1)), tau+ 1, tau- 1.05"``.
        """
        return f"SAPO gate (4/tau) sig(tau (r-1)), tau+ {self.tau_pos:g}, tau- {self.tau_neg:g}"


@dataclasses.dataclass(frozen=True)
class GMPO(Surrogate):
    """Geometric-mean policy optimization (:func:`gmpo_term`).

    Parameters
    ----------
    eps_low : float, default 0.4
        ``log r`` floor ``-ε_low`` where ``Â < 0`` (paper 0.4).
    eps_high : float, default 0.4
        ``log r`` cap ``ε_high`` where ``Â > 0`` (paper 0.4).
    """

    eps_low: float = 0.4
    eps_high: float = 0.4

    def __post_init__(self):
        _check_eps(self.eps_low, self.eps_high)

    def __call__(self, logprobs_RC, batch):
        return gmpo_term(logprobs_RC, self._old(batch), batch.advantage, batch,
                         eps_low=self.eps_low, eps_high=self.eps_high)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            For example ``"GMPO geo-mean clip(log r) [-0.4, 0.4]"``.
        """
        return f"GMPO geo-mean clip(log r) [-{self.eps_low:g}, {self.eps_high:g}]"


@dataclasses.dataclass(frozen=True)
class EntropyBonus(Surrogate):
    """``base term + c ĥ_t``: a surrogate plus the entropy bonus of :func:`entropy_bonus_term`.

    ``ĥ_t`` uses ``r_t = π_θ/π_old`` when the base surrogate reads ``old_logprob``, otherwise it
    is the on-policy ``-log π_θ``. The loss subtracts ``c ĥ`` with the base term, under the
    same loss weights and correction factor.

    Parameters
    ----------
    base : Surrogate
        The policy-gradient surrogate (for example ``PPOClip()``).
    coef : float, default 0.01
        The bonus coefficient ``c >= 0`` (PPO's Atari ``c_2`` 0.01).
    """

    base: Surrogate
    coef: float = 0.01

    def __post_init__(self):
        if not isinstance(self.base, Surrogate) or isinstance(self.base, EntropyBonus):
            raise TypeError(f"base: expected a Surrogate other than EntropyBonus, got "
                            f"{self.base!r}")
        check_nonnegative("coef", self.coef)

    @property
    def requires(self) -> tuple[str, ...]:  # numpydoc ignore=RT01
        """The base surrogate's fields."""
        return self.base.requires

    def prepare_step(self, batch, step):  # numpydoc ignore=PR01,RT01
        """The base surrogate's step-wide preparation."""
        return self.base.prepare_step(batch, step)

    def __call__(self, logprobs_RC, batch):
        terms = self.base(logprobs_RC, batch)
        old = self._old(batch) if "old_logprob" in self.base.requires else None
        bonus = entropy_bonus_term(logprobs_RC, old)
        return terms._replace(term_RC=terms.term_RC + self.coef * bonus)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            The base's label and ``" + 0.01 H"``.
        """
        return f"{self.base.describe()} + {self.coef:g} H"
