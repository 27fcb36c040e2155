"""Random normalizers by the Laplace identity: ``1/N^p`` as a finite sum of exponentials.

For ``N > 0`` and ``p >= 1``, ``N^{-p} = Γ(p)^{-1} ∫_0^∞ s^{p-1} e^{-sN} ds``. Where ``N`` is a
sum of per-token terms of independent responses (the token mean's ``Σ_i |y_i|``, a kept count,
a sum of importance weights), ``e^{-sN}`` is a product of per-token factors ``e^{-s ν_t}``, so
an expectation of ``h / N^p`` becomes an integral over ``s`` of lattice passes under the tilted
measure ``μ e^{-sν}`` (:mod:`~tokenmdp.exact.lattice.moments`).

The integral is discretised in ``x = log s`` by the trapezoidal rule on nodes ``x_j = x_0 + j h``
(``j = 0 .. n-1``), weights ``w_{p,j} = h e^{p x_j} / Γ(p)``:
``N^{-p} ≈ Σ_j w_{p,j} e^{-s_j N}``. Its relative error, for every ``N`` in ``[N_lo, N_hi]``, is
bounded by the sum of three terms (:func:`laplace_rule` computes each):

* discretisation (Poisson summation; the integrand ``e^{px - N e^x}`` has Fourier transform
  ``Γ(p - iω) N^{-(p - iω)}``, so the relative error does not depend on ``N``):
  ``2 Σ_{k>=1} |Γ(p + 2πik/h)| / Γ(p)``, with ``|Γ(1 + iy)|² = πy / sinh(πy)`` and
  ``|Γ(2 + iy)|² = (1 + y²) πy / sinh(πy)``;
* the nodes below ``x_0``, where ``e^{-sN}`` is nearly flat, replaced by a two-node Gauss
  rule of their discrete measure (Golub–Welsch on its moments, geometric sums in closed form):
  at most ``N_hi^{4+p} h e^{(4+p) x_0} / (4! Γ(p) (e^{(4+p)h} - 1))`` (``|d⁴/ds⁴ e^{-sN}| <=
  N^4``); this moves ``x_0`` up by about ``(4/5) log(1/ε)`` and saves some 60 nodes;
* the nodes left out from ``x_n`` up, with ``y = N_lo e^{x_n} >= p``:
  ``(h y^p e^{-y} + Γ(p, y)) / Γ(p)`` (``Γ(1, y) = e^{-y}``, ``Γ(2, y) = (1 + y) e^{-y}``);

plus ``4 n ε`` (``ε = 2^-52``) for evaluating the sum of ``n`` positive terms in float64.

The rule is exact to that bound for every ``N`` in the range at once, so one set of tilted
lattice passes serves ``1/N`` and ``1/N²`` together.
"""

from __future__ import annotations

import dataclasses
import math

import torch

__all__ = ["LaplaceRule", "laplace_rule", "DEFAULT_TOLERANCE", "MAX_NODES"]

#: The relative error the rule is built to stay below.
DEFAULT_TOLERANCE = 1e-11
#: A rule needing more nodes than this is refused (a normalizer range too wide).
MAX_NODES = 4000
POWERS = (1, 2)
EPS = 2.0 ** -52


@dataclasses.dataclass(frozen=True)
class LaplaceRule:
    """Nodes and weights with ``N^{-p} ≈ Σ_j weights[p][j] e^{-nodes[j] N}`` on ``[low, high]``.

    Built by :func:`laplace_rule`; each parameter is also the attribute of that name.

    Parameters
    ----------
    nodes : Tensor ``[n]``
        The ``s_j > 0``, float64.
    weights : dict of int to Tensor ``[n]``
        ``p -> w_{p,j}`` for ``p`` in 1, 2.
    low : float
        The smallest ``N`` the bound holds for.
    high : float
        The largest.
    error_bound : dict of int to float
        ``p ->`` the proven bound on ``|N^p Σ_j w_{p,j} e^{-s_j N} - 1|`` over the range.
    """

    nodes: torch.Tensor
    weights: dict
    low: float
    high: float
    error_bound: dict

    def __len__(self) -> int:
        return int(self.nodes.numel())

    def evaluate(self, values: torch.Tensor, power: int) -> torch.Tensor:
        """``Σ_j w_{p,j} e^{-s_j N}`` at each ``N`` of ``values`` (the rule's ``N^{-p}``).

        Parameters
        ----------
        values : Tensor
            Positive ``N``, any shape.
        power : int
            ``p`` (1 or 2).

        Returns
        -------
        Tensor
            The approximations, float64, the shape of ``values``.
        """
        n = torch.as_tensor(values, dtype=torch.float64)
        return (self.weights[power] * torch.exp(-n[..., None] * self.nodes)).sum(-1)


def _log_abs_gamma(power: int, y: float) -> float:
    """``log |Γ(p + iy)|`` for ``p`` in 1, 2 and ``y > 0``."""
    x = math.pi * y
    log_sinh = x + math.log1p(-math.exp(-2 * x)) - math.log(2)
    out = 0.5 * (math.log(x) - log_sinh)
    return out + 0.5 * math.log1p(y * y) if power == 2 else out


def _discretisation(power: int, h: float) -> float:
    total = 0.0
    for k in range(1, 64):
        term = math.exp(_log_abs_gamma(power, 2 * math.pi * k / h))
        total += term
        if term < 1e-30 * max(total, 1e-300):
            break
    return 2 * total / math.gamma(power)


