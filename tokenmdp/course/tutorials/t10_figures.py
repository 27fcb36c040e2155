"""Tutorial 10's three figures: one run evaluated exactly and by sampling, the zoo's ``J`` curves
(seed means, one panel per scenario), and the exact cosine at the start against the outcome.

Laid out for the documentation's content column (about 750 px, 7.5–8 in at 100 dpi): at most
8 in wide, fonts of 9 pt or more, one shared legend per figure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import torch

from tokenmdp.course.display import finish

__all__ = ["curves_figure", "monte_carlo_figure", "prediction_figure"]

#: Legend font size of tutorial 10's figures (points).
LEGEND_FONTSIZE = 9


def monte_carlo_figure(exact: torch.Tensor, estimates: Sequence[tuple[float, float]], label: str):
    """The exact ``J`` curve of a run beside Monte Carlo evaluations with ±2 s.e. bars.

    Parameters
    ----------
    exact : Tensor ``[updates + 1]``
        the ``objective`` of an :class:`~tokenmdp.exact.analysis.training.ExactTrainingRun`.
    estimates : sequence of (float, float)
        :func:`~tokenmdp.course.tutorials.t10.monte_carlo_objective` of each ``π_t``.
    label : str
        The estimator, for the title.

    Returns
    -------
    matplotlib.figure.Figure
    """
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = range(len(exact))
    ax.plot(steps, exact.numpy(), "k-", lw=1.6, label="exact J (no evaluation noise)")
    ax.errorbar(steps, [m for m, _ in estimates], yerr=[2 * s for _, s in estimates], fmt="o",
                color="C1", ms=4, capsize=2, label=f"Monte Carlo J, {label} (±2 s.e.)")
    finish(ax, title="One training run, evaluated exactly and by sampling", xlabel="update",
           ylabel="J", legend_fontsize=LEGEND_FONTSIZE)
    return fig


def prediction_figure(rows: Sequence[tuple], scenarios: Sequence[str]):
    """Each entry's exact ``cos(E ĝ, ∇J)`` at the start against its final ``J`` (seed mean),
    per scenario.

    Parameters
    ----------
    rows : sequence of tuple
        :func:`~tokenmdp.course.tutorials.t10.summary_rows`' rows (cosines from column 2, the
        on-policy ``J`` and the differences after the variance).
    scenarios : sequence of str
        The scenario labels, as for :func:`~tokenmdp.course.tutorials.t10.summary_rows`.

    Returns
    -------
    matplotlib.figure.Figure
    """
    k = len(scenarios)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, scenario in enumerate(scenarios):
        cos = [r[2 + i] for r in rows]
        final = [r[3 + k] + (r[3 + k + i] if i else 0.0) for r in rows]
        ax.scatter(cos, final, s=18, color=f"C{i}", label=scenario, alpha=0.8)
    finish(ax, title="The exact cosine at the start, against the final J",
           xlabel="cos(E[ĝ], ∇J) at the start (exact)", ylabel="exact J after the run (seed mean)",
           legend_fontsize=LEGEND_FONTSIZE)
    return fig


def curves_figure(zoo: Sequence[Mapping], names: Sequence[str], scenarios: Sequence[str], *,
                  noise: Mapping[str, float] | None = None, baseline: float | None = None):
    """The exact ``J`` after every update, averaged over seeds: one panel per scenario, stacked,
    one line per entry, one legend for all panels.

    Parameters
    ----------
    zoo : sequence of mapping
        :func:`~tokenmdp.course.tutorials.t10.zoo_seeds`' result (one mapping per seed).
    names : sequence of str
        The entries to draw (at most 20: ten colours, solid then dashed).
    scenarios : sequence of str
        The panels, top to bottom.
    noise : mapping of str to float, optional
        Scenario → the standard error of a seed mean of the final ``J``, drawn as a grey ±1 s.e.
        bar right of the curves' ends.
    baseline : float, optional
        A horizontal reference line (for example the optimum of ``J``).

    Returns
    -------
    matplotlib.figure.Figure
    """
    fig, axes = plt.subplots(len(scenarios), 1, figsize=(8, 1.0 + 2.25 * len(scenarios)),
                             sharex=True, sharey=True, squeeze=False)
    axes = axes[:, 0]
    for ax, scenario in zip(axes, scenarios):
        for i, name in enumerate(names):
            curve = torch.stack([runs[name, scenario].objective for runs in zoo]).mean(dim=0)
            ax.plot(range(len(curve)), curve.numpy(), color=f"C{i % 10}",
                    ls="-" if i < 10 else "--", lw=1.4, label=name)
        if noise is not None and scenario in noise:
            ends = [float(runs[name, scenario].objective[-1]) for runs in zoo for name in names]
            ax.errorbar([len(curve) - 0.6], [sum(ends) / len(ends)], yerr=[noise[scenario]],
                        color="0.45", capsize=3, lw=1.6, label="±1 s.e. of a seed mean")
        if baseline is not None:
            ax.axhline(baseline, color="0.6", lw=0.8, ls=":", label="max J")
        finish(ax, title=scenario, xlabel="update" if ax is axes[-1] else "", ylabel="exact J",
               legend=False)
        ax.title.set_fontsize(10)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=5, fontsize=LEGEND_FONTSIZE,
               frameon=False, title=f"Exact J after every sampled update: mean of {len(zoo)} "
                                    "seeds, identical budgets", title_fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.72 / fig.get_figheight()))  # room for the legend
    return fig
