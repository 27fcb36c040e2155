"""The result of :func:`~tokenmdp.exact.moments`: :class:`Moments`, and how it is computed.

:class:`Moments` holds the first two moments of an estimator's gradient ``ĝ`` (its mean, the
total variance ``tr Cov[ĝ]``, the covariance for small policies) next to the true ``∇J``, and
derives the figures the lab reports (bias, relative bias, cosine, the best rescaling ``c*``,
the directional bias, MSE; with standard errors under Monte Carlo). Two builders: from the exact
sums ``E[ĝ]``, ``E‖ĝ‖²``, ``E[ĝ ĝ^T]`` of an exact method, and from the per-batch gradients of
Monte Carlo draws (sample moments, standard errors by the delta method). :class:`Moments` is
re-exported by :mod:`tokenmdp.exact.lab.moments` and :mod:`tokenmdp.exact`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["Moments"]


@dataclass(frozen=True)
class Moments:
    """The first two moments of an estimator's gradient ``ĝ`` against the true ``∇J``.

    Built by :func:`~tokenmdp.exact.moments`; each parameter is also the attribute of that name,
    and the properties derive the figures from them.

    Parameters
    ----------
    mean : Tensor ``[d]``
        ``E[ĝ]``, flat in ``policy.parameters()`` order (an estimate of the ascent direction).
    true_gradient : Tensor ``[d]``
        ``∇J`` at the same parameters.
    total_variance : float
        ``tr Cov[ĝ] = E‖ĝ − E ĝ‖²``.
    covariance : Tensor ``[d, d]`` or None
        ``Cov[ĝ]`` when the policy has at most ``MAX_COVARIANCE_DIM`` parameters.
    method : str
        ``"enumeration"``, ``"exchangeability"`` or ``"monte_carlo"``.
    num_draws : int
        Batches enumerated (exact) or sampled (Monte Carlo).
    mean_se : Tensor ``[d]`` or None, default None
        Monte Carlo: standard error of each coordinate of ``mean``.
    total_variance_se : float or None, default None
        Monte Carlo: standard error of ``total_variance``.
    mse_se : float or None, default None
        Monte Carlo: standard error of ``mse``.
    relative_bias_se : float or None, default None
        Monte Carlo: standard error of ``relative_bias`` (delta method).
    cosine_se : float or None, default None
        Monte Carlo: standard error of ``cosine`` (delta method).
    keep_probability : float, default 1.0
        With ``filter_groups``: the probability that a drawn group is kept.
    monte_carlo_sums : MonteCarloSums or None, default None
        Monte Carlo: the running sums the figures come from
        (:class:`~tokenmdp.exact.lab.monte_carlo.MonteCarloSums`), which
        :func:`~tokenmdp.exact.lab.monte_carlo.pool` adds across calls.
    """

    mean: torch.Tensor
    true_gradient: torch.Tensor
    total_variance: float
    covariance: torch.Tensor | None
    method: str
    num_draws: int
    mean_se: torch.Tensor | None = None
    total_variance_se: float | None = None
    mse_se: float | None = None
    relative_bias_se: float | None = None
    cosine_se: float | None = None
    keep_probability: float = 1.0
    monte_carlo_sums: object | None = field(default=None, repr=False, compare=False)

    @property
    def bias(self) -> torch.Tensor:
        """``E[ĝ] − ∇J``."""
        return self.mean - self.true_gradient

    @property
    def relative_se(self) -> float:
        """``‖SE(E ĝ)‖ / ‖∇J‖``: how far the mean may be off, relative to the true gradient's
        length (``‖mean‖`` when ``∇J = 0``); 0 for an exact method. It is what
        ``method="auto"`` reaches (its ``target_rse``)."""
        if self.mean_se is None:
            return 0.0
        scale = float(self.true_gradient.norm()) or float(self.mean.norm())
        se = float(self.mean_se.norm())
        return se / scale if scale > 0 else (0.0 if se == 0 else float("inf"))

    @property
    def relative_bias(self) -> float:
        """``‖E[ĝ] − ∇J‖ / ‖∇J‖``."""
        return float(self.bias.norm() / self.true_gradient.norm())

    @property
    def cosine(self) -> float:
        """Cosine between ``E[ĝ]`` and ``∇J``."""
        return float(self.mean @ self.true_gradient
                     / (self.mean.norm() * self.true_gradient.norm()).clamp(min=1e-300))

    @property
    def scale(self) -> float:
        """The best positive rescaling ``c* = max(0, <E ĝ, ∇J> / ‖E ĝ‖²)``."""
        denom = float(self.mean @ self.mean)
        return max(0.0, float(self.mean @ self.true_gradient) / denom) if denom > 0 else 0.0

    @property
    def directional_bias(self) -> float:
        """``‖c* E[ĝ] − ∇J‖ / ‖∇J‖``: the bias left after the best positive rescaling
        (``sqrt(1 − cos²)`` when the cosine is positive, 1 otherwise)."""
        return float((self.scale * self.mean - self.true_gradient).norm()
                     / self.true_gradient.norm())

    @property
    def mse(self) -> float:
        """``E‖ĝ − ∇J‖² = tr Cov + ‖bias‖²``."""
        return self.total_variance + float(self.bias @ self.bias)

    def summary(self) -> dict[str, float]:
        """The scalar figures as a dict (for tables, CSV and JSON).

        Returns
        -------
        dict of str to float
            ``relative_bias``, ``cosine``, ``directional_bias``, ``scale``, ``total_variance``,
            ``mse``, ``mean_norm``, ``true_gradient_norm`` and ``num_draws``, plus the standard
            errors that are known (Monte Carlo).
        """
        out = {"relative_bias": self.relative_bias, "cosine": self.cosine,
               "directional_bias": self.directional_bias, "scale": self.scale,
               "total_variance": self.total_variance, "mse": self.mse,
               "mean_norm": float(self.mean.norm()),
               "true_gradient_norm": float(self.true_gradient.norm()),
               "num_draws": self.num_draws}
        for name in ("relative_bias_se", "cosine_se", "total_variance_se", "mse_se"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


def _exact_moments(mean, second, outer, true_grad, evaluated, p_keep, method) -> Moments:
    """The moments from an exact method's ``E[ĝ]``, ``E‖ĝ‖²`` and ``E[ĝ ĝ^T]`` (or None)."""
    total_var = float(second - mean @ mean)
    cov = (outer - torch.outer(mean, mean)) if outer is not None else None
    return Moments(mean=mean, true_gradient=true_grad, total_variance=max(total_var, 0.0),
                   covariance=cov, method=method, num_draws=evaluated, keep_probability=p_keep)


