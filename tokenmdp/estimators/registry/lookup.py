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

from tokenmdp.estimators.estimator import Estimator
from tokenmdp.estimators.registry import baselines, classic, zoo  # noqa: F401  (registers the entries)
from tokenmdp.estimators.registry.entry import _ENTRIES, Entry

__all__ = ["describe", "format_table", "get", "names", "resolve"]


def names() -> tuple[str, ...]:
    """Every registered name, bases first.

    Returns
    -------
    tuple of str
        The names, in registration order.
    """
    return tuple(_ENTRIES)


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


def format_table() -> str:
    """Every registered estimator as a plain-text table (for ``tokenmdp estimators``).

    Returns
    -------
    str
        One line per estimator (name, its five parts, paper) under a header and a rule.
    """
    header = ("name", "surrogate", "advantage", "correction", "aggregation", "KL", "paper")
    rows = [header]
    for entry in _ENTRIES.values():
        est = entry.build()
        rows.append((entry.name, est.surrogate.describe(), est.advantage.describe(),
                     est.correction.describe(), est.aggregation.value,
                     est.kl.describe() if est.kl is not None else "none", entry.paper))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
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
