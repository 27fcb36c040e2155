"""The trainer-world study with room for the mechanism (issue 19): long answers, an engine-mismatch
dial, seeds and standard errors. A small-scale test of the qualitative findings of Zheng et al.
(2025), "Stabilizing Reinforcement Learning with LLMs: Formulation and Practices" (arXiv
2512.01374, MiniRL).

``benchmarks/replay_study.py`` ran the same ablations on 2-digit addition, where a response has at
most 4 tokens and ``pi_old / mu`` stays within 1 ± 0.05: dropping the training-inference IS
correction did not collapse training there. Here:

* the task is :class:`~tokenmdp.rl.long_tasks.RunningSum` (``running_sum_L``: ``L`` answer
  digits, then EOS; exact-match reward), ``L = 64`` for the main grid;
* the rollout engine runs in simulated fp8 *and* perturbs its logits with the dial
  ``rollout_logit_noise = sigma`` (:class:`~tokenmdp.rl.rollout.RolloutEngine`), so
  ``KL(mu || pi_old)`` per token is set by ``sigma`` and the routing mismatch by fp8;
* every RL run starts from one SFT checkpoint per length (SFT, seed 0, until half of the
  held-out responses *sampled at temperature 1* are right), and every run is repeated for each
  RL seed. The start must be that good: checkpoints at 65% and 91% held-out accuracy near
  greedy (per-token entropy 0.59 and 0.35) got no sampled response of 64 digits right in 60
  steps x 32 samples, so every reward was 0 and nothing trained. Near greedy such a start is
  at about 100%, so the study measures whether training *stays* stable, which is where the
  paper's collapse without the IS correction shows.

Runs:

* **on-policy** (``minibatches = 1``): ``minirl`` vs ``minirl_no_is`` (no training-inference IS)
  vs ``minirl_len_norm`` (length normalization);
* **off-policy** (``minibatches`` N = 2, 4, 8), MiniRL with routing replay none / R2 / R3;
* **phase diagram**: ``minirl_no_is`` and ``minirl`` on-policy over ``sigma`` x ``L``; a cell
  *collapses* when the mean over seeds of (final held-out accuracy - the SFT checkpoint's) is
  below ``-COLLAPSE_DROP`` (half the accuracy lost: a run whose samples all fail has zero
  advantages and never recovers).

Per run: final and best held-out accuracy, the train reward of the last quarter, the drop of the
smoothed train reward from its peak, the training-inference KL (k3), routing mismatch, clip
fraction, gradient norm (before clipping), entropy, skipped updates, wall time. Per setting: the
mean ± standard error over seeds (``std(ddof=1) / sqrt(k)``). Outputs under ``--out``:
``results.md`` (the tables), ``results.csv`` (one row per run), ``curves.png`` (held-out accuracy,
entropy, training-inference KL, clip fraction and gradient norm per group, mean over seeds),
``phase.png`` (the phase diagram), ``summary.json`` and every run's ``metrics.jsonl``.

Configurations (``--config``):

* ``cpu`` — the tiny MoE on the CPU, sized for about 45 minutes on a 2-core machine with
  ``--workers 2`` (66 runs of 80 steps; measured 0.33 s per step at ``L = 64`` with one worker
  on a shared machine, so about 20 minutes of runs with two); a benchmark, not a test;
* ``gpu`` — a wider model, bigger batches and four lengths on one GPU, sized **by estimate, not
  measured** (written without a GPU) for about 8 minutes on one H200 with ``--workers 12`` (102
  runs of 100 steps share the GPU, at an assumed 0.4 s per step); ``benchmarks/gpu_study.sh``
  runs it with a time limit;
* ``--quick`` — a smoke check of the whole pipeline (about a minute, one worker); its numbers mean
  nothing.

Measured so far (parts of the cpu configuration, 60 steps, seeds 0-2, one worker; the full
grid, the off-policy runs and most of the phase diagram are not run yet), all from a start at
1.00 held-out accuracy near greedy, as Δ acc (mean ± SE over seeds):

* ``L = 64``, ``sigma = 1`` (KL(mu || pi_old) 0.03-0.06 per token, routing mismatch 2.5%):
  ``minirl_no_is`` -0.107 ± 0.041 (no seed collapsed), ``minirl`` -0.703 ± 0.297 (2 of 3
  collapsed: train reward 0 within 20 steps, entropy up from 0.08 to 0.17-0.36, and with every
  reward of a group 0 the advantages are 0, so it never recovers), ``minirl_len_norm``
  -0.603 ± 0.215 (1 of 3);
* ``L = 64``, ``sigma = 0`` (fp8 alone, KL 0.002-0.003): ``minirl_no_is`` -0.197 ± 0.133,
  ``minirl`` -0.433 ± 0.291 (1 of 3 collapsed).

So the paper's collapse without the IS correction does not appear; MiniRL with its token-level
truncated IS (cap 5) was the less stable, at both dial settings, but within about two standard
errors at ``sigma = 0``: RL at learning rate 3e-4 from this start is fragile by itself, and three
seeds of 60 steps do not separate the estimators there. One candidate reason for the gap at
``sigma = 1``, not tested: this dial's mismatch is fresh noise, not a systematic bias; a wrong
response is then mostly wrong at a token the noise promoted, where ``pi_old / mu`` is near 0
(``rho_min`` 0.001-0.02 measured), so the IS weight takes that token's blame away and the
negative advantage falls on the right tokens of the response.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/long_study.py --config cpu [--workers 2] [--seeds 0 1 2]
        [--out runs/long_study]
    OMP_NUM_THREADS=1 python benchmarks/long_study.py --quick
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay_study import _smooth, _worker, read_rows, summarize  # noqa: E402

MODEL_CPU = dict(d_model=64, n_layers=2, n_heads=4, n_experts=4, top_k=2, expert_hidden=64)
CONFIGS = {
    "cpu": dict(
        model=MODEL_CPU, device="cpu", precision="fp8", seeds=(0, 1, 2), workers=2,
        length=64, sigma=1.0, lengths=(16, 64), sigmas=(0.0, 1.0, 2.0),
        sft=dict(prompts_per_step=32, lr=1e-3, warmup_steps=50, target=0.5, check=10,
                 max_steps=1500),
        rl=dict(steps=80, prompts_per_step=8, group_size=4, lr=3e-4, eval_every=20,
                eval_size=100)),
    "gpu": dict(
        model=dict(d_model=128, n_layers=4, n_heads=4, n_experts=8, top_k=2, expert_hidden=128),
        device="cuda", precision="fp8", seeds=(0, 1, 2), workers=12,
        length=64, sigma=1.0, lengths=(16, 32, 64, 128), sigmas=(0.0, 1.0, 2.0),
        sft=dict(prompts_per_step=128, lr=1e-3, warmup_steps=50, target=0.5, check=10,
                 max_steps=2000),
        rl=dict(steps=100, prompts_per_step=32, group_size=8, lr=3e-4, eval_every=25,
                eval_size=256)),
    "quick": dict(
        model=dict(d_model=32, n_layers=2, n_heads=2, n_experts=4, top_k=2, expert_hidden=32),
        device="cpu", precision="fp8", seeds=(0,), workers=1,
        length=8, sigma=1.0, lengths=(8,), sigmas=(0.0, 1.0),
        sft=dict(prompts_per_step=8, lr=1e-3, warmup_steps=2, target=0.3, check=4, max_steps=4),
        rl=dict(steps=2, prompts_per_step=4, group_size=2, lr=3e-4, eval_every=2, eval_size=8)),
}
"""Sizes per configuration: model, device, engine precision, RL seeds, workers, the main grid's
length and dial, the phase diagram's lengths and dials, the SFT stage (until ``target``
held-out accuracy) and the RL stage (shared by every run)."""

ON_POLICY = ("minirl", "minirl_no_is", "minirl_len_norm")
MINIBATCHES = (2, 4, 8)
REPLAYS = ("none", "r2", "r3")
PHASE_ESTIMATORS = ("minirl_no_is", "minirl")
COLLAPSE_DROP = 0.5
"""A phase-diagram cell collapses when its mean held-out accuracy ends this far below SFT's."""
CURVES = (("eval_accuracy", "held-out accuracy"), ("entropy", "entropy"),
          ("train_infer_kl_k3", "train-inference KL k3"), ("clip_fraction", "clip fraction"),
          ("grad_norm", "grad norm (before clip)"))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", choices=("cpu", "gpu"), default="cpu", help="sizes (see docstring)")
    p.add_argument("--quick", action="store_true", help="smoke check, numbers mean nothing")
    p.add_argument("--out", default=None, help="output folder (default runs/long_study[_<config>])")
    p.add_argument("--workers", type=int, default=None, help="runs in parallel (default: per config)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="RL seeds (default: per config)")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default: per config)")
    p.add_argument("--no-phase", action="store_true", help="skip the phase diagram")
    p.add_argument("--only", nargs="+", default=None,
                   help="run only these run names (e.g. onpolicy_minirl offpolicy_n4_r3)")
    args = p.parse_args(argv)
    args.size = CONFIGS["quick" if args.quick else args.config]
    args.seeds = list(args.seeds or args.size["seeds"])
    if args.out is None:
        args.out = "runs/long_study" + ("_quick" if args.quick else
                                        "" if args.config == "cpu" else f"_{args.config}")
    if (args.workers is not None and args.workers < 1) or (args.steps is not None and args.steps < 1):
        p.error("--workers, --steps: must be >= 1")
    return args


