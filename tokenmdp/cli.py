"""The ``tokenmdp`` command line.

Subcommands:

* ``tokenmdp exact`` — build a small token MDP and a policy, print the exact ``J`` and ``∇J``;
"""

from __future__ import annotations

import argparse
import sys

import torch

REWARDS = ("count", "exact", "contains", "parity", "length", "random")
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

    if not 1 <= args.prompts <= args.vocab - 1:
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


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmdp", description="tokenmdp: exact estimator "
                                     "theory of RL for language models")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("exact", help=cmd_exact.__doc__, description=cmd_exact.__doc__)
    add_mdp_arguments(p)
    p.add_argument("--show", type=int, default=8, help="number of gradient entries to print")
    p.set_defaults(func=cmd_exact)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tokenmdp`` console script."""
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as err:
        parser.exit(2, f"tokenmdp {args.command}: error: {err}\n")


if __name__ == "__main__":
    sys.exit(main())
