"""Binary trust-region masks: DPPO's divergence masks and DeepSeek-V3.2's off-policy sequence mask.

Both drop tokens from the gradient instead of clipping a ratio: a detached 0/1 mask ``M_t``
multiplies the term, so a masked token keeps no gradient and an unmasked one keeps its full
weight.

* DPPO (Divergence PPO, arXiv 2602.04879) measures the distance of the sampled token's
  probability ``p = π_θ(y_t)`` from ``p_old = π_old(y_t)`` directly — the total variation
  ``|p - p_old|`` or the KL of the two Bernoulli distributions ``(p_old, 1-p_old)`` and
  ``(p, 1-p)`` — rather than the ratio ``p/p_old`` that over-penalizes rare tokens.
* OPSM (off-policy sequence masking, DeepSeek-V3.2, arXiv 2512.02556) drops the negative-advantage
  sequences whose mean token log-ratio ``log(μ/π_θ)`` exceeds ``δ``.
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators._common import (
    capped_exp,
    check_nonnegative,
    check_positive,
    loss_token_counts,
    require,
    sequence_sum,
    to_tokens,
)
from tokenmdp.estimators.surrogates.token import Surrogate, SurrogateTerms

__all__ = ["DPPO", "OffPolicySequenceMask", "dppo_keep_mask", "dppo_term",
           "off_policy_sequence_keep_mask"]

DIVERGENCES = ("tv", "kl")


def _check_divergence(divergence: str) -> None:
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence: expected one of {', '.join(DIVERGENCES)}, got "
                         f"{divergence!r}")


def _xlogy(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x log y``, 0 where ``x = 0``, for ``x`` in ``[0, 1]``: ``log y`` held to the finite
    range, then multiplied by ``x`` (``torch.xlogy`` has no vectorized CPU kernel and costs a
    few times more). Equal to ``torch.xlogy`` up to the rounding of ``log``, except that
    ``x log 0`` is ``-x · float max`` instead of ``-∞`` (for ``x > 0``: the binary KL below is
    then huge instead of infinite, the same side of every threshold).

    """
    return _xlogy_(x, torch.clone(y))