# ---------------------------------------------------------------------------------- runs
def run_specs(args) -> list[dict]:
    """Every run: its name, table group, seed, length, dial and the fields that differ."""
    size, specs = args.size, []

    def add(name, group, label, length, sigma, estimator, n, replay):
        specs.extend({"name": name, "group": group, "label": label, "seed": seed,
                      "length": length, "sigma": sigma, "estimator": estimator,
                      "minibatches": n, "replay": replay} for seed in args.seeds)

    L, sigma = size["length"], size["sigma"]
    for est in ON_POLICY:
        add(f"onpolicy_{est}", "on-policy (N=1)", est, L, sigma, est, 1, "none")
    for n in MINIBATCHES:
        for replay in REPLAYS:
            add(f"offpolicy_n{n}_{replay}", f"off-policy N={n}", f"minirl {replay}", L, sigma,
                "minirl", n, replay)
    if not args.no_phase:
        for length in size["lengths"]:
            for s in size["sigmas"]:
                for est in PHASE_ESTIMATORS:
                    if (length, s) == (L, sigma) and est in ON_POLICY:
                        continue  # the main grid's on-policy runs are this cell
                    add(f"phase_L{length}_s{s:g}_{est}", "phase", est, length, s, est, 1, "none")
    if args.only:
        unknown = set(args.only) - {s["name"] for s in specs}
        if unknown:
            raise SystemExit(f"--only: unknown run names {sorted(unknown)}")
        specs = [s for s in specs if s["name"] in args.only]
    return specs


