"""Which estimators the lattice computes exactly, and in which form.

An estimator's gradient on a group of ``G`` responses drawn from ``μ`` is computed exactly when
it has the form

``ĝ = w_0 · Σ_i h_i · κ-weighted Σ_t φ(t, z_it, a_it; A_i) ∇log π(a_it | t, z_it)``

with three parts, each recognised here (:class:`LatticeForm`):

* **the kind** — how a token's coefficient depends on the rest of its response:
  ``"local"`` (a token-local surrogate and correction: ``φ`` reads the token only),
  ``"sequence"`` (sequence IS: every token of ``y`` carries ``A · Π_s κ_s``, the product of the
  per-token ratios ``κ = π_θ/π_old`` times a sequence-level IS correction ``π_old/μ``) or
  ``"per_decision"`` (token ``t`` carries ``A · Π_{s<=t} κ_s``, ``κ = π_θ/μ``). A product of
  ratios is a multiplicative message: its mean is a lattice pass under the measure ``μ·κ`` and
  its second moment one under ``μ·κ²``.
* **the normalizer** ``h_i`` — ``"constant"`` (``1``), ``"length"`` (``1/|y_i|``),
  ``"kept"`` (``1/K_i``, ``K_i`` the tokens of ``y_i`` a rejection mask kept, when its rejects
  leave the normalizer), ``"total"`` (``1 / Σ_j ν(y_j)``: the token mean over the group, with
  ``ν`` counting every token, the kept tokens, or summing token-level importance weights for
  self-normalized IS) or ``"ratio"`` (``Σ_j |y_j| / Σ_j w(y_j)``: token-level self-normalized
  IS under a constant weight, whose factor ``w_t / w̄`` divides by the step's mean weight).
  The last three are random and coupled: the Laplace identity
  (:mod:`~tokenmdp.exact.lattice.laplace`) makes them exact.
* **the advantage** — a function of the group's rewards only (few-valued, so the group is
  summarised by its reward-class counts).

Not exact, with the reason :func:`exact_support` gives: GSPO's and GMPO's geometric means,
sequence-level clips, masks and truncations (a ``min`` of a product is not a product),
covariance selections (Clip-Cov, KL-Cov), a KL penalty in the reward, advantages reading
lengths or tokens, self-normalized IS at the sequence level or with the sequence-mean of token
means, and more class-count configurations than ``max_configurations``.
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmdp.estimators import Estimator
from tokenmdp.estimators.advantages.group import Advantage
from tokenmdp.estimators.corrections.factor import (
    ImportanceSampling,
    Level,
    MaskedIS,
    NoCorrection,
    TruncatedIS,
)
from tokenmdp.estimators.corrections.rejection import RejectionSampling
from tokenmdp.estimators.corrections.self_normalized import SelfNormalizedIS
from tokenmdp.estimators.surrogates.clipped import CISPO, MiniRL, PPOClip
from tokenmdp.estimators.surrogates.per_decision import PerDecisionRatio
from tokenmdp.estimators.surrogates.sequence import SequenceRatio
from tokenmdp.estimators.surrogates.soft import SAPO, EntropyBonus
from tokenmdp.estimators.surrogates.token import Reinforce, TokenRatio
from tokenmdp.estimators.surrogates.trust_region_masks import DPPO
from tokenmdp.exact.lattice.coefficients import weight_form

__all__ = ["LOCAL_SURROGATES", "LatticeForm", "exact_support", "lattice_form"]

LOCAL_SURROGATES = (Reinforce, TokenRatio, PPOClip, CISPO, MiniRL, SAPO, DPPO)
"""Surrogates whose term at a token reads only that token's log-probs and advantage."""
_LOCAL_CORRECTIONS = (NoCorrection, ImportanceSampling, TruncatedIS, MaskedIS, RejectionSampling)
KINDS = ("local", "sequence", "per_decision")
NORMALIZERS = ("constant", "length", "kept", "total", "ratio")


