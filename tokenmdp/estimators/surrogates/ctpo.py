"""CTPO: the cumulative token ratio with a position-adaptive, log-space PPO clip.

CTPO (Zhang, Ye, Jin, Yu, Xiong, Sahu, Jiang, "Rethinking importance sampling in LLM policy
optimization: a cumulative token perspective", arXiv 2605.07331) weights token t by the
cumulative ratio of its prefix and itself, ``ρ_{1:t} = Π_{s<=t} π_θ(y_s)/q(y_s)`` (the
per-decision IS of :mod:`~tokenmdp.estimators.surrogates.per_decision`), and clips it the PPO way in log
space with bounds that grow with the position, since ``Var(log ρ_{1:t})`` grows like ``t``.
The definition below is that of the authors' implementation (github.com/horizon-llm/CTPO, loss
``cum-token-cumprod-la`` in ``verl/trainer/ppo/core_algos.py``, defaults from there and from its
``ctpo.sh``): with ``L_t = Σ_{s<=t} clamp(log π_θ(y_s) - log q(y_s), ±20)`` over the loss tokens
of the sequence, ``L_t`` held at ``max_log_ratio`` (10), ``t`` the 1-based index of the token
among its sequence's loss tokens and ``τ_t = t^power``,

* the bounds ``lo_t = -clip_low · τ_t``, ``hi_t = clip_high · τ_t``, ``c_t = dual_clip · τ_t``;
* the term ``min(e^L Â, e^{clamp(L, lo, hi)} Â)``, and for ``Â < 0`` at least ``e^{c_t} Â``
  (a dual clip that is always on), that is ``Â e^{min(L, hi)}`` for ``Â > 0`` and
  ``Â e^{clamp(L, lo, c)}`` for ``Â < 0``;
* the gradient through token t's own log-probability only (the prefix ratio is a weight:
  ``L = sg(L) + log π_t - sg(log π_t)``): ``Â e^L ∇log π_t`` where the clip is not active
  (``L <= hi`` for ``Â > 0``, ``lo <= L <= c`` for ``Â < 0``) and ``L`` is below its cap,
  0 elsewhere.

``power = 0`` is the uniform-clip CTPO (the authors' ``cum-token-cumprod``). Defaults
``clip_low = 0.025``, ``clip_high = 0.05``, ``dual_clip = 0.05``, ``power = 0.5``: at ``t = 1``
the window is ``[0.975, 1.051]``, at ``t = 100`` ``[0.78, 1.65]``.
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators._common import (
    MAX_LOG_RATIO,
    check_nonnegative,
    check_positive,
    require,
    with_derivative,
)
from tokenmdp.estimators.surrogates.per_decision import cumulative_log_ratio
from tokenmdp.estimators.surrogates.token import Surrogate, SurrogateTerms

__all__ = ["CTPOClip", "ctpo_bounds", "ctpo_term"]


def ctpo_bounds(batch: TokenBatch, *, clip_low: float, clip_high: float, dual_clip: float,
                power: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The log-space bounds ``(lo_t, hi_t, c_t)`` of every loss token (0 elsewhere).

    Parameters
    ----------
    batch : TokenBatch
        The batch (its ``sequence_id``, ``position`` and ``loss_mask``).
    clip_low, clip_high, dual_clip : float
        The base values (> 0) of ``-lo``, ``hi`` and ``c`` at ``t = 1``.
    power : float
        ``τ_t = t^power``, ``t`` the 1-based index among the sequence's loss tokens.

    Returns
    -------
    lo, hi, c : Tensor ``[R, C]``
        ``-clip_low τ_t``, ``clip_high τ_t`` and ``dual_clip τ_t``.
    """
    t = cumulative_log_ratio(batch.loss_mask.to(batch.dtype), batch)
    scale = torch.where(batch.loss_mask, t.clamp(min=1).pow(power), 0.0)
    return -clip_low * scale, clip_high * scale, dual_clip * scale


