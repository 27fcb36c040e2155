"""Streaming Monte Carlo moments: running sums of sampled per-batch gradients, O(parameters) memory.

:func:`~tokenmdp.exact.moments` with ``method="monte_carlo"`` draws i.i.d. batches and folds each
block of them into a :class:`MonteCarloSums` as soon as its coefficients are known (the sparse
path of the exact methods: a batch touches the rows of the parameters its states own), so no
``[batches, parameters]`` tensor is ever kept. From the sums come the sample mean and its
per-coordinate standard errors, the unbiased total variance ``Σ‖g_i − ḡ‖² / (N − 1)`` (as
``Σ a_i − N ‖ḡ − ∇J‖²`` with ``a_i = ‖g_i − ∇J‖²``, well conditioned near the truth), the MSE,
and delta-method standard errors of the relative bias, the cosine and the total variance. The
latter need ``Var(u · g)`` for a direction ``u`` known only at the end: exactly ``u^T Cov u``
when the covariance is kept (small policies), else by batch means over
:data:`NUM_CHUNKS` consecutive chunks of the stream (Flegal and Jones 2010, "Batch means and
spectral variance estimators in MCMC", for i.i.d. draws simply a split of the sample).

Sums of independent streams add: :func:`pool` merges the results of several calls (for example
with one generator, which continues its stream from call to call) into one, as if drawn at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tokenmdp.exact.lab.moments_result import Moments

__all__ = ["MonteCarloSums", "pool", "NUM_CHUNKS"]

NUM_CHUNKS = 32
"""Chunks of the stream whose means give the batch-means variances (without a covariance)."""


@dataclass
class MonteCarloSums:
    """Running sums of per-batch gradients ``g_i`` ``[d]`` and of ``a_i = ‖g_i − ∇J‖²``.

    Parameters
    ----------
    true_gradient : Tensor ``[d]``
        ``∇J``, the centre of ``a_i``.
    keep_cov : bool
        Also sum ``g_i g_i^T`` (``[d, d]``; small policies only).
    p_keep : float, default 1.0
        The acceptance rate of filtered groups (carried to :class:`Moments`).

    The sums themselves (``n``, ``sum_g``, ``sum_g2``, ``sum_ag`` ``[d]``, ``sum_a``,
    ``sum_a2``, the stream's ``chunks``: per call a ``[NUM_CHUNKS]`` count and a
    ``[NUM_CHUNKS, d]`` sum, and with ``keep_cov``, ``outer``) start at zero and grow with
    :meth:`add_rows`.
    """

    true_gradient: torch.Tensor
    keep_cov: bool
    p_keep: float = 1.0
    n: int = field(default=0, init=False)
    sum_g: torch.Tensor = field(init=False)
    sum_g2: torch.Tensor = field(init=False)
    sum_ag: torch.Tensor = field(init=False)
    sum_a: float = field(default=0.0, init=False)
    sum_a2: float = field(default=0.0, init=False)
    chunks: list = field(default_factory=list, init=False)
    outer: torch.Tensor | None = field(init=False)

    def __post_init__(self) -> None:
        d = self.true_gradient.numel()
        zeros = self.true_gradient.new_zeros
        self.sum_g, self.sum_g2, self.sum_ag = zeros(d), zeros(d), zeros(d)
        self.outer = zeros(d, d) if self.keep_cov else None

    def add_rows(self, draw: torch.Tensor, cols: torch.Tensor, vals: torch.Tensor,
                 num_draws: int, chunk_of_draw: torch.Tensor) -> None:
        """Fold ``num_draws`` gradients given as rows: draw ``draw[u]`` has ``vals[u]`` at the
        parameters ``cols[u]`` (``[U, w]`` each; a draw's rows cover distinct parameters).

        Parameters
        ----------
        draw : LongTensor ``[U]``
            The draw (``0 .. num_draws - 1``) of each row.
        cols, vals : Tensor ``[U, w]``
            Parameter indices and gradient entries of each row.
        num_draws : int
            Draws in this block.
        chunk_of_draw : LongTensor ``[num_draws]``
            The chunk of the stream (``0 .. NUM_CHUNKS - 1``) each draw belongs to.
        """
        tg = self.true_gradient
        flat_cols, flat_vals = cols.reshape(-1), vals.reshape(-1)
        self.sum_g.index_add_(0, flat_cols, flat_vals)
        self.sum_g2.index_add_(0, flat_cols, flat_vals * flat_vals)
        zeros = tg.new_zeros(num_draws)
        norm2 = zeros.index_add(0, draw, (vals * vals).sum(-1))
        dot = zeros.index_add(0, draw, (vals * tg[cols]).sum(-1))
        a = norm2 - 2 * dot + float(tg @ tg)                         # ‖g_i − ∇J‖²
        self.sum_a += float(a.sum())
        self.sum_a2 += float(a @ a)
        self.sum_ag.index_add_(0, flat_cols, (a[draw][:, None] * vals).reshape(-1))
        d = tg.numel()
        if not self.chunks:                  # [NUM_CHUNKS, d] sums and counts, one index_add
            self.chunks.append((torch.zeros(NUM_CHUNKS, dtype=torch.long),
                                tg.new_zeros(NUM_CHUNKS, d)))
        counts, sums = self.chunks[-1]
        counts += torch.bincount(chunk_of_draw, minlength=NUM_CHUNKS)
        sums.view(-1).index_add_(0, (chunk_of_draw[draw][:, None] * d + cols).reshape(-1),
                                 flat_vals)
        if self.keep_cov:
            g = tg.new_zeros(num_draws, d).index_put_((draw[:, None].expand_as(cols), cols),
                                                      vals, accumulate=True)
            self.outer += g.T @ g
        self.n += num_draws

    def merged(self, other: MonteCarloSums) -> MonteCarloSums:
        """The sums of both streams (same ``∇J``), as one.

        Parameters
        ----------
        other : MonteCarloSums
            Sums of draws independent of this one's.

        Returns
        -------
        MonteCarloSums
            A new object; the acceptance rate is the draw-weighted mean of both.
        """
        if not torch.equal(self.true_gradient, other.true_gradient):
            raise ValueError("pool: the results are about different true gradients (another "
                             "policy, MDP or parameters)")
        out = MonteCarloSums(self.true_gradient, self.keep_cov and other.keep_cov,
                             (self.p_keep * self.n + other.p_keep * other.n)
                             / max(self.n + other.n, 1))
        out.n = self.n + other.n
        for name in ("sum_g", "sum_g2", "sum_ag"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.sum_a, out.sum_a2 = self.sum_a + other.sum_a, self.sum_a2 + other.sum_a2
        out.chunks = self.chunks + other.chunks
        if out.keep_cov:
            out.outer = self.outer + other.outer
        return out

    def moments(self) -> Moments:
        """The sample moments and their standard errors.

        Returns
        -------
        Moments
            ``method="monte_carlo"``, ``num_draws = n``, the sums in ``monte_carlo_sums``.
        """
        N, tg = self.n, self.true_gradient
        if N < 2:
            raise ValueError(f"num_samples: need at least 2 draws, got {N}")
        mean = self.sum_g / N
        bias = mean - tg
        a_mean = self.sum_a / N
        total_var = max((self.sum_a - N * float(bias @ bias)) / (N - 1), 0.0)
        cov = None
        if self.keep_cov:
            cov = (self.outer - N * torch.outer(mean, mean)) / (N - 1)

        def var_along(u: torch.Tensor) -> float:
            """``Var(u · g)``: exact from the covariance, else by batch means."""
            if cov is not None:
                return max(float(u @ cov @ u), 0.0)
            sums = self._chunk_sums()
            if len(sums) < 2:
                return math.nan
            counts = torch.tensor([c for c, _ in sums], dtype=tg.dtype)
            means = torch.stack([s for _, s in sums]) / counts[:, None]
            dev = means @ u - float(mean @ u)
            return max(float((counts * dev * dev).sum()) / (len(sums) - 1), 0.0)

        def delta_se(u: torch.Tensor) -> float:
            return (var_along(u) / N) ** 0.5

        gn, b_norm, m_norm = tg.norm(), bias.norm(), mean.norm()
        rel_se = (delta_se(bias / b_norm) / float(gn) if b_norm > 0 else 0.0) if gn > 0 else None
        cos_se = None
        if gn > 0 and m_norm > 0:
            cos = mean @ tg / (m_norm * gn)
            cos_se = delta_se((tg / gn - cos * mean / m_norm) / m_norm)
        var_a = max((self.sum_a2 - N * a_mean ** 2) / (N - 1), 0.0)
        # sq_i = ‖g_i − ḡ‖² = a_i − 2 (g_i − ∇J)·b + ‖b‖²: Var = Var a − 4 Cov(a, g·b) + 4 Var(g·b)
        cov_ab = (float(self.sum_ag @ bias) - N * a_mean * float(mean @ bias)) / (N - 1)
        var_gb = var_along(bias) if b_norm > 0 else 0.0
        var_sq = max(var_a - 4 * cov_ab + 4 * var_gb, 0.0) if math.isfinite(var_gb) else var_a
        coord_var = ((self.sum_g2 - N * mean * mean) / (N - 1)).clamp(min=0)
        return Moments(mean=mean, true_gradient=tg, total_variance=total_var, covariance=cov,
                       method="monte_carlo", num_draws=N, mean_se=(coord_var / N).sqrt(),
                       total_variance_se=(var_sq / N) ** 0.5, mse_se=(var_a / N) ** 0.5,
                       relative_bias_se=rel_se, cosine_se=cos_se, keep_probability=self.p_keep,
                       monte_carlo_sums=self)

    def _chunk_sums(self) -> list:
        """``(count, sum)`` of the stream's chunks, merged down to at most :data:`NUM_CHUNKS`
        (each pooled result brings its own ``NUM_CHUNKS``)."""
        sums = [(int(c), s) for counts, rows in self.chunks for c, s in zip(counts, rows)
                if int(c) > 0]
        while len(sums) > NUM_CHUNKS:
            sums = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(sums[::2], sums[1::2])] + (
                [sums[-1]] if len(sums) % 2 else [])
        return sums


def pool(*results: Moments) -> Moments:
    """One Monte Carlo result from several on independent draws (their sums added).

    Parameters
    ----------
    *results : Moments
        Results of :func:`~tokenmdp.exact.moments` with ``method="monte_carlo"`` (or ``auto``
        that ran it) for one policy at the same parameters, e.g. successive calls with one
        generator.

    Returns
    -------
    Moments
        The moments of all their draws together, with standard errors.

    Raises
    ------
    ValueError
        No results, a result that is not a streamed Monte Carlo one, or results about
        different true gradients.
    """
    if not results:
        raise ValueError("results: need at least one Monte Carlo result")
    for i, r in enumerate(results):
        if not isinstance(r, Moments) or r.monte_carlo_sums is None:
            raise ValueError(f"results[{i}]: not a Monte Carlo result of moments() "
                             f"(method={getattr(r, 'method', None)!r})")
    total = results[0].monte_carlo_sums
    for r in results[1:]:
        total = total.merged(r.monte_carlo_sums)
    return total.moments()
