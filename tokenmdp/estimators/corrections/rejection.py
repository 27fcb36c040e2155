"""Rejection masks without IS weighting: keep or drop tokens by a divergence band, factor 1.

verl's rollout rejection sampling (``algorithm.rollout_correction.rollout_rs``; Liu, Li et al.
2025, "When speed kills stability: demystifying RL collapse from the training-inference
mismatch") reweights nothing: it estimates, per token, how far the sampler ``μ`` is from the
training engine ``π_old`` and drops the tokens (or whole sequences) whose estimate falls outside
a band. With ``ℓ_t = log w_t = log π_old(y_t) - log μ(y_t)`` held to ``[-20, 20]`` (as verl
holds it, :data:`~tokenmdp.estimators._common.MAX_LOG_RATIO`), the three per-token statistics
are the KL estimators of ``KL(μ ‖ π_old)`` from a token drawn by ``μ``:

* ``k1 = -ℓ = log(μ/π_old)``;
* ``k2 = ℓ² / 2`` (>= 0);
* ``k3 = w - 1 - ℓ = expm1(ℓ) - ℓ`` (>= 0; unbiased for the KL).

A statistic is used per token (``reduce="token"``, verl ``token_k*``) or reduced over each
sequence's loss tokens: ``"sum"`` (``seq_sum_k*``), ``"mean"`` (``seq_mean_k*``; for k1 the log
of the geometric-mean ratio ``μ/π_old``) or ``"max"`` (``seq_max_k2``/``seq_max_k3`` only). A
sequence-level reject drops every token of the sequence. The band, as verl states it:

* k1: ``low <= exp(statistic) <= high``, bounds on the ratio ``μ/π_old`` (per token, or its
  product / geometric mean over the sequence), i.e. ``1/high <= w <= 1/low``; verl's threshold
  ``"lower_upper"``, a single number ``C`` meaning ``[1/C, C]``;
* k2, k3: ``statistic <= high`` (an upper bound only).

The kept tokens get factor exactly 1 and the rejected ones 0, so a band that accepts every
token reproduces the uncorrected loss bit for bit. ``masked_in_normalizer`` says whether the
rejected tokens still count in the aggregation's ``N_tokens``, ``S`` and ``|y_i|``: verl sets
the rejected tokens' ``response_mask`` to 0, so they leave its normalizers and every term of
its loss (False: their loss weight is 0, a KL-in-loss penalty included). With True they stay
in the normalizers and keep their KL-in-loss term (as with
:class:`~tokenmdp.estimators.MaskedIS`); only the surrogate is dropped.

verl's presets use tight bands for the small mismatch of one checkpoint in two engines:
``decoupled_geo_rs`` ``seq_mean_k1`` ``"0.999_1.001"``, ``bypass_ppo_clip_k3_rs``
``seq_mean_k3`` 0.01 (``RejectionSampling.from_verl`` builds any of them). A comma-separated
list of several options (all must pass) is one part per option, not composed here.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators._common import (
    MAX_LOG_RATIO,
    check_positive,
    loss_token_counts,
    require,
    sequence_sum,
    to_tokens,
)
from tokenmdp.estimators.corrections.factor import (
    Correction,
    CorrectionFactor,
    Level,
    training_inference_log_weight,
)

__all__ = ["RejectionSampling", "rejection_keep_mask", "rejection_statistic"]

STATISTICS = ("k1", "k2", "k3")
REDUCTIONS = ("token", "sum", "mean", "max")
_VERL_PREFIX = {"token": "token", "sum": "seq_sum", "mean": "seq_mean", "max": "seq_max"}
_LEVEL = {"token": Level.TOKEN, "sum": Level.SEQUENCE, "mean": Level.GEOMETRIC,
          "max": Level.SEQUENCE}


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(choices)}, got {value!r}")


def rejection_statistic(log_w_RC: torch.Tensor, batch: TokenBatch, *, statistic: str,
                        reduce: str) -> torch.Tensor:
    """The divergence statistic of each token (``reduce="token"``) or of its sequence.

    Parameters
    ----------
    log_w_RC : Tensor ``[R, C]``
        ``ℓ_t = log π_old - log μ`` on the loss tokens, 0 elsewhere
        (:func:`~tokenmdp.estimators.training_inference_log_weight`).
    batch : TokenBatch
        The batch the tokens belong to.
    statistic : {'k1', 'k2', 'k3'}
        ``-ℓ``, ``ℓ²/2`` or ``expm1(ℓ) - ℓ`` (ℓ held to ``[-20, 20]``).
    reduce : {'token', 'sum', 'mean', 'max'}
        Per token, or the sum / mean / max over each sequence's loss tokens (``'max'`` needs
        k2 or k3).

    Returns
    -------
    Tensor ``[R, C]``
        The statistic on each loss token (its sequence's value for a sequence reduction);
        0 off the loss tokens.
    """
    _check_choice("statistic", statistic, STATISTICS)
    _check_choice("reduce", reduce, REDUCTIONS)
    if reduce == "max" and statistic == "k1":
        raise ValueError("reduce: 'max' needs statistic k2 or k3 (verl has no seq_max_k1)")
    mask = batch.loss_mask
    ell = log_w_RC.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if statistic == "k1":
        per_token = -ell
    elif statistic == "k2":
        per_token = 0.5 * ell * ell
    else:
        per_token = torch.expm1(ell) - ell
    per_token = torch.where(mask, per_token, 0.0)
    if reduce == "token":
        return per_token
    if reduce == "max":  # k2, k3 >= 0: the zeros off the loss tokens never exceed the maximum
        sid = batch.sequence_id.clamp(min=0).reshape(-1)
        per_seq = per_token.new_zeros(batch.num_sequences).scatter_reduce(
            0, sid, per_token.reshape(-1), reduce="amax", include_self=True)
    else:
        per_seq = sequence_sum(per_token, batch)
        if reduce == "mean":
            per_seq = per_seq / loss_token_counts(batch).clamp(min=1)
    return torch.where(mask, to_tokens(per_seq, batch), 0.0)


def rejection_keep_mask(statistic_RC: torch.Tensor, *, statistic: str, high: float,
                        low: float | None = None) -> torch.Tensor:
    """``1{low <= exp(s) <= high}`` for k1, ``1{s <= high}`` for k2 and k3 (see the module).

    Parameters
    ----------
    statistic_RC : Tensor ``[R, C]``
        The statistic ``s`` (:func:`rejection_statistic`).
    statistic : {'k1', 'k2', 'k3'}
        Which statistic ``s`` is.
    high : float
        The upper bound (> 0): on the ratio ``exp(s)`` for k1, on ``s`` for k2 and k3.
    low : float, optional
        k1 only: the lower ratio bound, ``0 < low < high`` (default ``1/high``, as verl).

    Returns
    -------
    BoolTensor ``[R, C]``
        True where the token is kept.
    """
    _check_choice("statistic", statistic, STATISTICS)
    low = _check_band(statistic, high, low)
    if statistic == "k1":
        return (statistic_RC >= math.log(low)) & (statistic_RC <= math.log(high))
    return statistic_RC <= high


def _check_band(statistic: str, high: float, low: float | None) -> float | None:
    """Validate the band; return the k1 lower bound (``1/high`` by default), None for k2/k3."""
    check_positive("high", high)
    if statistic != "k1":
        if low is not None:
            raise ValueError(f"low: only the k1 statistic has a lower bound ({statistic} >= 0 "
                             f"takes an upper bound only), got low={low}")
        return None
    if low is None:
        low = 1.0 / high
    check_positive("low", low)
    if not low < high:
        raise ValueError(f"low: the k1 band needs 0 < low < high, got low={low}, high={high}")
    return low


@dataclasses.dataclass(frozen=True, kw_only=True)
class RejectionSampling(Correction):
    """Keep the tokens (or sequences) whose divergence statistic is in the band, factor 1; drop
    the others (factor 0). verl ``rollout_rs`` (see the module docstring for the statistics).

    All parameters are keyword-only. ``masked_in_normalizer`` has no default: say whether
    rejected tokens still count in the aggregation's normalizers (verl: False).

    Parameters
    ----------
    statistic : {'k1', 'k2', 'k3'}
        ``-log w``, ``(log w)²/2`` or ``w - 1 - log w`` per token (``w = π_old/μ``).
    high : float
        Upper bound, > 0: of the ratio ``μ/π_old`` (its product or geometric mean for the sum or
        mean reduction) for k1, of the statistic for k2 and k3.
    masked_in_normalizer : bool
        True: rejected tokens stay in the normalizer; False (verl): they leave it.
    reduce : {'token', 'sum', 'mean', 'max'}, default 'token'
        Per token, or per sequence by the sum, mean or max of its tokens' statistic.
    low : float, optional
        k1 only: the lower ratio bound, ``0 < low < high``; default ``1/high`` (verl's single
        threshold ``C`` is the band ``[1/C, C]``).
    """

    statistic: str
    high: float
    masked_in_normalizer: bool
    reduce: str = "token"
    low: float | None = None

    def __post_init__(self):
        _check_choice("statistic", self.statistic, STATISTICS)
        _check_choice("reduce", self.reduce, REDUCTIONS)
        if self.reduce == "max" and self.statistic == "k1":
            raise ValueError("reduce: 'max' needs statistic k2 or k3 (verl has no seq_max_k1)")
        object.__setattr__(self, "low", _check_band(self.statistic, self.high, self.low))
        if not isinstance(self.masked_in_normalizer, bool):
            raise TypeError("masked_in_normalizer: expected a bool")

    @classmethod
    def from_verl(cls, rollout_rs: str, rollout_rs_threshold: float | str, *,
                  masked_in_normalizer: bool = False) -> RejectionSampling:
        """The part of one verl option, as ``algorithm.rollout_correction`` spells it.

        Parameters
        ----------
        rollout_rs : str
            One option: ``token_k1`` .. ``token_k3``, ``seq_sum_k*``, ``seq_mean_k*``,
            ``seq_max_k2``, ``seq_max_k3`` (verl's comma-separated lists of several options
            are not accepted: compose one part per option).
        rollout_rs_threshold : float or str
            ``"lower_upper"`` or one number (k1: ``C`` means ``[1/C, C]``; k2, k3: the bound).
        masked_in_normalizer : bool, default False
            verl's behaviour (rejected tokens leave ``response_mask``).

        Returns
        -------
        RejectionSampling
            The equivalent part.
        """
        if not isinstance(rollout_rs, str) or "," in rollout_rs:
            raise ValueError(f"rollout_rs: expected one verl option such as 'seq_mean_k3', got "
                             f"{rollout_rs!r}")
        prefix, _, statistic = rollout_rs.rpartition("_")
        reduce = {v: k for k, v in _VERL_PREFIX.items()}.get(prefix)
        if reduce is None or statistic not in STATISTICS:
            raise ValueError(f"rollout_rs: unknown verl option {rollout_rs!r}")
        spec = rollout_rs_threshold
        low = None
        try:
            if isinstance(spec, str) and "_" in spec:
                low_text, high_text = spec.split("_", 1)
                low, high = float(low_text), float(high_text)
            elif isinstance(spec, (str, int, float)) and not isinstance(spec, bool):
                high = float(spec)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"rollout_rs_threshold: expected a number or 'lower_upper', got "
                             f"{spec!r}") from None
        return cls(statistic=statistic, reduce=reduce, high=high, low=low,
                   masked_in_normalizer=masked_in_normalizer)

    @property
    def level(self) -> Level:  # numpydoc ignore=RT01
        """Token for ``reduce='token'``, else sequence (geometric for the mean): the level of
        the weight diagnostics :func:`~tokenmdp.estimators.loss` reports."""
        return _LEVEL[self.reduce]

    @property
    def verl_option(self) -> str:  # numpydoc ignore=RT01
        """verl's name of this option, such as ``"seq_mean_k3"``."""
        return f"{_VERL_PREFIX[self.reduce]}_{self.statistic}"

    def statistic_RC(self, batch: TokenBatch) -> torch.Tensor:
        """The statistic of each loss token (or of its sequence) in ``batch``.

        Parameters
        ----------
        batch : TokenBatch
            With ``old_logprob`` and ``behavior_logprob``.

        Returns
        -------
        Tensor ``[R, C]``
            :func:`rejection_statistic` of the batch, 0 off the loss tokens.
        """
        who = f"correction {self.describe()}"
        log_w = training_inference_log_weight(require(batch, "old_logprob", who),
                                              require(batch, "behavior_logprob", who),
                                              batch.loss_mask)
        return rejection_statistic(log_w, batch, statistic=self.statistic, reduce=self.reduce)

    def __call__(self, batch):
        keep = rejection_keep_mask(self.statistic_RC(batch), statistic=self.statistic,
                                   high=self.high, low=self.low)
        return CorrectionFactor(keep.to(batch.dtype), keep)

    def diagnostics(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        """What the mask did to ``batch`` (as verl's ``rollout_rs_*`` metrics report it).

        Parameters
        ----------
        batch : TokenBatch
            With ``old_logprob`` and ``behavior_logprob``.

        Returns
        -------
        dict of str to Tensor ``[]``
            ``rs_masked_fraction`` (rejected loss tokens / loss tokens),
            ``rs_seq_masked_fraction`` (sequences with a rejected token / sequences with a
            loss token), ``rs_statistic_mean`` and ``rs_statistic_max`` (over the loss tokens,
            or over the sequences for a sequence reduction). Neutral zeros without loss tokens.
        """
        with torch.no_grad():
            stat = self.statistic_RC(batch)
            keep = rejection_keep_mask(stat, statistic=self.statistic, high=self.high,
                                       low=self.low)
            mask = batch.loss_mask
            rejected = (mask & ~keep).to(batch.dtype)
            tokens = mask.sum().to(batch.dtype)
            has_S = loss_token_counts(batch) > 0
            seqs = has_S.sum().to(batch.dtype)
            seq_rejected = (sequence_sum(rejected, batch) > 0) & has_S
            if self.reduce == "token":
                values, count = stat[mask], tokens
            else:  # the sequence's value sits on each of its loss tokens: take it once
                per_seq = stat.new_full((batch.num_sequences,), -math.inf).scatter_reduce(
                    0, batch.sequence_id[mask], stat[mask], reduce="amax", include_self=False)
                values, count = per_seq[has_S], seqs
            zero = stat.new_zeros(())
            return {
                "rs_masked_fraction": rejected.sum() / tokens.clamp(min=1),
                "rs_seq_masked_fraction": seq_rejected.sum().to(batch.dtype) / seqs.clamp(min=1),
                "rs_statistic_mean": values.sum() / count.clamp(min=1),
                "rs_statistic_max": values.max() if values.numel() else zero,
            }

    def describe(self) -> str:
        """Short label for tables.

        Returns
        -------
        str
            For example ``"RS seq_mean_k3 <= 0.01 (rejects out of normalizer)"`` or
            ``"RS token_k1 [0.5, 2] (...)"``.
        """
        band = (f"[{self.low:g}, {self.high:g}]" if self.statistic == "k1"
                else f"<= {self.high:g}")
        norm = "kept in" if self.masked_in_normalizer else "out of"
        return f"RS {self.verl_option} {band} (rejects {norm} normalizer)"

