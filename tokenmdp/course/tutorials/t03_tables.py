"""Tutorial 3's printed tables: rows plus a fixed-width layout, printed as the notebook's stdout.

Each function formats what the notebook has computed (the moments of the compositions, the
staleness sweep, the first-order path, PPO's clip, the caps) and keeps the rows as numbers, so
that a test compares them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tokenmdp.course.display import Table
from tokenmdp.course.tutorials.t03 import _excess, mse

__all__ = ["cap_table", "composition_table", "length_identity_table", "length_ratio_table", "mse_table",
           "path_table", "ppo_table", "sweep_table"]


def composition_table(pairs: dict) -> Table:
    """The two compositions of one estimator side by side (section 1).

    Parameters
    ----------
    pairs : dict
        ``name -> (by_surrogate, by_correction)``, two exact moments of the same estimator.

    Returns
    -------
    Table
        Rows ``(name, ‖E ĝ‖ by surrogate, ‖E ĝ‖ by correction, max |Δ E ĝ|, Δ variance)``.
    """
    rows = [(name, float(s.mean.norm()), float(c.mean.norm()), float((s.mean - c.mean).abs().max()),
             s.total_variance - c.total_variance) for name, (s, c) in pairs.items()]
    return Table(columns=[("estimator", 12, "s"), ("surrogate: ||E ĝ||", 19, ".6f"),
                        ("correction: ||E ĝ||", 20, ".6f"), ("max |Δ E ĝ|", 12, ".1e"),
                        ("Δ variance", 11, ".1e")], rows=rows)


def sweep_table(sweep: list[dict]) -> Table:
    """The staleness sweep of section 1: divergences and the two IS estimators' moments.

    Parameters
    ----------
    sweep : list of dict
        Per stale distance: ``distance``, ``kl``, ``chi2``, ``seq`` and ``tok`` (moments).

    Returns
    -------
    Table
        Rows ``(d, KL, exp KL, 1 + χ², ‖seq bias‖, seq variance, token relative bias,
        token variance)``.
    """
    rows = [(r["distance"], r["kl"], math.exp(r["kl"]), 1 + r["chi2"], float(r["seq"].bias.norm()),
             r["seq"].total_variance, r["tok"].relative_bias, r["tok"].total_variance)
            for r in sweep]
    return Table(columns=[("d", 5, ".2f"), ("KL(π‖μ)", 8, ".4f"), ("exp KL", 7, ".3f"),
                        ("1+χ²", 8, ".3f"), "|", ("seq IS ||bias||", 15, ".1e"),
                        ("seq IS var", 10, ".4f"), "|", ("token IS ||bias||/||∇J||", 24, ".4f"),
                        ("token IS var", 12, ".4f")], rows=rows)


def length_identity_table(entries: Sequence[tuple]) -> Table:
    """The two identities of the fixed-length experiment against ``T``.

    Parameters
    ----------
    entries : sequence of tuple
        ``(T, 1 + χ²_seq, (1 + χ²_tok)^T, E‖ĝ‖², (1 + χ²) E_q[R²‖σ‖²])``.

    Returns
    -------
    Table
        Each identity's two sides and their difference.
    """
    rows = [(T, a, b, a - b, s, p, s - p) for T, a, b, s, p in entries]
    return Table(columns=[("T", 2, ""), ("1+χ²_seq", 9, ".5f"), ("(1+χ²_tok)^T", 12, ".5f"),
                        ("diff", 8, ".1e"), "|", ("E||ĝ||² (moments)", 17, ".6f"),
                        ("(1+χ²) E_q[R²||σ||²]", 20, ".6f"), ("diff", 8, ".1e")], rows=rows)


def length_ratio_table(by_length: list[dict], chi2_tok: float) -> Table:
    """Successive ratios of the sequence-IS excess variance against ``1 + χ²_tok``.

    Parameters
    ----------
    by_length : list of dict
        Per length: ``T`` and the moments ``seq`` (sequence IS), ``tok`` (token IS), ``on``
        (on-policy REINFORCE).
    chi2_tok : float
        The per-token ``χ²``.

    Returns
    -------
    Table
        From the second length on: ``(T, excess(T)/excess(T−1), 1 + χ²_tok, difference,
        token-IS relative bias, sequence-IS relative bias)``.
    """
    excess = _excess(by_length)
    rows = [(r["T"], e / e_prev, 1 + chi2_tok, e / e_prev - 1 - chi2_tok, r["tok"].relative_bias,
             r["seq"].relative_bias) for r, e_prev, e in zip(by_length[1:], excess, excess[1:])]
    return Table(columns=[("T", 2, ""), ("var(T)/var(T-1), sequence IS / on-policy", 42, ".4f"),
                        ("1+χ²_tok", 9, ".4f"), ("difference", 11, "+.4f"), "|",
                        ("token IS rel. bias", 18, ".4f"), ("sequence IS rel. bias", 21, ".1e")], rows=rows)


def path_table(path: Sequence, path_kl: Sequence[float]) -> Table:
    """The first-order path: improvements, gap, bound, gradient error and KL per step.

    Parameters
    ----------
    path : sequence of FirstOrderPoint
        What ``first_order_path`` returns.
    path_kl : sequence of float
        ``KL(π_θ ‖ π_old)`` at each step (:func:`path_kls`).

    Returns
    -------
    Table
        Rows ``(s, J − J_old, L − J_old, seqIS − J_old, gap, bound, ‖∇L − ∇J‖, KL, gap/KL)``.
    """
    rows = [(p.step, p.true_improvement, p.token_surrogate_improvement, p.sequence_is_improvement,
             p.gap, p.bound, p.gradient_error, kl, p.gap / kl) for p, kl in zip(path, path_kl)]
    return Table(columns=[("s", 7, ".3g"), ("J - J_old", 10, ".3e"), ("L - J_old", 10, ".3e"),
                        ("seqIS - J_old", 13, ".3e"), ("gap J-L", 10, ".2e"), ("bound", 9, ".2e"),
                        ("||∇L-∇J||", 10, ".2e"), ("KL", 9, ".2e"), ("gap/KL", 7, ".4f")], rows=rows)


def ppo_table(ppo: dict, grad_L: dict, grad_J: torch.Tensor) -> Table:
    """PPO's exact moments per stale distance and clip range (section 3).

    Parameters
    ----------
    ppo : dict
        ``(d, ε) -> {"m": moments, "clip": exact clip fraction}``, in row order.
    grad_L : dict
        ``d -> ∇L_μ(π)`` at that stale distance.
    grad_J : Tensor
        ``∇J(π)``.

    Returns
    -------
    Table
        Rows ``(d, ε, clip fraction, cos(E ĝ, ∇J), ‖E ĝ − ∇L‖/‖∇J‖, ‖E ĝ‖/‖∇J‖, variance)``.
    """
    scale = grad_J.norm()
    rows = [(d, eps, v["clip"], v["m"].cosine, float((v["m"].mean - grad_L[d]).norm() / scale),
             float(v["m"].mean.norm() / scale), v["m"].total_variance) for (d, eps), v in ppo.items()]
    return Table(columns=[("d", 5, ".2f"), ("ε", 5, ""), ("clip frac", 9, ".4f"),
                        ("cos(E ĝ, ∇J)", 13, ".4f"), ("||E ĝ - ∇L||/||∇J||", 20, ".2e"),
                        ("||E ĝ||/||∇J||", 15, ".4f"), ("variance", 9, ".4f")], rows=rows)


def cap_table(same: dict) -> Table:
    """Corrections with a cap above every ratio beside the IS estimator they must equal.

    Parameters
    ----------
    same : dict
        ``name -> (moments, reference moments)``.

    Returns
    -------
    Table
        Rows ``(name, relative bias, IS relative bias, max |Δ E ĝ|, variance, IS variance)``.
    """
    rows = [(name, m.relative_bias, ref.relative_bias, float((m.mean - ref.mean).abs().max()),
             m.total_variance, ref.total_variance) for name, (m, ref) in same.items()]
    return Table(columns=[("correction", 22, "s"), ("rel. bias", 10, ".5f"), ("IS rel. bias", 13, ".5f"),
                        ("max |Δ E ĝ|", 12, ".1e"), ("variance", 9, ".5f"),
                        ("IS variance", 12, ".5f")], rows=rows)


def mse_table(references: dict, curves: dict, caps: Sequence[float], groups: int) -> Table:
    """Squared bias, variance and MSE of the references and of every cap of every family.

    Parameters
    ----------
    references : dict
        ``name -> moments`` (no cap; ``C`` shows ``-``).
    curves : dict
        ``family -> [moments per cap]``.
    caps : sequence of float
        The caps ``C`` of the curves.
    groups : int
        ``B`` of the last column.

    Returns
    -------
    Table
        Rows ``(name, C, ‖bias‖², variance, MSE_1, MSE_B)``.
    """
    entries = [(name, "-", m) for name, m in references.items()]
    entries += [(name, c, m) for name, ms in curves.items() for c, m in zip(caps, ms)]
    rows = [(name, c, float(m.bias @ m.bias), m.total_variance, mse(m, 1), mse(m, groups))
            for name, c, m in entries]
    return Table(columns=[("estimator", 14, "s"), ("C", 5, ""), ("||bias||²", 10, ".2e"),
                        ("variance", 9, ".4f"), ("MSE_1", 8, ".4f"), (f"MSE_{groups}", 9, ".5f")], rows=rows)
