"""Time and peak memory of building an exact MDP and its J and ∇J, 10^3 .. 10^7 sequences.

The pass of values down the prefix tree (:mod:`tokenmdp.exact.world.ground_truth`) is compared, in
the same run, with a straightforward per-sequence Python loop (sum the token log-probs of each
response, weight by its probability and reward, backpropagate) on the sizes where the loop
finishes in time. Per size: the MDP's build (its reward table included), the tabular policy's
initialization (separately: a seeded ``randn`` of ``states × V`` logits), ``J`` + ``∇J``
(``objective`` then ``gradient``; the median of 5 calls after one warm-up, wall and CPU time)
and the minor page faults of one such call. Target (issue 17): build + J + ∇J <= 1 s at
1.1·10^7 sequences on one thread. Last, 1.1·10^8 sequences under a 24 GiB budget: refused from
the closed-form count, with the time the refusal took.

Each size runs in a fresh subprocess so that its peak resident memory is its own, under
``TOKENMDP_MEMORY_BUDGET=24G`` (the budget guards the enumerated batch, which J and ∇J do not
need).
Usage: ``python benchmarks/exact_scaling.py [--loop-max-sequences N] [--lengths 3 4 5 6 7]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from tokenmdp.exact import TabularPolicy, TokenMDP, gradient, objective
from tokenmdp.exact.world.rewards import RandomTable

VOCAB = 11            # b = 10 non-EOS tokens: sum_{k<=L} 10^k sequences
LENGTHS = (3, 4, 5, 6, 7)  # 1.1e3 .. 1.1e7 sequences
BUDGET = "24G"
TARGET_S = 1.0          # build + J + ∇J at 1.1e7 sequences


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def loop_gradient(mdp: TokenMDP, policy: TabularPolicy) -> torch.Tensor:
    """The baseline: one Python iteration per sequence (and per token)."""
    J = policy.table.new_zeros(())
    for i, (prompt, response) in enumerate(mdp.responses()):
        p_idx = mdp.prompts.index(prompt)
        logp = policy.table.new_zeros(())
        for t, tok in enumerate(response):
            s = mdp.state_index(torch.tensor([p_idx]), torch.tensor([response[:t]],
                                dtype=torch.long).view(1, t))
            logp = logp + torch.log_softmax(policy.table[s[0]], -1)[tok]
        J = J + mdp.prompt_probs[p_idx] * logp.exp() * mdp.rewards[i]
    (g,) = torch.autograd.grad(J, [policy.table])
    return g.reshape(-1)


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def run_one(max_len: int, with_loop: bool) -> dict:
    base_rss = peak_rss_mb()
    t0 = time.perf_counter()
    mdp = TokenMDP(VOCAB, max_len, RandomTable(seed=0))
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    policy = TabularPolicy(mdp, generator=torch.Generator().manual_seed(0))
    init_s = time.perf_counter() - t0
    walls, cpus, faults = [], [], []
    for _ in range(6):                      # one warm-up, then 5 timed calls
        f0, c0, t0 = minor_faults(), time.process_time(), time.perf_counter()
        J = objective(mdp, policy)
        g = gradient(mdp, policy)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        faults.append(minor_faults() - f0)
    out = {"sequences": mdp.num_sequences, "states": mdp.num_states, "build_s": build_s,
           "init_s": init_s, "exact_s": statistics.median(walls[1:]),
           "exact_cpu_s": statistics.median(cpus[1:]), "faults": int(statistics.median(faults[1:])),
           "J": float(J.detach()), "peak_mb": peak_rss_mb() - base_rss}
    if with_loop:
        t0 = time.perf_counter()
        g_loop = loop_gradient(mdp, policy)
        out["loop_s"] = time.perf_counter() - t0
        out["max_abs_diff"] = float((g_loop - g).abs().max())
    return out


def refusal(max_len: int) -> dict:
    """Build an MDP past the budget: the error and how long refusing took."""
    t0 = time.perf_counter()
    try:
        TokenMDP(VOCAB, max_len, RandomTable(seed=0))
    except ValueError as err:
        return {"refused": True, "seconds": time.perf_counter() - t0, "message": str(err)}
    return {"refused": False, "seconds": time.perf_counter() - t0, "message": ""}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--loop", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--loop-max-sequences", type=int, default=12_000,
                        help="run the Python-loop baseline up to this many sequences")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads")
    parser.add_argument("--skip-refusal", action="store_true",
                        help="do not try the 1.1e8-sequence MDP")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS),
                        help="maximum response lengths L to time (10^L sequences and fewer)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.one is not None:
        print(json.dumps(run_one(args.one, args.loop)))
        return
    print(f"{'sequences':>10} {'states':>9} {'build s':>8} {'init s':>7} {'J+∇J s':>8} "
          f"{'cpu s':>7} {'faults':>7} {'peak MB':>8} {'loop s':>8} {'speed-up':>9} "
          f"{'max|Δ|':>9}")
    env = {**os.environ, "TOKENMDP_MEMORY_BUDGET": BUDGET}
    largest = None
    for L in args.lengths:
        n = sum((VOCAB - 1) ** k for k in range(L + 1))
        cmd = [sys.executable, __file__, "--one", str(L), "--threads", str(args.threads)]
        if n <= args.loop_max_sequences:
            cmd.append("--loop")
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True,
                                      env=env).stdout)
        loop = (f"{r['loop_s']:8.2f} {r['loop_s'] / r['exact_s']:8.0f}x {r['max_abs_diff']:9.1e}"
                if "loop_s" in r else f"{'—':>8} {'—':>9} {'—':>9}")
        print(f"{r['sequences']:>10} {r['states']:>9} {r['build_s']:8.3f} {r['init_s']:7.3f} "
              f"{r['exact_s']:8.4f} {r['exact_cpu_s']:7.4f} {r['faults']:>7} "
              f"{r['peak_mb']:8.0f} {loop}")
        largest = r
    if largest is not None:
        total = largest["build_s"] + largest["exact_s"]
        at_size = largest["sequences"] >= 11_111_111
        verdict = ("ok" if total <= TARGET_S else "MISS") if at_size else "not at that size"
        print(f"build + J + ∇J at {largest['sequences']:,} sequences: {total:.3f} s (policy "
              f"initialization {largest['init_s']:.3f} s apart); target <= {TARGET_S:g} s at "
              f"11,111,111: {verdict}")
    if not args.skip_refusal:
        os.environ["TOKENMDP_MEMORY_BUDGET"] = BUDGET
        r = refusal(8)
        verdict = "refused" if r["refused"] else "NOT refused"
        print(f"111,111,111 sequences under a {BUDGET} budget: {verdict} in {r['seconds']:.4f} s: "
              f"{r['message']}")


if __name__ == "__main__":
    main()
