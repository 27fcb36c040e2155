"""The ``tokenmdp sft`` and ``tokenmdp train`` subcommands, generated from :class:`TrainConfig`,
and ``tokenmdp plot`` (training curves of runs, :func:`~tokenmdp.rl.plot.plot_runs`).

Every field of :class:`~tokenmdp.rl.config.TrainConfig` except ``mode`` becomes an option
(``rollout_precision`` → ``--rollout-precision``), its docstring the help text, its default the
default; booleans get ``--flag / --no-flag``. ``tokenmdp cli`` calls
:func:`add_trainer_commands` and :func:`add_plot_command` with its sub-parser collection.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from tokenmdp.rl.config import TrainConfig, field_docs

__all__ = ["add_config_arguments", "add_plot_command", "add_trainer_commands", "config_from_args",
           "run_and_report"]

_TYPES = {"int": int, "float": float, "str": str, "float | None": float, "str | None": str}


def add_config_arguments(parser: argparse.ArgumentParser, *, defaults: dict | None = None,
                         skip: tuple[str, ...] = ("mode",)) -> None:
    """One option per :class:`TrainConfig` field not in ``skip`` (``defaults`` override)."""
    docs = field_docs(TrainConfig)
    defaults = defaults or {}
    for f in dataclasses.fields(TrainConfig):
        if f.name in skip:
            continue
        default = defaults.get(f.name, f.default)
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{docs.get(f.name, '')} (default: {default})"
        if f.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
        elif f.type in _TYPES:
            parser.add_argument(flag, type=_TYPES[f.type], default=default, help=help_text,
                                metavar=f.name.upper())
        else:  # a new field type must be mapped here, not silently dropped
            raise TypeError(f"TrainConfig.{f.name}: no command-line type for {f.type!r}")


def config_from_args(args: argparse.Namespace, mode: str) -> TrainConfig:
    """The :class:`TrainConfig` of parsed options, with ``mode``."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
              if hasattr(args, f.name)}
    return TrainConfig(**{**values, "mode": mode})


def run_and_report(cfg: TrainConfig) -> int:
    """Run ``cfg`` and print a one-line summary (on rank 0 only, under ``torchrun``); 0."""
    from tokenmdp.rl.trainer import train

    rows = train(cfg)
    if rows and int(os.environ.get("RANK", "0")) == 0:  # the process group is gone by now
        last = rows[-1]
        shown = {k: last[k] for k in ("step", "reward", "loss", "eval_accuracy") if k in last}
        print(f"{cfg.mode}: {len(rows)} steps, last {shown}; wrote {cfg.out_dir}")
    return 0


def _run(args: argparse.Namespace) -> int:
    return run_and_report(config_from_args(args, args.trainer_mode))


def add_trainer_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``sft`` (supervised warm start) and ``train`` (RL) to ``tokenmdp``'s sub-parsers."""
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
    """Add ``plot`` (training curves of runs from their ``metrics.jsonl``) to the sub-parsers."""
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
