"""The long-answer study's report: per-run summaries, the tables (mean ± SE over seeds, each
on-policy row beside the exact world's prediction at its length and engine), the collapse counts
and their tests, the learning-rate and clip sweep, the cold starts and the figures
(``long_study.py`` is the entry point; its docstring describes the study)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

COLLAPSE_FRACTION = 0.5
"""A run *collapses* when its final held-out accuracy is below this share of its start's (the
SFT checkpoint's by the run's own engine, at T = 1)."""
CURVES = (("eval_accuracy", "held-out accuracy (T = 1)"), ("entropy", "entropy"),
          ("train_infer_kl_k3", "train-inference KL k3"), ("clip_fraction", "clip fraction"),
          ("grad_norm", "grad norm (before clip)"))
SUMMARY = (("start acc", "sft_acc", "{:.3f}"), ("final acc", "final_acc", "{:.3f}"),
           ("Δ acc", "gain", "{:+.3f}"), ("reward last 1/4", "reward_last", "{:.3f}"),
           ("TI-KL k3", "kl_k3", "{:.1e}"), ("routing mismatch", "routing_mismatch", "{:.4f}"),
           ("clip frac", "clip_fraction", "{:.4f}"), ("grad norm", "grad_norm", "{:.2f}"),
           ("entropy last", "entropy_last", "{:.3f}"))
EARLY = ("train_infer_kl_k3", "is_ess", "seq_logw_std")
"""Per-step metrics averaged over the first quarter of each run (before a collapse changes the
policy): the training-inference KL, the token ESS, the spread of the sequence log-weight."""


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
    """Each key of :data:`EARLY`: its mean over the first quarter of ``rows`` (NaN if absent);
    and the training-inference KL's over the last quarter (``late_train_infer_kl_k3``: has the
    mismatch grown?)."""
    part, late = rows[:max(len(rows) // 4, 1)], rows[-max(len(rows) // 4, 1):]
    out = {}
    for key in EARLY:
        vals = [r[key] for r in part if r.get(key) is not None]
        out[f"early_{key}"] = float(np.mean(vals)) if vals else float("nan")
    vals = [r["train_infer_kl_k3"] for r in late if r.get("train_infer_kl_k3") is not None]
    out["late_train_infer_kl_k3"] = float(np.mean(vals)) if vals else float("nan")
    return out


def collapsed(result: dict) -> bool:
    """Whether a run collapsed (:data:`COLLAPSE_FRACTION`); a run without an evaluation did."""
    final = result["final_acc"]
    return bool(math.isnan(final) or final < COLLAPSE_FRACTION * result["sft_acc"])


def fisher_p(a: tuple[int, int], b: tuple[int, int]) -> float:
    """Two-sided Fisher's exact test of collapse counts ``(collapsed, runs)`` of two rows."""
    from scipy.stats import fisher_exact

    return float(fisher_exact([[a[0], a[1] - a[0]], [b[0], b[1] - b[0]]])[1])


def _rows(results: list[dict]) -> dict[str, list[dict]]:
    return {n: [r for r in results if r["name"] == n]
            for n in dict.fromkeys(r["name"] for r in results)}


def _count(rs: list[dict]) -> tuple[int, int]:
    return sum(collapsed(r) for r in rs), len(rs)


def exact_cell(exact: dict, spec: dict) -> str:
    """The exact world's prediction for an on-policy run at its ``(L, arm)``: cosine of the
    estimator's exact mean gradient with ``∇J``, its relative progress and its SNR."""
    row = exact.get((spec["length"], spec["arm"]))
    if row is None or spec["minibatches"] != 1 or spec["estimator"] not in row:
        return "-"
    e = row[spec["estimator"]]
    mc = "" if e["method"] == "lattice" else " (MC)"
    return f"cos {e['cosine']:.3f}, prog. {e['progress']:.2f}, SNR {e['snr']:.1e}{mc}"


