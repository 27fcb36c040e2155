"""Branching rollouts in the exact world: tree estimators against i.i.d. groups at equal budget.

On the reference MDP (``tokenmdp.reports.cards.REFERENCE``: vocabulary 3 with EOS, responses of
at most 3 tokens, 2 prompts, the random reward, a tabular policy from seed 0), one step is one
prompt's group: an i.i.d. group of ``G`` responses, or one tree of ``G`` nominal leaves grown by a
fork schedule (``fixed:DxB`` forks every live branch into ``B`` after ``D`` tokens;
``entropy:NxT`` / ``random:NxT`` add ``T`` children at ``N`` prefix states of the first chain,
the highest-entropy or uniformly drawn ones; :mod:`tokenmdp.exact.branching.schedules`). For
every estimator and draw, two scenarios — on-policy (``μ = π_old = π``) and stale + mismatched
(``π_old`` 0.5 behind along ``∇J``, ``μ`` = ``π_old`` with logit noise 0.3: the reference
scenario) — the exact moments (``Moments.method`` printed) and the cost in *generated* tokens;
then the figures at equal budget: the mean of ``budget / cost`` independent steps keeps the bias
and divides the variance (:func:`~tokenmdp.exact.branching.at_budget`). Columns: nominal and
expected leaves, expected generated tokens, relative bias and cosine of the mean, the total
variance of one step and per generated token (``var · tokens``), and ``MSE(c*)`` (after the
best rescaling, ``tokenmdp.reports.comparison.summary_row``) at ``B`` = the generated tokens of
an i.i.d. group of 4 and at ``16 B``, each also relative to the i.i.d. group of as many nominal
leaves at the same budget (``< 1``: the draw beats it).

Timing target (issue 28): exact moments of a tree estimator on the reference MDP <= 10 s (a fresh
workspace: tables, the tree law and the moments), printed for a fixed and an entropy schedule.

Usage: ``python benchmarks/trees.py [--figure PATH] [--estimators a,b] [--quick]``.
"""

from __future__ import annotations

import argparse
import time

from tokenmdp import estimators as E
from tokenmdp.exact.branching import TreeWorkspace, at_budget, compare_at_budget
from tokenmdp.reports.comparison import Setup, build_lab, summary_row
from tokenmdp.tree_schedules import EntropyForks, FixedForks, RandomForks

TARGET_S = 10.0
LEAF_LEVEL = ("reinforce", "rloo", "grpo", "dr_grpo")
TREE_ENTRIES = ("tree_rloo", "tree_grpo", "tree_value_diff", "tree_return_minus_value", "treerl",
                "vineppo_tree")
#: The draws of G = 4 (the budget's i.i.d. group first), then the branching-factor sweep.
DRAWS_G4 = (4, FixedForks((1,), (4,)), FixedForks((2,), (4,)), FixedForks((0, 1), (2, 2)),
            FixedForks((0, 2), (2, 2)), FixedForks((1, 2), (2, 2)), EntropyForks((1,), (3,)),
            EntropyForks((3,), (1,)), RandomForks((1,), (3,)))
DRAWS_B = (2, FixedForks((1,), (2,)), FixedForks((2,), (2,)), 8, FixedForks((1,), (8,)),
           FixedForks((2,), (8,)))
SCENARIOS = ("on-policy", "both")


def registered_names() -> set:
    """Every registry name, the tree entries included (``names(trees=None)``)."""
    try:
        return set(E.names(trees=None))
    except TypeError:                       # a registry without tree entries
        return set(E.names())


def workspace(scenario: str) -> TreeWorkspace:
    lab = build_lab(Setup(method="exact", scenario=scenario))
    return TreeWorkspace(lab.mdp, lab.policy, behavior=lab.behavior, old=lab.old,
                         reference=lab.old, jacobian=lab.jacobian)


def timing(name: str) -> None:
    for schedule in (FixedForks((1, 2), (2, 2)), EntropyForks((1,), (3,))):
        t0 = time.perf_counter()
        ws = workspace("both")
        m = ws.moments(name, schedule, method="exact")
        s = time.perf_counter() - t0
        law = ws.law(schedule)
        print(f"timing: exact moments of {name} on {schedule} (reference MDP: "
              f"{ws.mdp.num_sequences} sequences, {law.num_trees} trees, "
              f"{m.covariance.shape[0]} parameters): {s:.2f} s (target {TARGET_S:.0f} s: "
              f"{s / TARGET_S:.2f} of it)")


#: The second budget: this many i.i.d. groups of 4 (a batch of prompts), where bias matters more.
BIG_BUDGET = 16


