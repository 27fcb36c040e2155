"""The ``tokenmdp`` command line. Subcommands:

* ``compare`` — the main job: exact bias, variance and MSE of estimators on a small MDP
  (:mod:`tokenmdp.reports.comparison`), a table with a legend and hints (:mod:`tokenmdp.reports.hints`),
  a PNG plot, CSV/JSON files; ``--trl-config`` / ``--verl-config FILE`` add a peer's configured
  estimator as a row (:mod:`tokenmdp.integrations.commands`);
* ``estimators`` — the registry as a table; ``estimators NAME`` — one estimator's card
  (:mod:`tokenmdp.reports.cards`); ``--from-trl`` / ``--from-verl FILE`` — a configuration's;
* ``exact`` — build a small token MDP and a policy, print the exact ``J`` and ``∇J``;
* ``sft`` / ``train`` — the trainer (:mod:`tokenmdp.rl.trainer`), options from
  :class:`tokenmdp.rl.config.TrainConfig`; ``plot`` — training curves (:mod:`tokenmdp.rl.plot`);
* ``tutorials`` — the tutorials and their exercises; ``--student OUT_DIR`` — their student
  editions beside the full ones (:mod:`tokenmdp.course.student_editions`).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import sys
import textwrap
from pathlib import Path

from tokenmdp.integrations import commands as configs
from tokenmdp.reports.comparison import METHODS, POLICIES, REWARDS, SCENARIOS, Setup

__all__ = ["main", "make_parser"]

DEFAULT_ESTIMATORS = ("reinforce", "rloo", "token_is", "sequence_is", "ppo", "grpo", "dr_grpo",
                      "dapo", "gspo", "cispo", "minirl", "minirl_no_is", "minirl_len_norm")
COMPARE = Setup()  # the defaults of `tokenmdp compare`
WRAP = 100  # columns of the sentences around the table


def add_mdp_arguments(parser: argparse.ArgumentParser, *, max_len: int = 4, reward: str = "count",
                      prompts: int = 1) -> None:
    """Options that describe a small exact MDP and its policy (with these defaults)."""
    group = parser.add_argument_group("MDP")
    group.add_argument("--vocab", type=int, default=COMPARE.vocab,
                       help="vocabulary size V (last token EOS)")
    group.add_argument("--max-len", type=int, default=max_len, help="maximum response length L")
    group.add_argument("--reward", choices=REWARDS, default=reward, help="reward function")
    group.add_argument("--prompts", type=int, default=prompts,
                       help="number of prompts (0,), (1,), ... with uniform probabilities")
    group.add_argument("--policy", choices=POLICIES, default=COMPARE.policy, help="policy class")
    group.add_argument("--seed", type=int, default=COMPARE.seed,
                       help="seed of the policy's initialization")


def _setup(args: argparse.Namespace, **fixed) -> Setup:
    """The :class:`Setup` named by the parsed options (``fixed`` for what a command lacks)."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Setup)
             if hasattr(args, f.name)}
    try:
        return Setup(**{**given, **fixed})
    except ValueError as err:  # name the option, not the field
        field, _, rest = str(err).partition(": ")
        raise ValueError(f"--{field.replace('_', '-')}: {rest}") from None


def build_mdp_and_policy(args: argparse.Namespace):
    """The MDP and policy described by :func:`add_mdp_arguments`'s options."""
    from tokenmdp.reports.comparison import build_mdp

    return build_mdp(_setup(args, scenario="on-policy"))


def cmd_exact(args: argparse.Namespace) -> int:
    """Print the MDP's exact objective J and policy gradient ∇J."""
    from tokenmdp.exact import gradient, objective, token_entropy

    if args.show < 0:
        raise ValueError(f"--show: must be >= 0, got {args.show}")
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


#: ``tokenmdp compare``'s columns: header, row key, format (``None``: text).
COLUMNS = (("estimator", "estimator", None), ("rel. bias", "relative_bias", ".4f"),
           ("cosine", "cosine", ".4f"), ("total var", "total_variance", ".4g"),
           ("MSE", "mse", ".4g"), ("c*", "c_star", ".3g"), ("MSE(c*)", "mse_c_star", ".4g"),
           ("method", "method", None), ("s", "seconds", ".1f"))


_MIN_WIDTH = {".4f": 7, ".4g": 9, ".3g": 8, ".1f": 5}
_SE_KEYS = ("relative_bias", "cosine", "total_variance", "mse")  # Moments.summary()'s *_se


