"""Issue 28: held-out accuracy per *generated* token, tree rollouts against independent chains.

One SFT checkpoint (seed 0, ``--sft-steps`` steps on the task: a start with rewards to learn
from), then GRPO runs from it in two or more arms that differ only in how a prompt's group of
``G`` responses is sampled (the same prompts per step, estimator, learning rate, steps):

* **chains** — ``G`` independent responses per prompt (the trainer's default rollout);
* **tree** — one tree per prompt with ``G`` leaves (``--tree``, default ``fixed:0x2,4x2``: two
  chains from the prompt, each forked into two after 4 tokens), trained on the packed tree
  with ``grpo`` over the leaves (``--tree-estimator``);
* **chains_small** — ``--small-group`` independent responses per prompt (default 3): about the
  tree's generated tokens per step (equal generated tokens, fewer responses);
* optionally **tree_2** — the same trees with ``--tree-estimator-2`` (e.g. ``tree_value_diff``).

Equal leaves per step, so the tree arm generates fewer tokens per step (its shared prefixes are
sampled once). Per arm (mean ± SE over ``--seeds``): the held-out accuracy at the end (the
trainer's near-greedy evaluation, ``--eval-size`` prompts), its change from the SFT start, the
generated tokens of the whole run, the accuracy gain per 1000 generated tokens and, at **equal
generated tokens** (the tree arm's total of the same seed), the chains arm's accuracy read off its
evaluation curve (linear between evaluations). One diagnostic says why a tree can or cannot win
per generated token: at the SFT start, the reward correlation of two leaves that share response
tokens against two that share only the prompt, and the effective independent leaves of a group
(the design effect ``G / (1 + (G - 1) rho)``). Outputs under ``--out``: ``results.md``,
``results.json`` and every run's ``metrics.jsonl``.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/tree_study.py [--seeds 0 1 2 3 4] [--steps 150]
        [--tree fixed:0x2,4x2] [--tree-estimator-2 tree_value_diff] [--workers 1]
        [--out runs/tree_study]
    OMP_NUM_THREADS=1 python benchmarks/tree_study.py --quick     # a smoke check; means nothing
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import sys
import time
from pathlib import Path

import numpy as np

MODEL = dict(d_model=32, n_layers=2, n_heads=2, n_experts=4, top_k=2, expert_hidden=32)
"""The model of every run (the trainer's tiny MoE)."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke check, numbers mean nothing")
    p.add_argument("--out", default=None, help="output folder (default runs/tree_study[_quick])")
    p.add_argument("--task", default="running_sum_8", help="the trainer's task")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="RL seeds")
    p.add_argument("--workers", type=int, default=1, help="runs in parallel")
    p.add_argument("--sft-steps", type=int, default=470, help="SFT steps of the start")
    p.add_argument("--steps", type=int, default=150, help="RL steps of every run")
    p.add_argument("--eval-every", type=int, default=15, help="held-out evaluation every")
    p.add_argument("--last", type=int, default=3,
                   help="evaluations averaged into the final accuracy (and 3x steps of reward)")
    p.add_argument("--eval-size", type=int, default=200, help="held-out prompts")
    p.add_argument("--group-size", type=int, default=4, help="leaves (responses) per prompt")
    p.add_argument("--prompts-per-step", type=int, default=8, help="prompts per RL step")
    p.add_argument("--small-group", type=int, default=3,
                   help="G of the chains_small arm (about the tree's generated tokens; 0: none)")
    p.add_argument("--lr", type=float, default=1e-4, help="RL learning rate")
    p.add_argument("--tree", default="fixed:0x2,4x2", help="the tree arm's --rollout-tree")
    p.add_argument("--tree-estimator", default="grpo", help="the tree arm's estimator")
    p.add_argument("--tree-estimator-2", default=None,
                   help="a third arm: the same trees with this estimator (e.g. tree_value_diff)")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.sft_steps, args.steps, args.eval_every = [0], 4, 2, 1
        args.eval_size, args.prompts_per_step, args.workers = 8, 2, 1
    if args.small_group == 1 or args.small_group < 0:
        p.error("--small-group: must be 0 (no such arm) or >= 2")
    for name in ("workers", "sft_steps", "steps", "eval_every", "eval_size", "group_size",
                 "prompts_per_step", "last"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1")
    if args.out is None:
        args.out = "runs/tree_study" + ("_quick" if args.quick else "")
    return args


def base_config(args, mode: str):
    from tokenmdp.rl.config import TrainConfig

    length = int(args.task.rsplit("_", 1)[1]) if args.task.startswith("running_sum_") else 4
    return TrainConfig(mode=mode, task=args.task, max_new_tokens=length + 2,
                       eval_size=args.eval_size, checkpoint_every=0, **MODEL)


def train_sft(args) -> str:
    """The SFT start (reused when ``sft.json`` records the same settings); its checkpoint."""
    from tokenmdp.rl.trainer import train

    cfg = dataclasses.replace(base_config(args, "sft"), steps=args.sft_steps, seed=0, lr=3e-3,
                              warmup_steps=min(20, args.sft_steps), prompts_per_step=32,
                              eval_every=0, out_dir=str(Path(args.out) / "sft"), overwrite=True)
    record = Path(cfg.out_dir) / "sft.json"
    settings = json.loads(json.dumps(dataclasses.asdict(cfg)))
    checkpoint = str(Path(cfg.out_dir) / "checkpoint.pt")
    if record.exists() and Path(checkpoint).exists() and \
            json.loads(record.read_text())["settings"] == settings:
        print(f"  SFT: reused {cfg.out_dir}", flush=True)
        return checkpoint
    t0 = time.perf_counter()
    rows = train(cfg)
    record.write_text(json.dumps({"settings": settings, "accuracy": rows[-1]["eval_accuracy"]}))
    print(f"  SFT: {args.sft_steps} steps in {time.perf_counter() - t0:.0f} s, held-out "
          f"accuracy (near greedy): {rows[-1]['eval_accuracy']:.3f}", flush=True)
    return checkpoint


def arms(args) -> dict[str, dict]:
    """The RL fields of each arm."""
    out = {"chains": dict(estimator="grpo"),
           "tree": dict(estimator=args.tree_estimator, rollout_tree=args.tree)}
    if args.small_group:
        out["chains_small"] = dict(estimator="grpo", group_size=args.small_group)
    if args.tree_estimator_2:
        out["tree_2"] = dict(estimator=args.tree_estimator_2, rollout_tree=args.tree)
    return out


def run_config(args, arm: str, seed: int, init: str):
    return dataclasses.replace(
        base_config(args, "rl"), init=init, seed=seed, steps=args.steps, lr=args.lr,
        eval_every=args.eval_every, prompts_per_step=args.prompts_per_step, warmup_steps=5,
        zero_variance_groups="skip", overwrite=True,
        out_dir=str(Path(args.out) / "runs" / f"{arm}_seed{seed}"),
        **{"group_size": args.group_size, **arms(args)[arm]})


def _one(cfg) -> list[dict]:
    import torch

    from tokenmdp.rl.trainer import train

    torch.set_num_threads(1)
    return train(cfg)


def run_all(cfgs: list, workers: int) -> list[list[dict]]:
    if workers == 1:
        return [_one(c) for c in cfgs]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        return pool.map(_one, cfgs)


def generated(row: dict, cfg) -> float:
    """Response tokens the engine sampled in a step (the tree's nodes; every chain's tokens)."""
    if "generated_tokens" in row:
        return float(row["generated_tokens"])
    return row["response_length"] * cfg.prompts_per_step * cfg.group_size


def summarize(rows: list[dict], cfg, start: float, last: int) -> dict:
    """One run's curve (cumulative generated tokens, accuracy) and totals; ``final`` is the mean
    of the last ``last`` evaluations, ``reward`` the mean training reward of the last ``3 last``
    steps."""
    tokens, curve = 0.0, [(0.0, start)]
    for r in rows:
        tokens += generated(r, cfg)
        if r.get("eval_accuracy") is not None:
            curve.append((tokens, r["eval_accuracy"]))
    final = float(np.mean([a for _, a in curve[1:][-last:]]))
    return {"final": final, "gain": final - start, "generated": tokens, "curve": curve,
            "reward": float(np.mean([r["reward"] for r in rows[-3 * last:]])),
            "wall_s": sum(r["time_s"] for r in rows), "steps": len(rows),
            "shared": sum(r.get("shared_tokens", 0) for r in rows)}


def at_tokens(curve: list[tuple[float, float]], budget: float) -> float:
    """Accuracy on ``curve`` at ``budget`` generated tokens (linear between evaluations; the
    last value past the end)."""
    xs, ys = zip(*curve)
    return float(np.interp(budget, xs, ys))


def mean_se(values) -> str:
    v = np.asarray(values, dtype=float)
    se = v.std(ddof=1) / math.sqrt(v.size) if v.size > 1 else float("nan")
    return f"{v.mean():.3f} ± {se:.3f}"


def report(args, start: float, results: dict) -> str:
    lines = [f"# Tree rollouts against independent chains ({args.task})", "",
             f"SFT start: held-out accuracy {start:.3f} (near greedy, {args.eval_size} "
             f"prompts). RL, {args.steps} steps of {args.prompts_per_step} prompts, lr "
             f"{args.lr:g}, seeds {args.seeds}; tree {args.tree}. Mean ± SE over seeds.", "",
             f"acc: the mean of the last {args.last} evaluations; train reward: the mean "
             f"reward of the training samples (temperature 1) over the last {3 * args.last} "
             "steps; chains' acc at the arm's tokens: the chains arm's evaluation curve of the "
             "same seed read at this arm's generated tokens (linear between evaluations).", "",
             "| arm | estimator | G | acc | Δ acc | train reward | generated tokens | "
             "shared tokens | Δ acc per 1k gen. tokens | chains' acc at the arm's tokens | "
             "s/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    chains = results["chains"]
    for arm, runs in results.items():
        est = runs[0]["estimator"]
        per_k = [r["gain"] / r["generated"] * 1000 for r in runs]
        matched = [at_tokens(c["curve"], r["generated"]) for c, r in zip(chains, runs)]
        lines.append(f"| {arm} | {est} | {runs[0]['group_size']} | "
                     f"{mean_se([r['final'] for r in runs])} | "
                     f"{mean_se([r['gain'] for r in runs])} | "
                     f"{mean_se([r['reward'] for r in runs])} | "
                     f"{np.mean([r['generated'] for r in runs]):.0f} | "
                     f"{np.mean([r['shared'] for r in runs]):.0f} | {mean_se(per_k)} | "
                     f"{mean_se(matched)} | "
                     f"{np.mean([r['wall_s'] / r['steps'] for r in runs]):.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    init = train_sft(args)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from tokenmdp.rl.checkpoint import load_checkpoint
    start = _start_accuracy(args, init, load_checkpoint)
    keys = [(arm, seed) for arm in arms(args) for seed in args.seeds]
    cfgs = [run_config(args, arm, seed, init) for arm, seed in keys]
    all_rows = run_all(cfgs, args.workers)
    results: dict[str, list] = {}
    for (arm, _), cfg, rows in zip(keys, cfgs, all_rows):
        results.setdefault(arm, []).append({**summarize(rows, cfg, start, args.last),
                                            "estimator": cfg.estimator,
                                            "group_size": cfg.group_size})
    corr = leaf_correlation(args, init, load_checkpoint)
    text = report(args, start, results)
    text += (f"\nAt the SFT start ({args.tree}, 256 training prompts, temperature 1): leaf pass "
             f"rate {corr['pass_rate']:.3f}; reward correlation of two leaves sharing response "
             f"tokens {corr['rho_shared']:.3f}, sharing only the prompt {corr['rho_prompt']:.3f}; "
             f"effective independent leaves per group (design effect) "
             f"{corr['effective_leaves_tree']:.2f} for the tree against "
             f"{corr['effective_leaves_chains']:.2f} for {args.group_size} chains.\n")
    text += f"\nTotal wall time {time.perf_counter() - t0:.0f} s, --workers {args.workers}.\n"
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "start": start,
                                                  "leaf_correlation": corr,
                                                  "results": results}, indent=1))
    print(text)
    return 0


