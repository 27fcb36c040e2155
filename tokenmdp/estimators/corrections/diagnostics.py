"""Diagnostics of the correction weights ``w = π_old/μ``: effective sample size and χ².

A batch drawn by the inference engine ``μ`` but trained as if drawn by ``π_old`` carries the
weights ``w = π_old/μ`` (per token ``w_t``, per sequence ``W_i = Π_t w_t``; see
:mod:`~tokenmdp.estimators.corrections.factor`). For ``n`` such weights of samples drawn from ``μ``:

* the **normalized effective sample size** (Kong 1992, "A note on importance sampling using
  standardized weights", Tech. Rep. 348, Univ. of Chicago; Owen 2013, *Monte Carlo theory,
  methods and examples*, §9.3)

  ``ESS/n = (Σ_i w_i)² / (n Σ_i w_i²)``, in ``(0, 1]``: 1 when all weights are equal, ``1/n``
  when one weight carries everything. Importance-weighted averages over the batch are about as
  precise as plain averages over ``ESS`` unweighted samples;

* the **χ² estimate** ``χ̂² = (1/n) Σ_i w_i² − 1``. Since ``E_μ[w] = 1``, its expectation is
  ``E_μ[w²] − 1 = Var_μ[w] = χ²(π_old ‖ μ)``, the divergence that multiplies the second moment
  of an importance-weighted estimator and bounds the bias of ignoring the weights
  (Cauchy–Schwarz: ``|E_μ[f] − E_{π_old}[f]| = |E_μ[(1 − w) f]| <= sqrt(χ²) sqrt(E_μ[f²])``).
  Unbiased, so it may come out slightly negative when ``χ² << 1/sqrt(n)``. For ``n → ∞``,
  ``ESS/n → 1/(1 + χ²)``.

Both are computed from ``d = w − 1 = expm1(log w)`` (``log w`` held at ``MAX_LOG_RATIO`` as the
corrections hold it): with ``m1 = mean d`` and ``m2 = mean d²``, ``χ̂² = m2 + 2 m1`` and
``ESS/n = (1 + m1)² / (1 + χ̂²)`` — the same numbers as the definitions, without the
cancellation of ``mean(w²) − 1`` near ``w = 1`` in float32.

**Token level**: the ``w_t`` of the loss tokens. Their χ̂² estimates the per-token divergence
``Σ_s d^μ(s) χ²(π_old(·|s) ‖ μ(·|s)) / Σ_s d^μ(s)``, averaged over the states ``μ`` visits
(:func:`tokenmdp.exact.world.chi_square.chi_square` with ``level="token"``). **Sequence level**: the
``W_i`` of the sequences with at least one loss token; χ̂² estimates the divergence of whole
responses, ``χ²(π_old ‖ μ) = Σ_x D(x) Σ_y π_old(y|x)²/μ(y|x) − 1``. A sequence-level correction
uses ``W_i`` (or its geometric mean): one response with a large ``W_i`` then dominates the step,
which is what the sequence ESS shows.

:func:`weight_sums` gives the additive sums (summed over micro-batches or data-parallel ranks
before :func:`ess_and_chi2` divides; :func:`batch_weight_sums` and :func:`diagnostics_from_sums`
are that round trip as Python floats, for the trainer's step); :func:`correction_diagnostics`
gives the metrics of one batch, named as :func:`~tokenmdp.estimators.loss` and the trainer
report them: ``is_ess``, ``is_chi2`` and, at the sequence level, ``is_seq_ess``,
``is_seq_chi2``.
"""

from __future__ import annotations

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators._common import MAX_LOG_RATIO, loss_token_counts, require, sequence_sum

__all__ = ["batch_weight_sums", "correction_diagnostics", "diagnostics_from_sums", "ess_and_chi2",
           "sequence_log_weights", "weight_sums"]