def column_widths(names: list[str], monte_carlo: bool) -> list[int]:
    """Widths that fit the header, every name, ``exchangeability`` and the figures (with room for
    ``±se`` when ``monte_carlo``): the table's minimum widths, so that tables line up."""
    widths = []
    for header, key, fmt in COLUMNS:
        if key == "estimator":
            width = max((len(n) for n in names), default=0)
        elif key == "method":
            width = len("exchangeability")
        else:
            width = _MIN_WIDTH[fmt] + (len("±1.2e-05") if monte_carlo and key in _SE_KEYS else 0)
        widths.append(max(width, len(header)))
    return widths


def row_cells(row: dict) -> list[str]:
    """One row's cells; ``value±se`` where the row has a ``*_se`` standard error."""
    cells = []
    for _, key, fmt in COLUMNS:
        if fmt is None:
            cells.append(str(row[key]))
            continue
        text = format(row[key], fmt)
        if row.get(f"{key}_se") is not None:
            text += f"±{row[f'{key}_se']:.2g}"
        cells.append(text)
    return cells


def format_line(cells: list[str], widths: list[int]) -> str:
    """Cells two spaces apart: the first left-aligned, the others right-aligned."""
    return "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                     for i, (cell, w) in enumerate(zip(cells, widths, strict=True)))


def _output_folder(value: str) -> Path:
    """The ``--out`` folder, created; a clear error if it cannot be."""
    if not value.strip():
        raise ValueError("--out: empty; name a folder (the default is compare_out)")
    out = Path(value)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {out} exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--out: cannot create the folder {out} ({err.strerror or err})") from None
    return out


