"""Tutorial 3's five figures: the staleness sweep, variance against length, the first-order gap,
PPO's clip and the cap trade-off."""

from __future__ import annotations

import math
from collections.abc import Sequence

import matplotlib.pyplot as plt

from tokenmdp.course.tutorials.t03 import _excess, mse

__all__ = ["plot_cap_tradeoff", "plot_gap_orders", "plot_length_variance", "plot_ppo",
           "plot_sweep_variance"]


def plot_sweep_variance(sweep: list[dict], on_policy_variance: float, *, group_size: int):
    """Variance of sequence and token IS against the KL, and the multiplier against ``1 + χ²``.

    Parameters
    ----------
    sweep : list of dict
        As for :func:`sweep_table`.
    on_policy_variance : float
        The on-policy RLOO variance (reference line and denominator).
    group_size : int
        ``G``, for the title.

    Returns
    -------
    matplotlib.figure.Figure
    """
    kls = [row["kl"] for row in sweep]
    fig, (ax_v, ax_c) = plt.subplots(1, 2, figsize=(12, 4.2))
    ax_v.semilogy(kls, [row["seq"].total_variance for row in sweep], "o-", label="sequence IS")
    ax_v.semilogy(kls, [row["tok"].total_variance for row in sweep], "s-", label="token IS")
    ax_v.axhline(on_policy_variance, color="0.5", ls=":", label="on-policy RLOO")
    for row in sweep[-4:]:
        ax_v.annotate(f"d={row['distance']:g}", (row["kl"], row["seq"].total_variance),
                      textcoords="offset points", xytext=(-10, 6), fontsize=8)
    ax_v.set_xlabel("KL(π_θ ‖ μ) of whole responses")
    ax_v.set_ylabel("total variance tr Cov[ĝ]")
    ax_v.set_title(f"exact variance of one group (G = {group_size})")
    ax_v.legend()
    chi = [1 + row["chi2"] for row in sweep[1:]]
    ax_c.loglog(chi, [row["seq"].total_variance / on_policy_variance for row in sweep[1:]], "o-",
                label="sequence-IS variance / on-policy variance")
    ax_c.loglog(chi, chi, "k--", label="1 + χ²  (slope 1)")
    ax_c.loglog(chi, [math.exp(row["kl"]) for row in sweep[1:]], ":", color="C2",
                label="exp KL  (≤ 1 + χ²)")
    ax_c.set_xlabel("1 + χ²(π_θ ‖ μ)")
    ax_c.set_ylabel("multiplier")
    ax_c.set_title("the variance multiplier")
    ax_c.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_length_variance(by_length: list[dict], chi2_tok: float):
    """Exact variances against the response length, and the excess of sequence IS.

    Parameters
    ----------
    by_length : list of dict
        As for :func:`length_ratio_table`.
    chi2_tok : float
        The per-token ``χ²`` of the reference slope.

    Returns
    -------
    matplotlib.figure.Figure
    """
    Ts, excess = [row["T"] for row in by_length], _excess(by_length)
    fig, (ax_l, ax_r) = plt.subplots(1, 2, figsize=(12, 4.2))
    ax_l.semilogy(Ts, [row["seq"].total_variance for row in by_length], "o-", label="sequence IS")
    ax_l.semilogy(Ts, [row["tok"].total_variance for row in by_length], "s-", label="token IS")
    ax_l.semilogy(Ts, [row["on"].total_variance for row in by_length], "^-", color="0.4",
                  label="on-policy REINFORCE")
    ax_l.set_xlabel("response length T")
    ax_l.set_ylabel("total variance")
    ax_l.set_title("exact variance against the response length")
    ax_l.legend()
    ax_r.semilogy(Ts[1:], excess[1:], "o-", label="sequence-IS variance / on-policy variance")
    ax_r.semilogy(Ts[1:], [excess[-1] * (1 + chi2_tok) ** (T - Ts[-1]) for T in Ts[1:]], "k--",
                  label="∝ (1 + χ²_tok)^T")
    ax_r.set_xlabel("response length T")
    ax_r.set_ylabel("variance ratio")
    ax_r.set_title("the excess of sequence IS grows like (1 + χ²_tok)^T")
    ax_r.legend()
    fig.tight_layout()
    return fig


