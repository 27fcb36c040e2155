"""The long-answer study's report: per-run summaries, the tables (mean ± SE over seeds, each row
beside the exact world's prediction at its length and dial), the diagnostics of the
training-inference correction, the phase diagram and the figures (``long_study.py`` is the
entry point; its docstring describes the study)."""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _long_study_runs import PHASE_ESTIMATORS, ROOM_GROUP, phase_cell  # noqa: E402
from replay_study import _smooth  # noqa: E402

COLLAPSE_DROP = 0.5
"""A phase-diagram cell collapses when its mean held-out accuracy ends this far below SFT's."""
CURVES = (("eval_accuracy", "held-out accuracy"), ("entropy", "entropy"),
          ("train_infer_kl_k3", "train-inference KL k3"), ("clip_fraction", "clip fraction"),
          ("grad_norm", "grad norm (before clip)"))
SUMMARY = (("final acc", "final_acc", "{:.3f}"), ("Δ acc vs SFT", "gain", "{:+.3f}"),
           ("best acc", "best_acc", "{:.3f}"), ("reward last 1/4", "reward_last", "{:.3f}"),
           ("reward drop", "reward_drop", "{:.3f}"), ("TI-KL k3", "kl_k3", "{:.2e}"),
           ("routing mismatch", "routing_mismatch", "{:.4f}"),
           ("clip frac", "clip_fraction", "{:.4f}"), ("grad norm", "grad_norm", "{:.2f}"),
           ("entropy last", "entropy_last", "{:.3f}"))
BLAME = (("low tokens", "low_token_fraction", "{:.4f}"),
         ("π_old/μ at low (geo mean)", "w_low_geomean", "{:.3f}"),
         ("π_old/μ at high (mean)", "w_high_mean", "{:.4f}"),
         ("neg. push on low", "neg_push_low_share", "{:.3f}"),
         ("failed with a low token", "failed_low_fraction", "{:.3f}"),
         ("passed with a low token", "passed_low_fraction", "{:.3f}"),
         ("token ESS", "is_ess", "{:.3f}"),
         ("log Π π_old/μ: mean", "seq_logw_mean", "{:+.2f}"),
         ("… its std", "seq_logw_std", "{:.2f}"))
"""The correction's diagnostics (:func:`tokenmdp.rl.update.blame_stats`, ``is_ess``), as the
mean over the first quarter of each run's steps (before a collapse changes the policy)."""


def mean_se(values) -> tuple[float, float]:
    """Mean and standard error of the mean over seeds (NaN SE for a single value)."""
    v = np.array([x for x in values if x is not None and not math.isnan(x)], dtype=float)
    if not len(v):
        return float("nan"), float("nan")
    return float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else float("nan")


def _pm(values, fmt: str) -> str:
    m, se = mean_se(values)
    if math.isnan(m):
        return "-"
    return fmt.format(m) + ("" if math.isnan(se) else " ± " + fmt.replace("+", "").format(se))


