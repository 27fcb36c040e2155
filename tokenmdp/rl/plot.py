"""Training curves of one or more runs, read from their ``metrics.jsonl`` (``tokenmdp plot``).

:func:`plot_runs` draws a grid of panels, one per metric that some run logged, one line per run
(labelled by its folder name), against the step. Metrics logged only at some steps
(``eval_accuracy``) are drawn as points joined at those steps. Like :mod:`tokenmdp.reports.plots` the
module chooses no backend: figures show inline in a notebook, and a headless machine falls back
to Agg by itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from tokenmdp.rl.logger import METRICS_FILE, read_metrics

__all__ = ["DEFAULT_PANELS", "plot_runs"]

DEFAULT_PANELS: tuple[tuple[str, ...], ...] = (
    ("reward",), ("eval_accuracy",), ("response_length",), ("entropy",),
    ("train_infer_kl_k1", "train_infer_kl_k3"), ("clip_fraction",), ("routing_mismatch",),
    ("grad_norm",), ("loss",), ("tokens_per_s",))
"""Panels drawn by default (those some run logged), each with the metrics it overlays."""

_STYLES = ("-", "--", ":", "-.")
"""Line style of the 1st, 2nd, ... metric of a panel (the colour is the run's)."""


def _load(run_dir: str | Path) -> list[dict]:
    run = Path(run_dir)
    if not run.is_dir():
        raise ValueError(f"run_dirs: {run} is not a directory")
    path = run / METRICS_FILE
    if not path.is_file():
        raise ValueError(f"run_dirs: {run} has no {METRICS_FILE}")
    rows = read_metrics(path)
    if not rows:
        raise ValueError(f"run_dirs: {path} has no rows")
    return rows


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and values where ``key`` holds a finite number (null, bools and NaN are gaps)."""
    pairs = [(r["step"], float(r[key])) for r in rows
             if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)
             and math.isfinite(r[key])]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _labels(runs: list[Path]) -> list[str]:
    """Folder names, or the paths as given where two runs share a name."""
    names = [r.resolve().name or str(r) for r in runs]
    return [n if names.count(n) == 1 else str(r) for n, r in zip(names, runs)]


def plot_runs(run_dirs: str | Path | Sequence[str | Path], path: str | Path | None = None, *,
              metrics: str | Sequence[str] | None = None):
    """Curves of the runs' metrics against the step, one panel per metric.

    Parameters
    ----------
    run_dirs : path or sequence of paths
        Run folders, each with a ``metrics.jsonl`` (as :class:`~tokenmdp.rl.logger.RunLogger`
        writes it).
    path : path, optional
        Where to write the PNG (the figure is then closed). Default: ``RUN_DIR/curves.png`` for
        one run; for several runs nothing is written.
    metrics : sequence of str, or a comma-separated str, optional
        The metrics to draw, one panel each, in this order. Default: :data:`DEFAULT_PANELS`,
        those that some run logged.

    Returns
    -------
    matplotlib.figure.Figure

    Raises
    ------
    ValueError
        ``run_dirs``: empty, a folder missing, without ``metrics.jsonl``, or with an empty one;
        ``metrics``: empty, or a metric no run logged; ``path``: its folder missing, or not
        writable.
    """
    runs = [Path(run_dirs)] if isinstance(run_dirs, (str, Path)) else [Path(r) for r in run_dirs]
    if not runs:
        raise ValueError("run_dirs: no run folder given")
    data = [_load(r) for r in runs]
    present = {k for rows in data for r in rows for k in r} - {"step"}
    logged = {k for k in present if any(_series(rows, k)[0] for rows in data)}
    if metrics is None:
        panels = [p for p in DEFAULT_PANELS if any(k in logged for k in p)]
        if not panels:
            raise ValueError(f"run_dirs: none of the default metrics in {', '.join(map(str, runs))}"
                             f" (logged: {', '.join(sorted(logged))}); pass metrics=")
    else:
        names = [m.strip() for m in metrics.split(",")] if isinstance(metrics, str) else list(metrics)
        names = [m for m in names if m]
        if not names:
            raise ValueError("metrics: no metric given")
        missing = [m for m in names if m not in logged]
        if missing:
            raise ValueError(f"metrics: no run logged {', '.join(map(repr, missing))} "
                             f"(logged: {', '.join(sorted(logged))})")
        panels = [(m,) for m in names]

    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.0 * nrows), squeeze=False,
                             sharex=True, layout="constrained")
    flat = axes.ravel()
    labels = _labels(runs)
    for ax, keys in zip(flat, panels):
        for i, (rows, label) in enumerate(zip(data, labels)):
            for key, style in zip(keys, _STYLES):
                steps, values = _series(rows, key)
                if not steps:  # this run did not log it
                    continue
                sparse = len(steps) < len(rows) or len(steps) == 1  # a lone point needs a marker
                ax.plot(steps, values, style, color=f"C{i}", marker="o" if sparse else None,
                        markersize=3, label=label if key == keys[0] else None)
        ax.set_title(" / ".join(keys), fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(keys) > 1:  # which line style is which metric
            ax.legend([Line2D([], [], color="0.3", linestyle=s) for s in _STYLES[:len(keys)]],
                      keys, fontsize=7)
    for ax in flat[len(panels):]:
        ax.set_visible(False)
    for ax in flat[len(panels) - ncols:len(panels)]:  # the lowest visible panel of each column
        ax.xaxis.set_tick_params(labelbottom=True)
        ax.set_xlabel("step")
    if len(runs) > 1:
        fig.legend([Line2D([], [], color=f"C{i}") for i in range(len(runs))], labels,
                   loc="outside upper center", ncol=min(len(runs), 4), fontsize=8)
    else:
        fig.suptitle(labels[0], fontsize=10)
    if path is None and len(runs) == 1:
        path = runs[0] / "curves.png"
    if path is not None:
        path = Path(path)
        try:
            if not path.parent.is_dir():
                raise ValueError(f"path: the folder {path.parent} of {path} does not exist")
            fig.savefig(path, dpi=120, bbox_inches="tight")
        except OSError as err:
            raise ValueError(f"path: cannot write {path}: {err.strerror or err}") from None
        finally:
            plt.close(fig)
    return fig