def write_tables(out: Path, results: list[dict], header: str, exact: dict) -> str:
    """``results.md``'s tables (every row; the comparisons; the sweep; the cold starts) and
    ``results.csv``; returns the text."""
    rows = _rows(results)
    seeds = sorted({r["seed"] for r in results})
    lines = [header, "", f"Mean ± standard error over seeds (seeds {seeds[0]}–{seeds[-1]}; each "
             "row's count in *collapsed*). Δ acc: final held-out accuracy minus the SFT "
             "checkpoint's, both by the run's engine at T = 1; *collapsed*: final accuracy below "
             f"{COLLAPSE_FRACTION:g} × the start's. *exact*: the exact world at the row's L and "
             "engine (`_long_study_exact.engine_row`).", "",
             "| group | run | L | engine | lr | clip | " + " | ".join(c[0] for c in SUMMARY) +
             " | collapsed | skipped | exact |", "|" + "---|" * (len(SUMMARY) + 9)]
    for rs in rows.values():
        r0 = rs[0]
        cells = [_pm([r[key] for r in rs], fmt) for _, key, fmt in SUMMARY]
        k, n = _count(rs)
        lines.append(f"| {r0['group']} | {r0['label']} | {r0['length']} | {r0['arm']} | "
                     f"{r0['lr']:g} | {r0['grad_clip']:g} | " + " | ".join(cells) +
                     f" | {k}/{n} | {sum(r['skipped'] for r in rs)} | {exact_cell(exact, r0)} |")
    lines += ["", "## Comparisons", "", "Δ acc difference (second minus first, ± the two SEs "
              "combined) and Fisher's exact test of the collapse counts (two-sided).", "",
              "| first | second | Δ acc (first) | Δ acc (second) | difference | collapsed | "
              "Fisher p |", "|---|---|---|---|---|---|---|"]
    for a, b in comparisons(rows):
        ma, sa = mean_se([r["gain"] for r in rows[a]])
        mb, sb = mean_se([r["gain"] for r in rows[b]])
        ka, kb = _count(rows[a]), _count(rows[b])
        lines.append(f"| {a} | {b} | {ma:+.3f} ± {sa:.3f} | {mb:+.3f} ± {sb:.3f} | "
                     f"{mb - ma:+.3f} ± {math.hypot(sa, sb):.3f} | {ka[0]}/{ka[1]} vs "
                     f"{kb[0]}/{kb[1]} | {fisher_p(ka, kb):.3f} |")
    lines += sweep_table(rows) + coldstart_table(rows) + early_table(rows)
    text = "\n".join(lines) + "\n"
    keys = (["name", "seed", "length", "arm", "estimator", "optimizer", "minibatches", "replay", "lr",
             "grad_clip", "target", "sft_acc", "gain", "steps", "final_acc", "final_se",
             "best_acc", "reward_last", "reward_drop", "kl_k1", "kl_k3", "routing_mismatch",
             "clip_fraction", "grad_norm", "grad_norm_max", "entropy_last", "skipped", "wall_s",
             "error"] + [f"early_{k}" for k in EARLY] + ["late_train_infer_kl_k3"])
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(keys)
        w.writerows([r.get(k) for k in keys] for r in results)
    return text


def comparisons(rows: dict[str, list[dict]]) -> list[tuple[str, str]]:
    """The pairs the findings rest on, among the rows present: on-policy MiniRL against each
    ablation (per engine and length), off-policy N = 2 against N = 4 and 8 (per replay), R2
    against R3 (per N, and in the routing group), and the best cold start against the others."""
    pairs, names = [], list(rows)

    def add(a, b):
        if a in rows and b in rows:
            pairs.append((a, b))

    for name in names:
        for prefix in ("onpolicy_", "length"):
            if name.startswith(prefix) and name.endswith("_minirl"):
                for est in ("minirl_no_is", "minirl_len_norm", "minirl_seq_tis"):
                    add(name, name[:-len("minirl")] + est)
    for replay in ("none", "r2", "r3"):
        for n in (4, 8):
            add(f"offpolicy_n2_{replay}", f"offpolicy_n{n}_{replay}")
    for prefix in sorted({n.rsplit("_", 1)[0] for n in names
                          if n.startswith(("offpolicy_n", "routing_n"))}):
        add(f"{prefix}_r2", f"{prefix}_r3")
        add(f"{prefix}_none", f"{prefix}_r3")
    for prefix in ("coldstart_t", "convergence_t"):
        cold = [n for n in names if n.startswith(prefix)]
        if cold:
            best = max(cold, key=lambda n: rows[n][0]["target"])
            for n in cold:
                if n != best:
                    add(best, n)
    for name in names:   # the optimizer control: SGD MiniRL against SGD length normalization
        if name.startswith("optimizer_sgd_minirl_len_norm"):
            add("optimizer_sgd_minirl", name)
    return pairs


