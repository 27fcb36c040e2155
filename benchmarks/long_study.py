"""The trainer-world study with room for the mechanism (issue 19): long answers, an engine-mismatch
dial, seeds and standard errors. A small-scale test of the qualitative findings of Zheng et al.
(2025), "Stabilizing Reinforcement Learning with LLMs: Formulation and Practices" (arXiv
2512.01374, MiniRL).

``benchmarks/replay_study.py`` ran the same ablations on 2-digit addition, where a response has at
most 4 tokens and ``pi_old / mu`` stays within 1 ± 0.05: dropping the training-inference IS
correction did not collapse training there. Here:

* the task is :class:`~tokenmdp.rl.tasks.RunningSum` (``running_sum_L``: ``L`` answer
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
  vs ``minirl_len_norm`` (length normalization), evaluated near greedy (the start is at 100%:
  does RL keep it?);
* **room** (``room_s<sigma>_<estimator>``): the same trio at ``sigma`` in ``room_sigmas`` (0.25,
  the paper's small mismatch, and 1), evaluated by sampling at temperature 1, where the start is
  56% and 20% under those engines: RL can improve; ``room_steps`` steps;
* **off-policy** (``minibatches`` N = 2, 4, 8), MiniRL with routing replay none / R2 / R3;
* **phase diagram**: ``minirl_no_is`` and ``minirl`` on-policy over ``sigma`` x ``L``; a cell
  *collapses* when the mean over seeds of (final held-out accuracy - the SFT checkpoint's) is
  below ``-COLLAPSE_DROP`` (half the accuracy lost: a run whose samples all fail has zero
  advantages and never recovers).

Per run: final and best held-out accuracy, the train reward of the last quarter, the drop of the
smoothed train reward from its peak, the training-inference KL (k3), routing mismatch, clip
fraction, gradient norm (before clipping), entropy, skipped updates, wall time, and the
correction's diagnostics of :func:`tokenmdp.rl.update.blame_stats` over the first quarter of the
steps (``pi_old / mu`` at tokens ``pi_old`` gives less than 1/2 and at the others, the share of
the negative-advantage push on the former, the failed and passed answers holding one, the token
ESS, the sequence log-weight). Per setting: the mean ± standard error over seeds
(``std(ddof=1) / sqrt(k)``), beside the exact world's prediction at the row's ``L`` and ``sigma``
(``_long_study_exact.py``: the exact lattice moments with the engine's marginal, and a Monte
Carlo with the noise fresh per token as the trainer draws it). Outputs under ``--out``:
``results.md`` (the tables), ``results.csv`` (one row per run), ``curves.png`` (held-out
accuracy, entropy, training-inference KL, clip fraction and gradient norm per group, mean over
seeds), ``phase.png`` (the phase diagram), ``summary.json``, ``outcomes.json`` (what
``--report-only`` reads back) and every run's ``metrics.jsonl``. The code: ``_long_study_runs.py``
(sizes, grid, SFT, the pool), ``_long_study_report.py`` (tables, figures),
``_long_study_exact.py`` (the exact world).

Configurations (``--config``):

* ``cpu`` — the tiny MoE on the CPU, 84 runs (80 steps; the room group 120) with
  ``--workers 2``: measured 45 minutes of runs and 1.5 of SFT on a 2-core machine that two other
  jobs shared (load average about 5; an earlier run of the 66 runs without the room group took
  19 minutes on a less loaded one, which puts this one near 30 minutes on the two cores alone);
  a benchmark, not a test;
* ``gpu`` — a wider model, bigger batches and four lengths on one GPU, sized **by estimate, not
  measured** (written without a GPU) for about 8 minutes on one H200 with ``--workers 12`` (120
  runs of 100 steps, the room group 150, share the GPU, at an assumed 0.4 s per step);
  ``benchmarks/gpu_study.sh`` runs it with a time limit;
* ``--quick`` — a smoke check of the whole pipeline (about a minute, one worker); its numbers mean
  nothing.

Every RL run starts with ``_long_study_runs.RECIPE`` (issue 31: a 20-step learning-rate warm-up,
AdamW reset on purpose, groups of equal rewards skipped) and ``G = 16`` (chosen from the SFT
start's pass rate; ``rl_recipe.py`` measures it and the collapse rates with and without the
recipe). The figures below were measured **before** it, with ``G = 4`` x 8 prompts, no warm-up
and every group kept.

Measured (cpu configuration, seeds 0-2, mean ± SE of Δ acc; the tables, the phase diagram and the
reasons are in the documentation, *Benchmarks* › *Long answers with an engine-mismatch dial*):

* ``L = 64``, ``sigma = 1``, near greedy: ``minirl`` -0.81 ± 0.19, ``minirl_no_is``
  -0.31 ± 0.17, ``minirl_len_norm`` -0.59 ± 0.27; off-policy N >= 4 collapses for every replay;
* room, ``sigma = 0.25`` (KL 0.002 per token), from 0.56, seeds 0-4 (``--seeds 0 1 2 3 4 --only
  room_s0.25_minirl room_s0.25_minirl_no_is room_s0.25_minirl_len_norm --no-phase``): ``minirl``
  +0.10 ± 0.13, ``minirl_no_is`` -0.00 ± 0.16, ``minirl_len_norm`` +0.11 ± 0.13, each far below
  its start in one seed of five: a tie, as the exact world predicts there (seeds 0-2 alone read
  +0.25 ± 0.06, -0.15 ± 0.23, +0.02 ± 0.20, the paper's order);
* room, ``sigma = 1`` (KL 0.02-0.06), from 0.20, seeds 0-4 (``--only room_s1_minirl
  room_s1_minirl_no_is``): ``minirl_no_is`` +0.32 ± 0.13 (one seed of five collapsed),
  ``minirl`` +0.02 ± 0.13 (three collapsed); ``minirl_len_norm`` (seeds 0-2) -0.14 ± 0.06:
  against the paper, by 1.6 standard errors. The
  measured reason: 96-98% of wrong answers hold a token that ``pi_old`` gives less than 1/2,
  where ``pi_old / mu`` is about 0.2, so MiniRL's weight moves a third of the negative push from
  them onto the right tokens; in expectation that is exact (the exact world: cosine 1.000 with
  the gradient, against 0.90 without the weight), but the weight of each fresh draw is noisy on
  just those tokens, and the corrected gradient's signal-to-noise ratio is 0.44 times the
  uncorrected one (1.7 times with a mismatch fixed per state).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/long_study.py --config cpu [--workers 2] [--seeds 0 1 2]
        [--out runs/long_study]
    OMP_NUM_THREADS=1 python benchmarks/long_study.py --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _long_study_report import (  # noqa: E402
    COLLAPSE_DROP,
    early_diagnostics,
    exact_markdown,
    phase_table,
    plot_curves,
    plot_phase,
    write_tables,
)
from _long_study_runs import (  # noqa: E402
    CONFIGS,
    engine_accuracy,
    rl_config,
    run_all,
    run_specs,
    train_sft,
)
from replay_study import read_rows, summarize  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", choices=("cpu", "gpu"), default="cpu", help="sizes (see docstring)")
    p.add_argument("--quick", action="store_true", help="smoke check, numbers mean nothing")
    p.add_argument("--out", default=None, help="output folder (default runs/long_study[_<config>])")
    p.add_argument("--workers", type=int, default=None, help="runs in parallel (default: per config)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="RL seeds (default: per config)")
    p.add_argument("--steps", type=int, default=None,
                   help="RL steps of every run (default: per config and group)")
    p.add_argument("--no-phase", action="store_true", help="skip the phase diagram")
    p.add_argument("--no-room", action="store_true",
                   help="skip the group evaluated at temperature 1")
    p.add_argument("--no-exact", action="store_true",
                   help="skip the exact world's prediction per row")
    p.add_argument("--report-only", action="store_true",
                   help="no training: the report from the runs already in --out")
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


def exact_predictions(args, specs: list[dict]) -> tuple[dict, str]:
    """The exact world at every on-policy (L, σ) of ``specs`` (:mod:`_long_study_exact`): the
    exact lattice moments (marginal engine), and at the main grid's length, for ``minirl`` /
    ``minirl_no_is``, the Monte Carlo with the noise fresh per token as the trainer draws it
    (``fresh_groups`` groups)."""
    if args.no_exact:
        return {}, ""
    from _long_study_exact import exact_markdown_table, exact_row, fresh_noise_moments

    G = args.size["rl"]["group_size"]
    cells = sorted({(s["length"], s["sigma"]) for s in specs if s["minibatches"] == 1})
    rows = [exact_row(n, s, group_size=G) for n, s in cells]
    lines = ["", f"With the noise fresh per token (Monte Carlo, {args.size['fresh_groups']} groups "
             "of the trainer's G, ± jackknife SE): cosine / progress / SNR", "",
             "| L | σ | minirl (weight min(π/μ_ε, 5)) | minirl_no_is |", "|---|---|---|---|"]
    for row in rows:
        if row["L"] != args.size["length"]:
            continue
        cells_md = []
        for est in ("minirl", "minirl_no_is"):
            f = fresh_noise_moments(row["L"], row["sigma"], est, group_size=G,
                                    groups=args.size["fresh_groups"])
            row[est]["fresh"] = f
            cells_md.append(f"{f['cosine']:.3f} ± {f['cosine_se']:.3f} / {f['progress']:.3f} ± "
                            f"{f['progress_se']:.3f} / {f['snr']:.2e} ± {f['snr_se']:.1e}")
        lines.append(f"| {row['L']} | {row['sigma']:g} | " + " | ".join(cells_md) + " |")
    text = exact_markdown(rows, exact_markdown_table(rows)) + "\n".join(lines) + "\n"
    return {(r["L"], r["sigma"]): r for r in rows}, text


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    specs = run_specs(args)
    lengths = sorted({s["length"] for s in specs})
    workers = args.workers or args.size["workers"]
    if args.report_only:
        saved = json.loads((out / "outcomes.json").read_text())
        sft = {int(n): v for n, v in saved["sft"].items()}
        outcomes = [saved["outcomes"][f"{s['name']}_s{s['seed']}"] for s in specs]
        runs_s = saved["runs_s"]
        cfgs = [rl_config(args, spec, sft[spec["length"]]["checkpoint"]) for spec in specs]
    else:
        print(f"SFT per length {lengths} until the held-out accuracy reaches the target ...",
              flush=True)
        sft = {n: train_sft(args, n) for n in lengths}
        cfgs = [rl_config(args, spec, sft[spec["length"]]["checkpoint"]) for spec in specs]
        print(f"{len(specs)} runs, {workers} in parallel ...", flush=True)
        t_runs = time.perf_counter()
        outcomes = run_all(cfgs, workers, specs)
        runs_s = time.perf_counter() - t_runs
        (out / "outcomes.json").write_text(json.dumps(
            {"sft": sft, "runs_s": runs_s, "outcomes": {
                f"{s['name']}_s{s['seed']}": o for s, o in zip(specs, outcomes)}}, indent=2))

    results, curves, starts = [], {}, {}
    for spec, cfg, outcome in zip(specs, cfgs, outcomes):
        key = f"{spec['name']}_s{spec['seed']}"
        curves[key] = read_rows(Path(cfg.out_dir) / "metrics.jsonl")
        summary = summarize(curves[key], cfg.eval_size) if curves[key] else {
            "final_acc": float("nan"), "skipped": 0}
        start = (spec["length"], spec["sigma"], cfg.eval_temperature)
        if start not in starts:  # the SFT checkpoint by this run's engine (its dial included)
            starts[start] = engine_accuracy(cfg, sft[spec["length"]]["checkpoint"])
        sft_acc = starts[start]
        results.append({**spec, "key": key, "sft_acc": sft_acc, **summary, **outcome,
                        **early_diagnostics(curves[key]), "gain": summary["final_acc"] - sft_acc})
    exact, exact_text = exact_predictions(args, specs)
    total_s = time.perf_counter() - t_start
    load = os.getloadavg()
    size, c0 = args.size, cfgs[0]
    header = (f"# Long-answer study ({'quick' if args.quick else args.config})\n\n"
              f"Task running_sum_L, engine {size['precision']} + logit noise sigma, device "
              f"{size['device']}, model {size['model']}, RL {c0.prompts_per_step} prompts x "
              f"{c0.group_size}, lr {c0.lr:g} (warm-up {c0.warmup_steps} steps, AdamW "
              f"{c0.optimizer_state}, groups of equal rewards {c0.zero_variance_groups}), "
              f"{c0.steps} steps (room group "
              f"{size['room_steps']}, evaluated at T = 1), eval {c0.eval_size} prompts every "
              f"{c0.eval_every} steps. SFT (seed 0): " +
              ", ".join(f"L={n}: {s['steps']} steps, accuracy at T = 1 {s['accuracy']:.3f}"
                        for n, s in sft.items()) +
              f". Runs: {runs_s:.0f} s with {workers} workers; total {total_s:.0f} s (load "
              f"average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}).")
    text = write_tables(out, results, header, exact)
    if any(r["group"] == "phase" for r in results):
        phase, grid = phase_table(results, size)
        text += f"\n## Phase diagram (collapse: mean Δ acc < -{COLLAPSE_DROP:g})\n\n" + phase
        plot_phase(out, grid, size)
    text += exact_text
    (out / "results.md").write_text(text)
    plot_curves(out, results, curves)
    (out / "summary.json").write_text(json.dumps(
        {"config": "quick" if args.quick else args.config, "sft": sft, "runs_s": runs_s,
         "total_s": total_s, "workers": workers, "load_average_end": load,
         "exact": [dict(r) for r in exact.values()],
         "results": results, "configs": {r["key"]: dataclasses.asdict(c)
                                         for r, c in zip(results, cfgs)}}, indent=2))
    print()
    print(text)
    print(f"wrote {out / 'results.md'}, {out / 'curves.png'}"
          + (f", {out / 'phase.png'}" if (out / "phase.png").exists() else ""))
    return results


if __name__ == "__main__":
    main()
