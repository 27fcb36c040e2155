"""Time and peak memory of the exact J and ∇J for tabular policies, 10^3 .. 10^6 sequences.

The level-by-level recursion of :mod:`tokenmdp.exact.ground_truth` is compared, in the same run,
with a straightforward per-sequence Python loop (sum the token log-probs of each response, weight
by its probability and reward, backpropagate) on the sizes where the loop finishes in time.

Each size runs in a fresh subprocess so that its peak resident memory is its own.
Usage: ``python benchmarks/exact_scaling.py [--loop-max-sequences N] [--lengths 3 4 5 6]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from tokenmdp.exact import TabularPolicy, TokenMDP, gradient, objective
from tokenmdp.exact.rewards import RandomTable

VOCAB = 11            # b = 10 non-EOS tokens: sum_{k<=L} 10^k sequences
LENGTHS = (3, 4, 5, 6)  # 1.1e3, 1.1e4, 1.1e5, 1.1e6 sequences


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


def run_one(max_len: int, with_loop: bool) -> dict:
    base_rss = peak_rss_mb()
    t0 = time.perf_counter()
    mdp = TokenMDP(VOCAB, max_len, RandomTable(seed=0))
    policy = TabularPolicy(mdp, generator=torch.Generator().manual_seed(0))
    build_s = time.perf_counter() - t0
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        J = objective(mdp, policy)
        g = gradient(mdp, policy)
        times.append(time.perf_counter() - t0)
    out = {"sequences": mdp.num_sequences, "states": mdp.num_states, "build_s": build_s,
           "exact_s": min(times), "J": float(J), "peak_mb": peak_rss_mb() - base_rss}
    if with_loop:
        t0 = time.perf_counter()
        g_loop = loop_gradient(mdp, policy)
        out["loop_s"] = time.perf_counter() - t0
        out["max_abs_diff"] = float((g_loop - g).abs().max())
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--loop", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--loop-max-sequences", type=int, default=12_000,
                        help="run the Python-loop baseline up to this many sequences")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS),
                        help="maximum response lengths L to time (10^L sequences and fewer)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.one is not None:
        print(json.dumps(run_one(args.one, args.loop)))
        return
    print(f"{'sequences':>10} {'states':>9} {'build s':>8} {'J+∇J s':>8} {'peak MB':>8} "
          f"{'loop s':>8} {'speed-up':>9} {'max|Δ|':>9}")
    for L in args.lengths:
        n = sum((VOCAB - 1) ** k for k in range(L + 1))
        cmd = [sys.executable, __file__, "--one", str(L), "--threads", str(args.threads)]
        if n <= args.loop_max_sequences:
            cmd.append("--loop")
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        loop = (f"{r['loop_s']:8.2f} {r['loop_s'] / r['exact_s']:8.0f}x {r['max_abs_diff']:9.1e}"
                if "loop_s" in r else f"{'—':>8} {'—':>9} {'—':>9}")
        print(f"{r['sequences']:>10} {r['states']:>9} {r['build_s']:8.3f} {r['exact_s']:8.4f} "
              f"{r['peak_mb']:8.0f} {loop}")


if __name__ == "__main__":
    main()