def _monte_carlo_moments(g: torch.Tensor, true_grad: torch.Tensor, keep_cov: bool,
                         p_keep: float) -> Moments:
    """Sample mean, unbiased sample covariance and standard errors from per-batch gradients."""
    N = g.shape[0]
    mean = g.mean(0)
    centered = g - mean
    sq = (centered * centered).sum(1)                       # ‖ĝ − ḡ‖²
    total_var = float(sq.sum() / (N - 1))
    cov = centered.T @ centered / (N - 1) if keep_cov else None
    err = ((g - true_grad) ** 2).sum(1)                     # ‖ĝ − ∇J‖²
    bias = mean - true_grad
    gn = true_grad.norm()
    # delta method: SE of f(mean) = sqrt(∇f^T Cov ∇f / N)
    def delta_se(direction: torch.Tensor) -> float:
        return float(((centered @ direction) ** 2).sum() / (N - 1) / N) ** 0.5
    b_norm = bias.norm()
    m_norm = mean.norm()
    # relative bias and cosine are undefined where ∇J (or the mean) is zero: no standard error
    rel_se = (delta_se(bias / b_norm) / float(gn) if b_norm > 0 else 0.0) if gn > 0 else None
    cos_se = None
    if gn > 0 and m_norm > 0:
        cos = mean @ true_grad / (m_norm * gn)
        cos_se = delta_se((true_grad / gn - cos * mean / m_norm) / m_norm)
    return Moments(mean=mean, true_gradient=true_grad, total_variance=total_var, covariance=cov,
                   method="monte_carlo", num_draws=N,
                   mean_se=centered.std(0, unbiased=True) / N ** 0.5 if N > 1 else None,
                   total_variance_se=float(sq.std() / N ** 0.5),
                   mse_se=float(err.std() / N ** 0.5),
                   relative_bias_se=rel_se, cosine_se=cos_se, keep_probability=p_keep)
