"""Exact moments of every registry estimator against the group size, and streamed Monte Carlo.

On an MDP of 10,101 sequences (vocabulary 101, responses of up to 2 tokens, a parity reward;
stale and bf16/noisy sampling), for each group size ``G`` of ``--group-sizes``: the time of the
exact mean, variance and bias of every registry estimator (the registry as it is when the script
runs; ``--estimators`` picks some), their total, and the batches evaluated (the exchangeability
method packs every own term once). One :class:`~tokenmdp.exact.MomentsWorkspace` serves the
whole table (the policies' log-probs, μ's probabilities and ∇J once); its build is printed and
counted in every total. Targets (issue 17): all estimators at ``G = 8`` <= 30 s, at
``G = 16`` <= 120 s.

Monte Carlo on the same MDP (grpo, G = 4): the streamed running sums against the dense
per-batch gradients they replaced (every ``[batches, parameters]`` row kept, then sample
moments), both in this run on the same draws through the same gradient object, the per-call
setup (log-probabilities over the enumeration, ``∇J``) outside both clocks: batches per second
(target >= 10x). Then the whole ``moments()`` call, setup included, at two sizes; the memory a
run to a 1% standard error would hold; ``auto``'s choice and time for one estimator.

Last (``--memory-check``), the exchangeability method at 1.1·10^5 sequences (vocabulary 11,
responses of up to 5 tokens), G = 4, in a fresh process: its peak resident memory (target
<= 4 GB).

Usage: ``python benchmarks/moments.py [--vocab 101 --max-len 2 --group-sizes 2 4 8 16
--estimators a,b --mc-batches 2048 --memory-check]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from tokenmdp import estimators as E
from tokenmdp.exact import TabularPolicy, TokenMDP, inference_copy, moments, stale_copy
from tokenmdp.exact.lab.exchangeability import reduces_to_types
from tokenmdp.exact.lab.group_draws import sampled_draws
from tokenmdp.exact.lab.moments import MAX_COVARIANCE_DIM, MomentsWorkspace, _streamed_monte_carlo
from tokenmdp.exact.lab.moments_result import _monte_carlo_moments
from tokenmdp.exact.lab.step_gradients import StepGradients
from tokenmdp.exact.world.ground_truth import gradient, sequence_probs
from tokenmdp.exact.world.rewards import Parity

TARGETS_S = {8: 30.0, 16: 120.0}
MEMORY_TARGET_GB = 4.0


def world(vocab: int, max_len: int):
    mdp = TokenMDP(vocab, max_len, Parity(1))
    pi = TabularPolicy(mdp, generator=torch.Generator().manual_seed(0))
    old = stale_copy(mdp, pi, distance=0.5)
    mu = inference_copy(old, rounding="bf16", noise_std=0.2,
                        generator=torch.Generator().manual_seed(1))
    return mdp, pi, dict(behavior=mu, old=old, reference=old)


def group_sizes_table(mdp, pi, kw, names, group_sizes) -> None:
    # one workspace: the policies' log-probs, μ's probabilities and ∇J once for every G and
    # estimator (its build is timed, and counted in each G's total)
    t0 = time.perf_counter()
    ws = MomentsWorkspace(mdp, pi, **kw).build()
    build_s = time.perf_counter() - t0
    print(f"workspace (log-probs, probabilities, ∇J; once): {build_s:.2f} s")
    print(f"{'G':>3} {'estimators':>10} {'total s':>8} {'median s':>9} {'max s':>7} "
          f"{'slowest':>16} {'batches (grpo)':>15} {'target':>8}")
    for G in group_sizes:
        times, refused = {}, []
        batches = None
        for name in names:
            t0 = time.perf_counter()
            try:
                m = ws.moments(E.get(name), group_size=G, method="exact")
            except ValueError:      # more types than the memory budget allows: no exact method
                refused.append(name)
                continue
            times[name] = time.perf_counter() - t0
            if name == "grpo":
                batches = m.num_draws
        total = sum(times.values()) + build_s
        slowest = max(times, key=times.get)
        target = TARGETS_S.get(G)
        verdict = "—" if target is None else (f"{'ok' if total <= target else 'MISS'} "
                                              f"<= {target:g}")
        med = sorted(times.values())[len(times) // 2]
        print(f"{G:>3} {len(times):>10} {total:8.1f} {med:9.3f} {times[slowest]:7.2f} "
              f"{slowest:>16} {batches if batches is not None else '—':>15} {verdict:>8}")
        if refused:
            print(f"    refused by the memory budget (too many types): {', '.join(refused)}")


def monte_carlo_table(mdp, pi, kw, num_batches: int) -> None:
    """Streamed sums against the dense per-batch gradients they replaced, on the same draws.

    Both loops run on one :class:`StepGradients` over the same sampled ``ids``, with the one-off
    work of a call (the policies' log-probabilities over the enumeration, ``∇J``) done before
    either clock starts, so the ratio is the per-batch throughput; the whole ``moments()`` call,
    that work included, is timed separately at two sizes."""
    est = E.get("grpo")
    G = 4
    with torch.no_grad():
        probs = sequence_probs(mdp, kw["behavior"])
    enum = mdp.enumerate()
    with torch.no_grad():
        fields = {f"{k}_logprob": kw[k if k != "ref" else "reference"].token_logprobs(enum)
                  for k in ("behavior", "old", "ref")}
    true_grad = gradient(mdp, pi)
    ids, _, p_keep = sampled_draws(mdp, probs, G, 1, num_batches,
                                   torch.Generator().manual_seed(0), False)
    steps = StepGradients(mdp, pi, est, fields, G)
    keep_cov = steps.num_params <= MAX_COVARIANCE_DIM
    # before: dense per-batch gradients, every [batches, parameters] row kept
    t0 = time.perf_counter()
    dense = _monte_carlo_moments(torch.cat([g for _, g in steps.blocks(ids)]), true_grad,
                                 False, p_keep)
    dense_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    streamed = _streamed_monte_carlo(steps, ids, true_grad, keep_cov, p_keep)
    stream_s = time.perf_counter() - t0
    d = steps.num_params
    rate_dense, rate_stream = num_batches / dense_s, num_batches / stream_s
    speedup = rate_stream / rate_dense
    print(f"\nMonte Carlo, grpo, G = {G}, {num_batches} batches, {d} parameters (the same "
          "draws, the per-call setup outside both clocks):")
    print(f"  dense per-batch gradients (before): {rate_dense:,.0f} batches/s; streamed sums: "
          f"{rate_stream:,.0f} batches/s: {speedup:.1f}x (target >= 10x: "
          f"{'ok' if speedup >= 10 else 'MISS'})")
    print(f"  the same draws give the same mean: max |Δ| = "
          f"{float((dense.mean - streamed.mean).abs().max()):.1e}")
    for n in (num_batches, 32 * num_batches):
        t0 = time.perf_counter()
        call = moments(mdp, pi, est, group_size=G, method="monte_carlo", num_samples=n,
                       generator=torch.Generator().manual_seed(0), **kw)
        call_s = time.perf_counter() - t0
        print(f"  the whole moments() call, setup included: {n:,} batches in {call_s:.2f} s "
              f"({n / call_s:,.0f} batches/s)")
    scale = float(call.mean.norm()) ** 2
    n1 = call.total_variance / (1e-2 ** 2 * scale)
    print(f"  1% standard error of the mean: {n1:,.0f} batches; the dense path would hold "
          f"{n1 * d * 8 / 2 ** 30:,.1f} GiB of gradients, the streamed one "
          f"{(3 + 32) * d * 8 / 2 ** 20:,.1f} MiB of sums, "
          f"{n1 * call_s / (32 * num_batches):,.0f} s at the whole call's rate")
    t0 = time.perf_counter()
    auto = moments(mdp, pi, est, group_size=G, method="auto", **kw)
    print(f"  auto at G = {G}: chose {auto.method} ({auto.num_draws} batches, "
          f"{time.perf_counter() - t0:.2f} s)")
    t0 = time.perf_counter()
    auto = moments(mdp, pi, est, group_size=64, method="auto", num_samples=512, **kw)
    se = "" if auto.relative_bias_se is None else f" ± {auto.relative_bias_se:.3f}"
    print(f"  auto at G = 64: chose {auto.method} ({auto.num_draws} batches, "
          f"{time.perf_counter() - t0:.2f} s, relative bias {auto.relative_bias:.3f}{se})")


def memory_one(vocab: int, max_len: int) -> dict:
    mdp, pi, kw = world(vocab, max_len)
    t0 = time.perf_counter()
    m = moments(mdp, pi, E.get("grpo"), group_size=4, method="exchangeability", **kw)
    return {"sequences": mdp.num_sequences, "batches": m.num_draws,
            "seconds": time.perf_counter() - t0,
            "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=101)
    parser.add_argument("--max-len", type=int, default=2)
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--estimators", default=None,
                        help="comma-separated registry names (default: the whole registry)")
    parser.add_argument("--mc-batches", type=int, default=2048,
                        help="Monte Carlo batches timed for the throughput figures")
    parser.add_argument("--memory-check", action="store_true",
                        help="the 1.1e5-sequence exchangeability run, in a fresh process")
    parser.add_argument("--memory-one", nargs=2, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_one:
        print(json.dumps(memory_one(*args.memory_one)))
        return
    names = E.names() if args.estimators is None else [
        n.strip() for n in args.estimators.split(",") if n.strip()]
    for name in names:
        E.get(name)
    mdp, pi, kw = world(args.vocab, args.max_len)
    print(f"{mdp!r}; {mdp.num_states * mdp.vocab_size} parameters; stale + bf16/noisy "
          f"inference engine; {torch.get_num_threads()} thread(s)")
    coupled = [n for n in names if not reduces_to_types(E.get(n))]
    names = [n for n in names if n not in coupled]
    if coupled:     # their exact moments need the enumeration, out of reach at this size
        print(f"not reducible to types (enumeration only), left out: {', '.join(coupled)}")
    print()
    group_sizes_table(mdp, pi, kw, names, args.group_sizes)
    monte_carlo_table(mdp, pi, kw, args.mc_batches)
    if args.memory_check:
        out = subprocess.run([sys.executable, __file__, "--memory-one", "11", "5", "--threads",
                              str(args.threads)], check=True, capture_output=True, text=True)
        r = json.loads(out.stdout)
        print(f"\nexchangeability at {r['sequences']:,} sequences, G = 4: {r['batches']:,} "
              f"batches, {r['seconds']:.1f} s, peak resident {r['peak_gb']:.2f} GB (target <= "
              f"{MEMORY_TARGET_GB:g} GB: {'ok' if r['peak_gb'] <= MEMORY_TARGET_GB else 'MISS'})")


if __name__ == "__main__":
    main()