def _tail_bound(power: int, h: float, x0: float, high: float) -> float:
    """The 2-node Gauss rule's error on the nodes below ``x0``, relative to ``N^{-p}``: at most
    ``N^{4+p}/4! · Σ_j w_{p,j} s_j^4`` (``e^{-sN}`` has ``|f⁗| <= N^4``; the monic orthogonal
    polynomial of degree 2 has ``∫ π² <= ∫ s^4``), a geometric sum in closed form."""
    log = ((4 + power) * (math.log(high) + x0) + math.log(h) - math.log(24 * math.gamma(power))
           - math.log(math.expm1((4 + power) * h)))
    return math.exp(log)


def _gauss_tail(power: int, h: float, x0: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Two nodes and weights reproducing the moments 0..3 of the left-out nodes ``s_j = e^{x0 -
    jh}`` (``j >= 1``) with weights ``h e^{p x_j}/Γ(p)`` (Golub–Welsch on ``u = s e^{-x0}``)."""
    scale = h * math.exp(power * x0) / math.gamma(power)
    mom = [scale / math.expm1((power + i) * h) for i in range(4)]
    a0 = mom[1] / mom[0]
    n1 = mom[2] - 2 * a0 * mom[1] + a0 * a0 * mom[0]
    a1 = (mom[3] - 2 * a0 * mom[2] + a0 * a0 * mom[1]) / n1
    jacobi = torch.tensor([[a0, math.sqrt(n1 / mom[0])], [math.sqrt(n1 / mom[0]), a1]],
                          dtype=torch.float64)
    u, vectors = torch.linalg.eigh(jacobi)
    return math.exp(x0) * u, mom[0] * vectors[0] ** 2


def _upper(power: int, h: float, x_end: float, low: float) -> float:
    y = low * math.exp(x_end)
    tail = math.exp(-y) if power == 1 else (1 + y) * math.exp(-y)
    return (h * math.exp(power * math.log(y) - y) + tail) / math.gamma(power)


def laplace_rule(low: float, high: float, *, tolerance: float = DEFAULT_TOLERANCE,
                 max_nodes: int = MAX_NODES) -> LaplaceRule:
    """The trapezoidal rule in ``log s`` for ``1/N`` and ``1/N²`` on ``N ∈ [low, high]``.

    Parameters
    ----------
    low, high : float
        The smallest and largest value the normalizer takes where it matters
        (``0 < low <= high``).
    tolerance : float, default :data:`DEFAULT_TOLERANCE`
        The largest relative error allowed for either power.
    max_nodes : int, default :data:`MAX_NODES`
        Refuse a rule that needs more nodes.

    Returns
    -------
    LaplaceRule
        Nodes, weights and the proven error bound (each at most ``tolerance``).

    Raises
    ------
    ValueError
        ``low`` not positive or above ``high``, a non-finite bound, ``tolerance`` not in
        ``(0, 1)``, or a range that needs more than ``max_nodes`` nodes for ``tolerance``.
    """
    for name, v in (("low", low), ("high", high)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ValueError(f"{name}: expected a finite number, got {v!r}")
    if not low > 0:
        raise ValueError(f"low: the normalizer must be positive, got {low!r} (a normalizer that "
                         "can be zero has no Laplace rule)")
    if high < low:
        raise ValueError(f"high: must be >= low ({low!r}), got {high!r}")
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance: expected a number in (0, 1), got {tolerance!r}")
    part = tolerance / 3
    h = 1.0
    while max(_discretisation(p, h) for p in POWERS) > part:
        h *= 0.9
    # the lowest trapezoid node: below it, a 2-node Gauss rule per power within part
    x0 = -math.log(high)
    while max(_tail_bound(p, h, x0, high) for p in POWERS) > part:
        x0 -= h / 4
    # the first node left out: y = low e^{x_n} large enough for both upper tails
    y = 2.0
    while max(_upper(p, h, math.log(y / low), low) for p in POWERS) > part:
        y *= 1.1
    n = int(math.ceil((math.log(y / low) - x0) / h))
    if n > max_nodes:
        raise ValueError(f"tolerance: a relative error of {tolerance:g} on N in [{low:g}, "
                         f"{high:g}] needs {n} nodes, more than max_nodes={max_nodes}; the "
                         "normalizer's range is too wide for the Laplace rule")
    x = x0 + h * torch.arange(n, dtype=torch.float64)
    x_end = x0 + n * h
    tails = {p: _gauss_tail(p, h, x0) for p in POWERS}
    nodes = torch.cat([torch.exp(x)] + [tails[p][0] for p in POWERS])
    zeros = torch.zeros(2, dtype=torch.float64)
    weights = {p: torch.cat([h * torch.exp(p * x) / math.gamma(p)] +
                            [tails[p][1] if q == p else zeros for q in POWERS]) for p in POWERS}
    rounding = 4 * nodes.numel() * EPS     # the sum of n positive float64 terms, as evaluated
    bound = {p: _discretisation(p, h) + _tail_bound(p, h, x0, high) +
             _upper(p, h, x_end, low) + rounding for p in POWERS}
    if max(bound.values()) > tolerance:  # pragma: no cover - the construction above ensures it
        raise ValueError(f"tolerance: the rule's bound {max(bound.values()):.3g} exceeds "
                         f"{tolerance:g}")
    return LaplaceRule(nodes=nodes, weights=weights, low=float(low), high=float(high),
                       error_bound=bound)
