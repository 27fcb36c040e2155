"""Acceptance run of the trainer: SFT, then MiniRL, on 2-digit addition, on a small CPU.

The criterion (the trainer issue): *on a 2-core CPU, SFT followed by MiniRL on 2-digit addition
raises held-out exact-match accuracy by at least 15 points over the SFT checkpoint within 15
minutes of RL; report the curve and the tokens/s.*

What it does:

1. **SFT** (``train(TrainConfig(mode="sft", ...))``) for a fixed number of steps, chosen so the
   checkpoint sits at a moderate accuracy (RL needs room). Its wall time is reported separately
   and not counted in the RL budget.
2. **RL** (``train(TrainConfig(mode="rl", estimator="minirl", init=<SFT checkpoint>, ...))``): the
   registered MiniRL estimator, unmodified; the rollout engine in bf16 (as in production, so the
   training-inference correction has something to correct). The run is driven in chunks of
   ``--eval-every`` steps through the trainer's exact resume, so a wall-clock guard can stop it
   before ``--rl-budget-min`` is exceeded; the RL minutes reported are the wall time of every
   ``train`` call together (model set-up, rollouts, updates, evaluations, checkpoints).
3. **Evaluation**: the trainer's ``eval_accuracy`` on its held-out split (``--eval-size``
   distinct prompts from ``eval_seed``; training prompts never come from it), every
   ``--eval-every`` RL steps, near-greedy, by the same bf16 engine. The SFT checkpoint and the
   final RL checkpoint are also re-evaluated here, prompt by prompt, on the same split with the
   same engine, which gives the paired standard error of the improvement. Standard errors are
   binomial, ``sqrt(p (1 - p) / n)``.
4. Output: a table of the curve (step, RL seconds, train reward, eval accuracy ± SE, tokens/s) on
   stdout; ``curve.png``, ``summary.json`` and the two runs' ``metrics.jsonl`` under ``--out``.

Tokens/s counts every real token (prompt and response) of a step's batch, divided by the step's
wall time (rollout, old-logprob pass, updates and, on evaluation steps, the evaluation).

Run it with one intra-op thread (``OMP_NUM_THREADS=1``; the script also calls
``torch.set_num_threads``): on a small shared CPU, two threads are several times slower.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/acceptance.py [--out runs/acceptance] [--rl-steps 1500]
        [--rl-budget-min 15] [--lr 3e-4] [--quick]

``--quick`` is a smoke check (tiny run, under a minute); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch

from tokenmdp.rl.config import TrainConfig
from tokenmdp.rl.rollout import RolloutEngine
from tokenmdp.rl.tasks import get_task
from tokenmdp.rl.trainer import build_model, train

MODEL = dict(d_model=64, n_layers=2, n_heads=4, n_experts=4, top_k=2, expert_hidden=64)
"""The tiny MoE of the acceptance run (shared by SFT and RL)."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/acceptance", help="output folder")
    p.add_argument("--quick", action="store_true", help="smoke check (< 1 min), numbers mean nothing")
    p.add_argument("--seed", type=int, default=0, help="seed of both runs")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--eval-size", type=int, default=500, help="held-out prompts")
    p.add_argument("--max-new-tokens", type=int, default=4, help="longest response (3 digits + EOS)")
    p.add_argument("--rollout-precision", default="bf16", help="rollout / evaluation engine numerics")
    g = p.add_argument_group("SFT")
    g.add_argument("--sft-steps", type=int, default=600, help="SFT steps")
    g.add_argument("--sft-lr", type=float, default=3e-3, help="SFT learning rate")
    g.add_argument("--sft-prompts", type=int, default=64, help="demonstrations per SFT step")
    g = p.add_argument_group("RL")
    g.add_argument("--estimator", default="minirl", help="registry estimator of the RL stage")
    g.add_argument("--rl-steps", type=int, default=1500, help="RL steps (at most; see the budget)")
    g.add_argument("--rl-budget-min", type=float, default=15.0,
                   help="stop RL before its wall time would pass this many minutes")
    g.add_argument("--lr", type=float, default=3e-4, help="RL learning rate")
    g.add_argument("--prompts-per-step", type=int, default=16, help="RL prompts per step")
    g.add_argument("--group-size", type=int, default=8, help="responses per prompt")
    g.add_argument("--eval-every", type=int, default=100, help="RL steps between evaluations")
    args = p.parse_args(argv)
    if args.quick:
        args.eval_size, args.sft_steps, args.rl_steps, args.eval_every = 100, 60, 20, 10
        args.prompts_per_step, args.group_size = 8, 4
        if args.out == p.get_default("out"):
            args.out = "runs/acceptance_quick"
    return args