def phase_cell(spec: dict, specs: list[dict], size: dict) -> str:
    """The run name whose results fill a phase-diagram cell (the main grid's when shared)."""
    if (spec["length"], spec["sigma"]) == (size["length"], size["sigma"]):
        return f"onpolicy_{spec['estimator']}"
    return f"phase_L{spec['length']}_s{spec['sigma']:g}_{spec['estimator']}"


def base_config(args, length: int, mode: str):
    from tokenmdp.rl.config import TrainConfig

    size = args.size
    return TrainConfig(mode=mode, task=f"running_sum_{length}", max_new_tokens=length + 2,
                       rollout_precision=size["precision"], device=size["device"],
                       eval_size=size["rl"]["eval_size"], checkpoint_every=0,
                       deterministic=size["device"] == "cpu", **size["model"])


def rl_config(args, spec: dict, init: str):
    rl = {**args.size["rl"], **({"steps": args.steps} if args.steps else {})}
    return dataclasses.replace(
        base_config(args, spec["length"], "rl"), estimator=spec["estimator"],
        replay=spec["replay"], minibatches=spec["minibatches"], init=init, seed=spec["seed"],
        rollout_logit_noise=spec["sigma"], overwrite=True,
        out_dir=str(Path(args.out) / "runs" / f"{spec['name']}_s{spec['seed']}"), **rl)


def train_sft(args, length: int) -> dict:
    """SFT on ``running_sum_<length>`` in chunks of ``check`` steps (exact resume) until the
    held-out accuracy *sampled at temperature 1* (the RL runs' split and sampling temperature;
    the engine without the dial) reaches ``target``: the RL runs then get rewards to learn from."""
    from tokenmdp.rl.trainer import train

    sft = dict(args.size["sft"])
    target, check, max_steps = sft.pop("target"), sft.pop("check"), sft.pop("max_steps")
    cfg = dataclasses.replace(base_config(args, length, "sft"), eval_every=check, seed=0,
                              eval_temperature=1.0, out_dir=str(Path(args.out) / f"sft_L{length}"), **sft)
    t0, rows = time.perf_counter(), []
    for end in range(check, max_steps + check, check):
        rows += train(dataclasses.replace(cfg, steps=min(end, max_steps), resume=bool(rows),
                                          overwrite=not rows))
        if rows[-1]["eval_accuracy"] >= target or end >= max_steps:
            break
    acc = rows[-1]["eval_accuracy"]
    print(f"  SFT L={length}: {len(rows)} steps, {time.perf_counter() - t0:.0f} s, held-out "
          f"accuracy sampled at T = 1 {acc:.3f}", flush=True)
    return {"checkpoint": str(Path(cfg.out_dir) / "checkpoint.pt"), "accuracy": acc,
            "steps": len(rows), "seconds": time.perf_counter() - t0}


