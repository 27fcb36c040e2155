"""The trainer-world study on long answers (issues 19 and 31): the qualitative findings of Zheng
et al. (2025), "Stabilizing Reinforcement Learning with LLMs: Formulation and Practices" (arXiv
2512.01374, MiniRL), at toy scale, with engines that mismatch the trainer as engines do.

The task is :class:`~tokenmdp.rl.tasks.RunningSum` (``running_sum_L``: ``L`` answer digits,
then EOS; exact-match reward), ``L = 64`` unless a group says otherwise. The engines
(``_long_study_runs.ARMS``): an fp8 engine with one of the deterministic mismatch modes of
:class:`~tokenmdp.exact.EngineMismatch` — ``fixed``, ``heavy`` (rare large deviations) and
``growing`` (scales with the logits) — each set to the same per-token ``KL(μ ‖ π_old)`` at the
SFT start, about 1.3e-3, the paper's regime; and an fp4-weight engine with no logit
perturbation (the mismatch of numerics and routing alone). Every RL run starts from an SFT
checkpoint (seed 0, SFT until a target share of held-out answers *sampled at temperature 1* is
right; 0.5 unless a group says otherwise) with ``_long_study_runs.RECIPE`` (a 20-step warm-up,
AdamW reset, groups of equal rewards skipped) and ``G = 16``, and is evaluated by sampling at
temperature 1 (where the start is about 0.5: a run can gain or lose). A run *collapses* when its
final held-out accuracy is below half its start's.

Groups (``--groups``, in the order of priority in which they run):

* ``onpolicy`` — ``minirl``, ``minirl_no_is`` (no training-inference IS), ``minirl_len_norm``
  (length normalization) and ``minirl_seq_tis`` (the sequence-level truncated weight) at
  ``L = 64`` under the ``heavy``, ``growing`` and ``fixed`` engines, each beside the exact world's
  prediction at its length and KL (``_long_study_exact.engine_row``);
* ``sweep`` — off-policy MiniRL, N = 2 and 4 mini-batch updates per step, no replay, ``fixed``
  engine, over learning rate and gradient-norm clip (MiniRL's ratio clip stays its registry
  entry's, 0.2 / 0.27): the setting that keeps N = 2 and N = 4 alive is the configuration's
  ``rl_study`` learning rate and clip, which every group uses;
* ``offpolicy`` — N = 2, 4, 8 with routing replay none / R2 / R3, ``fixed`` engine;
* ``routing`` — the fp4 engine, N = 4, none / R2 / R3 (the R2/R3 question where routing is
  the mismatch);
* ``coldstart`` — MiniRL from three SFT starts of different quality (SFT stopped at three
  target accuracies), ``heavy`` engine, ten seeds each: collapse rates with Fisher's exact test,
  and whether the starts' accuracies converge;
* ``lengths`` — the four on-policy estimators at ``L = 16`` and ``L = 128`` (fewer steps and a
  smaller evaluation there; the configuration's ``long``), ``heavy`` engine.

Two controls run only when named (``_long_study_runs.CONTROLS``):

* ``optimizer`` — is AdamW what hides length normalization's cost? Plain SGD (no momentum, no
  gradient clip: the update is lr × the gradient), ``heavy`` engine, 120 steps: MiniRL and
  ``minirl_len_norm`` at the learning rate an SGD sweep of MiniRL picked (the 1/|y| scale and
  the direction), and ``minirl_len_norm`` at that rate times the answer's L + 1 tokens (the
  direction alone);
* ``convergence`` — the cold starts at 160 steps (five seeds each): do the starts end
  comparable?

Per run: start, final and best held-out accuracy, train reward of the last quarter, training-
inference KL (k3), routing mismatch, clip fraction, gradient norm, entropy, skipped updates,
wall time; the first quarter's KL, token ESS and spread of the sequence log-weight. Per row: the
mean ± standard error over seeds (``std(ddof=1) / sqrt(k)``), the collapse count; the
comparisons the findings rest on with Fisher's exact test of the collapse counts. Outputs under
``--out``: ``results.md``, ``results.csv`` (one row per run), ``curves.png`` (per group, mean
over seeds), ``summary.png`` (Δ accuracy per row, every seed), ``summary.json``,
``outcomes.json`` (every part's runs, timings and load; what ``--report-only`` and later parts
read back) and every run's ``metrics.jsonl``. The code: ``_long_study_runs.py`` (engines,
sizes, grid, SFT, the pool), ``_long_study_report.py`` (tables, tests, figures),
``_long_study_exact.py`` (the exact world).

Configurations (``--config``):

* ``cpu`` — the tiny MoE on the CPU, 40 RL steps per run (30 at ``L = 128``), five seeds (ten
  for the cold starts, three for the sweep), with ``--workers 2``; measured times and load in
  the documentation, *Benchmarks* › *Long answers*; a benchmark, not a test;
* ``gpu`` — a wider model, bigger batches and 100 steps, sized **by estimate, not measured**;
  ``benchmarks/gpu_study.sh`` runs it with a time limit;
* ``--quick`` — a smoke check of the whole pipeline (one seed, two steps); its numbers mean
  nothing.

The study before issue 31 (fresh logit noise per token, near-greedy evaluation, no warm-up,
G = 4, a phase diagram over the noise) is in the repository's history; its "measured reason"
for MiniRL's deficit (the noise of the fresh per-draw weight) was refuted by the marginal-weight
control (documentation, *Benchmarks* › *Long answers*).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/long_study.py --config cpu --workers 2 \
        [--groups onpolicy sweep ...] [--seeds 0 1 2] [--out runs/long_study]
    OMP_NUM_THREADS=1 python benchmarks/long_study.py --report-only [--out runs/long_study]
    OMP_NUM_THREADS=1 python benchmarks/long_study.py --calibrate 512   # the engines' KL
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
    collapsed,
    early_diagnostics,
    exact_markdown,
    plot_curves,
    plot_summary,
    write_tables,
)
from _long_study_runs import (  # noqa: E402
    ARMS,
    CONFIGS,
    CONTROLS,
    GROUPS,
    engine_accuracy,
    rl_config,
    run_all,
    run_specs,
    sft_starts,
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
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="RL seeds of every group (default: per config and group)")
    p.add_argument("--steps", type=int, default=None,
                   help="RL steps of every run (default: per config and group)")
    p.add_argument("--groups", nargs="+", default=None, choices=GROUPS + CONTROLS,
                   help="run (or report) only these groups (default: all but the controls "
                        f"{', '.join(CONTROLS)}, in this order)")
    p.add_argument("--only", nargs="+", default=None,
                   help="run only these run names (e.g. onpolicy_heavy_minirl offpolicy_n4_r3)")
    p.add_argument("--no-exact", action="store_true",
                   help="skip the exact world's prediction per on-policy row")
    p.add_argument("--report-only", action="store_true",
                   help="no training: the report from the runs already in --out (every group "
                        "with runs there, or those of --groups)")
    p.add_argument("--calibrate", type=int, default=None, metavar="PROMPTS",
                   help="no training: each engine's per-token KL(mu || pi_old) at the main SFT "
                        "start on PROMPTS held-out prompts (calibration.md)")
    args = p.parse_args(argv)
    args.size = CONFIGS["quick" if args.quick else args.config]
    if args.seeds:
        args.size = {**args.size, "seeds": tuple(args.seeds), "collapse_seeds": tuple(args.seeds),
                     "sweep_seeds": tuple(args.seeds)}
    args.seeds = list(args.size["seeds"])
    if args.out is None:
        args.out = "runs/long_study" + ("_quick" if args.quick else
                                        "" if args.config == "cpu" else f"_{args.config}")
    if (args.workers is not None and args.workers < 1) or (args.steps is not None and args.steps < 1):
        p.error("--workers, --steps: must be >= 1")
    return args


def exact_predictions(args, results: list[dict]) -> dict:
    """The exact world (:func:`_long_study_exact.engine_row`) at every (L, logit-mode engine) of
    the on-policy rows, its KL set to the mean first-quarter KL (k3) of those runs."""
    if args.no_exact:
        return {}
    import numpy as np
    from _long_study_exact import engine_row

    cells = {}
    for r in results:
        if r["group"].startswith("on-policy") and ARMS[r["arm"]]["mode"] != "none":
            cells.setdefault((r["length"], r["arm"]), []).append(r["early_train_infer_kl_k3"])
    out = {}
    for (length, arm), kls in sorted(cells.items()):
        a = ARMS[arm]
        t0 = time.perf_counter()
        out[(length, arm)] = engine_row(length, a["mode"], a["scale"], float(np.nanmean(kls)),
                                        group_size=args.size["rl"]["group_size"])
        print(f"  exact world L={length} {arm}: {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def calibrate(args, out: Path) -> str:
    """Each engine of ``ARMS`` (and the fp8 engine alone) at the main SFT start: the per-token
    ``KL(μ ‖ π_old)`` and ``χ²`` at the visited states, the sampled ``E[π_old/μ]`` and the tail
    share (``engine_mismatch.measure``: ``--calibrate`` prompts, one answer each at T = 1,
    seed 0); writes and returns ``calibration.md``."""
    import torch
    from engine_mismatch import markdown, measure

    from tokenmdp.exact import EngineMismatch
    from tokenmdp.rl.run_setup import build_model
    from tokenmdp.rl.tasks import get_task

    start = train_sft(args, args.size["length"])
    cfg = rl_config(args, run_specs(argparse.Namespace(**{**vars(args), "groups": ["onpolicy"],
                                                          "only": None}))[0], start["checkpoint"])
    task = get_task(cfg.task)
    model = build_model(cfg, task.tokenizer.vocab_size)
    model.load_state_dict(torch.load(start["checkpoint"], map_location=cfg.device,
                                     weights_only=True)["model"])
    prompts = [task.tokenizer.encode(ex.prompt)
               for ex in task.eval_split(args.calibrate, cfg.eval_seed)]
    engines = [("fp8 alone", args.size["precision"], EngineMismatch())] + [
        (name, a["precision"], EngineMismatch(a["mode"], a["scale"], a["fraction"]))
        for name, a in ARMS.items()]
    rows = [measure(model.eval(), task, cfg, precision, mm, prompts, 0)
            for _, precision, mm in engines]
    text = (f"# The study's engines at the SFT start (running_sum_{args.size['length']}, "
            f"{args.calibrate} held-out prompts, T = 1, seed 0)\n\nRows: " +
            ", ".join(name for name, _, _ in engines) + ".\n\n" + markdown(rows))
    (out / "calibration.md").write_text(text)
    return text


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch
    torch.set_num_threads(1)
    if args.calibrate:
        print(calibrate(args, out))
        return []
    t_start = time.perf_counter()
    specs = run_specs(args)
    workers = args.workers or args.size["workers"]
    saved_path = out / "outcomes.json"
    saved = json.loads(saved_path.read_text()) if saved_path.exists() else {
        "sft": {}, "parts": [], "outcomes": {}}
    if not args.report_only:
        print(f"SFT starts {sft_starts(specs)} (length, target accuracy at T = 1) ...", flush=True)
        for length, target in sft_starts(specs):
            saved["sft"][f"{length}_{target:g}"] = train_sft(args, length, target)
        cfgs = [rl_config(args, s, saved["sft"][f"{s['length']}_{s['target']:g}"]["checkpoint"])
                for s in specs]
        steps = sum(c.steps for c in cfgs)
        print(f"{len(specs)} runs ({steps} RL steps), {workers} in parallel ...", flush=True)
        t_runs, load0 = time.perf_counter(), os.getloadavg()
        outcomes = run_all(cfgs, workers, specs)
        saved["parts"].append({"groups": args.groups, "only": args.only, "runs": len(specs),
                               "rl_steps": steps, "seconds": time.perf_counter() - t_runs,
                               "workers": workers, "load_start": load0,
                               "load_end": os.getloadavg()})
        saved["outcomes"].update({f"{s['name']}_s{s['seed']}": o
                                  for s, o in zip(specs, outcomes)})
        saved_path.write_text(json.dumps(saved, indent=2))
    sft = saved["sft"]
    # the report covers every run of the folder (the controls too), or the groups named with
    # --report-only
    specs = run_specs(argparse.Namespace(**{**vars(args), "only": None, "groups": (
        args.groups if args.report_only and args.groups else GROUPS + CONTROLS)}))
    specs = [s for s in specs if f"{s['name']}_s{s['seed']}" in saved["outcomes"]]
    results, curves, starts = [], {}, {}
    for spec in specs:
        key = f"{spec['name']}_s{spec['seed']}"
        start = sft[f"{spec['length']}_{spec['target']:g}"]
        cfg = rl_config(args, spec, start["checkpoint"])
        curves[key] = read_rows(Path(cfg.out_dir) / "metrics.jsonl")
        summary = summarize(curves[key], cfg.eval_size) if curves[key] else {
            "final_acc": float("nan"), "skipped": 0}
        engine = (spec["length"], spec["target"], spec["arm"], cfg.eval_size, cfg.steps)
        if engine not in starts:  # the SFT checkpoint by this run's engine, at T = 1, with the
            # random numbers of the run's last evaluation
            starts[engine] = engine_accuracy(cfg, start["checkpoint"], step=cfg.steps)
        results.append({**spec, "key": key, "sft_acc": starts[engine], "sft_steps": start["steps"],
                        **summary, **saved["outcomes"][key], **early_diagnostics(curves[key]),
                        "gain": summary["final_acc"] - starts[engine]})
        results[-1]["collapsed"] = collapsed(results[-1])
    exact = exact_predictions(args, results)
    load = os.getloadavg()
    size, rl = args.size, {**args.size["rl"], **args.size["rl_study"]}
    parts = "; ".join(f"{p['runs']} runs / {p['rl_steps']} RL steps in {p['seconds']:.0f} s with "
                      f"{p['workers']} workers (load average {p['load_start'][0]:.1f} at the "
                      f"start, {p['load_end'][0]:.1f} / {p['load_end'][1]:.1f} / "
                      f"{p['load_end'][2]:.1f} at the end; groups {p['groups'] or 'all'})"
                      for p in saved["parts"])
    header = (f"# Long-answer study ({'quick' if args.quick else args.config})\n\n"
              f"Task running_sum_L, model {size['model']} on {size['device']}, RL "
              f"{rl['prompts_per_step']} prompts x G = {rl['group_size']}, warm-up "
              f"{rl['warmup_steps']} steps, AdamW {rl['optimizer_state']} (plain SGD where the "
              f"row says sgd), groups of equal "
              f"rewards {rl['zero_variance_groups']}, {rl['steps']} steps unless the row says, "
              f"held-out accuracy at T = {rl['eval_temperature']:g} every {rl['eval_every']} "
              f"steps. Engines: " + "; ".join(f"{k} {v}" for k, v in ARMS.items()) +
              ". SFT starts (seed 0): " +
              ", ".join(f"L={k.split('_')[0]} to {s['target']:g}: {s['steps']} steps, accuracy "
                        f"at T = 1 {s['accuracy']:.3f}" for k, s in sft.items()) +
              f". Parts: {parts}. Report {time.perf_counter() - t_start:.0f} s (load average "
              f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}).")
    text = write_tables(out, results, header, exact) + exact_markdown(exact)
    (out / "results.md").write_text(text)
    plot_curves(out, results, curves)
    plot_summary(out, results)
    (out / "summary.json").write_text(json.dumps(
        {"config": "quick" if args.quick else args.config, "sft": sft, "parts": saved["parts"],
         "exact": [dict(r) for r in exact.values()], "results": results,
         "configs": {r["key"]: dataclasses.asdict(rl_config(
             args, r, sft[f"{r['length']}_{r['target']:g}"]["checkpoint"])) for r in results}},
        indent=2))
    print()
    print(text)
    print(f"wrote {out / 'results.md'}, {out / 'curves.png'}, {out / 'summary.png'}")
    return results


if __name__ == "__main__":
    main()
