"""The registry of published estimators, at the edge of the package: names → compositions.

This is the only place where an estimator is looked up by a string. Each entry is a factory with
a docstring giving its summary and default hyperparameters as the papers give them; the
decorator appends its formula, paper and the names other frameworks use (as of late 2025). The
``±tis`` / ``±mis`` variants are generated from the bases.

>>> from tokenmdp import estimators
>>> estimators.get("dapo").surrogate
PPOClip(eps_low=0.2, eps_high=0.28, dual_clip=None)
"""

from __future__ import annotations

import difflib
import shutil

from tokenmdp.estimators.estimator import Estimator
from tokenmdp.estimators.registry import baselines, classic, zoo  # noqa: F401  (registers the entries)
from tokenmdp.estimators.registry import trees as _tree_entries  # noqa: F401  (registered last)
from tokenmdp.estimators.registry.entry import _ENTRIES, Entry

__all__ = ["TABLE_WIDTHS", "describe", "format_table", "get", "names", "resolve"]


def names(*, trees: bool | None = False) -> tuple[str, ...]:
    """Registered names, bases first: by default those that take any batch.

    Parameters
    ----------
    trees : bool or None, default False
        False: the entries that take any batch (independent groups included); True: the entries
        that need a tree batch (:attr:`Entry.needs_tree`, ``tokenmdp.estimators.registry.trees``:
        their advantages read ``token_extras['tree_node']``); None: every entry.

    Returns
    -------
    tuple of str
        The names, in registration order.
    """
    if trees is not None and not isinstance(trees, bool):
        raise TypeError(f"trees: expected a bool or None, got {type(trees).__name__}")
    return tuple(name for name, entry in _ENTRIES.items()
                 if trees is None or entry.needs_tree == trees)


def _entry(name: str) -> Entry:
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str, got {type(name).__name__}")
    if name not in _ENTRIES:
        close = difflib.get_close_matches(name, _ENTRIES, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(f"name: unknown estimator {name!r}{hint}; known: {', '.join(_ENTRIES)}")
    return _ENTRIES[name]


def get(name: str) -> Estimator:
    """The registered estimator ``name`` (a fresh frozen :class:`Estimator`).

    Parameters
    ----------
    name : str
        A registered name (:func:`names`); an unknown one raises ``ValueError`` with the
        closest matches.

    Returns
    -------
    Estimator
        The estimator, with the paper's hyperparameters.
    """
    return _entry(name).build()


def describe(name: str) -> str:
    """The docstring of entry ``name``: summary, defaults, formula, paper, other names.

    Parameters
    ----------
    name : str
        A registered name (:func:`names`).

    Returns
    -------
    str
        The docstring, paragraphs separated by blank lines.
    """
    return _entry(name).build.__doc__ or ""


#: The widths ``tokenmdp estimators`` fits its table to (a terminal's columns, clamped).
TABLE_WIDTHS = (80, 120)


#: Words ending in a full stop that do not end a sentence.
_ABBREVIATIONS = ("al.", "i.e.", "e.g.", "cf.", "vs.", "Sec.", "Eq.")


def _summary(entry: Entry) -> str:
    """The first sentence of an entry's builder docstring, on one line, markup dropped: it ends
    at the first full stop outside parentheses that is not an abbreviation ("et al.", "i.e.")."""
    text = " ".join((entry.build.__doc__ or entry.formula).split()).replace("``", "")
    depth = 0
    for i, char in enumerate(text):
        depth += (char == "(") - (char == ")")
        if char == "." and depth == 0 and text[i + 1:i + 2] in ("", " ") \
                and not text[:i + 1].endswith(_ABBREVIATIONS):
            return text[:i + 1]
    return text


def _fit(cell: str, width: int) -> str:
    return cell if len(cell) <= width else cell[:max(width - 1, 0)].rstrip() + "…"


def format_table(*, width: int | None = None, wide: bool = False) -> str:
    """Every registered estimator as a plain-text table (for ``tokenmdp estimators``).

    Parameters
    ----------
    width : int, optional
        The line width to fit (default: the terminal's, 100 when there is none, clamped to
        :data:`TABLE_WIDTHS`): each line is the name, the aggregation and a one-line summary,
        cut with "…" where it would not fit, and a last line says where the rest is
        (``tokenmdp estimators NAME`` prints the whole card).
    wide : bool, default False
        Instead one column per part (surrogate, advantage, correction, aggregation, KL) and the
        paper, however wide (``tokenmdp estimators --wide``).

    Returns
    -------
    str
        One line per estimator under a header and a rule.
    """
    if width is None:
        low, high = TABLE_WIDTHS
        width = min(max(shutil.get_terminal_size((100, 24)).columns, low), high)
    if isinstance(width, bool) or not isinstance(width, int) or width < 40:
        raise ValueError(f"width: expected an int >= 40, got {width!r}")
    if wide:
        header = ("name", "surrogate", "advantage", "correction", "aggregation", "KL", "paper")
        rows = [header]
        for entry in _ENTRIES.values():
            est = entry.build()
            rows.append((entry.name, est.surrogate.describe(), est.advantage.describe(),
                         est.correction.describe(), est.aggregation.value,
                         est.kl.describe() if est.kl is not None else "none", entry.paper))
    else:
        header = ("name", "aggregation", "what it is")
        rows = [header] + [(e.name, e.build().aggregation.value, _summary(e))
                           for e in _ENTRIES.values()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    if not wide:
        widths[-1] = max(width - sum(widths[:-1]) - 2 * (len(widths) - 1), 10)
        rows = [(*row[:-1], _fit(row[-1], widths[-1])) for row in rows]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if not wide:
        lines += ["", f"{len(rows) - 1} estimators. `tokenmdp estimators NAME`: one's card "
                  "(formula, parts, paper,", "other names, exact figures); --wide: every part "
                  "in its own column."]
    return "\n".join(lines)


def resolve(estimator: Estimator | str) -> Estimator:
    """``estimator``, or the registry's estimator of that name.

    Parameters
    ----------
    estimator : Estimator or str
        An estimator (returned as it is) or a registry name (:func:`names`).

    Returns
    -------
    Estimator

    Raises
    ------
    TypeError
        ``estimator``: neither an Estimator nor a str.
    ValueError
        ``estimator``: an unknown registry name.
    """
    if isinstance(estimator, Estimator):
        return estimator
    if isinstance(estimator, str):
        return get(estimator)
    raise TypeError(f"estimator: expected an Estimator or a registry name, got "
                    f"{type(estimator).__name__}")