def plot_gap_orders(path: Sequence, path_kl: Sequence[float], kl_bound: Sequence[float], anchor):
    """The gap and gradient error against the step (with slopes 2 and 1), and the gap against KL.

    Parameters
    ----------
    path : sequence of FirstOrderPoint
        What ``first_order_path`` returns.
    path_kl : sequence of float
        ``KL(π_θ ‖ π_old)`` at each step.
    kl_bound : sequence of float
        The Pinsker form of the bound at each step.
    anchor : FirstOrderPoint
        The point the reference slopes pass through.

    Returns
    -------
    matplotlib.figure.Figure
    """
    fig, (ax_s, ax_k) = plt.subplots(1, 2, figsize=(12, 4.4))
    s_arr = [p.step for p in path]
    ax_s.loglog(s_arr, [abs(p.gap) for p in path], "o-", color="C3", label="|J − L| (gap)")
    ax_s.loglog(s_arr, [p.bound for p in path], ":", color="C3",
                label="trust-region bound 2εα²L(L−1)")
    ax_s.loglog(s_arr, [p.gradient_error for p in path], "s-", color="C0", label="||∇L − ∇J||")
    ax_s.loglog(s_arr, [abs(anchor.gap) * (s / anchor.step) ** 2 for s in s_arr], "k--", lw=0.8,
                label="slope 2")
    ax_s.loglog(s_arr, [anchor.gradient_error * (s / anchor.step) for s in s_arr], "k-.", lw=0.8,
                label="slope 1")
    ax_s.set_xlabel("step s along ∇J(θ_old)")
    ax_s.set_ylabel("size")
    ax_s.legend(fontsize=8)
    ax_s.set_title("second-order gap, first-order gradient error")
    ax_k.loglog(path_kl, [abs(p.gap) for p in path], "o-", color="C3", label="|J − L|")
    ax_k.loglog(path_kl, [p.bound for p in path], ":", color="C3", label="2εα²L(L−1)")
    ax_k.loglog(path_kl, kl_bound, "--", color="C1", label="ε L(L−1) max_s KL_s  (Pinsker)")
    ax_k.set_xlabel("KL(π_θ ‖ π_old) of whole responses")
    ax_k.set_ylabel("|J − L| and its bounds")
    ax_k.legend(fontsize=8)
    ax_k.set_title("the gap is first order in the KL")
    fig.tight_layout()
    return fig


def plot_ppo(ppo: dict, distances: Sequence[float], epsilons: Sequence[float]):
    """PPO's cosine with ``∇J`` and its clip fraction against the stale distance.

    Parameters
    ----------
    ppo : dict
        As for :func:`ppo_table`; ``ε = inf`` is token IS (a dashed line, no clip fraction).
    distances : sequence of float
        The stale distances (x axis).
    epsilons : sequence of float
        The clip ranges, ``math.inf`` included where token IS is wanted.

    Returns
    -------
    matplotlib.figure.Figure
    """
    fig, (ax_c, ax_f) = plt.subplots(1, 2, figsize=(12, 4.2))
    for eps in epsilons:
        label = "token IS (ε = ∞)" if eps == math.inf else f"PPO ε = {eps}"
        style = "k--" if eps == math.inf else "o-"
        ax_c.plot(distances, [ppo[d, eps]["m"].cosine for d in distances], style, label=label)
        if eps != math.inf:
            ax_f.plot(distances, [ppo[d, eps]["clip"] for d in distances], "o-", label=label)
    ax_c.axhline(0, color="0.8", lw=0.8)
    ax_c.set_xlabel("stale distance d")
    ax_c.set_title("PPO's expected gradient against ∇J")
    ax_c.set_ylabel("cos(E[ĝ], ∇J)")
    ax_c.legend(fontsize=8)
    ax_f.set_xlabel("stale distance d")
    ax_f.set_ylabel("exact clip fraction")
    ax_f.set_title("share of tokens PPO clips")
    ax_f.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_cap_tradeoff(curves: dict, references: dict, caps: Sequence[float], groups: int, *,
                      tol: float):
    """Squared bias, variance and ``MSE_B`` against the cap, with the references as lines.

    Parameters
    ----------
    curves : dict
        ``family -> [moments per cap]``.
    references : dict
        ``name -> moments``, up to four (horizontal dotted lines).
    caps : sequence of float
        The caps (x axis, inverted: large caps on the left).
    groups : int
        ``B`` of the MSE panel.
    tol : float
        A reference at or below ``tol`` gets no line (an unbiased estimator on a log scale).

    Returns
    -------
    matplotlib.figure.Figure
    """
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [("||E ĝ − ∇J||²  (IS sequence: 0)", lambda m: float(m.bias @ m.bias)),
              ("total variance", lambda m: m.total_variance),
              (f"MSE of a step of B = {groups} groups", lambda m: mse(m, groups))]
    for ax, (title, f) in zip(axes, panels):
        for name, ms in curves.items():
            ax.semilogy(caps, [f(m) for m in ms], "o-", label=name)
        for (name, m), color in zip(references.items(), ["0.3", "C0", "C1", "C4"]):
            if f(m) > tol:
                ax.axhline(f(m), ls=":", color=color, label=name)
        ax.set_xlabel("cap C")
        ax.set_title(title)
        ax.invert_xaxis()                       # from IS (large C) on the left to hard caps
    for ax, label in zip(axes, ["squared bias", "tr Cov[ĝ]", f"MSE_{groups}"]):
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    return fig
