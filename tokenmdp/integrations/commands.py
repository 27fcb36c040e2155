"""The command line's configuration options: a peer's estimator as a ``compare`` row or a card.

``tokenmdp compare --trl-config FILE`` / ``--verl-config FILE`` add the configured estimator as
a row after the registry's, its notes under the table; ``tokenmdp estimators --from-trl FILE`` /
``--from-verl FILE`` print its card. :mod:`tokenmdp.cli` calls these functions.
"""

from __future__ import annotations

import argparse
import textwrap

from tokenmdp.integrations.common import ConfiguredEstimator
from tokenmdp.integrations.trl import estimator_from_trl
from tokenmdp.integrations.verl import estimator_from_verl

__all__ = ["add_card_options", "add_compare_options", "add_options", "card", "configured", "notes",
           "print_card", "print_notes", "rows"]

WRAP = 100


def add_compare_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--trl-config`` and ``--verl-config`` to ``tokenmdp compare``'s parser.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The ``compare`` subparser.
    """
    parser.add_argument("--trl-config", metavar="FILE", default=None,
                        help="a TRL GRPOConfig (YAML/JSON): add the estimator it computes as a row")
    parser.add_argument("--verl-config", metavar="FILE", default=None,
                        help="a verl trainer or actor config (YAML/JSON): add its estimator as a row")


def add_card_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--from-trl`` and ``--from-verl`` to ``tokenmdp estimators``' parser.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The ``estimators`` subparser.
    """
    parser.add_argument("--from-trl", metavar="FILE", default=None,
                        help="print the card of the estimator a TRL GRPOConfig (YAML/JSON) computes")
    parser.add_argument("--from-verl", metavar="FILE", default=None,
                        help="print the card of the estimator a verl config (YAML/JSON) trains")


def configured(trl: str | None, verl: str | None, *, flags=("--trl-config", "--verl-config")
               ) -> list[ConfiguredEstimator]:
    """The configured estimators of the given files, in the order TRL, verl.

    Parameters
    ----------
    trl, verl : str or None
        File paths (None: not given).
    flags : tuple of str
        The options' names, for the error message.

    Returns
    -------
    list of ConfiguredEstimator
        One per file given.

    Raises
    ------
    ValueError
        A bad file or field, prefixed with the option that named the file.
    """
    out = []
    for path, build, flag in ((trl, estimator_from_trl, flags[0]),
                              (verl, estimator_from_verl, flags[1])):
        if path is None:
            continue
        try:
            out.append(build(path))
        except (ValueError, TypeError) as err:
            raise ValueError(f"{flag} {path}: {err}") from None
    return out


def rows(lab, extra: list[ConfiguredEstimator]) -> tuple[list[dict], list]:
    """The compare rows (and moments) of the configured estimators in ``lab``.

    Parameters
    ----------
    lab : tokenmdp.reports.comparison.Lab
        The built comparison.
    extra : list of ConfiguredEstimator
        The configured estimators.

    Returns
    -------
    (list of dict, list of Moments)
        One row each, named as the estimator.
    """
    from tokenmdp.reports.comparison import timed_row

    measured = [timed_row(lab, c.estimator) for c in extra]
    return [row for row, _ in measured], [m for _, m in measured]


def notes(extra: list[ConfiguredEstimator]) -> list[str]:
    """The lines printed under the compare table for the configured rows.

    Parameters
    ----------
    extra : list of ConfiguredEstimator
        The configured estimators.

    Returns
    -------
    list of str
        Wrapped lines: what each equals, then its notes.
    """
    lines = []
    for c in extra:
        same = f"equals the registry's {c.same_as}" if c.same_as else "no registry entry equals it"
        lines += textwrap.wrap(f"{c.estimator.name} (from a {c.peer} config): {same}; "
                               f"`tokenmdp estimators --from-{c.peer.split()[0]} FILE` prints "
                               "its card", WRAP, subsequent_indent="      ")
        for note in c.notes:
            lines += textwrap.wrap(note, WRAP, initial_indent="  - ", subsequent_indent="    ")
    return lines


def card(trl: str | None, verl: str | None) -> str:
    """The card of the estimator ``--from-trl`` or ``--from-verl`` names (exactly one).

    Parameters
    ----------
    trl, verl : str or None
        File paths (None: not given).

    Returns
    -------
    str
        The card.

    Raises
    ------
    ValueError
        Both options or a bad file.
    """
    if trl is not None and verl is not None:
        raise ValueError("--from-trl, --from-verl: give one of them")
    (c,) = configured(trl, verl, flags=("--from-trl", "--from-verl"))
    return c.card()


def add_options(*, compare: argparse.ArgumentParser, estimators: argparse.ArgumentParser) -> None:
    """Add the configuration options to ``tokenmdp compare`` and ``tokenmdp estimators``.

    Parameters
    ----------
    compare, estimators : argparse.ArgumentParser
        The two subparsers.
    """
    add_compare_options(compare)
    add_card_options(estimators)


def print_notes(extra: list[ConfiguredEstimator]) -> None:
    """Print :func:`notes` (nothing when no configuration was given).

    Parameters
    ----------
    extra : list of ConfiguredEstimator
        The configured estimators.
    """
    for line in notes(extra):
        print(line)


def print_card(args: argparse.Namespace) -> int:
    """``tokenmdp estimators --from-trl FILE`` / ``--from-verl FILE``: print the card.

    Parameters
    ----------
    args : argparse.Namespace
        The parsed options (``name`` and ``wide`` must be unset).

    Returns
    -------
    int
        0.

    Raises
    ------
    ValueError
        A NAME or ``--wide`` given too, both options, or a bad file.
    """
    if args.name is not None or args.wide:
        raise ValueError("--from-trl/--from-verl: print a configuration's card alone (no NAME, "
                         "no --wide)")
    print(card(args.from_trl, args.from_verl))
    return 0