def rows_for(ws: TreeWorkspace, names, draws):
    """Rows at the budget ``B`` of an i.i.d. group of 4 and at ``BIG_BUDGET · B``; ``vs``: MSE(c*)
    over that of the i.i.d. group with as many (nominal) leaves, at the same budget."""
    out = []
    nominal = [d if isinstance(d, int) else d.leaves for d in draws]
    budget = 4 * ws.mean_length
    for i, row in enumerate(compare_at_budget(ws, names, draws, budget=budget)):
        big = summary_row(row.estimator, at_budget(row.step, BIG_BUDGET * budget))
        out.append(dict(estimator=row.estimator, draw=row.draw, step=row.step, at=row.budget,
                        G=nominal[i % len(draws)],
                        mse_c_star=summary_row(row.estimator, row.budget)["mse_c_star"],
                        mse_c_star_big=big["mse_c_star"]))
    for key in ("mse_c_star", "mse_c_star_big"):
        base = {(r["estimator"], r["G"]): r[key] for r in out if r["draw"].startswith("iid")}
        for r in out:
            b = base.get((r["estimator"], r["G"]))
            r[key + "_vs"] = r[key] / b if b else float("nan")
    return out


def table(title: str, rows, budget: float, grad2: float) -> None:
    print(f"\n### {title}\n\nB = {budget:.3f} generated tokens (an i.i.d. group of 4); "
          f"‖∇J‖² = {grad2:.4g} (the MSE of no step)\n")
    print("| estimator | draw | leaves | gen. tokens | rel. bias | cosine | var/step | "
          f"var·tokens | MSE(c*)@B | vs iid | MSE(c*)@{BIG_BUDGET}B | vs iid | method |")
    print("|" + "---|" * 13)
    for r in rows:
        s = r["step"]
        print(f"| {r['estimator']} | {r['draw']} | {s.leaves:.2f} | {s.generated_tokens:.3f} | "
              f"{s.relative_bias:.4f} | {s.cosine:.4f} | {s.total_variance:.4g} | "
              f"{s.total_variance * s.generated_tokens:.4g} | {r['mse_c_star']:.4g} | "
              f"{r['mse_c_star_vs']:.3f} | {r['mse_c_star_big']:.4g} | "
              f"{r['mse_c_star_big_vs']:.3f} | {s.method}"
              + (f", {s.skipped:.3f} skipped |" if s.skipped else " |"))


def figure(path: str, results) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for ax, (scenario, rows) in zip(axes[0], results.items()):
        draws = list(dict.fromkeys(r["draw"] for r in rows))
        for name in dict.fromkeys(r["estimator"] for r in rows):
            ys = [next(r["mse_c_star_big_vs"] for r in rows if r["estimator"] == name and r["draw"] == d)
                  for d in draws]
            ax.plot(range(len(draws)), ys, marker="o", label=name)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_yscale("log")
        ax.set_xticks(range(len(draws)), draws, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("MSE(c*) / that of an i.i.d. group of 4, equal budget")
        ax.set_title(f"{scenario}: G = 4, budget = {BIG_BUDGET} i.i.d. groups' tokens")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"figure: {path}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--figure", help="write the figure here (PNG)")
    parser.add_argument("--estimators", help="comma-separated registry names")
    parser.add_argument("--quick", action="store_true",
                        help="two estimators, the on-policy scenario, fixed forks only")
    args = parser.parse_args(argv)
    t_start = time.perf_counter()
    registered = registered_names()
    names = (args.estimators.split(",") if args.estimators else
             [n for n in LEAF_LEVEL + TREE_ENTRIES if n in registered])
    scenarios, draws_g4, draws_b = SCENARIOS, DRAWS_G4, DRAWS_B
    if args.quick:
        names, scenarios = names[:2], SCENARIOS[:1]
        draws_g4 = tuple(d for d in DRAWS_G4 if isinstance(d, (int, FixedForks)))[:3]
        draws_b = ()
    else:
        timing("treerl" if "treerl" in registered else "rloo")
    results = {}
    for scenario in scenarios:
        ws = workspace(scenario)
        budget = 4 * ws.mean_length
        grad2 = float(ws.tables.true_grad @ ws.tables.true_grad)
        rows = rows_for(ws, names, draws_g4)
        table(f"{scenario}: G = 4 — fork depth and schedule", rows, budget, grad2)
        results[scenario] = rows
        if draws_b:
            table(f"{scenario}: branching factor (fork at depth 1 or 2 into B, against iid:B)",
                  rows_for(ws, names, draws_b), budget, grad2)
    if args.figure:
        figure(args.figure, results)
    print(f"\ntotal: {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
