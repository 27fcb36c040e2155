"""What an invariance check reports, and against which tolerances.

:class:`InvarianceReport` holds the largest loss and gradient differences a check of
:mod:`tokenmdp.testing.checks` found over its cases, with the tolerances ``atol + rtol * scale``
they are held to; :func:`default_tolerances` gives the ``(rtol, atol)`` used when a check is
given none (:data:`FLOAT64_RTOL` ... :data:`FLOAT32_ATOL`). Every name here is re-exported by
:mod:`tokenmdp.testing.checks` and :mod:`tokenmdp.testing`.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from tokenmdp.batch import TokenBatch

__all__ = ["FLOAT32_ATOL", "FLOAT32_RTOL", "FLOAT64_ATOL", "FLOAT64_RTOL", "InvarianceReport",
           "default_tolerances"]

#: float64: layouts and splits change only the order of summation (~1e-16 relative per term).
FLOAT64_RTOL = 1e-10
FLOAT64_ATOL = 1e-10
#: float32: ~6e-8 relative per rounding; over the small batches of the strategies the largest
#: difference seen was 5e-7 (loss) and 2e-7 relative (gradient), 10x below these.
FLOAT32_RTOL = 1e-5
FLOAT32_ATOL = 5e-6


def default_tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` used by the checks for batches of ``dtype`` (float64 or float32).

    Parameters
    ----------
    dtype : torch.dtype
        The batches' float dtype: ``torch.float64`` or ``torch.float32``.

    Returns
    -------
    tuple of (float, float)
        ``(FLOAT64_RTOL, FLOAT64_ATOL)`` or ``(FLOAT32_RTOL, FLOAT32_ATOL)``.

    Raises
    ------
    TypeError
        For any other dtype (pass ``rtol`` and ``atol`` to the check instead).
    """
    if dtype == torch.float64:
        return FLOAT64_RTOL, FLOAT64_ATOL
    if dtype == torch.float32:
        return FLOAT32_RTOL, FLOAT32_ATOL
    raise TypeError(f"dtype: no default tolerances for {dtype}; pass rtol and atol")


def _tolerances(batch: TokenBatch, rtol, atol) -> tuple[float, float]:
    default_rtol, default_atol = (default_tolerances(batch.dtype) if None in (rtol, atol)
                                  else (rtol, atol))
    out = []
    for name, value in (("rtol", default_rtol if rtol is None else rtol),
                        ("atol", default_atol if atol is None else atol)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value >= 0):
            raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")
        out.append(float(value))
    return out[0], out[1]


@dataclasses.dataclass(frozen=True)
class InvarianceReport:
    """Largest differences found by a check, against ``atol + rtol * scale``.

    The checks build it; each parameter is also the attribute of that name.

    Parameters
    ----------
    loss_difference, gradient_difference : float
        Largest ``|loss - loss_ref|`` and largest ``max |grad - grad_ref|`` over the cases.
    loss_tolerance, gradient_tolerance : float
        ``atol + rtol * |loss_ref|`` and ``atol + rtol * max |grad_ref|``.
    reference_loss, gradient_scale : float
        ``loss_ref`` and ``max |grad_ref|`` (0 means the gradient check was trivial).
    worst_case : str
        The layout or split with the largest difference relative to its tolerance.
    num_cases : int
        Number of layouts or splits compared.
    """

    loss_difference: float
    gradient_difference: float
    loss_tolerance: float
    gradient_tolerance: float
    reference_loss: float
    gradient_scale: float
    worst_case: str
    num_cases: int

    @property
    def ok(self) -> bool:
        """True when both differences are within their tolerances."""
        return (self.loss_difference <= self.loss_tolerance
                and self.gradient_difference <= self.gradient_tolerance)

    def assert_ok(self) -> InvarianceReport:
        """Return ``self`` if :attr:`ok`, else raise ``AssertionError`` describing the failure.

        Returns
        -------
        InvarianceReport
            ``self``, so that ``check(...).assert_ok()`` can be chained.

        Raises
        ------
        AssertionError
            Naming the worst case, both differences and their tolerances.
        """
        if not self.ok:
            raise AssertionError(
                f"invariance violated in {self.worst_case}: loss differs by "
                f"{self.loss_difference:.3g} (tolerance {self.loss_tolerance:.3g}, reference loss "
                f"{self.reference_loss:.6g}); gradient differs by {self.gradient_difference:.3g} "
                f"(tolerance {self.gradient_tolerance:.3g}, max |grad| {self.gradient_scale:.3g})")
        return self


def _report(reference, cases, rtol, atol, raise_on_failure) -> InvarianceReport:
    ref_loss, ref_grad = reference
    loss_scale = float(ref_loss.abs())
    grad_scale = float(ref_grad.abs().max()) if ref_grad.numel() else 0.0
    loss_tol, grad_tol = atol + rtol * loss_scale, atol + rtol * grad_scale
    worst, worst_ratio, loss_diff, grad_diff = "", -1.0, 0.0, 0.0
    for name, (value, grad) in cases:
        dl = float((value - ref_loss).abs())
        dg = float((grad - ref_grad).abs().max()) if grad.numel() else 0.0
        if math.isnan(dl) or math.isnan(dg):
            dl = dg = math.inf
        loss_diff, grad_diff = max(loss_diff, dl), max(grad_diff, dg)
        ratio = max(dl / loss_tol if loss_tol else dl, dg / grad_tol if grad_tol else dg)
        if ratio > worst_ratio:
            worst, worst_ratio = name, ratio
    report = InvarianceReport(loss_diff, grad_diff, loss_tol, grad_tol, float(ref_loss),
                              grad_scale, worst, len(cases))
    return report.assert_ok() if raise_on_failure else report