def weight_sums(log_w: torch.Tensor, mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(n, Σ d, Σ d²)`` over the entries of ``mask``, ``d = expm1(min(log w, MAX_LOG_RATIO))``.

    Parameters
    ----------
    log_w : Tensor
        ``log w`` of each sample (finite), any shape.
    mask : BoolTensor
        The samples that count, the shape of ``log_w``.

    Returns
    -------
    n, sum_d, sum_d2 : Tensor ``[]``
        The count and the sums, in ``log_w``'s dtype; additive over disjoint sets of samples.
    """
    if not isinstance(log_w, torch.Tensor) or not isinstance(mask, torch.Tensor):
        raise TypeError("log_w, mask: expected tensors")
    if mask.dtype != torch.bool or mask.shape != log_w.shape:
        raise ValueError(f"mask: expected a bool tensor of shape {tuple(log_w.shape)}, got "
                         f"{mask.dtype} {tuple(mask.shape)}")
    d = torch.where(mask, log_w, 0.0).clamp(max=MAX_LOG_RATIO).expm1()
    return mask.sum().to(log_w.dtype), d.sum(), (d * d).sum()


def ess_and_chi2(n, sum_d, sum_d2) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ESS/n, χ̂²)`` from the sums of :func:`weight_sums` (see the module docstring).

    Parameters
    ----------
    n, sum_d, sum_d2 : Tensor ``[]`` or float
        The count of samples, ``Σ (w − 1)`` and ``Σ (w − 1)²``.

    Returns
    -------
    ess : Tensor ``[]``
        ``(Σ w)² / (n Σ w²) = (1 + m1)² / (1 + m2 + 2 m1)``; 1 (neutral) when ``n = 0``.
    chi2 : Tensor ``[]``
        ``Σ w² / n − 1 = m2 + 2 m1``; 0 (neutral) when ``n = 0``.
    """
    n, sum_d, sum_d2 = (torch.as_tensor(v, dtype=torch.float64) if not isinstance(v, torch.Tensor)
                        else v for v in (n, sum_d, sum_d2))
    has = n > 0
    denominator = n.clamp(min=1)
    m1, m2 = sum_d / denominator, sum_d2 / denominator
    chi2 = m2 + 2 * m1
    second = (1 + chi2).clamp(min=torch.finfo(chi2.dtype).tiny)   # mean w² > 0 (w > 0)
    ess = (1 + m1) ** 2 / second
    return torch.where(has, ess, 1.0), torch.where(has, chi2, 0.0)


def sequence_log_weights(log_w_RC: torch.Tensor, batch: TokenBatch
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``log W_i = Σ_t log w_it`` per sequence and the sequences that have a loss token.

    Parameters
    ----------
    log_w_RC : Tensor ``[R, C]``
        ``log w_t``, 0 off the loss tokens
        (:func:`~tokenmdp.estimators.training_inference_log_weight`).
    batch : TokenBatch
        The batch the tokens belong to.

    Returns
    -------
    log_W_S : Tensor ``[S]``
        The log of each sequence's product weight.
    has_tokens_S : BoolTensor ``[S]``
        True for the sequences with at least one loss token.
    """
    return sequence_sum(log_w_RC, batch), loss_token_counts(batch) > 0


def correction_diagnostics(batch: TokenBatch, *, sequence: bool = False
                           ) -> dict[str, torch.Tensor]:
    """ESS and χ² of the weights ``w = π_old/μ`` of one batch.

    Parameters
    ----------
    batch : TokenBatch
        With ``old_logprob`` (``π_old``) and ``behavior_logprob`` (``μ``, the sampler).
    sequence : bool, default False
        Also the sequence-level diagnostics (of ``W_i = Π_t w_it``), as reported for an
        estimator whose correction acts per sequence.

    Returns
    -------
    dict of str to Tensor ``[]``
        ``is_ess`` (``ESS/n`` of the loss tokens' ``w_t``) and ``is_chi2`` (``mean w_t² − 1``);
        with ``sequence``, ``is_seq_ess`` and ``is_seq_chi2`` of the ``W_i``. Neutral values
        (ESS 1, χ² 0) without loss tokens.
    """
    if not isinstance(batch, TokenBatch):
        raise TypeError(f"batch: expected a TokenBatch, got {type(batch).__name__}")
    log_w = _log_weights(batch, "correction_diagnostics")
    ess, chi2 = ess_and_chi2(*weight_sums(log_w, batch.loss_mask))
    out = {"is_ess": ess, "is_chi2": chi2}
    if sequence:
        ess, chi2 = ess_and_chi2(*weight_sums(*sequence_log_weights(log_w, batch)))
        out.update(is_seq_ess=ess, is_seq_chi2=chi2)
    return out


def _log_weights(batch: TokenBatch, who: str) -> torch.Tensor:
    return torch.where(batch.loss_mask, require(batch, "old_logprob", who)
                       - require(batch, "behavior_logprob", who), 0.0)


def batch_weight_sums(batch: TokenBatch, *, sequence: bool = False) -> dict[str, float]:
    """The sums of :func:`weight_sums` of one batch as float64 Python floats, to be added over
    data-parallel ranks before :func:`diagnostics_from_sums`.

    Parameters
    ----------
    batch : TokenBatch
        With ``old_logprob`` and ``behavior_logprob``.
    sequence : bool, default False
        Also the sums of the sequence weights ``W_i``.

    Returns
    -------
    dict of str to float
        ``is_n``, ``is_d``, ``is_d2`` (tokens) and with ``sequence`` ``is_seq_n``, ``is_seq_d``,
        ``is_seq_d2``.
    """
    if not isinstance(batch, TokenBatch):
        raise TypeError(f"batch: expected a TokenBatch, got {type(batch).__name__}")
    log_w = _log_weights(batch, "batch_weight_sums").double()
    parts = {"is": (log_w, batch.loss_mask)}
    if sequence:
        parts["is_seq"] = sequence_log_weights(log_w, batch)
    return {f"{key}_{name}": float(value) for key, args in parts.items()
            for name, value in zip(("n", "d", "d2"), weight_sums(*args))}


def diagnostics_from_sums(sums: dict[str, float]) -> dict[str, float]:
    """``is_ess``, ``is_chi2`` (and ``is_seq_ess``, ``is_seq_chi2`` when ``sums`` has the
    sequence sums) from the sums of :func:`batch_weight_sums`.

    Parameters
    ----------
    sums : dict of str to float
        :func:`batch_weight_sums`' keys, each summed over the batches of the step.

    Returns
    -------
    dict of str to float
        The diagnostics of the whole step (:func:`ess_and_chi2`).
    """
    out = {}
    for key in ("is", "is_seq"):
        if f"{key}_n" in sums:
            ess, chi2 = ess_and_chi2(sums[f"{key}_n"], sums[f"{key}_d"], sums[f"{key}_d2"])
            out.update({f"{key}_ess": float(ess), f"{key}_chi2": float(chi2)})
    return out
