"""The Laplace rule for random normalizers: its proven bound holds on every normalizer value of
its range (all integers for token counts, a dense grid for sums of weights), and it refuses
what it cannot do."""

import math

import pytest
import torch

from tokenmdp.exact.lattice import laplace_rule
from tokenmdp.exact.lattice.laplace import DEFAULT_TOLERANCE


def _worst(rule, values, power):
    return float((rule.evaluate(values, power) * values ** power - 1).abs().max())


@pytest.mark.parametrize("low,high", [(1, 1), (1, 64), (2, 2 * 4096), (8, 8 * 4096),
                                      (16, 16 * 4096)])
def test_bound_holds_on_every_token_count(low, high):
    """``1/N`` and ``1/N²`` for every integer ``N`` of the range, against the stated bound."""
    rule = laplace_rule(low, high)
    counts = torch.arange(low, high + 1, dtype=torch.float64)
    for power in (1, 2):
        assert rule.error_bound[power] <= DEFAULT_TOLERANCE
        assert _worst(rule, counts, power) <= rule.error_bound[power]


def test_bound_holds_on_real_sums_and_is_not_vacuous():
    """Sums of importance weights are real: a dense log grid over six decades; the bound is
    within a factor 100 of the worst error seen (it is a bound, not a guess)."""
    rule = laplace_rule(0.01, 1e4, tolerance=1e-10)
    grid = torch.logspace(-2, 4, 200_001, dtype=torch.float64)
    worst = _worst(rule, grid, 1)
    assert worst <= rule.error_bound[1] <= 100 * worst
    assert _worst(rule, grid, 2) <= rule.error_bound[2]


def test_a_looser_tolerance_needs_fewer_nodes():
    assert len(laplace_rule(8, 32768, tolerance=1e-6)) < len(laplace_rule(8, 32768)) <= 200


@pytest.mark.parametrize("kw,words", [
    (dict(low=0.0, high=4.0), "low: the normalizer must be positive"),
    (dict(low=-1.0, high=4.0), "low"),
    (dict(low=5.0, high=4.0), "high: must be >= low"),
    (dict(low=1.0, high=math.inf), "high: expected a finite number"),
    (dict(low=1.0, high=4.0, tolerance=0.0), "tolerance"),
    (dict(low=1e-300, high=1e300, max_nodes=100), "max_nodes=100"),
])
def test_refuses_what_it_cannot_bound(kw, words):
    with pytest.raises(ValueError, match=words):
        laplace_rule(**kw)
