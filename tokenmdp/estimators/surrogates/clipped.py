"""Clipped token-level surrogates: PPO's clip (clip-higher, dual clip), CISPO and MiniRL.

Notation as in :mod:`~tokenmdp.estimators.surrogates.token`: ``r_t = π_θ/π_old``, ``Â`` the
token's advantage, ``sg`` stop-gradient, ``M_t`` the PPO mask; each function returns
:class:`~tokenmdp.estimators.SurrogateTerms` (the term, and where a clip or mask was active).
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmdp.estimators._common import (
    MAX_LOG_RATIO,
    capped_exp,
    check_nonnegative,
    with_derivative,
)
from tokenmdp.estimators.surrogates.token import Surrogate, SurrogateTerms, _check_eps

__all__ = ["CISPO", "MiniRL", "PPOClip", "cispo_term", "minirl_term", "ppo_clip_term",
           "ppo_keep_mask"]


def _check_dual_clip(dual_clip: float | None) -> None:
    check_nonnegative("dual_clip", dual_clip, allow_none=True)
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip: the dual-clip constant c must be > 1, got {dual_clip}")


def ppo_keep_mask(ratio_RC: torch.Tensor, advantages_RC: torch.Tensor, *, eps_low: float,
                  eps_high: float, dual_clip: float | None = None) -> torch.Tensor:
    """The PPO mask ``M_t`` (bool): False iff ``Â>0, r>1+ε_high`` or ``Â<0, r<1-ε_low`` (or,
    with dual clip ``c``, ``Â<0, r>c``) — exactly the tokens whose PPO-clip gradient is zero.

    Parameters
    ----------
    ratio_RC : Tensor ``[R, C]``
        ``r_t = π_θ/π_old`` of each token.
    advantages_RC : Tensor ``[R, C]``
        ``Â`` of each token.
    eps_low, eps_high : float
        The clip band ``[1 - ε_low, 1 + ε_high]`` (each >= 0).
    dual_clip : float, optional
        The dual-clip constant ``c > 1``, or None (no dual clip).

    Returns
    -------
    BoolTensor ``[R, C]``
        ``M_t``: True where the token keeps its gradient.
    """
    _check_eps(eps_low, eps_high)
    _check_dual_clip(dual_clip)
    pos, neg = advantages_RC > 0, advantages_RC < 0
    dropped = (pos & (ratio_RC > 1 + eps_high)) | (neg & (ratio_RC < 1 - eps_low))
    if dual_clip is not None:
        dropped = dropped | (neg & (ratio_RC > dual_clip))
    return ~dropped


def ppo_clip_term(logprobs_RC: torch.Tensor, old_logprobs_RC: torch.Tensor,
                  advantages_RC: torch.Tensor, *, eps_low: float, eps_high: float,
                  dual_clip: float | None = None) -> SurrogateTerms:
    """``min(r_t Â, clip(r_t, 1-ε_low, 1+ε_high) Â)`` (PPO, arXiv 1707.06347, Eq. 7; separate
    ε_low/ε_high: DAPO's clip-higher, arXiv 2503.14476); with ``dual_clip = c`` and ``Â < 0``:
    ``max(min(...), c Â)`` (Ye et al., arXiv 1912.09729). Gradient ``M_t r_t Â ∇log π_θ``.

    The value ``Â · (r if M else the bound r crossed)`` and the gradient coefficient ``M r Â``
    (0 where ``log r`` exceeds the cap) are computed without autograd and joined by
    ``with_derivative``: the same numbers as
    ``torch.minimum(r Â, clip(r) Â)`` under autograd (``tests/estimators`` compares them), with
    a one-product backward pass.

    Parameters
    ----------
    logprobs_RC : Tensor ``[R, C]``
        ``log π_θ`` of each token (differentiable).
    old_logprobs_RC : Tensor ``[R, C]``
        ``log π_old`` of each token.
    advantages_RC : Tensor ``[R, C]``
        ``Â`` of each token.
    eps_low, eps_high : float
        The clip band ``[1 - ε_low, 1 + ε_high]`` (each >= 0).
    dual_clip : float, optional
        The dual-clip constant ``c > 1``, or None (no dual clip).

    Returns
    -------
    SurrogateTerms
        The term, where the clip was active (``~M_t``) and the capped ratio.
    """
    _check_eps(eps_low, eps_high)
    _check_dual_clip(dual_clip)
    with torch.no_grad():
        log_ratio = logprobs_RC - old_logprobs_RC
        ratio = capped_exp(log_ratio)
        keep = ppo_keep_mask(ratio, advantages_RC, eps_low=eps_low, eps_high=eps_high,
                             dual_clip=dual_clip)
        # a dropped token sits on the bound it crossed: 1+ε_high (Â > 0), 1-ε_low (Â < 0, r
        # low) or, with dual clip, c (Â < 0, r > c); there min/max(r Â, bound Â) = bound Â
        scalar = ratio.new_tensor  # bounds as 0-dim tensors of the ratio's dtype (exact in float64)
        low_bound = scalar(1 - eps_low) if dual_clip is None else torch.where(
            ratio < 1 - eps_low, scalar(1 - eps_low), scalar(dual_clip))
        bound = torch.where(advantages_RC > 0, scalar(1 + eps_high), low_bound)
        value = torch.where(keep, ratio, bound).mul_(advantages_RC)
        coef = torch.where(keep & (log_ratio <= MAX_LOG_RATIO), ratio, 0.0).mul_(advantages_RC)
    return SurrogateTerms(with_derivative(logprobs_RC, value, coef), ~keep, ratio)


def cispo_term(logprobs_RC: torch.Tensor, old_logprobs_RC: torch.Tensor,
               advantages_RC: torch.Tensor, *, eps_low: float, eps_high: float,
               mask_eps_low: float | None = None, mask_eps_high: float | None = None
               ) -> SurrogateTerms:
    """``sg(clip(r_t, 1-ε_low, 1+ε_high)) Â log π_θ`` (CISPO, MiniMax-M1, arXiv 2506.13585).

    Clipped tokens keep their gradient ``clip(r_t) Â ∇log π_θ``. With ``mask_eps_low`` and
    ``mask_eps_high`` it is the paper's unified form, multiplied by the PPO mask ``M_t`` taken
    with those ε (both or neither). ``clipped_RC`` marks tokens whose weight was clipped or masked.

    Parameters
    ----------
    logprobs_RC : Tensor ``[R, C]``
        ``log π_θ`` of each token (differentiable).
    old_logprobs_RC : Tensor ``[R, C]``
        ``log π_old`` of each token.
    advantages_RC : Tensor ``[R, C]``
        ``Â`` of each token.
    eps_low, eps_high : float
        The IS-weight clip band ``[1 - ε_low, 1 + ε_high]`` (each >= 0).
    mask_eps_low, mask_eps_high : float, optional
        The ε of the PPO mask ``M_t`` of the unified form (both or neither; default: no mask).

    Returns
    -------
    SurrogateTerms
        The term, where the weight was clipped or masked, and the capped ratio.
    """
    _check_eps(eps_low, eps_high)
    if (mask_eps_low is None) != (mask_eps_high is None):
        raise ValueError("mask_eps_low, mask_eps_high: give both (unified form) or neither")
    # sg(r): CISPO's IS weight is a constant of the gradient, ∇term = clip(r) Â ∇log π.
    ratio = capped_exp(logprobs_RC.detach() - old_logprobs_RC)
    weight = ratio.clamp(1 - eps_low, 1 + eps_high)
    clipped = weight != ratio
    if mask_eps_low is not None:
        keep = ppo_keep_mask(ratio, advantages_RC, eps_low=mask_eps_low, eps_high=mask_eps_high)
        weight = weight * keep
        clipped = clipped | ~keep
    return SurrogateTerms(weight * advantages_RC * logprobs_RC, clipped, ratio)


def minirl_term(logprobs_RC: torch.Tensor, old_logprobs_RC: torch.Tensor,
                advantages_RC: torch.Tensor, *, eps_low: float, eps_high: float) -> SurrogateTerms:
    """``M_t sg(r_t) Â log π_θ`` (MiniRL, Zheng et al., arXiv 2512.01374), ``M_t`` the PPO mask.

    Times the correction factor ``π_old/μ`` this is the paper's ``M_t sg(ρ_t) Â log π_θ``. Its
    gradient ``M_t r_t Â ∇log π_θ`` is PPO-clip's; only the loss value differs.

    Parameters
    ----------
    logprobs_RC : Tensor ``[R, C]``
        ``log π_θ`` of each token (differentiable).
    old_logprobs_RC : Tensor ``[R, C]``
        ``log π_old`` of each token.
    advantages_RC : Tensor ``[R, C]``
        ``Â`` of each token.
    eps_low, eps_high : float
        The band ``[1 - ε_low, 1 + ε_high]`` of the mask ``M_t`` (each >= 0).

    Returns
    -------
    SurrogateTerms
        The term, where the mask dropped a token (``~M_t``) and the capped ratio.
    """
    _check_eps(eps_low, eps_high)
    # sg(r): the ratio weights the score, ∇term = M r Â ∇log π (the PPO-clip gradient).
    ratio = capped_exp(logprobs_RC.detach() - old_logprobs_RC)
    keep = ppo_keep_mask(ratio, advantages_RC, eps_low=eps_low, eps_high=eps_high)
    return SurrogateTerms(torch.where(keep, ratio, 0.0) * advantages_RC
                          * logprobs_RC, ~keep, ratio)


# ---------------------------------------------------------------------- composable parts
@dataclasses.dataclass(frozen=True)
class PPOClip(Surrogate):
    """``min(r Â, clip(r, 1-ε_low, 1+ε_high) Â)``, optional dual clip (:func:`ppo_clip_term`).

    Parameters
    ----------
    eps_low : float, default 0.2
        ε_low: lower clip ``1 - ε_low`` (PPO 0.2).
    eps_high : float, default 0.2
        ε_high: upper clip ``1 + ε_high`` (PPO 0.2; DAPO's clip-higher 0.28).
    dual_clip : float, optional
        Dual-clip constant ``c > 1`` for ``Â < 0`` (Ye et al. use 3), or None (default).
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None

    def __post_init__(self):
        _check_eps(self.eps_low, self.eps_high)
        _check_dual_clip(self.dual_clip)

    def __call__(self, logprobs_RC, batch):
        return ppo_clip_term(logprobs_RC, self._old(batch), batch.advantage, eps_low=self.eps_low,
                             eps_high=self.eps_high, dual_clip=self.dual_clip)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            For example ``"PPO clip [1-0.2, 1+0.28]"``.
        """
        dual = f", dual c={self.dual_clip:g}" if self.dual_clip is not None else ""
        return f"PPO clip [1-{self.eps_low:g}, 1+{self.eps_high:g}]{dual}"


@dataclasses.dataclass(frozen=True)
class CISPO(Surrogate):
    """``[M_t] sg(clip(r)) Â log π_θ`` (:func:`cispo_term`).

    Parameters
    ----------
    eps_low : float, default 1.0
        ε_low^IS; the paper sets no lower bound (1.0 gives the bound 0, i.e. none).
    eps_high : float, default 0.2
        ε_high^IS; tuned in the paper without one reported value (verl's example uses 0.2).
    mask_eps_low : float, optional
        ε_low of the PPO mask ``M_t`` of the unified form, or None (default: plain CISPO).
    mask_eps_high : float, optional
        ε_high of the PPO mask ``M_t`` of the unified form, or None (given with
        ``mask_eps_low``).
    """

    eps_low: float = 1.0
    eps_high: float = 0.2
    mask_eps_low: float | None = None
    mask_eps_high: float | None = None

    def __post_init__(self):
        _check_eps(self.eps_low, self.eps_high)
        if (self.mask_eps_low is None) != (self.mask_eps_high is None):
            raise ValueError("mask_eps_low, mask_eps_high: give both (unified form) or neither")
        if self.mask_eps_low is not None:
            _check_eps(self.mask_eps_low, self.mask_eps_high)

    def __call__(self, logprobs_RC, batch):
        return cispo_term(logprobs_RC, self._old(batch), batch.advantage, eps_low=self.eps_low,
                          eps_high=self.eps_high, mask_eps_low=self.mask_eps_low,
                          mask_eps_high=self.mask_eps_high)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            For example ``"CISPO sg(clip(r, 1-1, 1+0.2)) A log pi"``.
        """
        mask = ("" if self.mask_eps_low is None
                else f", M [1-{self.mask_eps_low:g}, 1+{self.mask_eps_high:g}]")
        return f"CISPO sg(clip(r, 1-{self.eps_low:g}, 1+{self.eps_high:g})) A log pi{mask}"


@dataclasses.dataclass(frozen=True)
class MiniRL(Surrogate):
    """``M_t sg(r_t) Â log π_θ`` (:func:`minirl_term`).

    Parameters
    ----------
    eps_low : float, default 0.2
        ε_low of the mask (MiniRL 0.2).
    eps_high : float, default 0.27
        ε_high of the mask (MiniRL 0.27).
    """

    eps_low: float = 0.2
    eps_high: float = 0.27

    def __post_init__(self):
        _check_eps(self.eps_low, self.eps_high)

    def __call__(self, logprobs_RC, batch):
        return minirl_term(logprobs_RC, self._old(batch), batch.advantage, eps_low=self.eps_low,
                           eps_high=self.eps_high)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            For example ``"M sg(r) A log pi, M [1-0.2, 1+0.27]"``.
        """
        return f"M sg(r) A log pi, M [1-{self.eps_low:g}, 1+{self.eps_high:g}]"