def binomial_se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1.0 - p), 0.0) / n)


@torch.no_grad()
def per_prompt_correct(cfg: TrainConfig, checkpoint: Path, step: int) -> np.ndarray:
    """Correct (1) / wrong (0) per held-out prompt for the model in ``checkpoint``: the trainer's
    evaluation (same split, engine precision, temperature and generator seed ``eval_seed +
    step``), kept prompt by prompt so that two checkpoints can be compared pairwise."""
    task = get_task(cfg.task)
    model = build_model(cfg, task.tokenizer.vocab_size)
    model.load_state_dict(torch.load(checkpoint, map_location=cfg.device, weights_only=True)["model"])
    engine = RolloutEngine(model, precision=cfg.rollout_precision)
    eval_set = task.eval_split(cfg.eval_size, cfg.eval_seed)
    gen = torch.Generator(device=cfg.device).manual_seed(cfg.eval_seed + step)
    batch = engine.generate([task.tokenizer.encode(ex.prompt) for ex in eval_set],
                            max_new_tokens=cfg.max_new_tokens, eos_id=task.tokenizer.EOS,
                            generator=gen, temperature=cfg.eval_temperature)
    return np.array([task.is_correct(ex, r) for ex, (_, r) in zip(eval_set, batch.sequences())],
                    dtype=float)


def run_sft(args, out: Path) -> tuple[TrainConfig, list[dict], float]:
    cfg = TrainConfig(mode="sft", task="addition", steps=args.sft_steps,
                      prompts_per_step=args.sft_prompts, lr=args.sft_lr,
                      max_new_tokens=args.max_new_tokens, eval_every=max(args.sft_steps // 6, 1),
                      eval_size=args.eval_size, rollout_precision=args.rollout_precision,
                      seed=args.seed, out_dir=str(out / "sft"), checkpoint_every=0, **MODEL)
    t0 = time.perf_counter()
    rows = train(cfg)
    return cfg, rows, time.perf_counter() - t0


def run_rl(args, out: Path, init: Path) -> tuple[TrainConfig, list[dict], list[tuple[int, float]], str]:
    """RL in chunks of ``eval_every`` steps (exact resume); stops before the budget would be
    exceeded. Returns the config, the rows, ``(last step, wall seconds)`` per chunk, and why it
    stopped."""
    base = TrainConfig(mode="rl", task="addition", estimator=args.estimator, init=str(init),
                       rollout_precision=args.rollout_precision, lr=args.lr,
                       prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                       max_new_tokens=args.max_new_tokens, steps=args.rl_steps,
                       eval_every=args.eval_every, eval_size=args.eval_size, seed=args.seed,
                       out_dir=str(out / "rl"), checkpoint_every=0, **MODEL)
    budget = args.rl_budget_min * 60.0
    rows, chunks, elapsed, stop = [], [], 0.0, "all steps done"
    for end in range(args.eval_every, args.rl_steps + args.eval_every, args.eval_every):
        end = min(end, args.rl_steps)
        if chunks:
            worst = max(wall / (s - s0) for (s0, _), (s, wall) in zip([(0, 0.0)] + chunks, chunks))
            if elapsed + 1.25 * worst * (end - chunks[-1][0]) > budget:
                stop = f"budget guard: the next chunk would end past {args.rl_budget_min:g} min"
                break
        cfg = dataclasses.replace(base, steps=end, resume=bool(chunks))
        t0 = time.perf_counter()
        rows += train(cfg)
        wall = time.perf_counter() - t0
        elapsed += wall
        chunks.append((end, wall))
        print(f"  RL step {end:5d}  {elapsed / 60:5.2f} min  eval {rows[-1].get('eval_accuracy')}",
              flush=True)
    return base, rows, chunks, stop


def curve_table(rows: list[dict], chunks: list[tuple[int, float]], n_eval: int) -> list[dict]:
    """One line per chunk (each ends with an evaluation): RL seconds at its end (the measured wall
    of the ``train`` calls so far), and train reward, tokens/s, training-inference KL and entropy
    over the chunk's steps."""
    out, elapsed, first = [], 0.0, 0
    for end, wall in chunks:
        window = [r for r in rows if first <= r["step"] < end]
        elapsed += wall
        acc = window[-1]["eval_accuracy"]
        out.append({"step": end, "rl_s": elapsed,
                    "train_reward": float(np.mean([w["reward"] for w in window])),
                    "eval_accuracy": acc, "eval_se": binomial_se(acc, n_eval),
                    "tokens_per_s": sum(w["tokens"] for w in window) / sum(w["time_s"] for w in window),
                    "train_infer_kl_k3": float(np.mean([w["train_infer_kl_k3"] for w in window])),
                    "entropy": float(np.mean([w["entropy"] for w in window]))})
        first = end
    return out


def plot(path: Path, sft_acc: float, curve: list[dict], rows: list[dict], n_eval: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    t = [0.0] + [c["rl_s"] / 60 for c in curve]
    acc = [sft_acc] + [c["eval_accuracy"] for c in curve]
    se = [binomial_se(a, n_eval) for a in acc]
    ax[0].errorbar(t, acc, yerr=se, marker="o", capsize=3, label="held-out accuracy (± SE)")
    ax[0].axhline(sft_acc, color="grey", ls=":", label="SFT checkpoint")
    ax[0].axhline(sft_acc + 0.15, color="red", ls="--", label="SFT + 15 points")
    ax[0].set(xlabel="RL wall time (min)", ylabel="exact-match accuracy", title="held-out accuracy")
    ax[0].legend(fontsize=8)
    steps = np.array([r["step"] + 1 for r in rows])
    reward = np.array([r["reward"] for r in rows])
    k = max(len(reward) // 50, 1)
    smooth = np.convolve(reward, np.ones(k) / k, mode="valid")
    ax[1].plot(steps, reward, alpha=0.25, lw=0.5, label="train reward (T = 1)")
    ax[1].plot(steps[k - 1:], smooth, label=f"moving mean ({k} steps)")
    ax[1].set(xlabel="RL step", ylabel="mean reward", title="train reward")
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n = args.eval_size

    print(f"SFT: {args.sft_steps} steps ...", flush=True)
    sft_cfg, sft_rows, sft_s = run_sft(args, out)
    sft_ckpt = Path(sft_cfg.out_dir) / "checkpoint.pt"
    sft_acc = sft_rows[-1]["eval_accuracy"]
    print(f"SFT: {sft_s:.1f} s, held-out accuracy {sft_acc:.3f} ± {binomial_se(sft_acc, n):.3f} "
          f"(trainer's eval, n = {n})", flush=True)

    print(f"RL: {args.estimator}, up to {args.rl_steps} steps, budget {args.rl_budget_min:g} min ...",
          flush=True)
    rl_cfg, rl_rows, chunks, stop = run_rl(args, out, sft_ckpt)
    rl_s = sum(w for _, w in chunks)
    rl_steps = chunks[-1][0]
    curve = curve_table(rl_rows, chunks, n)

    # paired re-evaluation of the two checkpoints on the same prompts
    c_sft = per_prompt_correct(dataclasses.replace(rl_cfg, steps=rl_steps), sft_ckpt, 0)
    c_rl = per_prompt_correct(dataclasses.replace(rl_cfg, steps=rl_steps),
                              Path(rl_cfg.out_dir) / "checkpoint.pt", rl_steps)
    diff = c_rl - c_sft
    paired_se = float(diff.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    final = curve[-1]["eval_accuracy"]
    best = max(curve, key=lambda c: c["eval_accuracy"])
    tokens = sum(r["tokens"] for r in rl_rows)
    train_only = [r["tokens_per_s"] for r in rl_rows if "eval_accuracy" not in r]

    print()
    print(f"{'step':>6} {'RL s':>7} {'reward':>7} {'eval acc':>13} {'tok/s':>7} {'KL k3':>9} {'entropy':>7}")
    print(f"{0:6d} {0.0:7.1f} {'':>7} {sft_acc:6.3f} ±{binomial_se(sft_acc, n):.3f} {'':>7} {'':>9} {'':>7}"
          "   (SFT checkpoint)")
    for c in curve:
        print(f"{c['step']:6d} {c['rl_s']:7.1f} {c['train_reward']:7.3f} {c['eval_accuracy']:6.3f} "
              f"±{c['eval_se']:.3f} {c['tokens_per_s']:7.0f} {c['train_infer_kl_k3']:9.2e} "
              f"{c['entropy']:7.3f}")
    gain = final - sft_acc
    passed = bool(gain >= 0.15 and rl_s <= args.rl_budget_min * 60)
    summary = {
        "criterion": "final RL held-out accuracy >= SFT + 0.15 within the RL budget",
        "passed": passed,
        "sft": {"steps": args.sft_steps, "seconds": sft_s, "accuracy": sft_acc,
                "se": binomial_se(sft_acc, n), "accuracy_reevaluated": float(c_sft.mean()),
                "config": dataclasses.asdict(sft_cfg)},
        "rl": {"steps": rl_steps, "seconds": rl_s, "minutes": rl_s / 60, "stopped": stop,
               "final_accuracy": final, "final_se": binomial_se(final, n),
               "final_accuracy_reevaluated": float(c_rl.mean()),
               "best_accuracy": best["eval_accuracy"], "best_se": best["eval_se"],
               "best_step": best["step"], "gain_points": 100 * gain,
               "gain_paired_se_points": 100 * paired_se,
               "tokens": tokens, "tokens_per_s": tokens / rl_s,
               "tokens_per_s_median_train_step": float(np.median(train_only)) if train_only else None,
               "config": {**dataclasses.asdict(rl_cfg), "steps": rl_steps}},
        "eval_size": n, "curve": curve, "torch_threads": torch.get_num_threads(),
        "load_average_end": os.getloadavg(),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot(out / "curve.png", sft_acc, curve, rl_rows, n)
    print()
    print(f"SFT  {args.sft_steps} steps, {sft_s:.1f} s: accuracy {sft_acc:.3f} ± "
          f"{binomial_se(sft_acc, n):.3f} (re-evaluated {c_sft.mean():.3f})")
    print(f"RL   {rl_steps} steps, {rl_s / 60:.2f} min ({stop}): final {final:.3f} ± "
          f"{binomial_se(final, n):.3f} (re-evaluated {c_rl.mean():.3f}), best {best['eval_accuracy']:.3f}"
          f" ± {best['eval_se']:.3f} at step {best['step']}")
    print(f"gain {100 * gain:+.1f} points (paired SE {100 * paired_se:.1f});  tokens/s {tokens / rl_s:.0f} "
          f"over the whole RL time, median {summary['rl']['tokens_per_s_median_train_step'] or 0:.0f} "
          "on steps without evaluation")
    print(f"criterion (+15 points within {args.rl_budget_min:g} min): {'PASS' if passed else 'FAIL'}"
          + ("  (--quick: a smoke check, the numbers mean nothing)" if args.quick else ""))
    print("load average at the end (1 / 5 / 15 min): {:.1f} / {:.1f} / {:.1f}".format(*os.getloadavg()))
    print(f"wrote {out / 'summary.json'}, {out / 'curve.png'}")
    return summary


if __name__ == "__main__":
    main()