def leaf_correlation(args, checkpoint: str, load_checkpoint, prompts: int = 256) -> dict:
    """At the SFT start: the pass rate of the tree's leaves and the correlation of the rewards of
    two leaves of one tree that share response tokens (``shared``) or only the prompt
    (``prompt``), pooled over ``prompts`` training prompts (Pearson, over ordered pairs); and
    the design effect's effective leaves ``G / (1 + (G - 1) rho)`` with ``rho`` the mean over
    the tree's pairs (independent chains have ``rho`` = the ``prompt`` value)."""
    import torch

    from tokenmdp.rl.run_setup import build_engine, build_model
    from tokenmdp.rl.tasks import get_task

    cfg = dataclasses.replace(base_config(args, "rl"), rollout_tree=args.tree)
    task = get_task(cfg.task)
    model = build_model(cfg, task.tokenizer.vocab_size)
    model.load_state_dict(load_checkpoint(checkpoint, option="init")["model"])
    engine = build_engine(cfg, model)
    examples = task.sample(prompts, np.random.default_rng(99))
    out = engine.generate_tree([task.tokenizer.encode(ex.prompt) for ex in examples], args.tree,
                               max_new_tokens=cfg.max_new_tokens, eos_id=task.tokenizer.EOS,
                               generator=torch.Generator().manual_seed(99))
    pairs = {"shared": [], "prompt": []}
    for ex, tree in zip(examples, out.trees):
        reward = [float(task.is_correct(ex, r)) for r in tree.responses()]
        paths = [tree.path(leaf) for leaf in tree.leaves]
        for i in range(len(paths)):
            for j in range(len(paths)):
                if i != j:
                    kind = "shared" if paths[i][0] == paths[j][0] else "prompt"
                    pairs[kind].append((reward[i], reward[j]))
    rho = {k: float(np.corrcoef(np.array(v).T)[0, 1]) if len(v) > 2 else float("nan")
           for k, v in pairs.items()}
    n_pairs = {k: len(v) for k, v in pairs.items()}
    mean_rho = sum(rho[k] * n_pairs[k] for k in rho) / max(sum(n_pairs.values()), 1)
    G = args.group_size
    return {"pass_rate": float(np.mean([a for a, _ in pairs["shared"] + pairs["prompt"]])),
            **{f"rho_{k}": v for k, v in rho.items()},
            "effective_leaves_tree": G / (1 + (G - 1) * mean_rho),
            "effective_leaves_chains": G / (1 + (G - 1) * rho["prompt"])}


def _start_accuracy(args, checkpoint: str, load_checkpoint) -> float:
    """The SFT checkpoint's held-out accuracy by the RL runs' own evaluation (step 0)."""
    import torch

    from tokenmdp.rl.run_setup import build_engine, build_model
    from tokenmdp.rl.tasks import get_task

    cfg = base_config(args, "rl")
    task = get_task(cfg.task)
    model = build_model(cfg, task.tokenizer.vocab_size)
    model.load_state_dict(load_checkpoint(checkpoint, option="init")["model"])
    engine = build_engine(cfg, model)
    eval_set = task.eval_split(cfg.eval_size, cfg.eval_seed)
    batch = engine.generate([task.tokenizer.encode(ex.prompt) for ex in eval_set],
                            max_new_tokens=cfg.max_new_tokens, eos_id=task.tokenizer.EOS,
                            generator=torch.Generator().manual_seed(cfg.eval_seed),
                            temperature=cfg.eval_temperature)
    return float(np.mean([task.is_correct(ex, r) for ex, (_, r) in
                          zip(eval_set, batch.sequences())]))


if __name__ == "__main__":
    sys.exit(main())
