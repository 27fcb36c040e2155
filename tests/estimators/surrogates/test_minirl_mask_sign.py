"""MiniRL's mask ``M_t`` reads the sign of the advantage: it drops ``Â > 0, r > 1 + ε_high``
and ``Â < 0, r < 1 − ε_low``, and keeps the other side of each bound. Hand-worked gradient
coefficients ``M r Â`` of ``minirl_term`` and of the registry's ``minirl`` part, one token per
(ratio, sign) case."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmdp import estimators as E
from tokenmdp.batch import TokenBatch
from tokenmdp.estimators.surrogates.clipped import minirl_term

EXACT = 1e-12
EPS_LOW, EPS_HIGH = 0.2, 0.27
# (ratio r, advantage Â, kept by the mask)
CASES = [(1.5, +1.0, False), (1.5, -1.0, True), (0.5, -2.0, False), (0.5, +2.0, True),
         (1.0, +0.5, True), (1.0, -0.5, True), (1.2, +1.0, True), (0.9, -1.0, True)]


def _tensors():
    ratio = torch.tensor([[r for r, _, _ in CASES]], dtype=torch.float64)
    adv = torch.tensor([[a for _, a, _ in CASES]], dtype=torch.float64)
    old = torch.full_like(ratio, -1.0)
    lp = (old + ratio.log()).requires_grad_(True)
    return lp, old, adv


def _expected():
    return [r * a if kept else 0.0 for r, a, kept in CASES]


def test_minirl_term_masks_by_the_advantage_sign():
    lp, old, adv = _tensors()
    out = minirl_term(lp, old, adv, eps_low=EPS_LOW, eps_high=EPS_HIGH)
    (grad,) = torch.autograd.grad(out.term_RC.sum(), lp)
    assert grad[0].tolist() == pytest.approx(_expected(), abs=EXACT)
    assert out.clipped_RC[0].tolist() == [not kept for _, _, kept in CASES]
    # the value M sg(r) Â log π on a kept token
    assert out.term_RC[0, 1].item() == pytest.approx(1.5 * -1.0 * (-1.0 + math.log(1.5)),
                                                     abs=EXACT)


def test_the_registry_minirl_part_masks_by_the_advantage_sign():
    """The ``minirl`` estimator's surrogate on a batch (prompt token first, then the cases)."""
    lp, old, adv = _tensors()
    part = E.get("minirl").surrogate
    assert (part.eps_low, part.eps_high) == (EPS_LOW, EPS_HIGH)
    zero = torch.zeros(1, 1, dtype=torch.float64)
    batch = TokenBatch.from_sequences([[0]], [[1] * len(CASES)]).replace(
        old_logprob=torch.cat([zero, old], 1), advantage=torch.cat([zero, adv], 1))
    full = torch.cat([zero, lp.detach()], 1).requires_grad_(True)
    (grad,) = torch.autograd.grad(part(full, batch).term_RC.sum(), full)
    assert grad[0, 1:].tolist() == pytest.approx(_expected(), abs=EXACT)