def sweep_table(rows: dict[str, list[dict]]) -> list[str]:
    """The learning-rate and gradient-clip sweep: per (N, lr, clip) the collapse count, Δ acc
    and the train reward of the last quarter."""
    sweep = {n: rs for n, rs in rows.items() if rs[0]["group"] == "sweep"}
    if not sweep:
        return []
    lines = ["", "## Learning-rate and clip sweep (off-policy, no replay)", "",
             "| N | lr | clip | alive | Δ acc | final acc | reward last 1/4 | clip frac |",
             "|---|---|---|---|---|---|---|---|"]
    for rs in sweep.values():
        k, n = _count(rs)
        r0 = rs[0]
        lines.append(f"| {r0['minibatches']} | {r0['lr']:g} | {r0['grad_clip']:g} | {n - k}/{n} | "
                     f"{_pm([r['gain'] for r in rs], '{:+.3f}')} | "
                     f"{_pm([r['final_acc'] for r in rs], '{:.3f}')} | "
                     f"{_pm([r['reward_last'] for r in rs], '{:.3f}')} | "
                     f"{_pm([r['clip_fraction'] for r in rs], '{:.4f}')} |")
    return lines


def coldstart_table(rows: dict[str, list[dict]]) -> list[str]:
    """The cold starts (each group of them: the main one and the longer ``convergence``
    control): per SFT start its steps and accuracy, the final accuracy, the collapse count with
    Fisher's p against the best start, and the spread of the starts' means at the start and at
    the end (do they converge?)."""
    lines = []
    for group in dict.fromkeys(rs[0]["group"] for rs in rows.values()):
        if group.startswith("cold start"):
            lines += _coldstart_group(group, {n: rs for n, rs in rows.items()
                                              if rs[0]["group"] == group})
    return lines


def _coldstart_group(group: str, cold: dict[str, list[dict]]) -> list[str]:
    best = max(cold, key=lambda n: cold[n][0]["target"])
    lines = ["", f"## Cold starts (one recipe, three SFT starts): {group}", "",
             "| SFT target | SFT steps | start acc | final acc | Δ acc | best acc | collapsed | "
             "Fisher p vs best start |", "|---|---|---|---|---|---|---|---|"]
    for name, rs in cold.items():
        k = _count(rs)
        lines.append(f"| {rs[0]['target']:g} | {rs[0].get('sft_steps', '-')} | "
                     f"{rs[0]['sft_acc']:.3f} | {_pm([r['final_acc'] for r in rs], '{:.3f}')} | "
                     f"{_pm([r['gain'] for r in rs], '{:+.3f}')} | "
                     f"{_pm([r['best_acc'] for r in rs], '{:.3f}')} | {k[0]}/{k[1]} | "
                     f"{'-' if name == best else f'{fisher_p(_count(cold[best]), k):.3f}'} |")
    starts = [rs[0]["sft_acc"] for rs in cold.values()]
    finals = [mean_se([r["final_acc"] for r in rs])[0] for rs in cold.values()]
    lines += ["", f"Spread of the starts (largest minus smallest mean accuracy): at the start "
              f"{max(starts) - min(starts):.3f}, at the end {max(finals) - min(finals):.3f}."]
    return lines


def early_table(rows: dict[str, list[dict]]) -> list[str]:
    """The first quarter of each row: the training-inference KL, token ESS and the spread of
    the sequence log-weight (what the correction faces)."""
    lines = ["", "## The mismatch, first quarter of the steps (and the KL in the last)", "",
             "| run | engine | TI-KL k3 | token ESS | std of log Π π_old/μ | TI-KL k3, last 1/4 |",
             "|---|---|---|---|---|---|"]
    for name, rs in rows.items():
        lines.append(f"| {name} | {rs[0]['arm']} | "
                     + " | ".join(_pm([r[f"early_{k}"] for r in rs], f)
                                  for k, f in zip(EARLY, ("{:.1e}", "{:.4f}", "{:.3f}"))) +
                     f" | {_pm([r['late_train_infer_kl_k3'] for r in rs], '{:.1e}')} |")
    return lines


