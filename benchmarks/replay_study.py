"""Routing replay and the training-inference correction on the tiny MoE: a small-scale replication
of the qualitative findings of Zheng et al. (2025), "Stabilizing Reinforcement Learning with LLMs:
Formulation and Practices" (arXiv 2512.01374, MiniRL).

Runs (all from one shared SFT checkpoint, same RL seeds, a low-precision rollout engine so that
the inference policy μ differs from the training policy π_old, 2-digit addition):

* **on-policy** (``minibatches=1``, one update per rollout): ``minirl`` vs ``minirl_no_is`` (no
  training-inference IS correction) vs ``minirl_len_norm`` (length normalization). Paper: MiniRL
  with the correction is the most stable; without it training collapses; length normalization is
  stable but worse.
* **off-policy** (``minibatches`` N = 2, 4, 8: N updates per rollout, updates 2..N are stale),
  MiniRL with routing replay ``none`` / ``r2`` / ``r3``. Paper: off-policy needs routing replay
  (with the clipping MiniRL has) to stay stable; R2 is better at small off-policiness (N = 2),
  R3 at larger (N = 4, 8).

Per run it reports the final and best held-out accuracy (the trainer's ``eval_accuracy``, with its
binomial standard error), the mean train reward over the last quarter of the steps, the drop of
the smoothed train reward from its peak to the end (a collapse shows here), the mean
training-inference KL (``train_infer_kl_k1`` / ``_k3``, KL(μ ‖ π_old) per token), the routing
mismatch between the engines, the clip fraction, the mean and largest gradient norm (before
clipping), the final token entropy, skipped (non-finite) updates, and the wall time. It writes
``results.md``, ``results.csv``, ``curves.png`` (train reward, held-out accuracy and
training-inference KL per group) and every run's ``metrics.jsonl`` under ``--out``.

Configurations:

* ``--config cpu`` — the tiny MoE on the CPU, 12 runs x 2 seeds x 250 steps, sized to finish in
  under 20 minutes on a 2-core machine with ``--workers 2`` (one single-threaded run per core;
  measured 12 minutes on a shared 2-core machine);
* ``--config gpu`` — a plain scale-up (wider, deeper model, more experts, bigger batches,
  ``device=cuda``), sized by estimate for about 8 minutes on one H200 with ``--workers 4``:
  **not measured** (written without access to a GPU);
* ``--quick`` — a smoke check of the whole pipeline (under a minute); its numbers mean nothing.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/replay_study.py --config cpu [--workers 2] [--seeds 0 1]
        [--precision fp8] [--steps 250] [--out runs/replay_study]
    OMP_NUM_THREADS=1 python benchmarks/replay_study.py --quick

``--sft-checkpoint PATH`` reuses an SFT checkpoint of the same model shape instead of training
one (its path is recorded in the results).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

CONFIGS = {
    "cpu": dict(
        model=dict(d_model=64, n_layers=2, n_heads=4, n_experts=4, top_k=2, expert_hidden=64),
        device="cpu", sft=dict(prompts_per_step=64, lr=3e-3, target=0.25, check=50, max_steps=1500),
        rl=dict(steps=250, prompts_per_step=16, group_size=8, lr=3e-4, eval_every=50,
                eval_size=300),
        workers=2, precision="fp8", seeds=(0, 1)),
    "gpu": dict(  # unmeasured: a plain scale-up for one H200
        model=dict(d_model=256, n_layers=4, n_heads=8, n_experts=8, top_k=2, expert_hidden=256),
        device="cuda", sft=dict(prompts_per_step=256, lr=1e-3, target=0.25, check=50, max_steps=3000),
        rl=dict(steps=300, prompts_per_step=64, group_size=16, lr=1e-4, eval_every=50,
                eval_size=1000),
        workers=4, precision="fp8", seeds=(0,)),
    "quick": dict(
        model=dict(d_model=32, n_layers=2, n_heads=2, n_experts=4, top_k=2, expert_hidden=32),
        device="cpu", sft=dict(prompts_per_step=16, lr=3e-3, target=0.25, check=5, max_steps=10),
        rl=dict(steps=3, prompts_per_step=4, group_size=4, lr=3e-4, eval_every=3, eval_size=20),
        workers=2, precision="fp8", seeds=(0,)),
}
"""Sizes per configuration: model, SFT stage (until a target held-out accuracy), RL stage (shared by
every run), workers, engine precision, RL seeds."""

ON_POLICY = ("minirl", "minirl_no_is", "minirl_len_norm")
MINIBATCHES = (2, 4, 8)
REPLAYS = ("none", "r2", "r3")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", choices=("cpu", "gpu"), default="cpu", help="sizes (see docstring)")
    p.add_argument("--quick", action="store_true", help="smoke check (< 1 min), numbers mean nothing")
    p.add_argument("--out", default=None, help="output folder (default runs/replay_study[_<config>])")
    p.add_argument("--workers", type=int, default=None, help="runs in parallel (default: per config)")
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="RL seeds, each run once per seed (default: per config)")
    p.add_argument("--precision", default=None,
                   help="rollout engine numerics: bf16, fp16 or fp8 (default: per config)")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default: per config)")
    p.add_argument("--lr", type=float, default=None, help="RL learning rate (default: per config)")
    p.add_argument("--sft-checkpoint", default=None, help="reuse this SFT checkpoint")
    p.add_argument("--only", nargs="+", default=None,
                   help="run only these run names (e.g. onpolicy_minirl offpolicy_n4_r3)")
    p.add_argument("--max-new-tokens", type=int, default=4, help="longest response")
    args = p.parse_args(argv)
    args.size = CONFIGS["quick" if args.quick else args.config]
    if args.seeds is None:
        args.seeds = list(args.size["seeds"])
    if args.out is None:
        args.out = "runs/replay_study" + ("_quick" if args.quick else
                                          "" if args.config == "cpu" else f"_{args.config}")
    return args


# ---------------------------------------------------------------------------------- runs
def run_specs(args) -> list[dict]:
    """Every run: name, group, seed and the TrainConfig fields that differ between runs."""
    specs = []
    for est in ON_POLICY:
        specs += [{"name": f"onpolicy_{est}", "group": "on-policy (N=1)", "seed": seed,
                   "label": est, "estimator": est, "minibatches": 1, "replay": "none"}
                  for seed in args.seeds]
    for n in MINIBATCHES:
        for replay in REPLAYS:
            specs += [{"name": f"offpolicy_n{n}_{replay}", "group": f"off-policy N={n}",
                       "seed": seed, "label": f"minirl {replay}", "estimator": "minirl",
                       "minibatches": n, "replay": replay} for seed in args.seeds]
    if args.only:
        unknown = set(args.only) - {s["name"] for s in specs}
        if unknown:
            raise SystemExit(f"--only: unknown run names {sorted(unknown)}")
        specs = [s for s in specs if s["name"] in args.only]
    return specs


def rl_config(args, spec: dict, init: str):
    from tokenmdp.rl.config import TrainConfig

    size = args.size
    rl = {**size["rl"], **({"steps": args.steps} if args.steps else {}),
          **({"lr": args.lr} if args.lr else {})}
    return TrainConfig(mode="rl", task="addition", estimator=spec["estimator"],
                       replay=spec["replay"], minibatches=spec["minibatches"],
                       rollout_precision=args.precision or size["precision"], init=init,
                       seed=spec["seed"], device=size["device"], max_new_tokens=args.max_new_tokens,
                       out_dir=str(Path(args.out) / "runs" / f"{spec['name']}_s{spec['seed']}"),
                       checkpoint_every=0, deterministic=size["device"] == "cpu",
                       **rl, **size["model"])


def _worker(cfg) -> dict:
    """One run in its own process, one intra-op thread; a diverged run is a result, not an error."""
    import torch

    from tokenmdp.rl.run_state import NonFiniteError
    from tokenmdp.rl.trainer import train

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    error = None
    try:
        train(cfg)
    except NonFiniteError as err:
        error = str(err)
    return {"wall_s": time.perf_counter() - t0, "error": error}


def run_all(cfgs: list, workers: int, specs: list[dict], *, width: int = 24) -> list[dict]:
    """Every run in a pool of ``workers`` spawned processes (one intra-op thread each: spawn
    starts a clean interpreter, with no inherited OpenMP / torch thread state); one line per
    finished run, its name padded to ``width``."""
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        with ProcessPoolExecutor(max_workers=workers,
                                 mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_worker, cfg) for cfg in cfgs]
            outcomes = []
            for spec, fut in zip(specs, futures):
                outcomes.append(fut.result())
                error = outcomes[-1]["error"]
                print(f"  {spec['name']:{width}s} seed {spec['seed']}: "
                      f"{outcomes[-1]['wall_s']:6.1f} s{'  ' + error if error else ''}", flush=True)
    finally:
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
    return outcomes


def train_sft(args) -> tuple[str, float, float, int]:
    """SFT in chunks of ``check`` steps (exact resume) until the held-out accuracy (the RL runs'
    split and engine) reaches ``target``, or ``max_steps``: a starting point with room for RL,
    whatever the model size. Returns the checkpoint, seconds, its accuracy and steps."""
    from tokenmdp.rl.config import TrainConfig
    from tokenmdp.rl.trainer import train

    size, sft = args.size, dict(args.size["sft"])
    target, check, max_steps = sft.pop("target"), sft.pop("check"), sft.pop("max_steps")
    cfg = TrainConfig(mode="sft", task="addition", **sft, max_new_tokens=args.max_new_tokens,
                      eval_every=check, eval_size=size["rl"]["eval_size"],
                      rollout_precision=args.precision or size["precision"], seed=0,
                      device=size["device"], out_dir=str(Path(args.out) / "sft"), checkpoint_every=0,
                      **size["model"])
    t0 = time.perf_counter()
    for end in range(check, max_steps + 1, check):
        rows = train(dataclasses.replace(cfg, steps=end, resume=end > check))
        acc = rows[-1]["eval_accuracy"]
        print(f"  SFT step {end}: held-out accuracy {acc:.3f}", flush=True)
        if acc >= target:
            break
    return str(Path(cfg.out_dir) / "checkpoint.pt"), time.perf_counter() - t0, acc, end


def reused_sft_accuracy(args, path: str) -> tuple[float | None, int | None]:
    """The held-out accuracy a reused SFT checkpoint's own run logged last (``metrics.jsonl``
    next to it), when that run evaluated on this study's split with this study's engine."""
    import torch

    saved = torch.load(path, map_location="cpu", weights_only=True)["config"]
    want = {"eval_size": args.size["rl"]["eval_size"], "eval_seed": 1234, "task": "addition",
            "rollout_precision": args.precision or args.size["precision"],
            "max_new_tokens": args.max_new_tokens}
    evals = [r for r in read_rows(Path(path).parent / "metrics.jsonl") if "eval_accuracy" in r]
    if any(saved.get(k) != v for k, v in want.items()) or not evals:
        return None, None
    return evals[-1]["eval_accuracy"], evals[-1]["step"] + 1


# ---------------------------------------------------------------------------------- summaries
def _smooth(x: np.ndarray, k: int) -> np.ndarray:
    k = max(min(k, len(x)), 1)
    return np.convolve(x, np.ones(k) / k, mode="valid")


def summarize(rows: list[dict], n_eval: int) -> dict:
    def mean(key, part=rows):
        vals = [r[key] for r in part if r.get(key) is not None]
        return float(np.mean(vals)) if vals else float("nan")

    evals = [(r["step"] + 1, r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
    last = rows[-max(len(rows) // 4, 1):]
    reward = np.array([r["reward"] for r in rows])
    smooth = _smooth(reward, max(len(rows) // 10, 1))
    norms = [r["grad_norm"] for r in rows if r.get("grad_norm") is not None]
    final = evals[-1][1] if evals else float("nan")
    best = max(evals, key=lambda e: e[1]) if evals else (0, float("nan"))
    return {"steps": len(rows), "final_acc": final,
            "final_se": math.sqrt(final * (1 - final) / n_eval) if evals else float("nan"),
            "best_acc": best[1], "best_step": best[0], "reward_last": mean("reward", last),
            "reward_drop": float(smooth.max() - smooth[-1]) if len(smooth) else float("nan"),
            "kl_k1": mean("train_infer_kl_k1"), "kl_k3": mean("train_infer_kl_k3"),
            "routing_mismatch": mean("routing_mismatch"), "clip_fraction": mean("clip_fraction"),
            "grad_norm": float(np.mean(norms)) if norms else float("nan"),
            "grad_norm_max": float(np.max(norms)) if norms else float("nan"),
            "entropy_last": mean("entropy", last),
            "skipped": int(sum(r.get("skipped_updates", 0) for r in rows))}


COLUMNS = [("group", "group", "{}"), ("run", "label", "{}"), ("seed", "seed", "{}"),
           ("steps", "steps", "{}"), ("final acc", "final_acc", "{:.3f}"), ("± SE", "final_se", "{:.3f}"),
           ("best acc", "best_acc", "{:.3f}"), ("@step", "best_step", "{}"),
           ("reward last 1/4", "reward_last", "{:.3f}"), ("reward drop", "reward_drop", "{:.3f}"),
           ("TI-KL k1", "kl_k1", "{:.2e}"), ("TI-KL k3", "kl_k3", "{:.2e}"),
           ("routing mismatch", "routing_mismatch", "{:.4f}"), ("clip frac", "clip_fraction", "{:.4f}"),
           ("grad norm", "grad_norm", "{:.2f}"), ("max grad norm", "grad_norm_max", "{:.2f}"),
           ("entropy last", "entropy_last", "{:.3f}"), ("skipped", "skipped", "{}"),
           ("wall s", "wall_s", "{:.0f}"), ("error", "error", "{}")]


def _cell(fmt: str, value) -> str:
    if value is None:
        return "" if fmt == "{}" else "-"
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return fmt.format(value)


def write_tables(out: Path, results: list[dict], header: str) -> str:
    lines = [header, "", "| " + " | ".join(c[0] for c in COLUMNS) + " |",
             "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for r in results:
        lines.append("| " + " | ".join(_cell(fmt, r.get(key)) for _, key, fmt in COLUMNS) + " |")
    seeds = sorted({r["seed"] for r in results})
    if len(seeds) > 1:
        lines += ["", f"Mean ± standard deviation over seeds {seeds}:", "",
                  "| group | run | final acc | best acc | reward last 1/4 | reward drop | TI-KL k3 | "
                  "clip frac | grad norm | skipped |", "|---|---|---|---|---|---|---|---|---|---|"]
        for name in dict.fromkeys(r["name"] for r in results):
            rs = [r for r in results if r["name"] == name]

            def ms(key, fmt, rs=rs):
                v = np.array([r[key] for r in rs], dtype=float)
                return f"{fmt.format(v.mean())} ± {fmt.format(v.std(ddof=1))}"
            lines.append(f"| {rs[0]['group']} | {rs[0]['label']} | {ms('final_acc', '{:.3f}')} | "
                         f"{ms('best_acc', '{:.3f}')} | {ms('reward_last', '{:.3f}')} | "
                         f"{ms('reward_drop', '{:.3f}')} | {ms('kl_k3', '{:.1e}')} | "
                         f"{ms('clip_fraction', '{:.4f}')} | {ms('grad_norm', '{:.2f}')} | "
                         f"{sum(r['skipped'] for r in rs)} |")
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([c[1] for c in COLUMNS])
        for r in results:
            w.writerow([r.get(key) for _, key, _ in COLUMNS])
    return text


def plot(out: Path, results: list[dict], curves: dict[str, list[dict]], sft_acc: float | None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(r["group"] for r in results))
    fig, axes = plt.subplots(3, len(groups), figsize=(4.2 * len(groups), 9.5), squeeze=False)
    for j, group in enumerate(groups):
        for r in (r for r in results if r["group"] == group):
            rows = curves[r["key"]]
            if not rows:
                continue
            steps = np.array([x["step"] + 1 for x in rows])
            k = max(len(rows) // 10, 1)
            label = f"{r['label']} s{r['seed']}"
            line, = axes[0, j].plot(steps[k - 1:], _smooth(np.array([x["reward"] for x in rows]), k),
                                    label=label)
            ev = ([(0, sft_acc)] if sft_acc is not None else []) + \
                [(x["step"] + 1, x["eval_accuracy"]) for x in rows if "eval_accuracy" in x]
            if ev:
                axes[1, j].plot(*zip(*ev), marker="o", color=line.get_color(), label=label)
            axes[2, j].plot(steps[k - 1:], _smooth(np.array([x["train_infer_kl_k3"] for x in rows]), k),
                            color=line.get_color(), label=label)
        axes[0, j].set_title(group)
        axes[0, j].set_ylabel("train reward (moving mean)")
        axes[1, j].set_ylabel("held-out accuracy (step 0: SFT)")
        axes[2, j].set_ylabel("train-inference KL k3")
        axes[2, j].set_yscale("log")
        axes[2, j].set_xlabel("RL step")
        axes[0, j].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)
    plt.close(fig)


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------- main
def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch
    torch.set_num_threads(1)
    t_start = time.perf_counter()

    if args.sft_checkpoint:
        init, sft_s, sft_acc, sft_steps = args.sft_checkpoint, 0.0, None, None
        sft_acc, sft_steps = reused_sft_accuracy(args, init)
    else:
        print("SFT until the held-out accuracy reaches the target ...", flush=True)
        init, sft_s, sft_acc, sft_steps = train_sft(args)
        print(f"SFT: {sft_steps} steps, {sft_s:.1f} s, held-out accuracy {sft_acc:.3f}", flush=True)

    specs = run_specs(args)
    cfgs = [rl_config(args, spec, init) for spec in specs]
    workers = args.workers or args.size["workers"]
    print(f"{len(specs)} runs, {workers} in parallel, {cfgs[0].steps} steps each, engine "
          f"{cfgs[0].rollout_precision}, device {cfgs[0].device} ...", flush=True)
    t_runs = time.perf_counter()
    outcomes = run_all(cfgs, workers, specs)
    runs_s = time.perf_counter() - t_runs

    results, curves = [], {}
    for spec, cfg, outcome in zip(specs, cfgs, outcomes):
        key = f"{spec['name']}_s{spec['seed']}"
        rows = read_rows(Path(cfg.out_dir) / "metrics.jsonl")
        curves[key] = rows
        results.append({"key": key, "name": spec["name"], "group": spec["group"], "label": spec["label"],
                        "seed": spec["seed"], **summarize(rows, cfg.eval_size), **outcome})
    total_s = time.perf_counter() - t_start
    load = os.getloadavg()
    header = (f"# Replay study ({'quick' if args.quick else args.config})\n\n"
              f"Task addition, engine {cfgs[0].rollout_precision}, device {cfgs[0].device}, model "
              f"{args.size['model']}, RL {cfgs[0].prompts_per_step} prompts x {cfgs[0].group_size}, "
              f"lr {cfgs[0].lr:g}, {cfgs[0].steps} steps, eval {cfgs[0].eval_size} prompts every "
              f"{cfgs[0].eval_every} steps. SFT checkpoint {init}"
              + (f" ({sft_steps} steps, accuracy {sft_acc:.3f}, {sft_s:.0f} s)"
                 if sft_acc is not None else "")
              + f". Runs: {runs_s:.0f} s wall with {workers} workers; total {total_s:.0f} s (load average "
              f"at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} over 1 / 5 / 15 min).\n\n"
              "reward last 1/4: mean train reward (T = 1) over the last quarter of the steps; "
              "reward drop: peak minus final of the moving mean (10% of the steps) of the train "
              "reward; TI-KL: KL(mu || pi_old) per token; grad norm: before clipping.")
    text = write_tables(out, results, header)
    plot(out, results, curves, sft_acc)
    (out / "summary.json").write_text(json.dumps(
        {"config": "quick" if args.quick else args.config, "sft_checkpoint": init,
         "sft_accuracy": sft_acc, "sft_s": sft_s, "sft_steps": sft_steps, "runs_s": runs_s,
         "total_s": total_s,
         "workers": workers, "load_average_end": load, "results": results,
         "configs": {r["key"]: dataclasses.asdict(c) for r, c in zip(results, cfgs)}}, indent=2))
    print()
    print(text)
    print(f"wrote {out / 'results.md'}, {out / 'results.csv'}, {out / 'curves.png'}")
    return results


if __name__ == "__main__":
    main()