def _xlogy_(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """:func:`_xlogy` written over ``y``."""
    big = torch.finfo(y.dtype).max
    return y.log_().clamp_(-big, big).mul_(x)


def _binary_kl_constant(p_old: torch.Tensor, logp_old: torch.Tensor, q_old: torch.Tensor
                       ) -> torch.Tensor:
    """``p_old log p_old + q_old log q_old`` (``q_old = 1 - p_old``): the part of the binary KL
    that does not depend on ``p``."""
    return p_old * logp_old + _xlogy(q_old, q_old)


def _binary_kl_sum(p_old: torch.Tensor, logp: torch.Tensor, q_old_log_q: torch.Tensor
                   ) -> torch.Tensor:
    """``q_old log q + p_old log p`` written over ``q_old_log_q``: the binary KL is
    ``D = constant - this``, so ``D > δ`` is ``this < constant - δ`` (the formula of DPPO's mask
    on both loss paths)."""
    return q_old_log_q.addcmul_(p_old, logp)


def dppo_keep_mask(logprobs_RC: torch.Tensor, old_logprobs_RC: torch.Tensor,
                   advantages_RC: torch.Tensor, *, divergence: str, delta_low: float,
                   delta_high: float) -> torch.Tensor:
    """DPPO's binary mask ``M_t`` (bool, detached): False where the update moves the token
    beyond the trust region in the direction its advantage pushes.

    With ``p = π_θ(y_t)``, ``p_old = π_old(y_t)``:

    * ``"tv"``: drop ``Â > 0`` tokens with ``p - p_old > δ_high`` and ``Â <= 0`` tokens with
      ``p - p_old < -δ_low``;
    * ``"kl"``: ``D = p_old log(p_old/p) + (1-p_old) log((1-p_old)/(1-p))`` (binary KL); drop
      ``Â > 0`` tokens with ``D > δ_high`` and ``p > p_old``, and ``Â <= 0`` tokens with
      ``D > δ_low`` and ``p < p_old`` (the direction read on the log-probs, exactly).

    Parameters
    ----------
    logprobs_RC : Tensor ``[R, C]``
        ``log π_θ`` of each token.
    old_logprobs_RC : Tensor ``[R, C]``
        ``log π_old`` of each token.
    advantages_RC : Tensor ``[R, C]``
        ``Â`` of each token.
    divergence : {'tv', 'kl'}
        The divergence of the trust region.
    delta_low, delta_high : float
        The thresholds (> 0) for decreasing and increasing ``p``.

    Returns
    -------
    BoolTensor ``[R, C]``
        ``M_t``: True where the token keeps its gradient.
    """
    _check_divergence(divergence)
    check_positive("delta_low", delta_low)
    check_positive("delta_high", delta_high)
    with torch.no_grad():
        logp, logp_old = logprobs_RC.detach(), old_logprobs_RC
        p, p_old = logp.exp(), logp_old.exp()
        if divergence == "tv":
            up, down = p - p_old > delta_high, p - p_old < -delta_low
        else:
            q, q_old = -torch.expm1(logp), -torch.expm1(logp_old)     # 1 - p, 1 - p_old
            # D > δ as q_old log q + p_old log p < constant - δ
            t = _binary_kl_sum(p_old, logp, _xlogy_(q_old, q))
            constant = _binary_kl_constant(p_old, logp_old, q_old)
            scalar = constant.new_tensor
            over_high = t < constant - scalar(delta_high)
            over_low = t < constant - scalar(delta_low)
            # the direction on the log-probs: the same as p > p_old (exp increases), exactly
            up, down = over_high & (logp > logp_old), over_low & (logp < logp_old)
        pos = advantages_RC > 0
        return ~torch.where(pos, up, down)


def dppo_term(logprobs_RC: torch.Tensor, old_logprobs_RC: torch.Tensor,
              advantages_RC: torch.Tensor, *, divergence: str, delta_low: float,
              delta_high: float, cap: float | None = None) -> SurrogateTerms:
    """``M_t sg(min(r_t, C)) Â log π_θ`` (DPPO-Binary-TV / -KL, Qi et al., arXiv 2602.04879),
    ``M_t`` from :func:`dppo_keep_mask`. Gradient ``M_t min(r_t, C) Â ∇log π_t``: REINFORCE
    on-policy, the unclipped token ratio inside the trust region.

    Parameters
    ----------
    logprobs_RC : Tensor ``[R, C]``
        ``log π_θ`` of each token (differentiable).
    old_logprobs_RC : Tensor ``[R, C]``
        ``log π_old`` of each token.
    advantages_RC : Tensor ``[R, C]``
        ``Â`` of each token.
    divergence : {'tv', 'kl'}
        The divergence of the trust region.
    delta_low, delta_high : float
        The thresholds (> 0) of :func:`dppo_keep_mask`.
    cap : float, optional
        ``C > 0``, a truncation of the ratio weight (verl's ``clip_ratio_c``); None: no cap
        beyond ``e^20``.

    Returns
    -------
    SurrogateTerms
        The term, the masked tokens (``~M_t``) and the capped ratio.
    """
    if cap is not None:
        check_positive("cap", cap)
    keep = dppo_keep_mask(logprobs_RC, old_logprobs_RC, advantages_RC, divergence=divergence,
                          delta_low=delta_low, delta_high=delta_high)
    ratio = capped_exp(logprobs_RC.detach() - old_logprobs_RC)
    weight = ratio if cap is None else ratio.clamp(max=cap)
    return SurrogateTerms(torch.where(keep, weight, 0.0) * advantages_RC * logprobs_RC, ~keep,
                          ratio)


def off_policy_sequence_keep_mask(logprobs_RC: torch.Tensor, sampling_logprobs_RC: torch.Tensor,
                                  advantages_RC: torch.Tensor, batch: TokenBatch, *,
                                  delta: float) -> torch.Tensor:
    """OPSM's mask (bool, detached): False on the tokens with ``Â_t < 0`` of the sequences with
    ``(1/|y|) Σ_t log(μ(y_t)/π_θ(y_t)) > δ`` (DeepSeek-V3.2, arXiv 2512.02556, Eq. 9).

    Parameters
    ----------
    logprobs_RC : Tensor ``[R, C]``
        ``log π_θ`` of each token.
    sampling_logprobs_RC : Tensor ``[R, C]``
        ``log μ`` of each token (the policy that sampled it).
    advantages_RC : Tensor ``[R, C]``
        ``Â`` of each token.
    batch : TokenBatch
        The batch the tokens belong to (its ``sequence_id`` and ``loss_mask``).
    delta : float
        The threshold ``δ >= 0`` on the mean log-ratio (nats per token).

    Returns
    -------
    BoolTensor ``[R, C]``
        True where the token keeps its gradient.
    """
    check_nonnegative("delta", delta)
    with torch.no_grad():
        log_q = torch.where(batch.loss_mask, sampling_logprobs_RC - logprobs_RC.detach(), 0.0)
        mean_S = sequence_sum(log_q, batch) / loss_token_counts(batch).clamp(min=1)
        far = to_tokens(mean_S > delta, batch)
        return ~(far & (advantages_RC < 0))


# ---------------------------------------------------------------------- composable parts
@dataclasses.dataclass(frozen=True)
class DPPO(Surrogate):
    """DPPO's masked ratio-weighted likelihood (:func:`dppo_term`).

    Parameters
    ----------
    divergence : {'tv', 'kl'}, default 'tv'
        Total variation or binary KL.
    delta_low : float, default 0.15
        Threshold for decreasing ``p`` (verl's example: 0.15 TV, 0.05 KL).
    delta_high : float, default 0.15
        Threshold for increasing ``p`` (verl's example: 0.15 TV, 0.05 KL).
    cap : float, optional
        Truncation ``C`` of the ratio weight, or None (default: none).
    """

    divergence: str = "tv"
    delta_low: float = 0.15
    delta_high: float = 0.15
    cap: float | None = None

    def __post_init__(self):
        _check_divergence(self.divergence)
        check_positive("delta_low", self.delta_low)
        check_positive("delta_high", self.delta_high)
        if self.cap is not None:
            check_positive("cap", self.cap)

    def __call__(self, logprobs_RC, batch):
        return dppo_term(logprobs_RC, self._old(batch), batch.advantage,
                         divergence=self.divergence, delta_low=self.delta_low,
                         delta_high=self.delta_high, cap=self.cap)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            For example ``"DPPO M_tv(0.15, 0.15) sg(r) A log pi"``.
        """
        cap = "" if self.cap is None else f", cap {self.cap:g}"
        return (f"DPPO M_{self.divergence}({self.delta_low:g}, {self.delta_high:g}) "
                f"sg(r) A log pi{cap}")


@dataclasses.dataclass(frozen=True)
class OffPolicySequenceMask(Surrogate):
    """``M_i · base term``: OPSM (:func:`off_policy_sequence_keep_mask`) around a surrogate.

    The sampling policy is ``μ`` (``behavior_logprob``) when ``against='behavior'`` (DeepSeek's
    rollout engine; TRL's sampling log-probs) or ``π_old`` when ``against='old'`` (TRL's
    fallback without them).

    Parameters
    ----------
    base : Surrogate
        The surrogate whose term is masked (for example ``PPOClip()``).
    delta : float, default 0.5
        The threshold ``δ`` (the paper states none; TRL's documentation suggests 0.5).
    against : {'behavior', 'old'}, default 'behavior'
        The sampling log-probs of the divergence.
    """

    base: Surrogate
    delta: float = 0.5
    against: str = "behavior"

    def __post_init__(self):
        if not isinstance(self.base, Surrogate):
            raise TypeError(f"base: expected a Surrogate, got {self.base!r}")
        check_nonnegative("delta", self.delta)
        if self.against not in ("behavior", "old"):
            raise ValueError(f"against: expected 'behavior' or 'old', got {self.against!r}")

    @property
    def requires(self) -> tuple[str, ...]:  # numpydoc ignore=RT01
        """The base surrogate's fields and the sampling log-probs."""
        field = "behavior_logprob" if self.against == "behavior" else "old_logprob"
        return tuple(dict.fromkeys((*self.base.requires, field)))

    def prepare_step(self, batch, step):  # numpydoc ignore=PR01,RT01
        """The base surrogate's step-wide preparation."""
        return self.base.prepare_step(batch, step)

    def __call__(self, logprobs_RC, batch):
        field = "behavior_logprob" if self.against == "behavior" else "old_logprob"
        sampling = require(batch, field, f"surrogate {self.describe()}")
        keep = off_policy_sequence_keep_mask(logprobs_RC, sampling, batch.advantage, batch,
                                             delta=self.delta)
        terms = self.base(logprobs_RC, batch)
        clipped = ~keep if terms.clipped_RC is None else terms.clipped_RC | ~keep
        return terms._replace(term_RC=torch.where(keep, terms.term_RC, 0.0), clipped_RC=clipped)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            The base's label and the mask, for example ``"... + OPSM(0.5, mu)"``.
        """
        ref = "mu" if self.against == "behavior" else "pi_old"
        return f"{self.base.describe()} + OPSM({self.delta:g}, {ref})"