def _write_outputs(out: Path, rows: list[dict], config: dict, title: str) -> None:
    from tokenmdp.reports.plots import plot_comparison

    keys = list(dict.fromkeys(k for r in rows for k in r))
    try:
        with open(out / "compare.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
        (out / "compare.json").write_text(json.dumps({"config": config, "rows": rows}, indent=2))
        plot_comparison(rows, out / "compare.png", title=title)
    except OSError as err:
        raise ValueError(f"--out: cannot write in {out} ({err.strerror or err})") from None


def cmd_compare(args: argparse.Namespace) -> int:
    """Exact bias, variance and MSE of estimators against the true ∇J; table, PNG, CSV, JSON."""
    from tokenmdp import estimators

    if args.threads < 1:
        raise ValueError(f"--threads: must be >= 1, got {args.threads}")
    names = [n.strip() for n in args.estimators.split(",") if n.strip()]
    if not names:
        raise ValueError("--estimators: give at least one registry name")
    for n in names:
        estimators.get(n)  # unknown names fail here, before any work
    extra = configs.configured(args.trl_config, args.verl_config)  # --trl-config, --verl-config
    setup = _setup(args)
    created = not Path(args.out).exists()   # ('' is refused by _output_folder)
    out = _output_folder(args.out)
    try:
        return _compare(args, setup, names, out, extra)
    except BaseException:           # a refused size or Ctrl-C: leave no empty folder behind
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise


def _compare(args: argparse.Namespace, setup: Setup, names: list[str], out: Path, extra) -> int:
    import torch

    from tokenmdp.exact import sequence_kl
    from tokenmdp.reports.comparison import LEGEND, build_lab, describe_scenario, timed_row
    from tokenmdp.reports.hints import hints

    torch.set_num_threads(args.threads)
    lab = build_lab(setup)
    print(lab.mdp)
    print(f"policy {type(lab.policy).__name__} "
          f"({sum(p.numel() for p in lab.policy.parameters())} parameters)")
    print(textwrap.fill(f"scenario {setup.scenario}: {describe_scenario(setup)}", WRAP))
    if setup.scenario != "on-policy":
        print(f"KL(π_θ‖π_old) = {float(sequence_kl(lab.mdp, lab.policy, lab.old).detach()):.4g}, "
              f"KL(π_old‖μ) = {float(sequence_kl(lab.mdp, lab.old, lab.behavior).detach()):.4g}")
    rows, results = [], []
    for name in names:
        row, m = timed_row(lab, name)
        rows.append(row)
        results.append(m)
    rows += configs.rows(lab, extra)[0]
    cells = [row_cells(row) for row in rows]
    widths = [max([w, *(len(c[i]) for c in cells)]) for i, w in enumerate(column_widths(
        [r["estimator"] for r in rows], monte_carlo=setup.method == "monte_carlo"))]
    header = format_line([h for h, _, _ in COLUMNS], widths)
    print(header)
    print("-" * len(header))
    for line in cells:
        print(format_line(line, widths))
    print(f"no step at all (ĝ = 0): MSE = ‖∇J‖² = {rows[0]['no_step_mse']:.4g}")
    print("columns:")
    for column, meaning in LEGEND:
        print(f"  {column:<10} {meaning}")
    for hint in hints(lab, names, results):
        print(textwrap.fill(f"hint: {hint}", WRAP, subsequent_indent="      "))
    configs.print_notes(extra)   # the configured rows' notes (--trl-config, --verl-config)
    config = {k: v for k, v in vars(args).items() if k != "func"}
    _write_outputs(out, rows, config, f"{lab.mdp!r}\nscenario {setup.scenario}, "
                                      f"G = {setup.group_size}")
    print(f"wrote {out / 'compare.png'}, {out / 'compare.csv'}, {out / 'compare.json'}")
    return 0


def cmd_estimators(args: argparse.Namespace) -> int:
    """List the estimator registry as a table, or print one estimator's card."""
    from tokenmdp import estimators

    if args.from_trl is not None or args.from_verl is not None:   # a configuration's card
        return configs.print_card(args)
    if args.name is None:
        print(estimators.format_table(wide=args.wide))
        return 0
    if args.wide:
        raise ValueError("--wide: lists the table; with a NAME the card is already complete")
    estimators.describe(args.name)  # an unknown name fails here, with the registry's hint
    from tokenmdp.reports.cards import card_text, reference_rows

    print(card_text(args.name, reference_rows([args.name]).get(args.name)))  # trees: no row
    return 0


def cmd_tutorials(args: argparse.Namespace) -> int:
    """List the tutorials, or write their student editions (solutions stubbed) and full ones."""
    from tokenmdp.course.student_editions import find_tutorials, read_tutorial, write_editions

    if args.student is None:
        if args.overwrite or args.ipynb:
            raise ValueError("--overwrite, --ipynb: only with --student OUT_DIR")
        for path in find_tutorials(args.source):
            text = read_tutorial(path)
            title = next((line[2:].strip() for line in text.splitlines()
                          if line.startswith("# # Tutorial")), path.stem)
            exercises = sum(line.strip() == "# Check" for line in text.splitlines())
            print(f"{path.name:<60} {title} ({exercises} exercises)")
        return 0
    written = write_editions(args.student, source=args.source, overwrite=args.overwrite,
                             ipynb=args.ipynb)
    out = Path(args.student)
    students = sum(p.parent.name == "student" for p in written)
    print(f"wrote {students} student-edition files to {out / 'student'} and "
          f"{len(written) - students} full-edition files to {out / 'full'}")
    return 0


def make_parser() -> argparse.ArgumentParser:
    """The ``tokenmdp`` argument parser, with one subparser per command.

    Returns
    -------
    argparse.ArgumentParser
        ``parse_args`` gives a namespace whose ``func`` runs the chosen command.
    """
    parser = argparse.ArgumentParser(prog="tokenmdp", description="tokenmdp: exact estimator "
                                     "theory of RL for language models")
    sub = parser.add_subparsers(dest="command", required=True)
    shown = argparse.ArgumentDefaultsHelpFormatter
    p = sub.add_parser("compare", help=cmd_compare.__doc__, description=cmd_compare.__doc__,
                       formatter_class=shown)
    add_mdp_arguments(p, max_len=COMPARE.max_len, reward=COMPARE.reward, prompts=COMPARE.prompts)
    group = p.add_argument_group("scenario")
    group.add_argument("--scenario", choices=SCENARIOS, default=COMPARE.scenario,
                       help="on-policy; stale (π_old ≠ π_θ); discrepancy (μ ≠ π_old); both")
    group.add_argument("--stale-distance", type=float, default=COMPARE.stale_distance,
                       help="‖θ − θ_old‖ along ∇J for the stale scenarios")
    group.add_argument("--rounding", default=COMPARE.rounding,
                       help="inference logits: none, bf16, fp16, fp8_e4m3 or a number of bits")
    group.add_argument("--noise", type=float, default=COMPARE.noise,
                       help="std of the inference engine's fixed logit perturbation")
    p.add_argument("--group-size", type=int, default=COMPARE.group_size,
                   help="responses per prompt G")
    p.add_argument("--estimators", default=",".join(DEFAULT_ESTIMATORS),
                   help="comma-separated registry names (see `tokenmdp estimators`)")
    p.add_argument("--method", choices=METHODS, default=COMPARE.method,
                   help="exact enumeration of group draws, or Monte Carlo (auto: exact when it "
                        "evaluates at most 200000 batches)")
    p.add_argument("--samples", type=int, default=COMPARE.samples, help="Monte Carlo batches")
    p.add_argument("--out", default="compare_out", help="folder for the PNG, CSV and JSON")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads (the exact lab's many small operations run fastest "
                        "on one)")
    p.set_defaults(func=cmd_compare)
    p = sub.add_parser("estimators", help=cmd_estimators.__doc__,
                       description=cmd_estimators.__doc__, formatter_class=shown)
    p.add_argument("name", nargs="?", default=None,
                   help="an estimator's registry name: print its card (formula, paper, "
                        "components, other names, exact figures on the reference MDP)")
    p.add_argument("--wide", action="store_true",
                   help="one column per part (surrogate, advantage, correction, aggregation, "
                        "KL) and the paper, however wide")
    p.set_defaults(func=cmd_estimators)
    configs.add_options(compare=sub.choices["compare"], estimators=p)
    p = sub.add_parser("exact", help=cmd_exact.__doc__, description=cmd_exact.__doc__,
                       formatter_class=shown)
    add_mdp_arguments(p)
    p.add_argument("--show", type=int, default=8, help="number of gradient entries to print")
    p.set_defaults(func=cmd_exact)
    p = sub.add_parser("tutorials", help=cmd_tutorials.__doc__,
                       description=cmd_tutorials.__doc__ + " A student edition keeps every cell "
                       "but the '# Solution' cells, whose code becomes one NaN answer per checked "
                       "variable: each '# Check' cell then fails with its hint until the student "
                       "solves the exercise.", formatter_class=shown)
    p.add_argument("--student", metavar="OUT_DIR", default=None,
                   help="write OUT_DIR/student/NN_*.py (solutions stubbed) and OUT_DIR/full/NN_*.py "
                        "(the tutorials as they are)")
    p.add_argument("--source", default=None,
                   help="the tutorials' folder (default: tutorials/ of this checkout)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty OUT_DIR, replacing files of the same names")
    p.add_argument("--ipynb", action="store_true",
                   help="also write each edition as an .ipynb notebook (needs jupytext)")
    p.set_defaults(func=cmd_tutorials)
    from tokenmdp.rl.cli_commands import add_plot_command, add_trainer_commands

    add_trainer_commands(sub)
    add_plot_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tokenmdp`` console script.

    Parameters
    ----------
    argv : list of str, optional
        The arguments after the program name (default: ``sys.argv[1:]``).

    Returns
    -------
    int
        The exit status of the command (0 on success). A usage error (a ``ValueError``) exits 2
        and a diverged run 1, each with one line on stderr, through ``SystemExit``; a reader
        that closed standard output ends the command quietly with 141 (``BROKEN_PIPE_STATUS``).
    """
    parser = make_parser()
    args = parser.parse_args(argv)
    from tokenmdp.rl.run_state import INTERRUPTED_NOW, INTERRUPTED_STATUS, NonFiniteError, RunInterrupted

    try:
        return int(args.func(args) or 0)
    except ValueError as err:  # bad input: a usage error
        parser.exit(2, f"tokenmdp {args.command}: error: {err}\n")
    except NonFiniteError as err:  # a run that diverged: its output folder says how far it got
        parser.exit(1, f"tokenmdp {args.command}: stopped: {err}\n")
    except RunInterrupted as err:  # Ctrl-C once: stopped at a step with its checkpoint
        parser.exit(INTERRUPTED_STATUS, f"tokenmdp {args.command}: stopped: {err}\n")
    except KeyboardInterrupt:  # Ctrl-C twice, or outside a training run
        parser.exit(INTERRUPTED_STATUS, f"tokenmdp {args.command}: stopped: {INTERRUPTED_NOW}\n")
    except BrokenPipeError:  # the reader went away (`tokenmdp estimators | head`): stop quietly
        _silence_stdout()
        return BROKEN_PIPE_STATUS


#: The exit status when the reader of standard output closed it: 128 + SIGPIPE, as a shell
#: reports for a program the signal ended.
BROKEN_PIPE_STATUS = 141


def _silence_stdout() -> None:
    # Python flushes stdout once more at exit; point it at /dev/null so that flush cannot raise
    # BrokenPipeError again (the recipe of the `signal` module's documentation)
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):   # stdout without a file descriptor (captured): nothing to do
        pass


if __name__ == "__main__":
    sys.exit(main())
