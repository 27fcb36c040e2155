"""The packed tree against its expanded paths: training tokens/s of one loss step, and equality.

Issue 28's target: *the packed tree's training step reaches at least 1.5x the tokens/s of its
expanded paths when the shared prefix is half the tokens; the packed-tree loss equals the
expanded one to 1e-12 in float64.*

Workload: ``--trees`` trees of ``--leaves`` leaves; every root-to-leaf path has ``--path-len``
tokens (prompt included). The first ``f * path-len`` tokens of every path are one shared trunk,
then the tree forks into its leaves, so the shared-prefix copies are the fraction ``f`` of the
expanded tokens (``f = 0.5``: half; the 4-token prompt is always shared, so ``f >= 4 /
path-len``). Trees are small against the row capacity (as the trainer's tasks' are): a tree is
never split across rows, so a tree of nearly a row's size would leave the packed rows half
empty (the table prints both fills). The expanded batch (one sequence per leaf) is packed by
first-fit decreasing into rows of ``--capacity`` tokens, as the trainer packs; the packed tree
puts each node once into rows of the same capacity (:func:`tokenmdp.tree_packing.pack_tree`).
Both batches hold the same training tokens: the expanded paths' tokens, which is what tokens/s
counts for both.

A step is what an update does: the forward pass (log-probs, replaying nothing), the GRPO loss
of the prepared expanded batch (:func:`tokenmdp.estimators.loss`; through the packed tree with
the gathered log-probs, :func:`tokenmdp.tree_training.packed_tree_outputs`) and the backward
pass. The model is the trainer's default (``TrainConfig()``: width 32, 2 layers, 4 experts,
top-2; vocabulary 32) in float32. Packing is done once per step before the timed part (like the
expanded batch's own packing) and timed separately. The two steps alternate, ``--repeats`` times
each, in one process; each figure is the median, the speedup the ratio of the medians. Then the
shared fraction is swept (``--sweep``). Last, in float64, the loss and parameter gradient of
GRPO, PPO, DAPO and GSPO through the packed tree against the expanded ones (max abs difference).

Run with one intra-op thread (``OMP_NUM_THREADS=1``; the script sets it too).

Usage: ``python benchmarks/tree_packing.py [--trees 64] [--leaves 8] [--path-len 32]
[--capacity 1024] [--repeats 7] [--sweep 0.125 0.25 0.75 0.9] [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmdp import estimators
from tokenmdp.model import MoETransformer
from tokenmdp.packing import pack_first_fit_decreasing
from tokenmdp.rl.config import TrainConfig
from tokenmdp.rl.run_setup import model_config
from tokenmdp.tree_packing import pack_tree
from tokenmdp.tree_training import packed_tree_outputs
from tokenmdp.trees import ResponseTree, batch_from_trees

VOCAB = 32
PROMPT_LEN = 4
TARGET_SPEEDUP, TARGET_EQUALITY = 1.5, 1e-12


def make_trees(num_trees: int, leaves: int, path_len: int, shared: float, seed: int):
    """Trees whose paths have ``path_len`` tokens, the first ``shared * path_len`` one trunk."""
    gen = torch.Generator().manual_seed(seed)
    trunk = max(int(round(shared * path_len)), PROMPT_LEN) - PROMPT_LEN  # response trunk
    branch = path_len - PROMPT_LEN - trunk
    if branch < 1:
        raise ValueError(f"--path-len {path_len} leaves no branch after a {shared:.0%} trunk")
    trees = []
    for _ in range(num_trees):
        prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=gen).tolist()
        parent = list(range(-1, trunk - 1))
        for _ in range(leaves):
            start = len(parent)
            parent += [trunk - 1 if trunk else -1] + list(range(start, start + branch - 1))
        tokens = torch.randint(0, VOCAB, (len(parent),), generator=gen).tolist()
        reward = torch.randint(0, 2, (leaves,), generator=gen).double().tolist()
        trees.append(ResponseTree(prompt, tokens, parent, reward=reward))
    return trees


def make_step(trees, capacity: int, dtype: torch.dtype, estimator, seed: int = 0):
    """The prepared expanded step (packed as the trainer packs) and its packed tree."""
    mus = [(-torch.rand(len(t.tokens), generator=torch.Generator().manual_seed(seed + k)))
           .tolist() for k, t in enumerate(trees)]
    batch = batch_from_trees(trees, behavior_logprobs=mus, dtype=dtype)
    batch = batch.replace(old_logprob=batch.behavior_logprob.clone(),
                          ref_logprob=batch.behavior_logprob.clone())
    step = estimators.prepare(pack_first_fit_decreasing(batch, capacity), estimator,
                              max_len=capacity)
    t0 = time.perf_counter()
    packed = pack_tree(step, capacity)
    return step, packed, time.perf_counter() - t0


def make_model(dtype: torch.dtype, seed: int = 0) -> MoETransformer:
    config = model_config(TrainConfig(), VOCAB)
    return MoETransformer(config, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def expanded_loss(model, step, estimator):
    logprobs = model.token_outputs(step).logprob_RC
    return estimators.loss(logprobs, step, estimator, metrics=False)[0]


def packed_loss(model, step, packed, estimator):
    logprobs = packed_tree_outputs(model, step, packed).logprob_RC
    return estimators.loss(logprobs, step, estimator, metrics=False)[0]


def timed_step(model, loss_fn) -> float:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    loss_fn().backward()
    return time.perf_counter() - t0


def measure(args, shared: float, model, estimator) -> dict:
    trees = make_trees(args.trees, args.leaves, args.path_len, shared, args.seed)
    step, packed, pack_s = make_step(trees, args.capacity, torch.float32, estimator)
    expanded_tokens = step.num_real_tokens
    times = {"expanded": [], "packed": []}
    timed_step(model, lambda: packed_loss(model, step, packed, estimator))      # warm-up
    timed_step(model, lambda: expanded_loss(model, step, estimator))
    for _ in range(args.repeats):
        times["packed"].append(timed_step(model, lambda: packed_loss(model, step, packed,
                                                                     estimator)))
        times["expanded"].append(timed_step(model, lambda: expanded_loss(model, step,
                                                                         estimator)))
    med = {k: statistics.median(v) for k, v in times.items()}
    leaves = packed.leaves_RC
    return {"shared": float((leaves * (leaves > 1)).sum()) / expanded_tokens,
            "expanded_tokens": expanded_tokens, "packed_tokens": packed.num_nodes,
            "expanded_rows": step.num_rows, "packed_rows": packed.num_rows,
            "expanded_fill": expanded_tokens / (step.num_rows * step.capacity),
            "packed_fill": packed.num_nodes / (packed.num_rows * packed.capacity),
            "expanded_s": med["expanded"], "packed_s": med["packed"], "pack_s": pack_s,
            "speedup": med["expanded"] / med["packed"]}


def equality(args) -> dict[str, tuple[float, float]]:
    """Max |loss| and max |gradient| differences, packed vs expanded, float64."""
    model = make_model(torch.float64, seed=1)
    params = list(model.parameters())
    trees = make_trees(min(args.trees, 4), min(args.leaves, 4), min(args.path_len, 32), 0.5,
                       args.seed + 1)
    out = {}
    for name in ("grpo", "ppo", "dapo", "gspo"):
        est = estimators.get(name)
        step, packed, _ = make_step(trees, min(args.capacity, 256), torch.float64, est)
        with torch.no_grad():   # old log-probs at the current weights (on-policy ratios)
            old = packed_tree_outputs(model, step, packed).logprob_RC
        step = step.replace(old_logprob=old)
        ref_loss = expanded_loss(model, step, est)
        ref_grad = torch.autograd.grad(ref_loss, params)
        loss = packed_loss(model, step, packed, est)
        grad = torch.autograd.grad(loss, params)
        out[name] = (float((loss - ref_loss).detach().abs()),
                     max(float((a - b).abs().max()) for a, b in zip(grad, ref_grad)))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", type=int, default=64)
    parser.add_argument("--leaves", type=int, default=8)
    parser.add_argument("--path-len", type=int, default=32)
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sweep", type=float, nargs="*", default=[0.125, 0.25, 0.75, 0.9])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, one repeat (a smoke run; the figures mean nothing)")
    args = parser.parse_args(argv)
    if args.quick:
        args.trees, args.leaves, args.path_len, args.capacity = 2, 4, 24, 128
        args.repeats, args.sweep = 1, [0.75]
    torch.set_num_threads(1)
    est = estimators.get("grpo")
    model = make_model(torch.float32)
    print(f"tiny MoE of TrainConfig() (vocab {VOCAB}), float32, {args.trees} trees x "
          f"{args.leaves} leaves, paths of {args.path_len} tokens, rows of {args.capacity}; "
          f"GRPO loss, forward + backward, median of {args.repeats}")
    print(f"{'shared':>7} {'expanded tok':>12} {'packed tok':>10} {'rows e/p':>8} "
          f"{'fill e/p':>9} {'expanded tok/s':>14} {'packed tok/s':>12} {'speedup':>8} "
          f"{'pack ms':>8}")
    results = []
    for shared in [0.5, *[f for f in args.sweep if f != 0.5]]:
        r = measure(args, shared, model, est)
        results.append(r)
        print(f"{r['shared']:7.2f} {r['expanded_tokens']:12d} {r['packed_tokens']:10d} "
              f"{r['expanded_rows']:>3d}/{r['packed_rows']:<4d} "
              f"{r['expanded_fill']:4.2f}/{r['packed_fill']:4.2f} "
              f"{r['expanded_tokens'] / r['expanded_s']:14.0f} "
              f"{r['expanded_tokens'] / r['packed_s']:12.0f} {r['speedup']:7.2f}x "
              f"{1e3 * r['pack_s']:8.1f}")
    half = results[0]
    verdict = "PASS" if half["speedup"] >= TARGET_SPEEDUP else "FAIL"
    print(f"{verdict} speedup at half shared: {half['speedup']:.2f}x (target >= "
          f"{TARGET_SPEEDUP}x)")
    worst = 0.0
    for name, (dl, dg) in equality(args).items():
        worst = max(worst, dl, dg)
        print(f"float64 {name:5s} max |loss diff| {dl:.2e}  max |grad diff| {dg:.2e}")
    verdict = "PASS" if worst <= TARGET_EQUALITY else "FAIL"
    print(f"{verdict} float64 equality: largest difference {worst:.2e} (target <= "
          f"{TARGET_EQUALITY:g})")


if __name__ == "__main__":
    main()
