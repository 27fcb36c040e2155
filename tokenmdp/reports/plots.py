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


#: Figure sizes and fonts for the documentation's ~750 px content column: a figure is at most
#: ``WIDTH`` inches wide (shown at about 80% of its 120-dpi pixels) and no text is under 9 pt.
WIDTH = 8.0
_STYLE = {"font.size": 9.5, "axes.titlesize": 10.5, "axes.labelsize": 9.5,
          "xtick.labelsize": 9, "ytick.labelsize": 9.5, "legend.fontsize": 9,
          "figure.titlesize": 10.5}


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
    ax.tick_params(axis="x", labelrotation=30)


def _legend_below(fig, entries: Sequence[tuple]) -> None:
    """One legend for the whole figure, centred under the panels, in one row when it fits."""
    if entries:
        handles, labels = zip(*entries)
        fig.legend(handles, labels, loc="outside lower center", ncols=min(3, len(entries)),
                   frameon=False)


def plot_comparison(rows: Sequence[Mapping[str, float]], path: str | Path | None = None,
                    *, title: str = ""):
    """Per-estimator panels: relative bias, cosine to ``∇J``, total variance, and the MSE before
    and after the best positive rescaling ``c*`` against ``‖∇J‖²`` (no step at all).

    A 2 × 2 grid ``WIDTH`` = 8 inches wide (it reads at the documentation's column width), the
    estimator names on the left of each row, one legend under the grid.

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
    with plt.rc_context(_STYLE):
        fig, grid = plt.subplots(2, 2, figsize=(WIDTH, 2 * (0.24 * len(names) + 1.1) + 0.6),
                                 sharey=True, layout="constrained")
        axes, legend = grid.ravel(), []
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
                legend.append((ax.errorbar(vals, y, xerr=xerr, fmt="o", color="tab:blue"),
                               "MSE at c = 1"))
                legend.append((ax.plot(scaled, y, "D", color="tab:orange")[0],
                               "MSE(c*), best c ≥ 0"))
                if all("no_step_mse" in r for r in rows):
                    legend.append((ax.axvline(rows[0]["no_step_mse"], color="k", ls="--", lw=1),
                                   "‖∇J‖² (no step at all)"))
            if key == "cosine":
                ax.axvline(0.0, color="k", lw=0.8)
            ax.set_title(name)
            ax.set_xlabel(label)
            if log:
                _log_ticks(ax)
            ax.grid(axis="x", which="major", alpha=0.3)
        axes[0].set_yticks(list(y), names)
        axes[0].invert_yaxis()    # the first estimator on top (the y axis is shared)
        _legend_below(fig, legend)
        if title:
            fig.suptitle(title)
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
        trust-region bound and ``‖∇L − ∇J‖`` on log-log axes; one legend under both.
    """
    s = [p.step for p in points]
    positive = [p for p in points if p.step > 0]
    far = [p.step for p in positive]
    with plt.rc_context(_STYLE):
        fig, (a, b) = plt.subplots(1, 2, figsize=(WIDTH, 3.6), layout="constrained")
        legend = [
            (a.plot(s, [p.true_improvement for p in points], "k-")[0], "true J(θ) − J(θ_old)"),
            (a.plot(s, [p.token_surrogate_improvement for p in points], "C0--")[0],
             "token surrogate L(θ) − J(θ_old)"),
            (a.plot(s, [p.sequence_is_improvement for p in points], "C1:")[0], "sequence IS"),
            (b.loglog(far, [abs(p.gap) for p in positive], "C3-")[0], "|J − L| (gap)"),
            (b.loglog(far, [p.bound for p in positive], "C3:")[0],
             "trust-region bound 2εα²L(L−1)"),
            (b.loglog(far, [p.gradient_error for p in positive], "C0-")[0], "‖∇L − ∇J‖"),
        ]
        a.set_title("improvement")
        b.set_title("errors (log-log)")
        for ax in (a, b):
            ax.set_xlabel("distance along the direction")
        _legend_below(fig, legend)
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
        Left: ``E|y|`` per step; right: ``J`` per step, one line per estimator; one legend
        under both.
    """
    with plt.rc_context(_STYLE):
        fig, (a, b) = plt.subplots(1, 2, figsize=(WIDTH, 3.4), layout="constrained")
        legend = []
        for name, track in tracks.items():
            legend.append((a.plot([t[1] for t in track])[0], name))
            b.plot([t[0] for t in track])
        a.set_title("expected response length E|y|")
        b.set_title("objective J")
        for ax in (a, b):
            ax.set_xlabel("exact ascent step")
        _legend_below(fig, legend)
    return _save(fig, path)
