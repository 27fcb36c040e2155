"""The ``tokenmdp`` command line.

Subcommands:

* ``tokenmdp compare`` — the main job: exact bias, variance and MSE of estimators on a small MDP,
  as a table, a PNG plot and CSV/JSON files;
* ``tokenmdp estimators`` — the estimator registry as a table;
* ``tokenmdp exact`` — build a small token MDP and a policy, print the exact ``J`` and ``∇J``;
* ``tokenmdp sft`` / ``tokenmdp train`` — the trainer (:mod:`tokenmdp.rl.trainer`), options generated
  from :class:`tokenmdp.rl.config.TrainConfig`;
* ``tokenmdp plot`` — training curves of runs from their ``metrics.jsonl`` (:mod:`tokenmdp.rl.plot`).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import torch

REWARDS = ("count", "exact", "contains", "parity", "length", "random")
SCENARIOS = ("on-policy", "stale", "discrepancy", "both")
DEFAULT_ESTIMATORS = ("reinforce", "rloo", "token_is", "sequence_is", "ppo", "grpo", "dr_grpo",
                      "dapo", "gspo", "cispo", "minirl", "minirl_no_is", "minirl_len_norm")
POLICIES = ("tabular", "loglinear", "neural")


def build_reward(name: str, vocab_size: int):
    """A built-in reward by name (targets chosen from the vocabulary)."""
    from tokenmdp.exact import rewards

    eos = vocab_size - 1
    table = {
        "count": lambda: rewards.TokenCount(0),
        "exact": lambda: rewards.ExactMatch((0, min(1, eos - 1), eos)),
        "contains": lambda: rewards.ContainsPattern((0, 0)),
        "parity": lambda: rewards.Parity(1),
        "length": lambda: rewards.LengthReward(-0.1, content=rewards.TokenCount(0)),
        "random": lambda: rewards.RandomTable(seed=0),
    }
    if name not in table:
        raise ValueError(f"reward: expected one of {', '.join(REWARDS)}, got {name!r}")
    return table[name]()


def add_mdp_arguments(parser: argparse.ArgumentParser) -> None:
    """Options that describe a small exact MDP and its policy."""
    group = parser.add_argument_group("MDP")
    group.add_argument("--vocab", type=int, default=3, help="vocabulary size V (last token EOS)")
    group.add_argument("--max-len", type=int, default=4, help="maximum response length L")
    group.add_argument("--reward", choices=REWARDS, default="count", help="reward function")
    group.add_argument("--prompts", type=int, default=1,
                       help="number of prompts (0,), (1,), ... with uniform probabilities")
    group.add_argument("--policy", choices=POLICIES, default="tabular", help="policy class")
    group.add_argument("--seed", type=int, default=0, help="seed of the policy's initialization")


def build_mdp_and_policy(args: argparse.Namespace):
    """The MDP and policy described by :func:`add_mdp_arguments`'s options."""
    from tokenmdp.exact import LogLinearPolicy, NeuralPolicy, TabularPolicy, TokenMDP

    if args.vocab >= 2 and not 1 <= args.prompts <= args.vocab - 1:
        raise ValueError(f"--prompts: must be in [1, {args.vocab - 1}] (one token per prompt)")
    mdp = TokenMDP(args.vocab, args.max_len, build_reward(args.reward, args.vocab),
                   prompts=[(i,) for i in range(args.prompts)])
    cls = {"tabular": TabularPolicy, "loglinear": LogLinearPolicy, "neural": NeuralPolicy}
    policy = cls[args.policy](mdp, generator=torch.Generator().manual_seed(args.seed))
    return mdp, policy


def cmd_exact(args: argparse.Namespace) -> int:
    """Print the MDP's exact objective J and policy gradient ∇J."""
    from tokenmdp.exact import gradient, objective, token_entropy

    mdp, policy = build_mdp_and_policy(args)
    J = float(objective(mdp, policy).detach())
    g = gradient(mdp, policy)
    print(mdp)
    print(f"policy: {type(policy).__name__}, {g.numel()} parameters")
    print(f"J         = {J:.12g}")
    print(f"|∇J|      = {float(g.norm()):.12g}")
    print(f"entropy   = {float(token_entropy(mdp, policy).detach()):.6f} nats/token")
    shown = min(args.show, g.numel())
    print(f"∇J[:{shown}] = " + " ".join(f"{v:+.6f}" for v in g[:shown].tolist()))
    return 0


def build_scenario(args: argparse.Namespace, mdp, policy):
    """``(behavior μ, old π_old)`` for the scenario: on-policy, stale, discrepancy or both."""
    from tokenmdp.exact import inference_copy, stale_copy

    if args.scenario not in SCENARIOS:
        raise ValueError(f"--scenario: expected one of {', '.join(SCENARIOS)}")
    old = policy
    if args.scenario in ("stale", "both"):
        old = stale_copy(mdp, policy, distance=args.stale_distance)
    behavior = old
    if args.scenario in ("discrepancy", "both"):
        rounding = None if args.rounding == "none" else (
            int(args.rounding) if args.rounding.isdigit() else args.rounding)
        behavior = inference_copy(old, rounding=rounding, noise_std=args.noise,
                                  generator=torch.Generator().manual_seed(args.seed + 1))
    return behavior, old


