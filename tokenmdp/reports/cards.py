"""Estimator cards: one page per registry entry, generated from the registry itself.

A card gives the entry's summary (its factory's docstring), formula, paper, the built
:class:`~tokenmdp.estimators.Estimator`'s parts with their hyperparameters, the batch fields it
needs, the names other frameworks use, and one live row of exact figures on the reference MDP
(:data:`REFERENCE`, the defaults of ``tokenmdp compare``).

* :func:`reference_rows` — relative bias, cosine, total variance, MSE, ``c*`` and ``MSE(c*)``;
* :func:`card_text` — the card for a terminal (``tokenmdp estimators NAME``);
* :func:`card_markdown` — the card as a MyST-Markdown page for the documentation, its formula
  also as math (:mod:`~tokenmdp.reports.card_math`; the terminal card keeps the plain text).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import textwrap
from collections.abc import Mapping, Sequence

from tokenmdp import estimators
from tokenmdp.reports.card_math import NOTATION, math_block
from tokenmdp.reports.comparison import LEGEND, Setup, build_lab, describe_scenario, timed_row

__all__ = ["REFERENCE", "Reference", "card_markdown", "card_text", "reference_rows"]

WIDTH = 90  # columns of a terminal card
_PARTS = ("surrogate", "advantage", "correction", "aggregation", "kl")
#: The reference row's figures: label, row key, format.
_FIGURES = (("rel. bias", "relative_bias", ".4f"), ("cosine", "cosine", ".4f"),
            ("total var", "total_variance", ".4g"), ("MSE", "mse", ".4g"),
            ("c*", "c_star", ".3g"), ("MSE(c*)", "mse_c_star", ".4g"),
            ("‖∇J‖²", "no_step_mse", ".4g"), ("method", "method", "s"))


@dataclasses.dataclass(frozen=True)
class Reference:
    """The MDP, policy and scenario of a card's live row.

    Parameters
    ----------
    setup : Setup
        What is built (a ``tokenmdp.reports.comparison.Setup``).
    """

    setup: Setup

    @property
    def description(self) -> str:
        """The reference in one sentence, generated from ``setup``."""
        s = self.setup
        method = "exact moments" if s.method == "exact" else f"moments by {s.method}"
        return (f"The defaults of `tokenmdp compare` with {method}: a token MDP with {s.vocab} "
                f"tokens (the last is EOS), responses of at most {s.max_len} tokens, {s.prompts} "
                f"equally likely prompts and the `{s.reward}` reward; a {s.policy} policy from "
                f"seed {s.seed}; scenario {s.scenario}: {describe_scenario(s)}")


#: The reference of every card's live row: ``tokenmdp compare``'s defaults with exact moments
#: (vocabulary 3, responses up to 3 tokens, 2 prompts, random reward, tabular policy from seed 0,
#: π_old stale by 0.5 along ∇J, μ = π_old with logit noise of std 0.3, G = 4).
REFERENCE = Reference(Setup(method="exact"))


def _check_name(name: str) -> None:
    estimators.describe(name)  # raises with the registry's "did you mean" hint


def reference_rows(names: Sequence[str] | None = None) -> dict[str, dict]:
    """Exact figures of registry estimators on :data:`REFERENCE`, one row per name.

    One MDP, policy, ``π_old``, ``μ`` and state-action Jacobian are shared by every estimator, as
    ``tokenmdp compare`` does (all 30 entries take about two seconds on one CPU core).

    Parameters
    ----------
    names : sequence of str, optional
        Registry names (default: every name that takes independent groups,
        :func:`tokenmdp.estimators.names`).

    Returns
    -------
    dict of str to dict
        Per name, ``tokenmdp.reports.comparison.summary_row``: ``Moments.summary()`` (relative bias,
        cosine, total variance, MSE, ...) with ``c_star``, ``mse_c_star``, ``no_step_mse``,
        ``method`` and ``seconds``. An entry that needs a tree batch
        (``estimators.names(trees=True)``) has no row: the reference draws independent groups.
    """
    if isinstance(names, str):
        raise TypeError("names: expected a sequence of registry names, got a str")
    names = estimators.names() if names is None else tuple(names)
    for name in names:
        _check_name(name)
    trees = set(estimators.names(trees=True))
    names = [name for name in names if name not in trees]
    if not names:
        return {}
    lab = build_lab(REFERENCE.setup)
    return {name: timed_row(lab, name)[0] for name in names}


def _docstring_parts(name: str) -> dict[str, str]:
    """Summary, formula, paper and other names from the registry's docstring of ``name``."""
    paragraphs = inspect.cleandoc(estimators.describe(name)).split("\n\n")
    out = {"summary": " ".join(paragraphs[0].split())}
    for label, key in (("Formula: ", "formula"), ("Paper: ", "paper"),
                       ("Other names: ", "aliases")):
        found = [p for p in paragraphs if p.startswith(label)]
        if len(found) != 1:
            raise ValueError(f"name: the registry docstring of {name!r} has no single {label!r}")
        out[key] = " ".join(found[0][len(label):].split())
    return out


def _setting(value) -> str:
    """A part's hyperparameters, ``Name(field=value, ...)``, functions by name, enums by value."""
    fields = []
    for f in dataclasses.fields(value):
        v = getattr(value, f.name)
        # functions by name (a part holding a part, such as a wrapped surrogate, by its repr)
        v = (v.__name__ if callable(v) and hasattr(v, "__name__")
             else (v.value if isinstance(v, enum.Enum) else v))
        fields.append(f"{f.name}={v!r}" if isinstance(v, str) else f"{f.name}={v}")
    return f"{type(value).__name__}({', '.join(fields)})"


