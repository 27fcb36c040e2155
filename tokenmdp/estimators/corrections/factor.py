"""Corrections of the training–inference gap: the detached factor ``w = π_old / μ``.

The full token weight decomposes exactly (Zheng et al. 2025, arXiv 2512.01374):
``ρ_t = π_θ/μ = (π_old/μ)_t · (π_θ/π_old)_t`` — training–inference discrepancy times staleness.
Surrogates handle ``r_t = π_θ/π_old``; a correction turns ``w`` into a per-token multiplier that
is a constant of the step (``π_old`` and ``μ`` do not depend on θ, so there is nothing to detach):

* none — ablation ("w/o train-infer IS");
* IS — ``w``;
* truncated IS (TIS, Yao et al. 2025, "Your efficient RL framework secretly brings you
  off-policy RL training") — ``min(w, C)``, or ``clamp(w, F, C)`` with a floor;
* masked IS (MIS; IcePop, arXiv 2510.18855, uses the band ``[0.5, 5]``) — ``w · 1{α <= w <= β}``.

Each at one of three :class:`Level` s: per token ``w_t``; per sequence the product
``W_i = Π_t w_t`` (log space); or per sequence the geometric mean ``exp(mean_t log w_t)``. A
sequence-level factor multiplies every token of its sequence. Masked IS states whether rejected
tokens stay in the loss normalizer (most frameworks keep them: masking shrinks the step rather
than re-weighting the rest); :func:`~tokenmdp.estimators.prepare` reads that choice.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import NamedTuple

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators._common import (
    MAX_LOG_RATIO,
    capped_exp,
    check_nonnegative,
    check_positive,
    loss_token_counts,
    require,
    sequence_sum,
    to_tokens,
)

__all__ = [
    "Correction", "CorrectionFactor", "ImportanceSampling", "Level", "MaskedIS", "NoCorrection",
    "TruncatedIS", "importance_weight", "level_log_weight", "masked_importance_weight",
    "training_inference_log_weight", "truncated_importance_weight",
]


# PR01 would ask for the parameters of Enum's functional API (names, module, qualname, ...).
class Level(enum.Enum):  # numpydoc ignore=PR01
    """Where the factor ``w`` is formed: per token, per sequence (product), geometric mean.

    Parameters
    ----------
    value : str
        A member's value: ``Level("sequence")`` is ``Level.SEQUENCE``.
    """

    TOKEN = "token"
    SEQUENCE = "sequence"
    GEOMETRIC = "geometric"


def _coerce_level(correction) -> None:
    """``correction.level`` as a :class:`Level` (its value, ``"sequence"``, is accepted too)."""
    level = correction.level
    if isinstance(level, str):
        try:
            level = Level(level)
        except ValueError:
            raise ValueError(f"level: expected one of {', '.join(v.value for v in Level)}, got "
                             f"{level!r}") from None
    if not isinstance(level, Level):
        raise TypeError(f"level: expected a Level, got {type(level).__name__}")
    object.__setattr__(correction, "level", level)


class CorrectionFactor(NamedTuple):
    """A correction's output: ``factor_RC`` (None = 1) and ``keep_RC`` (None = all kept).

    Parameters
    ----------
    factor_RC : Tensor ``[R, C]`` or None
        The detached per-token multiplier of the surrogate; None means 1 everywhere.
    keep_RC : BoolTensor ``[R, C]`` or None
        The tokens a masked correction kept; None means all kept.
    """

    factor_RC: torch.Tensor | None
    keep_RC: torch.Tensor | None


def training_inference_log_weight(old_logprobs_RC: torch.Tensor, behavior_logprobs_RC: torch.Tensor,
                                  loss_mask_RC: torch.Tensor) -> torch.Tensor:
    """``log w_t = log π_old(y_t) - log μ(y_t)`` on loss tokens, 0 elsewhere.

    Parameters
    ----------
    old_logprobs_RC : Tensor ``[R, C]``
        ``log π_old`` of each token (finite; a new tensor is returned, this one is not changed).
    behavior_logprobs_RC : Tensor ``[R, C]``
        ``log μ`` of each token, from the inference engine that drew it.
    loss_mask_RC : BoolTensor ``[R, C]``
        The loss tokens.

    Returns
    -------
    Tensor ``[R, C]``
        ``log w_t`` on the loss tokens, 0 elsewhere.
    """
    # batch log-probs are finite, so a product with the 0/1 mask zeroes the rest in place
    return (old_logprobs_RC - behavior_logprobs_RC).mul_(loss_mask_RC)


def level_log_weight(log_w_RC: torch.Tensor, batch: TokenBatch, level: Level) -> torch.Tensor:
    """``log w`` at ``level``, per token: ``log w_t``; ``sum_t log w_t`` (sequence, the log of
    the product); or ``mean_t log w_t`` (geometric) of the token's sequence. ``log_w_RC`` must be
    0 off loss tokens (as :func:`training_inference_log_weight` returns).

    Parameters
    ----------
    log_w_RC : Tensor ``[R, C]``
        ``log w_t``, 0 off the loss tokens.
    batch : TokenBatch
        The batch the tokens belong to (its ``sequence_id`` and ``loss_mask``).
    level : Level
        Token, sequence (sum of logs) or geometric (mean of logs).

    Returns
    -------
    Tensor ``[R, C]``
        The log factor at ``level``, the sequence's value on each of its tokens.
    """
    if level is Level.TOKEN:
        return log_w_RC
    if not isinstance(level, Level):
        raise TypeError(f"level: expected a Level, got {type(level).__name__} {level!r}")
    log_w_S = sequence_sum(log_w_RC, batch)
    if level is Level.GEOMETRIC:
        log_w_S = log_w_S / loss_token_counts(batch).clamp(min=1)
    return to_tokens(log_w_S, batch)


def importance_weight(log_w_RC: torch.Tensor, *, bound: float = MAX_LOG_RATIO) -> torch.Tensor:
    """IS: ``w = exp(log w)``, held at ``e^bound`` (default e^20) so products of thousands of
    tokens stay finite.

    Parameters
    ----------
    log_w_RC : Tensor ``[R, C]``
        ``log w`` of each token (at any :class:`Level`).
    bound : float, default ``MAX_LOG_RATIO`` (20)
        The cap on ``log w``.

    Returns
    -------
    Tensor ``[R, C]``
        ``exp(min(log w, bound))``.
    """
    return capped_exp(log_w_RC, bound=bound)


def truncated_importance_weight(log_w_RC: torch.Tensor, *, cap: float,
                                floor: float | None = None) -> torch.Tensor:
    """TIS: ``min(w, C)`` computed as ``exp(min(log w, log C))`` (Yao et al. 2025); with a
    ``floor`` ``F``, ``clamp(w, F, C) = max(F, min(w, C))``.

    Parameters
    ----------
    log_w_RC : Tensor ``[R, C]``
        ``log w`` of each token (at any :class:`Level`).
    cap : float
        ``C > 0``.
    floor : float, optional
        ``0 <= F < C``; None (default) or 0 is no floor.

    Returns
    -------
    Tensor ``[R, C]``
        ``min(w, C)``, or ``clamp(w, F, C)`` with a floor.
    """
    check_positive("cap", cap)
    _check_floor(floor, cap)
    weight = log_w_RC.clamp(max=math.log(cap)).exp_()
    if floor:  # F = 0 changes nothing: w >= 0 already
        weight.clamp_(min=floor)
    return weight


def _check_floor(floor: float | None, cap: float) -> None:
    """Raise ``TypeError``/``ValueError`` naming ``floor`` unless it is None or in ``[0, cap)``."""
    check_nonnegative("floor", floor, allow_none=True)
    if floor is not None and not floor < cap:
        raise ValueError(f"floor: must be < cap, got floor={floor}, cap={cap}")


def masked_importance_weight(log_w_RC: torch.Tensor, *, low: float, high: float
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """MIS: ``(w · 1{low <= w <= high}, keep)`` with ``keep = 1{low <= w <= high}`` (IcePop,
    arXiv 2510.18855). ``low = 0`` is a one-sided threshold ``w <= high``.

    Parameters
    ----------
    log_w_RC : Tensor ``[R, C]``
        ``log w`` of each token (at any :class:`Level`).
    low, high : float
        The band ``[α, β]``, ``0 <= low < high``.

    Returns
    -------
    weight : Tensor ``[R, C]``
        ``w · 1{low <= w <= high}``.
    keep : BoolTensor ``[R, C]``
        ``1{low <= w <= high}``.
    """
    if not (0 <= low < high):
        raise ValueError(f"low, high: need 0 <= low < high, got low={low}, high={high}")
    log_high = math.log(high)
    keep = log_w_RC <= log_high
    if low > 0:
        keep &= log_w_RC >= math.log(low)
    weight = log_w_RC.clamp(max=log_high).exp_().mul_(keep)
    return weight, keep


# ---------------------------------------------------------------------- composable parts
class Correction:
    """Base of the correction parts: ``part(batch) -> CorrectionFactor``.

    A part that rejects tokens (returns ``keep_RC``) must also have a bool attribute
    ``masked_in_normalizer``, read by :func:`~tokenmdp.estimators.prepare`.
    """

    requires: tuple[str, ...] = ("old_logprob", "behavior_logprob")

    def __call__(self, batch: TokenBatch) -> CorrectionFactor:
        raise NotImplementedError

    def describe(self) -> str:
        """Short label for tables."""
        raise NotImplementedError

    def prepare_step(self, batch: TokenBatch, step: torch.Tensor | None) -> TokenBatch:
        """Step-wide preparation, as :meth:`~tokenmdp.estimators.Surrogate.prepare_step`
        (called after the surrogate's; self-normalized IS computes its factors here).

        Parameters
        ----------
        batch : TokenBatch
            The batch of the step(s), ``advantage`` and ``loss_weight`` filled.
        step : LongTensor ``[S]`` or None
            The optimizer-step id of each sequence when steps are stacked.

        Returns
        -------
        TokenBatch
            ``batch`` (the default), or a copy with the part's step-wide quantities.
        """
        return batch

    def _log_w(self, batch: TokenBatch) -> torch.Tensor:
        who = f"correction {self.describe()}"
        log_w = training_inference_log_weight(require(batch, "old_logprob", who),
                                              require(batch, "behavior_logprob", who),
                                              batch.loss_mask)
        return level_log_weight(log_w, batch, self.level)


@dataclasses.dataclass(frozen=True)
class NoCorrection(Correction):
    """No training–inference correction (factor 1): the ablation "w/o train-infer IS"."""

    requires = ()

    def __call__(self, batch):
        return CorrectionFactor(None, None)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            ``"none"``.
        """
        return "none"


@dataclasses.dataclass(frozen=True)
class ImportanceSampling(Correction):
    """Multiply by ``w = π_old/μ`` at ``level`` (:func:`importance_weight`).

    Parameters
    ----------
    level : Level or str, default ``Level.TOKEN``
        Token ``w_t``, sequence ``Π_t w_t`` or geometric mean ``exp(mean_t log w_t)`` (a
        :class:`Level` value such as ``"sequence"`` is accepted and converted).
    """

    level: Level = Level.TOKEN

    def __post_init__(self):
        _coerce_level(self)

    def __call__(self, batch):
        return CorrectionFactor(importance_weight(self._log_w(batch)), None)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            For example ``"IS (token)"``.
        """
        return f"IS ({self.level.value})"


@dataclasses.dataclass(frozen=True)
class TruncatedIS(Correction):
    """Multiply by ``min(w, C)`` at ``level``, or by ``clamp(w, F, C) = max(F, min(w, C))`` with
    a ``floor`` ``F`` (:func:`truncated_importance_weight`); detached like every correction.

    TIS is Yao et al. 2025 ("Your efficient RL framework secretly brings you off-policy RL
    training"). TRL's ``GRPOConfig`` applies it with ``vllm_importance_sampling_correction=True``
    and a ``"token_truncate"`` or ``"sequence_truncate"`` ``vllm_importance_sampling_mode``,
    clamping the ratio to ``[vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max]``
    (TRL 1.x, defaults None, no floor, and 3.0; earlier releases had only the cap,
    ``vllm_importance_sampling_cap``): ``floor`` is its ``clip_min``. A floor keeps tokens that
    the inference engine over-sampled (``w`` small) from vanishing from the step, at a further
    bias: such a token counts with weight ``F`` instead of ``w``.

    Parameters
    ----------
    cap : float, default 2.0
        ``C > 0`` (Yao et al. 2025 use 2; MiniRL, arXiv 2512.01374, uses 5).
    level : Level or str, default ``Level.TOKEN``
        Token, sequence or geometric-mean factor.
    floor : float, optional
        ``F``, finite with ``0 <= F < C``; None (default) is no floor, the plain ``min(w, C)``.
    """

    cap: float = 2.0
    level: Level = Level.TOKEN
    floor: float | None = None

    def __post_init__(self):
        check_positive("cap", self.cap)
        _check_floor(self.floor, self.cap)
        _coerce_level(self)

    def __call__(self, batch):
        weight = truncated_importance_weight(self._log_w(batch), cap=self.cap, floor=self.floor)
        return CorrectionFactor(weight, None)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            For example ``"TIS C=2 (token)"``, or ``"TIS [0.5, 2] (token)"`` with a floor.
        """
        if self.floor is None:
            return f"TIS C={self.cap:g} ({self.level.value})"
        return f"TIS [{self.floor:g}, {self.cap:g}] ({self.level.value})"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MaskedIS(Correction):
    """Multiply by ``w · 1{low <= w <= high}`` at ``level`` (:func:`masked_importance_weight`).

    ``masked_in_normalizer`` has no default: say whether rejected tokens still count in the
    aggregation's ``N_tokens``, ``S`` and ``|y_i|`` (True, as most frameworks do) or leave them.

    Parameters
    ----------
    high : float
        Upper threshold ``β`` (IcePop 5; a one-sided MIS threshold is often 2).
    masked_in_normalizer : bool
        True: rejected tokens stay in the normalizer (they shrink the step); False: they leave it.
    low : float, default 0.0
        Lower threshold ``α`` (0 = one-sided; IcePop 0.5).
    level : Level or str, default ``Level.TOKEN``
        Token, sequence or geometric-mean factor; a sequence-level reject drops the sequence.
    """

    high: float
    masked_in_normalizer: bool
    low: float = 0.0
    level: Level = Level.TOKEN

    def __post_init__(self):
        check_positive("high", self.high)
        if not 0 <= self.low < self.high:
            raise ValueError(f"low: need 0 <= low < high, got low={self.low}, high={self.high}")
        if not isinstance(self.masked_in_normalizer, bool):
            raise TypeError("masked_in_normalizer: expected a bool")
        _coerce_level(self)

    def __call__(self, batch):
        factor, keep = masked_importance_weight(self._log_w(batch), low=self.low, high=self.high)
        return CorrectionFactor(factor, keep)

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            For example ``"MIS [0.5, 5] (token; masked kept in normalizer)"``.
        """
        band = f"[{self.low:g}, {self.high:g}]" if self.low > 0 else f"<= {self.high:g}"
        norm = "kept in" if self.masked_in_normalizer else "out of"
        return f"MIS {band} ({self.level.value}; masked {norm} normalizer)"
