"""Plot helpers for the exact lab (every function returns its figure, or writes it to ``path``).

The module does not choose a backend: in a notebook figures show inline, on a headless machine
matplotlib falls back to Agg by itself.

* :func:`plot_comparison` — relative bias, cosine to ``∇J``, total variance and MSE (raw and after
  the best rescaling ``c*``) per estimator;
* :func:`plot_first_order` — true vs surrogate improvement along a path, the gap and its bound;
* :func:`plot_length_drift` — ``E|y|`` and ``J`` under exact gradient ascent per aggregation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np

__all__ = ["plot_comparison", "plot_first_order", "plot_length_drift"]


def _save(fig, path: str | Path | None):
    if path is not None:
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
    return fig


def _log_ticks(ax) -> None:
    """Readable ticks on a log x axis however few decades it spans (labels at 1, 2, 5 × 10^k)."""
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(matplotlib.ticker.LogFormatterSciNotation(
        labelOnlyBase=False, minor_thresholds=(np.inf, np.inf)))
    ax.xaxis.set_minor_locator(matplotlib.ticker.LogLocator(base=10, subs="auto"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.tick_params(axis="x", labelsize=7, labelrotation=30)


def plot_comparison(rows: Sequence[Mapping[str, float]], path: str | Path | None = None,
                    *, title: str = ""):
    """Per-estimator panels: relative bias, cosine to ``∇J``, total variance, and the MSE before
    and after the best positive rescaling ``c*`` against ``‖∇J‖²`` (no step at all).

    Parameters
    ----------
    rows : sequence of mappings
        Each with ``estimator``, ``relative_bias``, ``cosine``, ``total_variance``, ``mse`` and,
        optionally, ``mse_c_star`` and ``no_step_mse`` (``tokenmdp.reports.comparison.summary_row``)
        and ``*_se`` standard errors (drawn as error bars).
    path : path, optional
        Where to write the PNG (the figure is returned either way).
    title : str
        The figure's title (above the panels' own titles).

    Returns
    -------
    matplotlib.figure.Figure
        The four-panel figure (closed once written when ``path`` is given).
    """
    names = [r["estimator"] for r in rows]
    panels = [("relative_bias", "relative bias", "‖E ĝ − ∇J‖ / ‖∇J‖", False),
              ("cosine", "cosine to ∇J", "cos(E ĝ, ∇J)", False),
              ("total_variance", "total variance", "tr Cov ĝ (log scale)", True),
              ("mse", "mean squared error", "E‖c ĝ − ∇J‖² (log scale)", True)]
    fig, axes = plt.subplots(1, 4, figsize=(16, 0.32 * len(names) + 2.6), sharey=True,
                             layout="constrained")
    y = np.arange(len(names))
    for ax, (key, name, label, log) in zip(axes, panels):
        vals = np.array([r[key] for r in rows], dtype=float)
        err = [r.get(f"{key}_se", 0.0) or 0.0 for r in rows]
        xerr = err if any(err) else None
        log = log and len(vals) > 0 and bool((vals > 0).all())
        if not log:   # bars from 0 on linear axes
            ax.barh(y, vals, xerr=xerr, color="tab:blue", alpha=0.8)
        elif key != "mse" or not all("mse_c_star" in r for r in rows):
            ax.errorbar(vals, y, xerr=xerr, fmt="o", color="tab:blue")   # dots on log axes
        else:
            scaled = np.array([r["mse_c_star"] for r in rows], dtype=float)
            log = bool((scaled > 0).all())
            ax.hlines(y, scaled, vals, color="0.7", lw=1.5)
            ax.errorbar(vals, y, xerr=xerr, fmt="o", color="tab:blue", label="MSE at c = 1")
            ax.plot(scaled, y, "D", color="tab:orange", label="MSE(c*), best c ≥ 0")
            if all("no_step_mse" in r for r in rows):
                ax.axvline(rows[0]["no_step_mse"], color="k", ls="--", lw=1,
                           label="‖∇J‖² (no step at all)")
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2,
                      frameon=False)
        if key == "cosine":
            ax.axvline(0.0, color="k", lw=0.8)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel(label, fontsize=9)
        if log:
            _log_ticks(ax)
        ax.grid(axis="x", which="major", alpha=0.3)
    axes[0].set_yticks(list(y), names, fontsize=8)
    axes[0].invert_yaxis()
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def plot_first_order(points, path: str | Path | None = None):
    """Improvements along a path (:func:`tokenmdp.exact.analysis.first_order.first_order_path`).

    Parameters
    ----------
    points : sequence of PathPoint
        The path's points, in step order (``step``, the improvements, ``gap``, ``bound``,
        ``gradient_error``).
    path : path, optional
        Where to write the PNG (the figure is returned either way).

    Returns
    -------
    matplotlib.figure.Figure
        Left: true, token-surrogate and sequence-IS improvements; right: ``|J − L|``, its
        trust-region bound and ``‖∇L − ∇J‖`` on log-log axes.
    """
    s = [p.step for p in points]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(s, [p.true_improvement for p in points], "k-", label="true J(θ) − J(θ_old)")
    a.plot(s, [p.token_surrogate_improvement for p in points], "C0--",
           label="token surrogate L(θ) − J(θ_old)")
    a.plot(s, [p.sequence_is_improvement for p in points], "C1:", label="sequence IS")
    a.set_xlabel("distance along the direction")
    a.legend(fontsize=8)
    b.loglog([x for x in s if x > 0], [abs(p.gap) for p in points if p.step > 0], "C3-",
             label="|J − L| (gap)")
    b.loglog([x for x in s if x > 0], [p.bound for p in points if p.step > 0], "C3:",
             label="trust-region bound 2εα²L(L−1)")
    b.loglog([x for x in s if x > 0], [p.gradient_error for p in points if p.step > 0], "C0-",
             label="‖∇L − ∇J‖")
    b.set_xlabel("distance along the direction")
    b.legend(fontsize=8)
    return _save(fig, path)


def plot_length_drift(tracks: Mapping[str, Sequence[tuple[float, float]]],
                      path: str | Path | None = None):
    """``E|y|`` and ``J`` per ascent step for each estimator (:func:`length_drift`).

    Parameters
    ----------
    tracks : mapping of str to sequence of (float, float)
        Estimator name → ``(J, E|y|)`` per step, as :func:`length_drift` returns them.
    path : path, optional
        Where to write the PNG (the figure is returned either way).

    Returns
    -------
    matplotlib.figure.Figure
        Left: ``E|y|`` per step; right: ``J`` per step, one line per estimator.
    """
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, track in tracks.items():
        a.plot([t[1] for t in track], label=name)
        b.plot([t[0] for t in track], label=name)
    a.set_title("expected response length E|y|")
    b.set_title("objective J")
    for ax in (a, b):
        ax.set_xlabel("exact ascent step")
    a.legend(fontsize=8)
    return _save(fig, path)
