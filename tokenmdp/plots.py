"""Plot helpers for the exact lab (every function returns its figure, or writes it to ``path``).

The module does not choose a backend: in a notebook figures show inline, on a headless machine
matplotlib falls back to Agg by itself.

* :func:`plot_comparison` — relative bias, cosine to ``∇J``, total variance and MSE per estimator;
* :func:`plot_first_order` — true vs surrogate improvement along a path, the gap and its bound;
* :func:`plot_length_drift` — ``E|y|`` and ``J`` under exact gradient ascent per aggregation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import matplotlib.ticker

__all__ = ["plot_comparison", "plot_first_order", "plot_length_drift"]


def _save(fig, path: str | Path | None):
    if path is not None:
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
    return fig


def plot_comparison(rows: Sequence[Mapping[str, float]], path: str | Path | None = None,
                    *, title: str = ""):
    """Four panels of per-estimator figures.

    Parameters
    ----------
    rows : sequence of mappings
        Each with ``estimator``, ``relative_bias``, ``cosine``, ``total_variance``, ``mse`` and,
        optionally, ``*_se`` standard errors (drawn as error bars).
    path : path, optional
        Where to write the PNG (the figure is returned either way).
    """
    names = [r["estimator"] for r in rows]
    panels = [("relative_bias", "relative bias ‖E ĝ − ∇J‖/‖∇J‖", False),
              ("cosine", "cosine(E ĝ, ∇J)", False),
              ("total_variance", "total variance tr Cov ĝ", True),
              ("mse", "MSE E‖ĝ − ∇J‖²", True)]
    fig, axes = plt.subplots(1, 4, figsize=(16, 0.35 * len(names) + 1.8), sharey=True)
    y = range(len(names))
    for ax, (key, label, log) in zip(axes, panels):
        vals = [r[key] for r in rows]
        err = [r.get(f"{key}_se", 0.0) or 0.0 for r in rows]
        ax.barh(list(y), vals, xerr=err if any(err) else None, color="tab:blue", alpha=0.8)
        ax.set_title(label, fontsize=9)
        if log and all(v > 0 for v in vals):
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(list(y), names, fontsize=8)
    axes[0].invert_yaxis()
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def plot_first_order(points, path: str | Path | None = None):
    """Improvements along a path (:func:`tokenmdp.exact.first_order.first_order_path`)."""
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
    """``E|y|`` and ``J`` per ascent step for each estimator (:func:`length_drift`)."""
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