def engine_accuracy(cfg, checkpoint: str) -> float:
    """Held-out accuracy of the model in ``checkpoint`` by the engine of ``cfg`` (its precision
    and its dial, as the RL run's own evaluations): the start that run's Δ acc is measured from.
    The trainer's evaluation, step 0 (split, temperature, generator seed ``eval_seed``)."""
    import torch

    from tokenmdp.rl.rollout import RolloutEngine
    from tokenmdp.rl.tasks import get_task
    from tokenmdp.rl.trainer import build_model

    task = get_task(cfg.task)
    model = build_model(cfg, task.tokenizer.vocab_size)
    model.load_state_dict(torch.load(checkpoint, map_location=cfg.device,
                                     weights_only=True)["model"])
    engine = RolloutEngine(model, precision=cfg.rollout_precision,
                           logit_noise=cfg.rollout_logit_noise)
    eval_set = task.eval_split(cfg.eval_size, cfg.eval_seed)
    with torch.no_grad():
        batch = engine.generate([task.tokenizer.encode(ex.prompt) for ex in eval_set],
                                max_new_tokens=cfg.max_new_tokens, eos_id=task.tokenizer.EOS,
                                generator=torch.Generator(device=cfg.device).manual_seed(
                                    cfg.eval_seed), temperature=cfg.eval_temperature)
    return float(np.mean([task.is_correct(ex, r) for ex, (_, r) in
                          zip(eval_set, batch.sequences())]))


# ---------------------------------------------------------------------------------- summaries
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


SUMMARY = (("final acc", "final_acc", "{:.3f}"), ("Δ acc vs SFT", "gain", "{:+.3f}"),
           ("best acc", "best_acc", "{:.3f}"), ("reward last 1/4", "reward_last", "{:.3f}"),
           ("reward drop", "reward_drop", "{:.3f}"), ("TI-KL k3", "kl_k3", "{:.2e}"),
           ("routing mismatch", "routing_mismatch", "{:.4f}"),
           ("clip frac", "clip_fraction", "{:.4f}"), ("grad norm", "grad_norm", "{:.2f}"),
           ("entropy last", "entropy_last", "{:.3f}"))


def write_tables(out: Path, results: list[dict], header: str) -> str:
    lines = [header, "", f"Mean ± standard error over seeds {sorted({r['seed'] for r in results})}"
             " (Δ acc: final held-out accuracy minus the SFT checkpoint's, both by the run's engine):", "",
             "| group | run | L | sigma | " + " | ".join(c[0] for c in SUMMARY) + " | skipped |",
             "|" + "---|" * (len(SUMMARY) + 5)]
    for name in dict.fromkeys(r["name"] for r in results):
        rs = [r for r in results if r["name"] == name]
        cells = [_pm([r[key] for r in rs], fmt) for _, key, fmt in SUMMARY]
        lines.append(f"| {rs[0]['group']} | {rs[0]['label']} | {rs[0]['length']} | "
                     f"{rs[0]['sigma']:g} | " + " | ".join(cells) +
                     f" | {sum(r['skipped'] for r in rs)} |")
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    keys = ["name", "seed", "length", "sigma", "sft_acc", "gain", "steps", "final_acc", "final_se",
            "best_acc", "reward_last", "reward_drop", "kl_k1", "kl_k3", "routing_mismatch",
            "clip_fraction", "grad_norm", "grad_norm_max", "entropy_last", "skipped", "wall_s",
            "error"]
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(keys)
        w.writerows([r.get(k) for k in keys] for r in results)
    return text


def phase_table(results: list[dict], specs: list[dict], size: dict) -> tuple[str, dict]:
    """Markdown of the phase diagram: per (L, sigma), each estimator's mean Δ acc ± SE and
    whether it collapsed; and the grid of mean Δ acc per estimator (for the figure)."""
    lengths, sigmas = size["lengths"], size["sigmas"]
    grid = {est: np.full((len(lengths), len(sigmas)), np.nan) for est in PHASE_ESTIMATORS}
    lines = ["| L | sigma | " + " | ".join(f"{e} Δ acc" for e in PHASE_ESTIMATORS) +
             " | TI-KL k3 (no IS) | collapsed (no IS) |", "|---|---|" + "---|" * (len(PHASE_ESTIMATORS) + 2)]
    for i, length in enumerate(lengths):
        for j, s in enumerate(sigmas):
            cells, kl, collapsed = [], "-", "-"
            for est in PHASE_ESTIMATORS:
                name = phase_cell({"length": length, "sigma": s, "estimator": est}, specs, size)
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
                axes[i, j].set_ylabel(label)
        axes[0, j].set_title(f"{group} (mean over seeds)")
        axes[2, j].set_yscale("log")
        axes[-1, j].set_xlabel("RL step")
        axes[0, j].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=100)
    plt.close(fig)


