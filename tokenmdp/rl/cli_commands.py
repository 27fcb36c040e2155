"""The ``tokenmdp sft`` and ``tokenmdp train`` subcommands, generated from :class:`TrainConfig`,
and ``tokenmdp plot`` (training curves of runs, :func:`~tokenmdp.rl.plot.plot_runs`).

Every field of :class:`~tokenmdp.rl.config.TrainConfig` except ``mode`` becomes an option
(:mod:`tokenmdp.rl.options`, re-exported here); :func:`run_and_report` comes from the trainer
(which does not import this module). ``tokenmdp cli`` calls
:func:`add_trainer_commands` and :func:`add_plot_command` with its sub-parser collection.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenmdp.rl.options import add_config_arguments, config_from_args
from tokenmdp.rl.trainer import run_and_report

__all__ = ["add_plot_command", "add_trainer_commands"]


def _run(args: argparse.Namespace) -> int:
    return run_and_report(config_from_args(args, args.trainer_mode))


def add_trainer_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``sft`` (supervised warm start) and ``train`` (RL) to ``tokenmdp``'s sub-parsers.

    Parameters
    ----------
    sub : argparse._SubParsersAction
        What ``ArgumentParser.add_subparsers`` returned.
    """
    p = sub.add_parser("sft", help="supervised fine-tuning on a task's demonstrations",
                       description="SFT: the trainer loop with correct answers and A = 1; "
                                   "its checkpoint starts `tokenmdp train --init`.")
    add_config_arguments(p, defaults={"out_dir": "runs/sft"})
    p.set_defaults(func=_run, trainer_mode="sft")
    p = sub.add_parser("train", help="RL on a verifiable task with any estimator",
                       description="RL: rollout, reward, packed estimator updates, metrics.")
    add_config_arguments(p)
    p.set_defaults(func=_run, trainer_mode="rl")


def _plot(args: argparse.Namespace) -> int:
    from tokenmdp.rl.plot import plot_runs

    out = Path(args.out) if args.out else (
        Path(args.run_dirs[0]) / "curves.png" if len(args.run_dirs) == 1 else Path("curves.png"))
    plot_runs(args.run_dirs, out, metrics=args.metrics)
    print(f"wrote {out}")
    return 0


def add_plot_command(sub: argparse._SubParsersAction) -> None:
    """Add ``plot`` (training curves of runs from their ``metrics.jsonl``) to the sub-parsers.

    Parameters
    ----------
    sub : argparse._SubParsersAction
        What ``ArgumentParser.add_subparsers`` returned.
    """
    p = sub.add_parser("plot", help="training curves of runs (their metrics.jsonl) as a PNG",
                       description="Plot metrics.jsonl of one or more runs against the step, one "
                                   "panel per metric, one line per run.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders (--out-dir of train)")
    p.add_argument("--out", metavar="PNG", default=None,
                   help="the PNG to write (default: RUN_DIR/curves.png for one run, "
                        "curves.png for several)")
    p.add_argument("--metrics", default=None, metavar="A,B",
                   help="comma-separated metrics, one panel each (default: the standard panels "
                        "that some run logged)")
    p.set_defaults(func=_plot)