def ctpo_term(logprobs_RC: torch.Tensor, sampling_logprobs_RC: torch.Tensor,
              advantages_RC: torch.Tensor, batch: TokenBatch, *, clip_low: float = 0.025,
              clip_high: float = 0.05, dual_clip: float = 0.05, power: float = 0.5,
              max_log_ratio: float = 10.0) -> SurrogateTerms:
    """CTPO's clipped cumulative-ratio term (see the module docstring for the formula).

    Parameters
    ----------
    logprobs_RC : Tensor ``[R, C]``
        ``log π_θ`` of each token (differentiable).
    sampling_logprobs_RC : Tensor ``[R, C]``
        ``log q``: ``log π_old`` (the authors' setting) or ``log μ``.
    advantages_RC : Tensor ``[R, C]``
        ``Â`` of each token.
    batch : TokenBatch
        The batch the tokens belong to.
    clip_low, clip_high, dual_clip : float, default 0.025, 0.05, 0.05
        The log-space base bounds (> 0).
    power : float, default 0.5
        The position exponent (>= 0; 0 is a uniform clip).
    max_log_ratio : float, default 10.0
        The cap on ``L_t`` (the value is held there, no gradient above it).

    Returns
    -------
    SurrogateTerms
        The term and where the clip (or the cap) removed the gradient; no ratio.
    """
    _check(clip_low, clip_high, dual_clip, power, max_log_ratio)
    with torch.no_grad():
        log_r = (logprobs_RC - sampling_logprobs_RC).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        cum = cumulative_log_ratio(log_r, batch)
        held = cum.clamp(max=max_log_ratio)
        lo, hi, c = ctpo_bounds(batch, clip_low=clip_low, clip_high=clip_high,
                                dual_clip=dual_clip, power=power)
        positive = advantages_RC > 0
        clipped_log = torch.where(positive, held.clamp(max=hi), held.clamp(min=lo).clamp(max=c))
        value = clipped_log.exp().mul_(advantages_RC)
        free = torch.where(positive, held <= hi, (held >= lo) & (held <= c))
        free &= (cum <= max_log_ratio) & batch.loss_mask
        derivative = torch.where(free, held.exp() * advantages_RC, 0.0)
        clipped = ~free & batch.loss_mask & (advantages_RC != 0)
    return SurrogateTerms(with_derivative(logprobs_RC, value, derivative), clipped)


def _check(clip_low, clip_high, dual_clip, power, max_log_ratio) -> None:
    for name, value in (("clip_low", clip_low), ("clip_high", clip_high),
                        ("dual_clip", dual_clip), ("max_log_ratio", max_log_ratio)):
        check_positive(name, value)
    check_nonnegative("power", power)


@dataclasses.dataclass(frozen=True)
class CTPOClip(Surrogate):
    """CTPO-LA (:func:`ctpo_term`; arXiv 2605.07331, the authors' ``cum-token-cumprod-la``).

    Parameters
    ----------
    clip_low : float, default 0.025
        ``-lo_1``, the log-space lower bound at ``t = 1`` (authors' ``la_clip_low``).
    clip_high : float, default 0.05
        ``hi_1`` (``la_clip_high``).
    dual_clip : float, default 0.05
        ``c_1``, the dual clip of negative advantages (``la_clip_c``).
    power : float, default 0.5
        Bounds scale with ``t^power`` (``clip_ratio_la_power``; 0 = uniform CTPO).
    against : {'old', 'behavior'}, default 'old'
        The ratio's denominator: ``π_old`` (the authors' verl setting, with verl's rollout
        correction on ``π_old/μ`` as a separate part) or ``μ``.
    max_log_ratio : float, default 10.0
        The cap on the cumulative log-ratio.
    """

    clip_low: float = 0.025
    clip_high: float = 0.05
    dual_clip: float = 0.05
    power: float = 0.5
    against: str = "old"
    max_log_ratio: float = 10.0

    def __post_init__(self):
        _check(self.clip_low, self.clip_high, self.dual_clip, self.power, self.max_log_ratio)
        if self.against not in ("old", "behavior"):
            raise ValueError(f"against: expected 'old' or 'behavior', got {self.against!r}")

    @property
    def requires(self) -> tuple[str, ...]:  # numpydoc ignore=RT01
        """``old_logprob`` or ``behavior_logprob``, as ``against`` says."""
        return ("old_logprob",) if self.against == "old" else ("behavior_logprob",)

    def __call__(self, logprobs_RC, batch):
        sampling = require(batch, self.requires[0], f"surrogate {self.describe()}")
        return ctpo_term(logprobs_RC, sampling, batch.advantage, batch, clip_low=self.clip_low,
                         clip_high=self.clip_high, dual_clip=self.dual_clip, power=self.power,
                         max_log_ratio=self.max_log_ratio)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            For example ``"CTPO rho_1:t clip [-0.025, 0.05] t^0.5, dual 0.05"``.
        """
        return (f"CTPO rho_1:t clip [-{self.clip_low:g}, {self.clip_high:g}] "
                f"t^{self.power:g}, dual {self.dual_clip:g}")