def cmd_compare(args: argparse.Namespace) -> int:
    """Exact bias, variance and MSE of estimators against the true ∇J; table, PNG, CSV, JSON."""
    from tokenmdp import estimators
    from tokenmdp.exact import moments, sequence_kl
    from tokenmdp.exact.step_gradients import state_action_jacobian
    from tokenmdp.plots import plot_comparison

    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.estimators.split(",") if n.strip()]
    ests = [estimators.get(n) for n in names]  # unknown names fail here, before any work
    if args.group_size < 1:
        raise ValueError(f"--group-size: must be >= 1, got {args.group_size}")
    mdp, policy = build_mdp_and_policy(args)
    behavior, old = build_scenario(args, mdp, policy)
    print(mdp)
    print(f"policy {type(policy).__name__} ({sum(p.numel() for p in policy.parameters())} "
          f"parameters), scenario {args.scenario}, G = {args.group_size}")
    if args.scenario != "on-policy":
        print(f"KL(π_θ‖π_old) = {float(sequence_kl(mdp, policy, old).detach()):.4g}, "
              f"KL(π_old‖μ) = {float(sequence_kl(mdp, old, behavior).detach()):.4g}")
    jacobian = state_action_jacobian(mdp, policy)  # shared by every estimator at this θ
    rows = []
    header = (f"{'estimator':<18}{'rel. bias':>11}{'cosine':>9}{'dir. bias':>11}"
              f"{'total var':>12}{'MSE':>12}{'method':>13}{'s':>6}")
    print(header)
    print("-" * len(header))
    for name, est in zip(names, ests):
        t0 = time.perf_counter()
        m = moments(mdp, policy, est, group_size=args.group_size, behavior=behavior, old=old,
                    reference=old, method=args.method, num_samples=args.samples,
                    generator=torch.Generator().manual_seed(args.seed), jacobian=jacobian)
        row = {"estimator": name, **m.summary(), "method": m.method,
               "seconds": time.perf_counter() - t0}
        rows.append(row)
        print(f"{name:<18}{row['relative_bias']:>11.4f}{row['cosine']:>9.4f}"
              f"{row['directional_bias']:>11.4f}{row['total_variance']:>12.4g}"
              f"{row['mse']:>12.4g}{m.method:>13}{row['seconds']:>6.1f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(out / "compare.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    config = {k: v for k, v in vars(args).items() if k != "func"}
    (out / "compare.json").write_text(json.dumps({"config": config, "rows": rows}, indent=2))
    plot_comparison(rows, out / "compare.png",
                    title=f"{mdp!r}, {args.scenario}, G = {args.group_size}")
    print(f"wrote {out / 'compare.png'}, {out / 'compare.csv'}, {out / 'compare.json'}")
    return 0


def cmd_estimators(args: argparse.Namespace) -> int:
    """List the estimator registry as a table."""
    from tokenmdp.estimators import format_table

    print(format_table())
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmdp", description="tokenmdp: exact estimator "
                                     "theory of RL for language models")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("compare", help=cmd_compare.__doc__, description=cmd_compare.__doc__)
    add_mdp_arguments(p)
    group = p.add_argument_group("scenario")
    group.add_argument("--scenario", choices=SCENARIOS, default="both",
                       help="on-policy; stale (π_old ≠ π_θ); discrepancy (μ ≠ π_old); both")
    group.add_argument("--stale-distance", type=float, default=0.5,
                       help="‖θ − θ_old‖ along ∇J for the stale scenarios")
    group.add_argument("--rounding", default="none",
                       help="inference logits: none, bf16, fp16, fp8_e4m3 or a number of bits")
    group.add_argument("--noise", type=float, default=0.3,
                       help="std of the inference engine's fixed logit perturbation")
    p.add_argument("--group-size", type=int, default=4, help="responses per prompt G")
    p.add_argument("--estimators", default=",".join(DEFAULT_ESTIMATORS),
                   help="comma-separated registry names (see `tokenmdp estimators`)")
    p.add_argument("--method", choices=("auto", "exact", "monte_carlo"), default="auto",
                   help="exact enumeration of group draws, or Monte Carlo")
    p.add_argument("--samples", type=int, default=4096, help="Monte Carlo batches")
    p.add_argument("--out", default="compare_out", help="folder for the PNG, CSV and JSON")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads (the exact lab's many small operations run fastest "
                        "on one)")
    p.set_defaults(func=cmd_compare, reward="random", prompts=2, max_len=3)
    p = sub.add_parser("estimators", help=cmd_estimators.__doc__,
                       description=cmd_estimators.__doc__)
    p.set_defaults(func=cmd_estimators)
    p = sub.add_parser("exact", help=cmd_exact.__doc__, description=cmd_exact.__doc__)
    add_mdp_arguments(p)
    p.add_argument("--show", type=int, default=8, help="number of gradient entries to print")
    p.set_defaults(func=cmd_exact)
    from tokenmdp.rl.cli_commands import add_plot_command, add_trainer_commands

    add_trainer_commands(sub)
    add_plot_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tokenmdp`` console script."""
    parser = make_parser()
    args = parser.parse_args(argv)
    from tokenmdp.rl.trainer import NonFiniteError

    try:
        return int(args.func(args) or 0)
    except ValueError as err:  # bad input: a usage error
        parser.exit(2, f"tokenmdp {args.command}: error: {err}\n")
    except NonFiniteError as err:  # a run that diverged: its output folder says how far it got
        parser.exit(1, f"tokenmdp {args.command}: stopped: {err}\n")


if __name__ == "__main__":
    sys.exit(main())