def exact_markdown(exact: dict) -> str:
    """The exact world's section of ``results.md``."""
    if not exact:
        return ""
    names = [k for k in next(iter(exact.values())) if isinstance(next(iter(exact.values()))[k],
                                                                 dict)]
    lines = ["", "## The exact world at the trainer's engines and lengths", "",
             "Exact-match lattice, the trainer's vocabulary, π's per-token entropy 0.08 (the SFT "
             "start's), G = 16; μ the lattice's engine copy in the row's mode with its dial set "
             "so that the per-token KL is the trainer's (first quarter of its runs; "
             "`_long_study_exact.engine_row`). Per estimator: cosine with ∇J / progress along ∇J "
             "relative to exact ascent / SNR ‖E ĝ‖² / tr Cov ĝ (MC: Monte Carlo).", "",
             "| L | mode | dial | KL target → KL | J(π) → J(μ) | " +
             " | ".join(names) + " |", "|" + "---|" * (5 + len(names))]
    for r in exact.values():
        dial = (f"fraction {r['fraction']:.2e}" if r["mode"] == "heavy"
                else f"scale {r['scale']:.3f}")
        cells = [f"{r[e]['cosine']:.3f} / {r[e]['progress']:.2f} / {r[e]['snr']:.1e}"
                 + ("" if r[e]["method"] == "lattice" else " (MC)") for e in names]
        lines.append(f"| {r['L']} | {r['mode']} | {dial} | {r['kl_target']:.1e} → "
                     f"{r['kl']:.1e} | {r['J_pi']:.3f} → {r['J_mu']:.3f} | " +
                     " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_curves(out: Path, results: list[dict], curves: dict[str, list[dict]]) -> None:
    """``curves.png``: every group's curves of :data:`CURVES`, mean over seeds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(r["group"] for r in results))
    fig, axes = plt.subplots(len(groups), len(CURVES), figsize=(4.2 * len(CURVES),
                                                                2.6 * len(groups)), squeeze=False)
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
                    y = np.convolve(y, np.ones(k) / k, mode="valid")
                    steps = steps[k - 1:]
                axes[j, i].plot(steps, y, marker="o" if key == "eval_accuracy" else None,
                                label=rs[0]["label"])
                axes[j, i].set_title(f"{group}: {label}", fontsize=8)
        axes[j, 2].set_yscale("log")
        axes[j, 0].legend(fontsize=6)
    for i in range(len(CURVES)):
        axes[-1, i].set_xlabel("RL step (mean over seeds)")
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=70)
    plt.close(fig)


def plot_summary(out: Path, results: list[dict]) -> None:
    """``summary.png``: Δ held-out accuracy per row (mean ± SE over seeds, every seed a dot),
    one panel per group."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows(results)
    groups = list(dict.fromkeys(r["group"] for r in results))
    cols = min(len(groups), 5)
    rows_n = -(-len(groups) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(3.4 * cols, 4.2 * rows_n), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    for ax, group in zip(axes.flat, groups):
        names = [n for n, rs in rows.items() if rs[0]["group"] == group]
        for x, name in enumerate(names):
            gains = [r["gain"] for r in rows[name]]
            m, se = mean_se(gains)
            ax.errorbar([x], [m], yerr=[0 if math.isnan(se) else se], fmt="o", capsize=3)
            ax.scatter(np.full(len(gains), x + 0.15), gains, s=6, color="grey")
        ax.axhline(0, color="k", lw=0.5)
        ax.set_xticks(range(len(names)), [rows[n][0]["label"] for n in names], rotation=60,
                      ha="right", fontsize=7)
        ax.set_title(group, fontsize=9)
    for row in axes:
        row[0].set_ylabel("Δ held-out accuracy (T = 1) vs start")
    fig.tight_layout()
    fig.savefig(out / "summary.png", dpi=90)
    plt.close(fig)
