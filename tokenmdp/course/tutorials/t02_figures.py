"""Tutorial 2's three figures: the baseline's variance parabola, GRPO's scale, and bias and
variance against the group size."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import torch

__all__ = ["baseline_parabola_figure", "grpo_scale_figure", "bias_variance_figure"]


#: Colours of the estimators in :func:`bias_variance_figure`.
COLORS = {"REINFORCE": "#4c72b0", "RLOO": "#55a868", "group mean": "#c44e52",
          "GRPO, sample std": "#8172b2", "GRPO, population std": "#ccb974",
          "group max (peeks)": "#64b5cd"}


def baseline_parabola_figure(b_grid: Sequence[float], curve: Sequence[float],
                             points: Mapping[str, tuple[float, float]],
                             per_prompt_variance: float, group_size: int):
    """REINFORCE's variance against a constant baseline ``b``, with the exact points.

    Parameters
    ----------
    b_grid, curve : sequence of float
        The baselines and the closed-form variance at each.
    points : mapping of str to (float, float)
        Label, baseline and exact variance of each marked constant baseline.
    per_prompt_variance : float
        The exact variance with the per-prompt baseline ``V(x)`` (a horizontal line).
    group_size : int
        ``G``, for the axis label.

    Returns
    -------
    matplotlib.figure.Figure
    """
    fig, ax = plt.subplots(figsize=(7.5, 4))
    ax.plot(list(map(float, b_grid)), curve, color="#4c72b0", label="constant b, closed form")
    for label, (b, var) in points.items():
        ax.plot(b, var, "o", color="#4c72b0", mec="k")
        ax.annotate(label, (b, var), textcoords="offset points", xytext=(6, 6), fontsize=9)
    ax.axhline(per_prompt_variance, color="#55a868", ls="--",
               label="b = V(x), per prompt (exact moments)")
    ax.set_xlabel("baseline b  (equivalently: every reward shifted by −b)")
    ax.set_ylabel(f"tr Cov ĝ,  G = {group_size}")
    ax.set_title("REINFORCE: unbiased for every b, variance quadratic in b")
    ax.legend()
    fig.tight_layout()
    return fig


def grpo_scale_figure(p_grid: Sequence[float], curves: Mapping[int, Sequence[float]],
                      dots: Mapping[str, tuple[float, Mapping[int, float]]]):
    """GRPO's factor ``c(p)`` on a prompt's gradient against its success probability.

    Parameters
    ----------
    p_grid : sequence of float
        Success probabilities in ``(0, 1)``.
    curves : mapping of int to sequence of float
        ``c(p)`` on ``p_grid`` for each group size ``G`` (closed form).
    dots : mapping of str to (float, mapping of int to float)
        Per prompt label: its ``p_x`` and the factor from the exact moments at some ``G``.

    Returns
    -------
    matplotlib.figure.Figure
    """
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = plt.get_cmap("viridis")(torch.linspace(0, 0.9, len(curves)).tolist())
    for (G, values), color in zip(curves.items(), colors, strict=True):
        ax.plot(p_grid, values, color=color, label=f"G = {G}")
    ax.plot(p_grid, [1 / math.sqrt(p * (1 - p)) for p in p_grid], "k--", lw=1,
            label="1/√(p(1−p)): 1/std, the G → ∞ limit")
    ax.axhline(1.0, color="0.5", lw=1, ls=":", label="RLOO (c = 1 for every prompt)")
    sizes = sorted({G for _, by_g in dots.values() for G in by_g})
    for label, (p, by_g) in dots.items():
        ax.axvline(p, color="#c44e52", lw=0.8)
        ax.text(p + 0.01, 0.25, label, color="#c44e52", fontsize=8)
        for c in by_g.values():
            ax.plot(p, c, "o", color="#c44e52", mec="k", ms=6)
    ax.set_ylim(0, 7)
    ax.set_xlabel("success probability p of the prompt")
    ax.set_ylabel("c(p): E[ĝ | x] = c(p) ∇J_x")
    ax.set_title("GRPO (sample std) with 0/1 rewards: the factor on each prompt's gradient\n"
                 f"(red dots: exact moments at G = {' and '.join(map(str, sizes))})")
    ax.legend(fontsize=8, ncol=2, loc="upper center")
    fig.tight_layout()
    return fig


def bias_variance_figure(moments_by_name: Mapping[str, Sequence], group_sizes: Sequence[int],
                         predicted_bias: Mapping[str, Sequence[float]],
                         oracle: Sequence[float]):
    """Three panels against ``G``: relative bias, variance, variance after the best rescaling.

    Parameters
    ----------
    moments_by_name : mapping of str to sequence of Moments
        The exact moments of each estimator, one per group size (colours from ``COLORS``).
    group_sizes : sequence of int
        The group sizes.
    predicted_bias : mapping of str to sequence of float
        Closed-form relative biases (black crosses) of some estimators.
    oracle : sequence of float
        The variance of the ``V(x)`` baseline at each ``G`` (a dotted reference).

    Returns
    -------
    matplotlib.figure.Figure
    """
    fig, (ax_b, ax_v, ax_s) = plt.subplots(1, 3, figsize=(15, 4.6))
    for name, ms in moments_by_name.items():
        style = dict(color=COLORS.get(name), label=name, ls="--" if name == "REINFORCE" else "-")
        ax_b.plot(group_sizes, [m.relative_bias for m in ms], "o", **style)
        ax_v.plot(group_sizes, [m.total_variance for m in ms], "o", **style)
        ax_s.plot(group_sizes, [m.scale ** 2 * m.total_variance for m in ms], "o", **style)
        if name in predicted_bias:
            ax_b.plot(group_sizes, predicted_bias[name], "x", color="k", ms=9)
    for ax in (ax_v, ax_s):
        ax.plot(group_sizes, oracle, "k:", lw=1.5, label="V(x) baseline (closed form)")
        ax.set_yscale("log")
    ax_b.set_ylabel("relative bias ‖E ĝ − ∇J‖ / ‖∇J‖")
    ax_v.set_ylabel("tr Cov ĝ")
    ax_s.set_ylabel("c*² tr Cov ĝ")
    for ax in (ax_b, ax_v, ax_s):
        ax.set_xlabel("group size G")
        ax.set_xticks(list(group_sizes))
        ax.grid(alpha=0.3)
    ax_b.set_title("bias (x: closed form)")
    ax_v.set_title("variance")
    ax_s.set_title("variance after the best rescaling c*")
    handles, labels = ax_s.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=7, fontsize=8.5, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig
