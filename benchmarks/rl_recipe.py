"""Issue 31: does the RL recipe that does not start cold stop the long-answer study's collapses?

The plain on-policy MiniRL runs of the long-answer study (``long_study.py``: ``running_sum_64``,
the simulated-fp8 engine with the logit-noise dial ``sigma``, the study's model, learning rate and
SFT checkpoint), at ``sigma = 0`` and ``sigma = 1``, in two arms that differ only in the recipe:

* **cold** — the study's RL recipe before issue 31: ``G = 4`` responses for each of 8 prompts, a
  fresh AdamW at the full learning rate from the first step, groups of equal rewards kept (a step
  whose advantages are all 0 still moves the weights: AdamW's moments);
* **warm** — the recipe the study uses now (``_long_study_runs.RECIPE`` and the configuration's
  ``group_size``): a linear learning-rate warm-up, AdamW reset on purpose (as the frameworks
  start RL), groups of equal rewards skipped (a step left with none takes no optimizer update),
  and ``G = 16`` responses for each of 2 prompts (the same 32 samples a step).

Before the runs, the SFT checkpoint's pass rate: ``K`` samples at temperature 1 from each of
``P`` training prompts under each ``sigma``'s engine, the per-prompt count ``c`` of right answers,
and the chance that a group of ``G`` has no right answer, ``E_x C(K - c_x, G) / C(K, G)`` (the
unbiased estimate of ``E_x (1 - p_x)^G``; with one pass rate ``p`` for every prompt it would be
``(1 - p)^G``, which the prompts' spread raises).

A run **collapses** when its held-out accuracy (the study's on-policy evaluation: 100 prompts,
near greedy, by the run's engine) is 0 at each of its last ``--collapse-evals`` evaluations. Per
arm and ``sigma``: collapses out of seeds, Fisher's exact test (two-sided) between the arms, the
final accuracy and its change from the SFT start (mean ± SE over seeds), the fraction of groups
with equal rewards over the first 10 steps, the steps that took no update. Outputs under
``--out``: ``results.md``, ``results.json`` and every run's ``metrics.jsonl``.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/rl_recipe.py [--workers 2] [--seeds 0 1 2 3 4]
        [--steps 60] [--out runs/rl_recipe]
    OMP_NUM_THREADS=1 python benchmarks/rl_recipe.py --quick     # a smoke check; means nothing
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _long_study_report import mean_se  # noqa: E402
from _long_study_runs import (  # noqa: E402
    CONFIGS,
    RECIPE,
    base_config,
    engine_accuracy,
    run_all,
    train_sft,
)
from replay_study import read_rows  # noqa: E402

COLD = dict(warmup_steps=0, optimizer_state="reset", zero_variance_groups="keep", group_size=4,
            prompts_per_step=8)
"""The study's RL recipe before issue 31 (the trainer's defaults, G = 4 x 8 prompts)."""
EARLY_STEPS = 10
"""Steps over which the fraction of groups with equal rewards is averaged."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke check, numbers mean nothing")
    p.add_argument("--arms", nargs="+", default=["cold", "warm"],
                   choices=["cold", "warm", "warm_keep"], help="the recipes compared")
    p.add_argument("--report-only", action="store_true",
                   help="no training: the report from the runs already in --out")
    p.add_argument("--out", default=None, help="output folder (default runs/rl_recipe[_quick])")
    p.add_argument("--workers", type=int, default=2, help="runs in parallel")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="RL seeds")
    p.add_argument("--sigmas", type=float, nargs="+", default=[0.0, 1.0],
                   help="engine logit-noise dials")
    p.add_argument("--steps", type=int, default=60, help="RL steps of every run")
    p.add_argument("--eval-every", type=int, default=10, help="held-out evaluation every")
    p.add_argument("--collapse-evals", type=int, default=2,
                   help="a run collapses when its last this many evaluations are all 0")
    p.add_argument("--pass-prompts", type=int, default=64, help="prompts of the pass-rate check")
    p.add_argument("--pass-samples", type=int, default=32,
                   help="samples per prompt of the pass-rate check")
    args = p.parse_args(argv)
    for name in ("workers", "steps", "eval_every", "collapse_evals", "pass_prompts",
                 "pass_samples"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1")
    if any(s < 0 for s in args.sigmas) or any(s < 0 for s in args.seeds):
        p.error("--sigmas, --seeds: must be >= 0")
    args.size = CONFIGS["quick" if args.quick else "cpu"]
    if args.quick:
        args.seeds, args.sigmas, args.steps, args.eval_every = [0], [0.0, 1.0], 3, 1
        args.pass_prompts, args.pass_samples, args.workers = 4, 8, 1
    if args.out is None:
        args.out = "runs/rl_recipe" + ("_quick" if args.quick else "")
    return args


def arms(size: dict) -> dict[str, dict]:
    """The RL settings of each arm (on top of the configuration's ``rl`` block): ``cold``,
    ``warm`` and the ablation ``warm_keep`` (the warm recipe with the groups of equal rewards
    kept: whether the warm arm's survival is only the frozen weights of its skipped steps)."""
    warm = {**RECIPE, "group_size": size["rl"]["group_size"],
            "prompts_per_step": size["rl"]["prompts_per_step"]}
    return {"cold": COLD, "warm": warm, "warm_keep": {**warm, "zero_variance_groups": "keep"}}


def run_config(args, arm: str, sigma: float, seed: int, init: str):
    """The training configuration of one run: the study's on-policy MiniRL with ``arm``."""
    rl = {**args.size["rl"], **arms(args.size)[arm], "steps": args.steps,
          "eval_every": args.eval_every}
    name = f"{arm}_s{sigma:g}_seed{seed}"
    return dataclasses.replace(
        base_config(args, args.size["length"], "rl"), estimator="minirl", init=init, seed=seed,
        rollout_logit_noise=sigma, overwrite=True,
        out_dir=str(Path(args.out) / "runs" / name), **rl)


def all_fail_probability(correct: np.ndarray, samples: int, group_size: int) -> float:
    """``E_x C(K − c_x, G) / C(K, G)``: the unbiased estimate of the chance that ``G`` fresh
    samples of a prompt are all wrong, averaged over the prompts (``c_x`` right of ``K``)."""
    if group_size > samples:
        raise ValueError(f"group_size: {group_size} exceeds the {samples} samples per prompt")
    return float(np.mean([math.comb(samples - int(c), group_size) / math.comb(samples, group_size)
                          for c in correct]))


def pass_rates(args, init: str, sigma: float) -> dict:
    """The SFT checkpoint's right answers per training prompt at temperature 1 under the engine
    of ``sigma``; the mean pass rate and the chance of an all-wrong group at G = 4, 8, 16."""
    import torch

    from tokenmdp.rl.run_setup import build_engine, build_model
    from tokenmdp.rl.tasks import get_task

    cfg = run_config(args, "cold", sigma, 0, init)
    task = get_task(cfg.task)
    model = build_model(cfg, task.tokenizer.vocab_size)
    model.load_state_dict(torch.load(init, map_location=cfg.device, weights_only=True)["model"])
    engine = build_engine(cfg, model)
    exclude = frozenset(ex.prompt for ex in task.eval_split(cfg.eval_size, cfg.eval_seed))
    examples = task.sample(args.pass_prompts, np.random.default_rng(10_000), exclude=exclude)
    K = args.pass_samples
    repeated = [ex for ex in examples for _ in range(K)]
    with torch.no_grad():
        batch = engine.generate([task.tokenizer.encode(ex.prompt) for ex in repeated],
                                max_new_tokens=cfg.max_new_tokens, eos_id=task.tokenizer.EOS,
                                generator=torch.Generator(device=cfg.device).manual_seed(10_000),
                                temperature=1.0)
    right = np.array([task.is_correct(ex, r) for ex, (_, r) in zip(repeated, batch.sequences())])
    correct = right.reshape(len(examples), K).sum(axis=1)
    p = float(right.mean())
    return {"sigma": sigma, "pass_rate": p, "prompts_never_right": float(np.mean(correct == 0)),
            **{f"all_fail_G{G}": all_fail_probability(correct, K, G) for G in (4, 8, 16)
               if G <= K},
            **{f"uniform_G{G}": (1 - p) ** G for G in (4, 8, 16)}}


def summarize_run(rows: list[dict], collapse_evals: int) -> dict:
    """A run's outcome from its metrics rows (``collapsed`` per the module docstring)."""
    evals = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
    early = rows[:EARLY_STEPS]
    zero_reward = [r["step"] for r in rows if r["reward"] == 0]
    return {"final_acc": evals[-1] if evals else float("nan"),
            "collapsed": len(evals) >= collapse_evals and all(
                a == 0 for a in evals[-collapse_evals:]),
            "zero_std_early": float(np.mean([r["frac_reward_zero_std"] for r in early])),
            "all_zero_early": float(np.mean([r["frac_reward_all_zero"] for r in early])),
            "no_update_steps": sum(r.get("optimizer_steps", 1) == 0 for r in rows),
            "first_zero_reward_step": zero_reward[0] if zero_reward else None,
            "reward_last": float(np.mean([r["reward"] for r in rows[-max(len(rows) // 4, 1):]])),
            "entropy_last": float(np.mean([r["entropy"] for r in rows[-max(len(rows) // 4, 1):]]))}


def fisher_p(a: tuple[int, int], b: tuple[int, int]) -> float:
    """Two-sided Fisher exact test of ``(collapsed, runs)`` in two arms."""
    from scipy.stats import fisher_exact

    return float(fisher_exact([[a[0], a[1] - a[0]], [b[0], b[1] - b[0]]])[1])


def report(args, sft: dict, rates: list[dict], results: list[dict], runs_s: float,
           total_s: float, load: tuple) -> str:
    c = run_config(args, "cold", 0.0, 0, sft["checkpoint"])
    lines = [f"# RL recipe check ({'quick' if args.quick else 'cpu'})", "",
             f"On-policy minirl, task {c.task}, engine {c.rollout_precision} + logit noise σ, "
             f"model {args.size['model']}, lr {c.lr:g}, {args.steps} RL steps per run, held-out "
             f"accuracy on {c.eval_size} prompts near greedy every {args.eval_every} steps; "
             f"seeds {args.seeds}. SFT start (seed 0): {sft['steps']} steps, accuracy at T = 1 "
             f"{sft['accuracy']:.3f}. Runs {runs_s:.0f} s with {args.workers} workers, total "
             f"{total_s:.0f} s (load average at the end {load[0]:.1f} / {load[1]:.1f} / "
             f"{load[2]:.1f}).", "",
             "Arms: " + "; ".join(f"**{k}** {arms(args.size)[k]}" for k in args.arms) + ".", "",
             f"## The SFT start's pass rate (T = 1, {args.pass_prompts} prompts x "
             f"{args.pass_samples} samples)", "",
             "| σ | pass rate | prompts never right | P(all wrong) G=4 | G=8 | G=16 | "
             "(1-p)^4 | (1-p)^8 | (1-p)^16 |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rates:
        lines.append(f"| {r['sigma']:g} | {r['pass_rate']:.3f} | {r['prompts_never_right']:.3f} | "
                     + " | ".join(f"{r[f'all_fail_G{G}']:.3f}" if f"all_fail_G{G}" in r
                                  else "-" for G in (4, 8, 16)) + " | "
                     + " | ".join(f"{r[f'uniform_G{G}']:.3f}" for G in (4, 8, 16)) + " |")
    lines += ["", f"## Collapses (held-out accuracy 0 at the last {args.collapse_evals} "
              "evaluations)", "",
              "| σ | arm | collapsed | Fisher p vs cold | final acc | Δ acc vs SFT | "
              "equal-reward groups, first 10 steps | of them all wrong | steps without update "
              "| reward last 1/4 |", "|---|---|---|---|---|---|---|---|---|---|"]
    groups = {}
    for r in results:
        groups.setdefault((r["sigma"], r["arm"]), []).append(r)
    pooled = {arm: [0, 0] for arm in args.arms}
    for sigma in args.sigmas:
        counts = {arm: (sum(r["collapsed"] for r in groups[(sigma, arm)]),
                        len(groups[(sigma, arm)])) for arm in args.arms}
        for arm in args.arms:
            rs = groups[(sigma, arm)]
            pooled[arm][0] += counts[arm][0]
            pooled[arm][1] += counts[arm][1]
            p = fisher_p(counts["cold"], counts[arm]) if "cold" in counts and arm != "cold" \
                else None

            def pm(key, fmt, rs=rs):
                m, se = mean_se([x[key] for x in rs])
                return fmt.format(m) + ("" if math.isnan(se) else
                                        " ± " + fmt.replace("+", "").format(se))

            lines.append(f"| {sigma:g} | {arm} | {counts[arm][0]} / {counts[arm][1]} | "
                         f"{'-' if p is None else f'{p:.3f}'} | {pm('final_acc', '{:.3f}')} | "
                         f"{pm('gain', '{:+.3f}')} | {pm('zero_std_early', '{:.3f}')} | "
                         f"{pm('all_zero_early', '{:.3f}')} | {pm('no_update_steps', '{:.1f}')} "
                         f"| {pm('reward_last', '{:.3f}')} |")
    lines.append("")
    lines.append("Pooled over σ: " + ", ".join(
        f"{arm} {n} / {k}" for arm, (n, k) in pooled.items()) + " collapsed" + "".join(
        f"; Fisher p {arm} vs cold = {fisher_p(tuple(pooled['cold']), tuple(pooled[arm])):.3f}"
        for arm in args.arms if arm != "cold" and "cold" in pooled) + ".")
    lines += ["", "Per run: " + "; ".join(
        f"{r['arm']} σ={r['sigma']:g} seed {r['seed']}: final {r['final_acc']:.2f}"
        + (" (collapsed)" if r["collapsed"] else "")
        + (f", reward 0 first at step {r['first_zero_reward_step']}"
           if r["first_zero_reward_step"] is not None else "")
        for r in results) + "."]
    return "\n".join(lines) + "\n"


def outcomes_of(args, specs, cfgs, outcomes, sft) -> list[dict]:
    """Each run's spec, pool outcome and summary, with its start (the SFT checkpoint by the
    run's engine, near greedy) and the change from it."""
    starts, results = {}, []
    for spec, cfg, outcome in zip(specs, cfgs, outcomes):
        if spec["sigma"] not in starts:
            starts[spec["sigma"]] = engine_accuracy(cfg, sft["checkpoint"])
        summary = summarize_run(read_rows(Path(cfg.out_dir) / "metrics.jsonl"),
                                args.collapse_evals)
        results.append({**spec, **outcome, **summary, "sft_acc": starts[spec["sigma"]],
                        "gain": summary["final_acc"] - starts[spec["sigma"]]})
    return results


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    if args.report_only:                  # the arms, dials and seeds of the runs in --out
        saved = json.loads((out / "results.json").read_text())
        sft, rates, runs_s = saved["sft"], saved["pass_rates"], saved["runs_s"]
        total_s, load = saved["total_s"], saved["load_average_end"]
        specs = [{k: r[k] for k in ("name", "arm", "sigma", "seed")} for r in saved["results"]]
        outcomes = [{k: r[k] for k in ("wall_s", "error")} for r in saved["results"]]
        args.arms = list(dict.fromkeys(s["arm"] for s in specs))
        args.sigmas = list(dict.fromkeys(s["sigma"] for s in specs))
        args.seeds = list(dict.fromkeys(s["seed"] for s in specs))
    else:
        length = args.size["length"]
        print(f"SFT on running_sum_{length} until the held-out accuracy reaches the target ...",
              flush=True)
        sft = train_sft(args, length)
        rates = []
        for sigma in args.sigmas:
            rates.append(pass_rates(args, sft["checkpoint"], sigma))
            print(f"  pass rate at σ = {sigma:g}: {rates[-1]['pass_rate']:.3f}", flush=True)
        specs = [{"name": f"{arm}_s{sigma:g}", "arm": arm, "sigma": sigma, "seed": seed}
                 for sigma in args.sigmas for arm in args.arms for seed in args.seeds]
    cfgs = [run_config(args, s["arm"], s["sigma"], s["seed"], sft["checkpoint"]) for s in specs]
    if not args.report_only:
        print(f"{len(cfgs)} runs, {args.workers} in parallel ...", flush=True)
        t_runs = time.perf_counter()
        outcomes = run_all(cfgs, args.workers, specs)
        runs_s = time.perf_counter() - t_runs
    results = outcomes_of(args, specs, cfgs, outcomes, sft)
    if not args.report_only:
        total_s, load = time.perf_counter() - t0, os.getloadavg()
    text = report(args, sft, rates, results, runs_s, total_s, load)
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps(
        {"sft": sft, "pass_rates": rates, "results": results, "runs_s": runs_s,
         "total_s": total_s, "load_average_end": list(load),
         "arms": {arm: arms(args.size)[arm] for arm in args.arms},
         "configs": [dataclasses.asdict(c) for c in cfgs]}, indent=2))
    print()
    print(text)
    print(f"wrote {out / 'results.md'}")
    return results


if __name__ == "__main__":
    main()