def _components(name: str) -> list[tuple[str, str, str]]:
    """``(part, description, hyperparameters)`` of the built estimator, plus its batch needs."""
    est = estimators.get(name)
    rows = []
    for part in _PARTS:
        value = getattr(est, part)
        if value is None:
            rows.append((part, "none", ""))
        elif part == "aggregation":
            rows.append((part, value.value, f"Aggregation.{value.name}"))
        else:
            rows.append((part, value.describe(), _setting(value)))
    needs = sorted(set(est.requires("prepare") + est.requires("loss")))
    if getattr(est.advantage, "needs_tree", False):
        needs.insert(0, "a tree batch (token_extras['tree_node'], tokenmdp.trees)")
    rows.append(("needs", ", ".join(needs) if needs else "tokens, rewards and groups only", ""))
    return rows


def _aliases(text: str) -> list[str]:
    """The registry's other names, one item per framework (``;`` outside parentheses)."""
    if text.startswith("--"):
        return [f"none recorded {text[2:].strip()}".strip()]
    items, depth, current = [], 0, ""
    for char in text:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == ";" and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    return [item.strip() for item in [*items, current] if item.strip()]


def _figures(row: Mapping) -> list[tuple[str, str]]:
    missing = [key for _, key, _ in _FIGURES if key not in row]
    if missing:
        raise ValueError(f"row: missing {', '.join(missing)} (use reference_rows)")
    return [(label, format(row[key], fmt)) for label, key, fmt in _FIGURES]


def card_text(name: str, row: Mapping | None = None) -> str:
    """The card of estimator ``name`` as plain text (about 90 columns).

    Parameters
    ----------
    name : str
        A registry name.
    row : mapping, optional
        Its reference row (:func:`reference_rows`), printed at the end when given.

    Returns
    -------
    str
        The card, lines joined by newlines (no trailing newline).
    """
    doc = _docstring_parts(name)
    wrap = textwrap.TextWrapper(WIDTH, subsequent_indent="  ", break_on_hyphens=False)
    lines = [name, "=" * len(name),
             *textwrap.wrap(doc["summary"].replace("``", "`"), WIDTH, break_on_hyphens=False), "",
             *wrap.wrap(f"formula: {doc['formula']}"), *wrap.wrap(f"paper:   {doc['paper']}"),
             "", "components:"]
    parts = _components(name)
    width = max(len(p) for p, _, _ in parts)
    indent = " " * (width + 4)
    for part, text, setting in parts:
        lines += textwrap.wrap(f"{part:<{width}}  {text}", WIDTH, initial_indent="  ",
                               subsequent_indent=indent)
        lines += textwrap.wrap(setting, WIDTH, initial_indent=indent, subsequent_indent=indent)
    lines += ["", "other names:"]
    for alias in _aliases(doc["aliases"]):
        lines += textwrap.wrap(alias, WIDTH, initial_indent="  - ", subsequent_indent="    ")
    if row is not None:
        lines += ["", "on the reference MDP:",
                  *textwrap.wrap(REFERENCE.description, WIDTH, initial_indent="  ",
                                 subsequent_indent="  ")]
        figures = _figures(row)
        cells = [[label for label, _ in figures], [value for _, value in figures]]
        widths = [max(len(c[i]) for c in cells) for i in range(len(figures))]
        for line in cells:
            lines.append("  " + "  ".join(c.rjust(w) for c, w in zip(line, widths)))
        lines += [f"  {column:<10} {meaning}" for column, meaning in LEGEND[4:6]]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def card_markdown(name: str, row: Mapping | None = None) -> str:
    """The card of estimator ``name`` as a MyST-Markdown page (for ``docs/estimators/``).

    A ``# name`` title, the summary, the loss as a ``$$`` math block composed from the estimator's
    parts (:func:`~tokenmdp.reports.card_math.math_block`, rendered by MathJax) with a sentence
    on its notation, the registry's formula as a ``text`` code block (Unicode, as the terminal
    card prints it), the paper, a components table, the other names and, when ``row`` is given,
    the reference row as a table with a sentence saying what the reference MDP is.

    Parameters
    ----------
    name : str
        A registry name.
    row : mapping, optional
        Its reference row (:func:`reference_rows`); without it the page has no figures.

    Returns
    -------
    str
        The page's MyST-Markdown source, ending with a newline.
    """
    doc = _docstring_parts(name)
    md = [f"# {name}", "", doc["summary"], "", math_block(name), "",
          f"{NOTATION} The registry's formula in plain text:", "",
          "```text", doc["formula"], "```", "",
          f"**Paper:** {doc['paper']}", "", "## Components", "",
          "| part | what it does | hyperparameters |", "| --- | --- | --- |"]
    for part, text, setting in _components(name):
        md.append(f"| {part} | {_cell(text)} | {f'`{_cell(setting)}`' if setting else ''} |")
    md += ["", "## Other names", ""]
    md += [f"- {_cell(alias)}" for alias in _aliases(doc["aliases"])]
    if row is not None:
        figures = _figures(row)
        md += ["", "## On the reference MDP", "", REFERENCE.description, "",
               "| " + " | ".join(label for label, _ in figures) + " |",
               "| " + " | ".join("---:" for _ in figures) + " |",
               "| " + " | ".join(value for _, value in figures) + " |", "",
               f"`c*` is {LEGEND[4][1]}; `MSE(c*)` is {LEGEND[5][1]}."]
    md += ["", f"Build it with ``tokenmdp.estimators.get({name!r})`` "
               "(see {py:func}`tokenmdp.estimators.get`).", ""]
    return "\n".join(md)