def early_diagnostics(rows: list[dict]) -> dict:
    """Each key of :data:`BLAME`: its mean over the first quarter of ``rows`` (NaN if absent)."""
    part = rows[:max(len(rows) // 4, 1)]
    out = {}
    for _, key, _ in BLAME:
        vals = [r[key] for r in part if r.get(key) is not None]
        out[f"d_{key}"] = float(np.mean(vals)) if vals else float("nan")
    return out


def exact_cell(exact: dict, spec: dict) -> str:
    """The exact world's prediction for a run: cosine to ``∇J`` and relative progress of its
    estimator's exact mean gradient at the run's ``L`` and ``σ`` (``-`` where none exists)."""
    row = exact.get((spec["length"], spec["sigma"]))
    if row is None or spec["minibatches"] != 1 or spec["estimator"] not in row:
        return "-"
    e = row[spec["estimator"]]
    text = f"cos {e['cosine']:.3f}, progress {e['progress']:.2f}, SNR {e['snr']:.1e}"
    if "fresh" in e:
        text += f"; fresh noise: SNR {e['fresh']['snr']:.1e}"
    return text


def write_tables(out: Path, results: list[dict], header: str, exact: dict) -> str:
    """``results.md`` (the summary over seeds, the diagnostics) and ``results.csv``; the text."""
    names = list(dict.fromkeys(r["name"] for r in results))
    lines = [header, "", f"Mean ± standard error over seeds {sorted({r['seed'] for r in results})}"
             " (Δ acc: final held-out accuracy minus the SFT checkpoint's, both by the run's engine"
             " and evaluation temperature). *exact*: the exact world at the row's L and σ "
             "(`_long_study_exact.py`: cosine of the estimator's exact mean gradient with ∇J, "
             "its progress along ∇J relative to exact ascent, its signal-to-noise ratio).", "",
             "| group | run | L | σ | " + " | ".join(c[0] for c in SUMMARY) +
             " | skipped | exact |", "|" + "---|" * (len(SUMMARY) + 6)]
    for name in names:
        rs = [r for r in results if r["name"] == name]
        cells = [_pm([r[key] for r in rs], fmt) for _, key, fmt in SUMMARY]
        lines.append(f"| {rs[0]['group']} | {rs[0]['label']} | {rs[0]['length']} | "
                     f"{rs[0]['sigma']:g} | " + " | ".join(cells) +
                     f" | {sum(r['skipped'] for r in rs)} | {exact_cell(exact, rs[0])} |")
    lines += ["", "## The training-inference correction, measured (first quarter of the steps)",
              "", "A token is *low* when π_old gives the sampled token less than 1/2; *neg. push "
              "on low*: the share of the negative-advantage push |φ| (1 − π_old(a)) of the "
              "update at θ_old that lands on low tokens.", "",
              "| run | L | σ | " + " | ".join(c[0] for c in BLAME) + " |",
              "|" + "---|" * (len(BLAME) + 3)]
    for name in names:
        rs = [r for r in results if r["name"] == name]
        if rs[0]["minibatches"] != 1 or rs[0]["group"] == "phase":
            continue
        lines.append(f"| {rs[0]['label']} ({rs[0]['group']}) | {rs[0]['length']} | "
                     f"{rs[0]['sigma']:g} | " +
                     " | ".join(_pm([r[f"d_{k}"] for r in rs], f) for _, k, f in BLAME) + " |")
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    keys = (["name", "seed", "length", "sigma", "eval_temperature", "sft_acc", "gain", "steps",
             "final_acc", "final_se", "best_acc", "reward_last", "reward_drop", "kl_k1", "kl_k3",
             "routing_mismatch", "clip_fraction", "grad_norm", "grad_norm_max", "entropy_last",
             "skipped", "wall_s", "error"] + [f"d_{k}" for _, k, _ in BLAME])
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(keys)
        w.writerows([r.get(k) for k in keys] for r in results)
    return text


def exact_markdown(exact_rows: list[dict], table: str) -> str:
    """The exact world's section of ``results.md``."""
    return ("\n## The exact world at the trainer's mismatch and length\n\n"
            "Exact-match lattice, the trainer's vocabulary, π's per-token entropy 0.08 (the SFT "
            "checkpoint's), the engine the marginal of the fresh logit noise; G = 4 "
            "(`benchmarks/_long_study_exact.py`). Per estimator: cosine of the exact mean "
            "gradient with ∇J / its progress along ∇J relative to exact ascent / signal-to-noise "
            "ratio ‖E ĝ‖² / tr Cov ĝ.\n\n" + table)


def phase_table(results: list[dict], size: dict) -> tuple[str, dict]:
    """Markdown of the phase diagram: per (L, sigma), each estimator's mean Δ acc ± SE and
    whether it collapsed; and the grid of mean Δ acc per estimator (for the figure)."""
    lengths, sigmas = size["lengths"], size["sigmas"]
    grid = {est: np.full((len(lengths), len(sigmas)), np.nan) for est in PHASE_ESTIMATORS}
    lines = ["| L | sigma | " + " | ".join(f"{e} Δ acc" for e in PHASE_ESTIMATORS) +
             " | TI-KL k3 (no IS) | collapsed (no IS) |",
             "|---|---|" + "---|" * (len(PHASE_ESTIMATORS) + 2)]
    for i, length in enumerate(lengths):
        for j, s in enumerate(sigmas):
            cells, kl, collapsed = [], "-", "-"
            for est in PHASE_ESTIMATORS:
                name = phase_cell({"length": length, "sigma": s, "estimator": est}, size)
                rs = [r for r in results if r["name"] == name]
                if not rs:
                    cells.append("-")
                    continue
                m, _ = mean_se([r["gain"] for r in rs])
                grid[est][i, j] = m
                cells.append(_pm([r["gain"] for r in rs], "{:+.3f}"))
                if est == "minirl_no_is":
                    kl = _pm([r["kl_k3"] for r in rs], "{:.2e}")
                    collapsed = "yes" if m < -COLLAPSE_DROP else "no"
            lines.append(f"| {length} | {s:g} | " + " | ".join(cells) + f" | {kl} | {collapsed} |")
    return "\n".join(lines) + "\n", grid


def plot_curves(out: Path, results: list[dict], curves: dict[str, list[dict]]) -> None:
    """``curves.png``: every group's curves of :data:`CURVES`, mean over seeds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [g for g in dict.fromkeys(r["group"] for r in results) if g != "phase"]
    fig, axes = plt.subplots(len(CURVES), len(groups), figsize=(4.2 * len(groups), 13),
                             squeeze=False)
    for j, group in enumerate(groups):
        for name in dict.fromkeys(r["name"] for r in results if r["group"] == group):
            rs = [r for r in results if r["name"] == name]
            for i, (key, label) in enumerate(CURVES):
                per_seed = [[(x["step"] + 1, x[key]) for x in curves[r["key"]]
                             if x.get(key) is not None] for r in rs]
                per_seed = [p for p in per_seed if p]
                if not per_seed:
                    continue
                n = min(len(p) for p in per_seed)
                steps = np.array([s for s, _ in per_seed[0][:n]])
                y = np.mean([[v for _, v in p[:n]] for p in per_seed], axis=0)
                if key != "eval_accuracy":
                    k = max(n // 10, 1)
                    steps, y = steps[k - 1:], _smooth(y, k)
                axes[i, j].plot(steps, y, marker="o" if key == "eval_accuracy" else None,
                                label=rs[0]["label"])
                axes[i, j].set_ylabel(label + (" (T = 1)" if group == ROOM_GROUP and i == 0
                                               else ""))
        axes[0, j].set_title(f"{group} (mean over seeds)")
        axes[2, j].set_yscale("log")
        axes[-1, j].set_xlabel("RL step")
        axes[0, j].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=100)
    plt.close(fig)


def plot_phase(out: Path, grid: dict, size: dict) -> None:
    """``phase.png``: the phase diagram's mean Δ acc per estimator over σ x L."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(grid), figsize=(4.5 * len(grid), 3.8), squeeze=False)
    for ax, (est, g) in zip(axes[0], grid.items()):
        im = ax.imshow(g, origin="lower", cmap="RdBu", vmin=-0.5, vmax=0.5, aspect="auto")
        ax.set_xticks(range(len(size["sigmas"])), [f"{s:g}" for s in size["sigmas"]])
        ax.set_yticks(range(len(size["lengths"])), [str(n) for n in size["lengths"]])
        for (i, j), v in np.ndenumerate(g):
            if not np.isnan(v):
                ax.text(j, i, f"{v:+.2f}", ha="center", va="center", fontsize=8)
        ax.set(xlabel="logit-noise dial sigma", ylabel="response length L",
               title=f"{est}: Δ held-out acc vs SFT")
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(out / "phase.png", dpi=100)
    plt.close(fig)