@dataclasses.dataclass(frozen=True)
class LatticeForm:
    """How the lattice computes an estimator exactly (see the module).

    Built by :func:`lattice_form`; each parameter is also the attribute of that name.

    Parameters
    ----------
    kind : {"local", "sequence", "per_decision"}
        How a token's coefficient reads its response.
    w0 : float
        The aggregation's constant factor.
    normalizer : {"constant", "length", "kept", "total", "ratio"}
        The random part ``h_i`` of a response's weight.
    counted : {"all", "kept", "weight"}
        What the normalizer counts per token: every token, the tokens a rejection mask kept,
        or the (capped) importance weight ``π_old/μ`` of self-normalized IS.
    local : Estimator
        The estimator whose per-token coefficients ``φ`` the lattice reads (the estimator
        itself, or, for self-normalized IS, the same one with the unnormalized weight).
    """

    kind: str
    w0: float
    normalizer: str
    counted: str
    local: Estimator

    def log_kappa(self, logp: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """``log κ`` at every lattice entry (None for the local kind).

        Parameters
        ----------
        logp : dict of str to Tensor ``[T, K, V]``
            ``policy``, ``old_logprob`` and ``behavior_logprob``.

        Returns
        -------
        Tensor ``[T, K, V]`` or None
            The per-token log-ratio whose products the sequence kinds carry.
        """
        if self.kind == "local":
            return None
        if self.kind == "per_decision":
            against = self.local.surrogate.requires[0]
            return logp["policy"] - logp[against]
        out = logp["policy"] - logp["old_logprob"]
        if isinstance(self.local.correction, ImportanceSampling):
            out = out + logp["old_logprob"] - logp["behavior_logprob"]
        return out


def _local_surrogate(surrogate) -> bool:
    if isinstance(surrogate, EntropyBonus):
        return isinstance(surrogate.base, LOCAL_SURROGATES)
    return isinstance(surrogate, LOCAL_SURROGATES)


def _undefined_at(estimator: Estimator, group_size: int) -> str:
    """Why the estimator's advantage is undefined for one group of ``group_size`` (its own
    ``ValueError``, e.g. leave-one-out or a group std at ``G = 1``), or ``""``; asked of the part
    itself on a probe group of equal rewards."""
    part = estimator.advantage
    if getattr(part, "token_level", False):
        return ""
    reward_S = torch.zeros(group_size, dtype=torch.float64)
    try:
        part(reward_S, torch.zeros(group_size, dtype=torch.long))
    except ValueError as err:
        return f"undefined at G = {group_size}: advantage {part.describe()}: {err}"
    return ""


def _kind(estimator: Estimator) -> tuple[str | None, str]:
    """The kind and, for a non-local one, whether its correction and KL fit; else a reason."""
    surrogate, corr = estimator.surrogate, estimator.correction
    if isinstance(surrogate, SequenceRatio | PerDecisionRatio):
        kind = "sequence" if isinstance(surrogate, SequenceRatio) else "per_decision"
        allowed = (NoCorrection(),) if kind == "per_decision" else (
            NoCorrection(), ImportanceSampling(level=Level.SEQUENCE))
        if corr not in allowed:
            return None, (f"correction {corr.describe()} on the {kind.replace('_', '-')} ratio: "
                          "only a plain sequence-level IS weight keeps the product a product")
        if estimator.kl is not None:
            return None, f"a KL penalty beside the {kind.replace('_', '-')} ratio"
        return kind, ""
    if not _local_surrogate(surrogate):
        return None, (f"surrogate {surrogate.describe()} is not token-local (a sequence-level "
                      "ratio, mask or clip couples the tokens of a response)")
    if getattr(corr, "level", Level.TOKEN) is not Level.TOKEN:
        return None, f"correction {corr.describe()} is not token-level"
    if not isinstance(corr, _LOCAL_CORRECTIONS + (SelfNormalizedIS,)):
        return None, (f"correction {corr.describe()} is not a token-local factor (those are IS, "
                      "truncated IS, masked IS, token rejection masks and token-level "
                      "self-normalized IS)")
    return "local", ""


def lattice_form(estimator: Estimator, group_size: int, *, max_len: int = 2
                 ) -> tuple[LatticeForm | None, str]:
    """The :class:`LatticeForm` of ``estimator`` at ``G = group_size``, or None and the reason.

    Parameters
    ----------
    estimator : Estimator
        The estimator.
    group_size : int
        ``G``.
    max_len : int, default 2
        The lattice's ``T`` (the constant normalizer reads it).

    Returns
    -------
    form : LatticeForm or None
        How the lattice computes it.
    reason : str
        Empty when exact, else what prevents it.
    """
    if not isinstance(estimator, Estimator):
        raise TypeError(f"estimator: expected an Estimator, got {type(estimator).__name__}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size: expected an int >= 1, got {group_size!r}")
    part = estimator.advantage
    overridden = [m for m in ("from_batch", "per_sequence")
                  if getattr(type(part), m, None) is not getattr(Advantage, m, None)]
    if getattr(part, "token_level", False) or getattr(part, "couples_sequences", False) or \
            overridden:
        return None, (f"advantage {part.describe()} reads more of the batch than the group's "
                      "rewards")
    undefined = _undefined_at(estimator, group_size)
    if undefined:
        return None, undefined
    kind, why = _kind(estimator)
    if kind is None:
        return None, why
    if estimator.kl is not None and estimator.kl.in_reward:
        return None, "a KL penalty in the reward makes the reward a sum over tokens"
    local = estimator
    corr = estimator.correction
    counted = "all"
    if isinstance(corr, SelfNormalizedIS):
        local = estimator.replace(correction=ImportanceSampling() if corr.cap is None else
                                  TruncatedIS(cap=corr.cap))
        counted = "weight"
    found = weight_form(local, group_size, max_len=max_len)
    if found is None:
        return None, (f"aggregation {estimator.aggregation.value} with G = {group_size}: the "
                      "weight is none of constant, 1/|y_i| and the token mean")
    w0, normalizer = found
    if isinstance(corr, MaskedIS | RejectionSampling) and not corr.masked_in_normalizer:
        if estimator.sequence_count.value != "sampled" and normalizer != "total":
            return None, (f"correction {corr.describe()} with sequences counted "
                          f"{estimator.sequence_count.value!r}: a fully rejected response "
                          "changes the sequence count")
        if normalizer in ("length", "total"):
            counted = "kept"
            normalizer = "kept" if normalizer == "length" else "total"
    if counted == "weight" and normalizer == "constant":
        normalizer = "ratio"          # w0 · N / W: the token count over the weights' sum
    elif counted == "weight" and normalizer != "total":
        return None, (f"self-normalized IS with aggregation {estimator.aggregation.value}: "
                      "exact under the token mean and the constant-weight rules only (1/|y_i| "
                      "beside the weights' sum is not a sum of token terms)")
    if kind != "local" and normalizer == "kept":  # pragma: no cover - no correction allows it
        return None, "a rejection mask beside a product of ratios"
    return LatticeForm(kind=kind, w0=w0, normalizer=normalizer, counted=counted,
                       local=local), ""


def exact_support(estimator: Estimator, group_size: int) -> tuple[bool, str]:
    """Whether the lattice computes ``estimator``'s moments exactly, and the reason if not.

    Exact (:func:`lattice_form` recognises it): a token-local surrogate (:data:`LOCAL_SURROGATES`,
    or an entropy bonus on one) with no correction or a token-level IS / truncated IS / masked
    IS / rejection mask / self-normalized IS; sequence IS (with a sequence-level IS correction
    or none) and per-decision IS; no KL or a KL penalty in the loss (token-local kinds); an
    advantage that reads only the group's rewards; an aggregation whose weight is constant,
    ``w_0/|y_i|`` or the token mean's ``w_0 / Σ_j |y_j|`` at every ``G`` (with rejects leaving
    the normalizer: the kept counts; with self-normalized IS under the token mean: the sum of
    the weights; under a constant weight: the token count over the weights' sum). Sequence ratios
    are exact while no response reaches their ``e^20`` cap,
    which :func:`~tokenmdp.exact.lattice.moments` checks on the policies. Not exact: see the
    module.

    Parameters
    ----------
    estimator : Estimator
        The estimator.
    group_size : int
        ``G``.

    Returns
    -------
    exact : bool
        True when :func:`~tokenmdp.exact.lattice.moments` can be exact.
    reason : str
        Empty when exact, else what prevents it (``"undefined at G = 1: ..."`` when the
        estimator's advantage has no value for a group of that size, as leave-one-out and a
        group's standard deviation at ``G = 1``).
    """
    form, reason = lattice_form(estimator, group_size)
    return form is not None, reason
