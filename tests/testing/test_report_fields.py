"""Every field of an :class:`~tokenmdp.testing.InvarianceReport` counts: a loss whose *value* is
the same in every layout and split while its *gradient* is not must fail the checks, and the
report must carry the hand-worked differences, scales, tolerances and worst case.

The loss under test detaches a layout-dependent factor: with ``k`` = the token's row + 1,

``loss = -Σ_loss-tokens [k·lp − stop_grad(k·lp) + stop_grad(lp)]``,

whose value is ``-Σ lp`` (layout-free) and whose gradient is ``-Σ k ∇lp`` (it reads the row).
On the batch below (responses ``(1,)`` and ``(2, 2, 2)``, ``log π(y) = w[y]``,
``w = (0, 0.5, 1)``) the value is ``-(0.5 + 3) = -3.5`` everywhere; the gradient is
``(0, -1, -6)`` one sequence per row and ``(0, -1, -3)`` when both share row 0.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenmdp import testing
from tokenmdp.batch import TokenBatch

EXACT = 1e-12
PADDED, FLAT = testing.Layout("padded"), testing.Layout("flat")
REFERENCE_LOSS, PADDED_GRAD, ONE_ROW_GRAD = -3.5, (0.0, -1.0, -6.0), (0.0, -1.0, -3.0)


def _batch() -> TokenBatch:
    return TokenBatch.from_sequences([[0], [0]], [[1], [2, 2, 2]], rewards=[1.0, 1.0],
                                     groups=[0, 0])


def _model():
    w = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64, requires_grad=True)
    return (lambda b: torch.where(b.sequence_id >= 0, w[b.tokens], 0.0)), [w]


def row_weighted_gradient(logprobs_RC: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    k = (torch.arange(batch.num_rows, dtype=logprobs_RC.dtype) + 1)[:, None]
    kl = k * logprobs_RC
    return -(kl - kl.detach() + logprobs_RC.detach())[batch.loss_mask].sum()


def _gradient(batch: TokenBatch) -> torch.Tensor:
    """Independent: the loss's gradient on one layout, by autograd, outside the checkers."""
    model, (w,) = _model()
    (g,) = torch.autograd.grad(row_weighted_gradient(model(batch), batch), [w])
    return g


def test_the_hand_worked_gradients_of_the_row_weighted_loss():
    torch.testing.assert_close(_gradient(_batch()), torch.tensor(PADDED_GRAD, dtype=torch.float64))
    torch.testing.assert_close(_gradient(FLAT(_batch())),
                               torch.tensor(ONE_ROW_GRAD, dtype=torch.float64))


def test_a_layout_check_fails_on_a_gradient_difference_alone():
    model, params = _model()
    report = testing.check_layout_invariance(row_weighted_gradient, _batch(), [PADDED, FLAT],
                                             model=model, parameters=params)
    assert report.reference_loss == pytest.approx(REFERENCE_LOSS, abs=EXACT)
    assert report.loss_difference == pytest.approx(0.0, abs=EXACT)
    assert report.loss_difference <= report.loss_tolerance
    assert report.gradient_scale == pytest.approx(6.0, abs=EXACT)
    assert report.gradient_difference == pytest.approx(3.0, abs=EXACT)
    assert report.gradient_tolerance == pytest.approx(testing.FLOAT64_ATOL + testing.FLOAT64_RTOL * 6)
    assert report.num_cases == 2
    assert "flat" in report.worst_case          # the padded case differs in nothing
    assert not report.ok
    with pytest.raises(AssertionError, match="gradient differs by 3"):
        report.assert_ok()
    with pytest.raises(AssertionError, match="flat"):
        testing.check_layout_invariance(row_weighted_gradient, _batch(), [FLAT], model=model,
                                        parameters=params, raise_on_failure=True)


def test_a_micro_batch_check_fails_on_a_gradient_difference_alone():
    model, params = _model()
    report = testing.check_micro_batch_invariance(row_weighted_gradient, _batch(),
                                                  [testing.MicroBatchSplit(1),
                                                   testing.MicroBatchSplit(2)],
                                                  model=model, parameters=params)
    # each of the 2 micro-batches holds one row: k = 1 for both sequences
    assert report.loss_difference == pytest.approx(0.0, abs=EXACT)
    assert report.gradient_difference == pytest.approx(3.0, abs=EXACT)
    assert "num_micro_batches=2" in report.worst_case and report.num_cases == 2
    assert not report.ok
    with pytest.raises(AssertionError, match="num_micro_batches=2"):
        report.assert_ok()


def test_the_same_loss_passes_when_no_case_moves_a_row():
    model, params = _model()
    report = testing.check_layout_invariance(row_weighted_gradient, _batch(), [PADDED],
                                             model=model, parameters=params)
    assert report.gradient_difference == 0.0 and report.ok
    assert report.assert_ok() is report


_WITHIN = testing.InvarianceReport(loss_difference=1.0, gradient_difference=1.0,
                                   loss_tolerance=1.0, gradient_tolerance=1.0,
                                   reference_loss=0.0, gradient_scale=0.0, worst_case="case",
                                   num_cases=1)


@pytest.mark.parametrize(("changes", "ok"), [
    ({}, True),                                             # both at their tolerance
    ({"loss_difference": 1.5}, False),
    ({"gradient_difference": 1.5}, False),
    ({"loss_difference": 1.5, "gradient_difference": 1.5}, False),
    ({"loss_tolerance": 0.5}, False),
    ({"gradient_tolerance": 0.5}, False),
    ({"gradient_difference": float("inf")}, False),
], ids=["within", "loss", "gradient", "both", "loss-tolerance", "gradient-tolerance", "inf"])
def test_ok_needs_both_differences_within_their_tolerances(changes, ok):
    report = dataclasses.replace(_WITHIN, **changes)
    assert report.ok is ok
    if ok:
        assert report.assert_ok() is report
    else:
        with pytest.raises(AssertionError, match="invariance violated in case"):
            report.assert_ok()
