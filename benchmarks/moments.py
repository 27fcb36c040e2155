"""Exact moments of every registry estimator on an MDP with >= 10^4 sequences and G = 4.

For each estimator: the time of its exact mean, variance and bias (the exchangeability method:
``n · C(K+G−2, G−1)`` batches instead of ``C(n+G−1, G)``), the figures themselves, and how many
Monte Carlo batches would reach the same precision: ``N = tr Cov / (tol · ‖E ĝ‖)²`` batches bring
the standard error of the mean to ``tol`` relative to ``‖E ĝ‖``; with the Monte Carlo throughput
measured in the same run this gives the Monte Carlo time for 1% and for 1e-6 relative error.
The exact figures carry float64 round-off only (checked against enumeration in the tests).

Usage: ``python benchmarks/moments.py [--vocab 101 --max-len 2 --estimators a,b]``.
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenmdp import estimators as E
from tokenmdp.exact import TabularPolicy, TokenMDP, inference_copy, moments, stale_copy
from tokenmdp.exact.rewards import Parity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=101)
    parser.add_argument("--max-len", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--estimators", default=",".join(E.names()))
    parser.add_argument("--mc-batches", type=int, default=2048,
                        help="Monte Carlo batches timed for the throughput figure")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    mdp = TokenMDP(args.vocab, args.max_len, Parity(1))
    pi = TabularPolicy(mdp, generator=torch.Generator().manual_seed(0))
    old = stale_copy(mdp, pi, distance=0.5)
    mu = inference_copy(old, rounding="bf16", noise_std=0.2,
                        generator=torch.Generator().manual_seed(1))
    kw = dict(group_size=args.group_size, behavior=mu, old=old, reference=old)
    print(f"{mdp!r}; {mdp.num_states * mdp.vocab_size} parameters; G = {args.group_size}; "
          "stale + bf16/noisy inference engine")
    t0 = time.perf_counter()
    moments(mdp, pi, E.get("grpo"), method="monte_carlo", num_samples=args.mc_batches,
            generator=torch.Generator().manual_seed(0), **kw)
    mc_rate = args.mc_batches / (time.perf_counter() - t0)
    print(f"Monte Carlo throughput (grpo): {mc_rate:,.0f} batches/s")
    print(f"{'estimator':<16}{'exact s':>8}{'batches':>9}{'rel.bias':>10}{'cosine':>8}"
          f"{'tot.var':>10}{'N(1%)':>10}{'MC s(1%)':>10}{'N(1e-6)':>10}{'MC s(1e-6)':>11}")
    total = 0.0
    for name in [n.strip() for n in args.estimators.split(",") if n.strip()]:
        t0 = time.perf_counter()
        m = moments(mdp, pi, E.get(name), method="exact", **kw)
        dt = time.perf_counter() - t0
        total += dt
        scale = float(m.mean.norm()) ** 2
        n1 = m.total_variance / (1e-2 ** 2 * scale) if scale > 0 else float("nan")
        n6 = m.total_variance / (1e-6 ** 2 * scale) if scale > 0 else float("nan")
        print(f"{name:<16}{dt:8.2f}{m.num_draws:>9}{m.relative_bias:10.4f}{m.cosine:8.4f}"
              f"{m.total_variance:10.3g}{n1:10.3g}{n1 / mc_rate:10.3g}{n6:10.3g}"
              f"{n6 / mc_rate:11.3g}")
    print(f"total exact time: {total:.1f} s for {len(args.estimators.split(','))} estimators "
          f"(target <= 30 s)")


if __name__ == "__main__":
    main()
