"""Exact results at LLM lengths on the lattice (:mod:`tokenmdp.exact.lattice`): tables, a figure,
and the timing targets.

A random reward automaton with ``K`` states and 0/1 rewards over a vocabulary of ``V`` tokens;
the policy's logits depend on the state only (tiled over positions, so the per-token mismatch
is the same at every length) with EOS made rare enough that ``E|y|`` grows with ``T``; the
engine ``μ`` adds a fixed logit perturbation of standard deviation σ per (state, token).

1. ``log E_μ[ρ²]`` of sequence IS (``ρ = π_old/μ``, exact, in log space) against ``T``, beside
   ``T · log(1 + χ²_token)`` (the per-token χ² averaged over ``μ``'s visitation);
2. the cosine to ``∇J`` of the exact mean gradient of ``minirl``, ``minirl_no_is`` and
   ``minirl_len_norm`` (``G`` responses per step) against ``T`` at fixed σ, and against σ at
   the largest ``T``;
3. the first-order gap ``|J(π) − L_{π_old}(π)|`` and its trust-region bound ``2 ε α² T(T − 1)``
   against ``T`` for a fixed stale step (the same logit change at every node), with a
   per-token length penalty added to the reward (the automaton's 0/1 reward alone is decided
   by the last few tokens of a mixing automaton, so its gap does not grow with ``T``).

4. with ``--trainer-match``, instead: the exact world at the long-answer study's mismatch and
   length (``benchmarks/_long_study_exact.py``): an exact-match lattice with the trainer's
   vocabulary and per-token entropy, the engine the marginal of its fresh logit noise; per
   ``(L, σ)`` the exact cosine, progress along ``∇J`` and signal-to-noise ratio of ``minirl``,
   ``minirl_no_is`` and ``minirl_len_norm``, and the same by Monte Carlo over groups with the
   noise drawn fresh per token, as the trainer's engine does (MiniRL's weight then uses that
   draw's ``μ_ε``).

5. who counts the tokens, at length (``benchmarks/_lattice_aggregation.py``): the exact bias,
   variance and length bias of the token mean (DAPO) against the per-sequence token mean (GRPO)
   and the constant normalizer (Dr. GRPO), REINFORCE with a group-mean (or no) baseline, for
   ``G`` in ``--group-sizes`` and ``T`` in ``--aggregation-lengths``, in tutorial 4's world at
   length (the answer first, then chatter: wrong answers ramble twice as long as right ones);
   every figure is scale-free and exact (``Moments.method`` is printed), and the mean's figures
   are given both for the tabular policy and for one logit table shared by all positions.

Timing targets (one thread, ``T = 4096``, ``K = 32``, ``V = 8``, ``G = 8``): ``J + ∇J`` within
1 s; one token-mean estimator's exact mean and total variance (``--timing-estimator``, default
``dapo``) within 30 s; every registry estimator the lattice computes exactly within 3 minutes
(``--skip-all`` leaves the last out). The ratio to each target is printed.

Usage: ``python benchmarks/lattice.py [--lengths 16 64 256 1024 4096] [--states 32] [--vocab 8]
[--figure docs/_static/long_responses.png] [--aggregation-lengths 64 256 1024 4096]
[--group-sizes 1 2 4 8 16] [--aggregation-figure docs/_static/long_responses_aggregation.png]``;
``python benchmarks/lattice.py [--aggregation-only] [--quick]`` (``--aggregation-only``: section 5
alone; ``--quick``: tiny sizes, no figure unless asked for); ``python benchmarks/lattice.py
--trainer-match
[--lengths 16 64] [--sigmas 0.1 0.25 0.5 1 2] [--group-size 4] [--groups 4000]
[--fresh-estimators minirl minirl_no_is sequence_tis] [--skip-exact]``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from tokenmdp import estimators
from tokenmdp.exact import lattice as L

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _lattice_aggregation as agg  # noqa: E402

TARGETS_S = {"J + ∇J": 1.0, "one token-mean estimator, G = 8": 30.0,
             "all exact estimators, G = 8": 180.0}
COSINE_ESTIMATORS = ("minirl", "minirl_no_is", "minirl_len_norm")


def world(T: int, K: int, V: int, sigma: float, seed: int = 0, length_reward: float = 0.0):
    """The lattice, ``π_θ`` (state-only logits, EOS rare) and the engine ``μ`` at σ."""
    rng = np.random.default_rng(seed)
    rewards = rng.permutation(np.arange(K) % 2).astype(float)         # half the states pay 1
    aut = L.RewardAutomaton(_reachable_table(rng, K, V), rewards)
    mdp = L.LatticeMDP(aut, T, length_reward=length_reward)
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(K, V, generator=g, dtype=torch.float64)
    base[:, -1] -= math.log(T)                        # EOS about 1/T per token: E|y| ~ T
    noise = torch.randn(K, V, generator=g, dtype=torch.float64) * sigma
    pi = L.LatticePolicy(mdp, logits=base.expand(T, K, V))
    mu = L.LatticePolicy(mdp, logits=(base + noise).expand(T, K, V)).requires_grad_(False)
    return mdp, pi, mu


def _reachable_table(rng, K: int, V: int) -> np.ndarray:
    """A random ``[K, V − 1]`` table in which state ``i + 1`` is reachable from state ``i``."""
    table = rng.integers(0, K, size=(K, V - 1))
    table[np.arange(K - 1), rng.integers(0, V - 1, K - 1)] = np.arange(1, K)
    return table


def sequence_is_table(lengths, K, V, sigma):
    rows = []
    for T in lengths:
        mdp, pi, mu = world(T, K, V, sigma)
        log_m2 = float(L.log_second_moment(mdp, pi, mu))
        chi_tok = float(L.chi_square(mdp, pi, mu, level="token"))
        rows.append((T, float(L.expected_length(mdp, pi).detach()), log_m2,
                     T * math.log1p(chi_tok)))
    print(f"\n1. sequence IS: log E_mu[rho^2] against T (sigma = {sigma})")
    print(f"{'T':>6} {'E|y|':>9} {'log E[rho^2]':>14} {'T log(1+chi2_tok)':>18}")
    for T, n, a, b in rows:
        print(f"{T:>6} {n:>9.1f} {a:>14.4f} {b:>18.4f}")
    return rows


def cosines(mdp, pi, mu, G):
    out = {}
    for name in COSINE_ESTIMATORS:
        m = L.moments(mdp, pi, estimators.get(name), group_size=G, behavior=mu, old=pi)
        out[name] = m.cosine
    return out


def cosine_tables(lengths, sigmas, K, V, sigma, G):
    by_T = [(T, cosines(*world(T, K, V, sigma), G)) for T in lengths]
    by_sigma = [(s, cosines(*world(lengths[-1], K, V, s), G)) for s in sigmas]
    for title, key, rows in ((f"against T (sigma = {sigma})", "T", by_T),
                             (f"against sigma (T = {lengths[-1]})", "sigma", by_sigma)):
        print(f"\n2. cosine(E[g], grad J), G = {G}, {title}")
        print(f"{key:>7} " + " ".join(f"{n:>16}" for n in COSINE_ESTIMATORS))
        for x, c in rows:
            print(f"{x:>7g} " + " ".join(f"{c[n]:>16.5f}" for n in COSINE_ESTIMATORS))
    return by_T, by_sigma


def first_order_table(lengths, K, V, step, cost):
    rows = []
    for T in lengths:
        mdp, pi, _ = world(T, K, V, 0.0, length_reward=-cost)
        g = torch.Generator().manual_seed(1)
        u = torch.randn(K, V, generator=g, dtype=torch.float64)
        old = L.LatticePolicy(mdp, logits=pi.logits.detach() - step * u)
        with torch.no_grad():
            gap = abs(float(L.objective(mdp, pi) - L.surrogate(mdp, pi, old)))
        rows.append((T, gap, float(L.trust_region_bound(mdp, pi, old))))
    print(f"\n3. first-order gap |J - L_old| and its bound, stale logit step {step} (std), "
          f"length penalty {cost} per token")
    print(f"{'T':>6} {'gap':>12} {'bound':>12}")
    for T, gap, bound in rows:
        print(f"{T:>6} {gap:>12.4e} {bound:>12.4e}")
    return rows


def timings(T, K, V, G, sigma, all_estimators: bool, name: str = "dapo"):
    """Time ``J + ∇J``, one token-mean estimator and every exact registry estimator."""
    mdp, pi, mu = world(T, K, V, sigma)
    ref = L.LatticePolicy(mdp, logits=pi.logits.detach() * 0.9).requires_grad_(False)
    t0 = time.perf_counter()
    with torch.no_grad():
        L.objective(mdp, pi)
    L.gradient(mdp, pi)
    results = {"J + ∇J": time.perf_counter() - t0}
    est = estimators.get(name)
    if est.aggregation is not estimators.Aggregation.TOKEN_MEAN:
        raise ValueError(f"--timing-estimator: {name!r} does not aggregate by the token mean")
    t0 = time.perf_counter()
    m = L.moments(mdp, pi, est, group_size=G, behavior=mu, old=pi, reference=ref,
                  method="lattice")
    results["one token-mean estimator, G = 8"] = time.perf_counter() - t0
    names = [n for n in estimators.names() if L.exact_support(estimators.get(n), G)[0]]
    refused = {}                  # exact in form, but a ratio reaches its cap on these policies
    each = {}
    if all_estimators:
        t0 = time.perf_counter()
        for n in names:
            each[n] = time.perf_counter()
            try:
                L.moments(mdp, pi, estimators.get(n), group_size=G, behavior=mu, old=pi,
                          reference=ref, method="lattice")
            except ValueError as err:
                refused[n] = str(err).split(": ", 2)[-1]
            each[n] = time.perf_counter() - each[n]
        results["all exact estimators, G = 8"] = time.perf_counter() - t0
    targeted = T == 4096 and K <= 32 and V <= 8 and G == 8
    print(f"\ntimings at T = {T}, K = {K}, V = {V}, G = {G} ({torch.get_num_threads()} thread(s)); "
          f"the token-mean estimator: {name} (method {m.method})")
    print(f"{'what':<34} {'seconds':>9} {'target':>8} {'ratio':>7}  verdict")
    for what, s in results.items():
        target = TARGETS_S[what] if targeted else None
        verdict = "-" if target is None else ("met" if s <= target else "MISSED")
        shown = "-" if target is None else f"{target:g}"
        ratio = "-" if target is None else f"{s / target:.2f}"
        print(f"{what:<34} {s:>9.2f} {shown:>8} {ratio:>7}  {verdict}")
    print(f"exact on the lattice at G = {G}: {len(names)} registry estimators: {', '.join(names)}")
    for n, why in refused.items():
        print(f"  {n}: refused on these policies (timed until the refusal): {why}")
    if each:
        print("slowest: " + ", ".join(f"{n} {s:.1f} s" for n, s in
                                      sorted(each.items(), key=lambda kv: -kv[1])[:6]))
    return results


def aggregation_table(rows, references, sigma: float = 0.0) -> None:
    """Print section 5: per advantage, the tabular (exact mean and variance) and the shared
    (the mean summed over positions) figures, and the reference lines of ``∇J``."""
    engine = "on-policy (mu = pi)" if sigma == 0 else f"engine logit noise sigma = {sigma:g}"
    print(f"\n5. who counts the tokens at length: REINFORCE, {engine}, one group of G per step; "
          "tutorial 4's world (answer first, then chatter; 3 states)")
    print(f"{'T':>6} {'J':>6} {'E|y|':>8} {'E[|y| right]':>13} {'E[|y| wrong]':>13}   grad J: "
          "cos(., grad E|y|) and dlogE|y|/dJ, tabular | shared")
    for T, r in references.items():
        tab, sh = r["tabular"], r["shared"]
        print(f"{T:>6} {r['J']:>6.3f} {r['length']:>8.1f} {r['right']:>13.1f} {r['wrong']:>13.1f}"
              f"   {tab['length_cosine']:+.4f} {tab['length_per_J']:+.3f} | "
              f"{sh['length_cosine']:+.4f} {sh['length_per_J']:+.3f}")
    direction = (f"{'cos gradJ':>10} {'bias@c*':>9} {'cos gradE|y|':>12} {'dlogRight':>10} "
                 f"{'dlogWrong':>10}")
    for adv in dict.fromkeys(r.advantage for r in rows):
        for coords in agg.COORDINATES:
            print(f"\nadvantage {agg.ADVANTAGES[adv].describe()}, {coords} coordinates "
                  + ("(exact E g and tr Cov; s: seconds of moments)" if coords == "tabular" else
                     "(one logit table for all positions: E g summed over positions)"))
            print(f"{'T':>6} {'G':>3} {'aggregation':<27} "
                  + (f"{'method':<8} " if coords == "tabular" else "") + direction
                  + (f" {'trCov/|Eg|^2':>13} {'gain':>9} {'s':>6}" if coords == "tabular" else ""))
            shown = set()
            for r in (r for r in rows if r.advantage == adv):
                d = getattr(r, coords)
                G = r.G
                if coords == "shared":                # one line where no figure depends on G
                    same = [getattr(o, coords) for o in rows if (o.advantage, o.aggregation,
                                                                 o.T) == (adv, r.aggregation, r.T)]
                    if all(abs(o[k] - d[k]) <= 1e-9 * max(1.0, abs(d[k])) for o in same
                           for k in d) and len(same) > 1:
                        if (r.aggregation, r.T) in shown:
                            continue
                        shown.add((r.aggregation, r.T))
                        G = "all"
                line = (f"{r.T:>6} {G:>3} {agg.LABELS[r.aggregation]:<27} "
                        + (f"{r.method:<8} " if coords == "tabular" else "")
                        + f"{d['cosine']:>10.6f} {d['bias']:>9.2e} {d['length_cosine']:>+12.4f} "
                        f"{d['right_per_J']:>+10.4f} {d['wrong_per_J']:>+10.4f}")
                if coords == "tabular":
                    line += f" {r.relative_variance:>13.4g} {r.gain:>9.3e} {r.seconds:>6.2f}"
                print(line)
        if adv == "group-mean":
            Gs = sorted({r.G for r in rows if r.advantage == adv})
            print("groups per step B* at which the gains cos^2/(1 + trCov/(B |Eg|^2)) of the "
                  "constant and of seq-mean-token-mean cross (tabular; the constant's is larger "
                  "above it when its cosine is; -: never):")
            for T in references:
                print(f"  T = {T:>5}: " + ", ".join(
                    f"G = {G}: " + ("-" if math.isnan(b := agg.crossover_groups(rows, T, G))
                                    else f"{b:.0f}") for G in Gs if G > 1))
    print("(dlogRight, dlogWrong: d log E[|y| | right or wrong] / dJ along E g, 0 along grad J; "
          "the group mean at G = 1 gives A = 0, a zero gradient: left out; "
          f"{len(rows)} rows, {sum(r.seconds for r in rows):.0f} s of moments)")


def figure(path, seq_rows, by_T, by_sigma, fo_rows, sigma, G):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(10, 7.5))
    T = [r[0] for r in seq_rows]
    ax[0, 0].plot(T, [r[2] for r in seq_rows], "o-", label=r"$\log E_\mu[\rho^2]$ (exact)")
    ax[0, 0].plot(T, [r[3] for r in seq_rows], "s--", label=r"$T\,\log(1+\chi^2_{token})$")
    ax[0, 0].set(xscale="log", yscale="log", xlabel="T (max response length)",
                 ylabel="nats", title=f"Sequence IS second moment (σ = {sigma})")
    for name in COSINE_ESTIMATORS:
        ax[0, 1].plot([x for x, _ in by_T], [c[name] for _, c in by_T], "o-", label=name)
        ax[1, 0].plot([x for x, _ in by_sigma], [c[name] for _, c in by_sigma], "o-", label=name)
    ax[0, 1].set(xscale="log", xlabel="T", ylabel=r"cos(E[ĝ], ∇J)",
                 title=f"Exact mean gradient vs ∇J, G = {G}, σ = {sigma}")
    ax[1, 0].set(xlabel="σ (engine logit noise)", ylabel=r"cos(E[ĝ], ∇J)",
                 title=f"… against the mismatch, T = {by_T[-1][0]}")
    ax[1, 1].plot([r[0] for r in fo_rows], [r[1] for r in fo_rows], "o-",
                  label=r"$|J(\pi) - L_{\pi_{old}}(\pi)|$")
    ax[1, 1].plot([r[0] for r in fo_rows], [r[2] for r in fo_rows], "s--",
                  label=r"bound $2\epsilon\alpha^2T(T-1)$")
    ax[1, 1].set(xscale="log", yscale="log", xlabel="T", ylabel="gap",
                 title="First-order gap, fixed stale step")
    for a in ax.flat:
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nfigure: {path}")


def trainer_match(lengths, sigmas, G, groups, fresh_estimators, skip_exact=False):
    """4.: exact (marginal engine) and Monte Carlo (fresh noise) at the trainer's mismatch."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _long_study_exact import exact_table, fresh_noise_moments

    if not skip_exact:
        _, table = exact_table(tuple(lengths), tuple(sigmas), group_size=G)
        print(f"\n4. the exact world at the trainer's mismatch (G = {G}): cosine / progress / "
              "SNR\n")
        print(table)
    print(f"fresh noise per token, Monte Carlo over {groups} groups (± jackknife SE): "
          "cosine, progress, SNR")
    print(f"{'L':>4} {'sigma':>6} {'estimator':>13} {'cosine':>16} {'progress':>16} {'SNR':>20}")
    for n in lengths:
        for s in sigmas:
            for est in fresh_estimators:
                r = fresh_noise_moments(n, s, est, group_size=G, groups=groups)
                print(f"{n:>4} {s:>6g} {est:>13} {r['cosine']:>8.4f} ± {r['cosine_se']:<5.4f} "
                      f"{r['progress']:>8.3f} ± {r['progress_se']:<5.3f} "
                      f"{r['snr']:>10.2e} ± {r['snr_se']:<8.1e}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 256, 1024, 4096])
    p.add_argument("--states", type=int, default=32)
    p.add_argument("--vocab", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--sigma", type=float, default=0.1, help="engine logit noise of 1. and 2.")
    p.add_argument("--sigmas", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.2, 0.4])
    p.add_argument("--stale-step", type=float, default=0.1,
                   help="standard deviation of the stale logit change of 3., the same at each t")
    p.add_argument("--length-cost", type=float, default=1e-3,
                   help="per-token length penalty of 3. (the automaton's reward alone mixes: "
                        "its advantages, and so the gap, do not grow with T)")
    p.add_argument("--timing-length", type=int, default=4096)
    p.add_argument("--skip-all", action="store_true",
                   help="leave out the timing of every exactly computable registry estimator")
    p.add_argument("--timing-estimator", default="dapo",
                   help="the token-mean registry estimator of the 30 s target")
    p.add_argument("--figure", default=None,
                   help="figure of 1.-3. (default docs/_static/long_responses.png)")
    p.add_argument("--aggregation-lengths", type=int, nargs="+", default=[64, 256, 1024, 4096],
                   help="the T of 5.")
    p.add_argument("--group-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                   help="the G of 5.")
    p.add_argument("--advantages", nargs="+", default=["group-mean", "reward"],
                   choices=list(agg.ADVANTAGES), help="the advantages of 5.")
    p.add_argument("--aggregation-sigma", type=float, default=0.0,
                   help="engine logit noise of 5. (0: on-policy)")
    p.add_argument("--empty-answer", type=float, default=0.01,
                   help="probability of the empty answer in the world of 5.")
    p.add_argument("--aggregation-figure", default=None,
                   help="figure of 5. (default docs/_static/long_responses_aggregation.png)")
    p.add_argument("--aggregation-only", action="store_true", help="only 5.")
    p.add_argument("--skip-aggregation", action="store_true", help="leave 5. out")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes everywhere (T = 8, 16; K = 4; V = 3; G = 1, 2 in 5.; timing "
                        "at T = 32 without --skip-all's part), no figure unless asked for")
    p.add_argument("--trainer-match", action="store_true",
                   help="only 4.: the exact world at the long-answer study's mismatch and length")
    p.add_argument("--groups", type=int, default=8000,
                   help="groups of the fresh-noise Monte Carlo of --trainer-match")
    p.add_argument("--fresh-estimators", nargs="+", default=["minirl", "minirl_no_is"],
                   choices=["minirl", "minirl_no_is", "sequence_tis"],
                   help="the estimators of --trainer-match's fresh-noise Monte Carlo")
    p.add_argument("--skip-exact", action="store_true",
                   help="--trainer-match: only the fresh-noise Monte Carlo")
    a = p.parse_args(argv)
    if a.trainer_match:
        if a.groups < 20 or min(a.lengths) < 1 or min(a.sigmas) < 0:
            print("lattice.py: --groups must be >= 20, --lengths >= 1, --sigmas >= 0",
                  file=sys.stderr)
            return 2
        torch.set_num_threads(1)
        trainer_match(a.lengths, a.sigmas, a.group_size, a.groups, a.fresh_estimators,
                      a.skip_exact)
        return 0
    static = ROOT / "docs" / "_static"
    if a.quick:
        a.lengths = a.aggregation_lengths = [8, 16]
        a.states, a.vocab, a.group_sizes, a.sigmas = 4, 3, [1, 2], [0.0, 0.3]
        a.timing_length, a.skip_all = 32, True
    else:
        a.figure = a.figure or str(static / "long_responses.png")
        a.aggregation_figure = a.aggregation_figure or str(static /
                                                           "long_responses_aggregation.png")
    if a.states < 2 or a.vocab < 2 or min(a.lengths) < 1:
        print("lattice.py: --states and --vocab must be >= 2, --lengths >= 1", file=sys.stderr)
        return 2
    run_aggregation = not a.skip_aggregation
    if run_aggregation and (a.vocab < 3 or min(a.aggregation_lengths) < 1
                            or min(a.group_sizes) < 1 or a.aggregation_sigma < 0
                            or not 0 < a.empty_answer < 0.7):
        print("lattice.py: 5. needs --vocab >= 3, --aggregation-lengths and --group-sizes >= 1, "
              "--aggregation-sigma >= 0 and 0 < --empty-answer < 0.7", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    if not a.aggregation_only:
        seq_rows = sequence_is_table(a.lengths, a.states, a.vocab, a.sigma)
        by_T, by_sigma = cosine_tables(a.lengths, a.sigmas, a.states, a.vocab, a.sigma,
                                       a.group_size)
        fo_rows = first_order_table(a.lengths, a.states, a.vocab, a.stale_step, a.length_cost)
    if run_aggregation:
        rows, refs = agg.grid(a.aggregation_lengths, a.group_sizes, a.advantages, V=a.vocab,
                              sigma=a.aggregation_sigma, p_empty=a.empty_answer)
        aggregation_table(rows, refs, a.aggregation_sigma)
        if a.aggregation_figure:
            agg.figure(a.aggregation_figure, rows, refs, a.advantages[0])
    if not a.aggregation_only:
        timings(a.timing_length, a.states, a.vocab, a.group_size, a.sigma, not a.skip_all,
                a.timing_estimator)
        if a.figure:
            figure(a.figure, seq_rows, by_T, by_sigma, fo_rows, a.sigma, a.group_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