def plot_phase(out: Path, grid: dict, size: dict) -> None:
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


# ---------------------------------------------------------------------------------- main
def run_all(cfgs: list, workers: int, specs: list[dict]) -> list[dict]:
    """Every run in a pool of ``workers`` spawned processes (one intra-op thread each)."""
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        with ProcessPoolExecutor(max_workers=workers,
                                 mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_worker, cfg) for cfg in cfgs]
            outcomes = []
            for spec, fut in zip(specs, futures):
                outcomes.append(fut.result())
                print(f"  {spec['name']:30s} seed {spec['seed']}: {outcomes[-1]['wall_s']:6.1f} s"
                      f"{'  ' + outcomes[-1]['error'] if outcomes[-1]['error'] else ''}",
                      flush=True)
    finally:
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
    return outcomes


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    specs = run_specs(args)
    lengths = sorted({s["length"] for s in specs})
    print(f"SFT per length {lengths} until the held-out accuracy reaches the target ...", flush=True)
    sft = {n: train_sft(args, n) for n in lengths}
    cfgs = [rl_config(args, spec, sft[spec["length"]]["checkpoint"]) for spec in specs]
    workers = args.workers or args.size["workers"]
    print(f"{len(specs)} runs, {workers} in parallel, {cfgs[0].steps} steps each ...", flush=True)
    t_runs = time.perf_counter()
    outcomes = run_all(cfgs, workers, specs)
    runs_s = time.perf_counter() - t_runs

    results, curves, starts = [], {}, {}
    for spec, cfg, outcome in zip(specs, cfgs, outcomes):
        key = f"{spec['name']}_s{spec['seed']}"
        curves[key] = read_rows(Path(cfg.out_dir) / "metrics.jsonl")
        summary = summarize(curves[key], cfg.eval_size) if curves[key] else {
            "final_acc": float("nan"), "skipped": 0}
        start = (spec["length"], spec["sigma"])
        if start not in starts:  # the SFT checkpoint by this run's engine (its dial included)
            starts[start] = engine_accuracy(cfg, sft[spec["length"]]["checkpoint"])
        sft_acc = starts[start]
        results.append({**spec, "key": key, "sft_acc": sft_acc, **summary, **outcome,
                        "gain": summary["final_acc"] - sft_acc})
    total_s = time.perf_counter() - t_start
    load = os.getloadavg()
    size = args.size
    header = (f"# Long-answer study ({'quick' if args.quick else args.config})\n\n"
              f"Task running_sum_L, engine {size['precision']} + logit noise sigma, device "
              f"{size['device']}, model {size['model']}, RL {cfgs[0].prompts_per_step} prompts x "
              f"{cfgs[0].group_size}, lr {cfgs[0].lr:g}, {cfgs[0].steps} steps, eval "
              f"{cfgs[0].eval_size} prompts every {cfgs[0].eval_every} steps. SFT (seed 0): " +
              ", ".join(f"L={n}: {s['steps']} steps, accuracy at T = 1 {s['accuracy']:.3f}"
                        for n, s in sft.items()) +
              f". Runs: {runs_s:.0f} s with {workers} workers; total {total_s:.0f} s (load "
              f"average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}).")
    text = write_tables(out, results, header)
    if any(r["group"] == "phase" for r in results):
        phase, grid = phase_table(results, specs, size)
        text += f"\n## Phase diagram (collapse: mean Δ acc < -{COLLAPSE_DROP:g})\n\n" + phase
        (out / "results.md").write_text(text)
        plot_phase(out, grid, size)
    plot_curves(out, results, curves)
    (out / "summary.json").write_text(json.dumps(
        {"config": "quick" if args.quick else args.config, "sft": sft, "runs_s": runs_s,
         "total_s": total_s, "workers": workers, "load_average_end": load,
         "results": results, "configs": {r["key"]: dataclasses.asdict(c)
                                         for r, c in zip(results, cfgs)}}, indent=2))
    print()
    print(text)
    print(f"wrote {out / 'results.md'}, {out / 'curves.png'}"
          + (f", {out / 'phase.png'}" if (out / "phase.png").exists() else ""))
    return results


if __name__ == "__main__":
    main()
