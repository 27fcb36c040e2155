"""How the tutorials print: text with an HTML twin, tables, the alias box, figure finishing.

* :class:`Rendered` — text with an HTML twin: a notebook (and the documentation) shows the HTML,
  a terminal the text; :func:`show` displays either in both places;
* :func:`table` — a quick table of rows under headers, numbers formatted with one spec;
  :class:`Table` — rows under right-aligned, fixed-width columns, each with its own format;
  :class:`Printout` — text laid out by its caller, with its rows kept as numbers for the tests;
* :func:`alias_box` — "what verl / TRL / others call this", from the registry's cards;
* :func:`finish` — title, axis labels, legend and readable ticks on a Matplotlib axis.

Tables keep their rows unformatted (numbers stay numbers, so a test compares them).
"""

from __future__ import annotations

import html
from collections.abc import Sequence

import torch

from tokenmdp import estimators
from tokenmdp.reports import cards

__all__ = ["Printout", "Rendered", "Table", "alias_box", "finish", "show", "table"]

class Rendered:
    """Text with an HTML twin: a notebook shows the HTML, a terminal (``print``) the text.

    Parameters
    ----------
    text : str
        The plain-text form (``str``, ``repr`` and ``print``).
    html_text : str
        The HTML form (``_repr_html_``, what Jupyter and the documentation show).
    """

    def __init__(self, text: str, html_text: str):
        self.text = text
        self.html = html_text

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return self.text

    def _repr_html_(self) -> str:
        return self.html


def _format(value, fmt: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)                         # counts stay counts
    return format(value + 0.0, fmt)               # + 0.0: no "-0" for a negative zero


def table(rows: Sequence[Sequence], headers: Sequence[str], *, fmt: str = ".4g",
          title: str | None = None) -> Rendered:
    """A table of ``rows`` under ``headers``: numbers formatted with ``fmt``, strings as given.

    Parameters
    ----------
    rows : sequence of sequences
        One entry per cell; ``int``/``float``/0-d tensors are formatted, ``str`` kept.
    headers : sequence of str
        Column names (as many as cells in each row).
    fmt : str
        Format spec of the numbers (``format(value, fmt)``), e.g. ``".4f"`` or ``"+.2e"``.
    title : str, optional
        A line above the table.

    Returns
    -------
    Rendered
        The table as aligned text and as an HTML ``<table>``.
    """
    headers = [str(h) for h in headers]
    cells = [[_format(v, fmt) for v in row] for row in rows]
    for i, row in enumerate(cells):
        if len(row) != len(headers):
            raise ValueError(f"rows: row {i} has {len(row)} cells for {len(headers)} headers")
    widths = [max([len(h)] + [len(r[j]) for r in cells]) for j, h in enumerate(headers)]
    lines = [] if title is None else [title]
    lines.append("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return Rendered("\n".join(lines), html_table(headers, cells, title))


#: The space around each HTML table cell (CSS), so that adjacent numbers never run together.
CELL_PADDING = "0.2em 0.9em"


def html_table(headers: Sequence[str], cells: Sequence[Sequence[str]], title: str | None = None
               ) -> str:
    """An HTML ``<table>`` of already formatted cells, right-aligned, with an optional caption.

    Parameters
    ----------
    headers : sequence of str
        The column names.
    cells : sequence of sequences of str
        The formatted cells, row by row (surrounding spaces are dropped).
    title : str, optional
        The caption (none when empty).

    Returns
    -------
    str
        The table's HTML, escaped.
    """
    # the cells carry their own spacing: a site theme or a notebook may pad nothing, and
    # "−0.489" "−0.306" would then read as one number
    pad = f"padding:{CELL_PADDING};white-space:nowrap"
    head = "".join(f'<th style="text-align:right;{pad}">{html.escape(h)}</th>' for h in headers)
    body = "".join("<tr>" + "".join(f'<td style="text-align:right;{pad}">'
                                    f"{html.escape(c.strip())}</td>" for c in row) + "</tr>"
                   for row in cells)
    caption = f"<caption>{html.escape(title)}</caption>" if title else ""
    return (f'<table class="tokenmdp-table">{caption}<thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table>")


def alias_box(names: Sequence[str], *,
              title: str = "What verl / TRL / others call this") -> Rendered:
    """The registry entries ``names`` with their formula and the names other frameworks use.

    Generated from the registry (:func:`tokenmdp.estimators.describe`) through the same parser
    as the estimator cards (:mod:`tokenmdp.reports.cards`), so a box never disagrees with a card.

    Parameters
    ----------
    names : sequence of str
        Registry names; an unknown name raises the registry's ``ValueError`` ("did you mean").
    title : str
        The box's heading.

    Returns
    -------
    Rendered
        The box as text and as HTML.
    """
    if isinstance(names, str):
        raise TypeError("names: expected a sequence of registry names, got a str")
    entries = []
    for name in names:
        estimators.describe(name)              # the registry's error for an unknown name
        doc = cards._docstring_parts(name)
        entries.append((name, doc["formula"], cards._aliases(doc["aliases"])))
    lines = [title, "-" * len(title)]
    for name, formula, aliases in entries:
        lines += [f"{name}: {formula}", *(f"    - {a}" for a in aliases)]
    items = "".join(
        f"<li><code>{html.escape(name)}</code>: <code>{html.escape(formula)}</code><ul>"
        + "".join(f"<li>{html.escape(a)}</li>" for a in aliases) + "</ul></li>"
        for name, formula, aliases in entries)
    box = ('<div style="border:1px solid #999;border-radius:4px;padding:0.5em 1em">'
           f"<strong>{html.escape(title)}</strong><ul>{items}</ul></div>")
    return Rendered("\n".join(lines), box)


def show(obj) -> None:
    """Display ``obj``: rich (HTML) inside IPython/Jupyter, ``print`` in a plain interpreter.

    Parameters
    ----------
    obj : object
        Anything printable; a :class:`Rendered` shows its HTML in a notebook.
    """
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # a plain interpreter without IPython installed
        print(obj)
        return
    if get_ipython() is None:
        print(obj)
    else:
        display(obj)


def finish(ax, *, title: str, xlabel: str, ylabel: str, legend: bool = True,
           legend_fontsize: float = 8) -> None:
    """Give a Matplotlib axis its title, axis labels, legend and readable ticks.

    Ticks get size 9 and the grid a light dotted line.

    Parameters
    ----------
    ax : matplotlib.axes.Axes
    title, xlabel, ylabel : str
        The title and the axis labels.
    legend : bool
        Draw the legend; False only where the axis has a single unlabelled artist (the title
        says what it is).
    legend_fontsize : float
        The legend's font size.
    """
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.tick_params(labelsize=9)
    ax.grid(True, ls=":", lw=0.6, alpha=0.7)
    if legend:
        ax.legend(fontsize=legend_fontsize)


# ---------------------------------------------------------------------- aligned tables
SEPARATOR = "|"


def _cell(value, width: int, spec: str) -> str:
    """``value`` right-aligned in ``width`` characters (a sign option of ``spec`` goes first)."""
    if value is None:
        return " " * width
    if isinstance(value, str):  # names and marks: aligned, whatever the column's number format
        return f"{value:>{width}}"
    if isinstance(value, torch.Tensor):
        value = value.item()
    sign, rest = (spec[0], spec[1:]) if spec and spec[0] in "+- " else ("", spec)
    return format(value, f">{sign}{width}{rest}")


class Table(Rendered):
    """Rows of numbers and names under right-aligned headers, one space between columns.

    Parameters
    ----------
    columns : sequence of (str, int, str) or "|"
        Per column the header, the width and the format spec of its values (``".9f"``,
        ``"+.2e"``, ``""``; a sign option such as ``+`` is placed before the width); the string
        ``"|"`` is a separator column, which takes no value.
    rows : sequence of sequences
        One value per (non-separator) column: a number or 0-d tensor (formatted), a str
        (aligned) or None (left blank). Kept, as tuples, in the attribute ``rows``.
    title : str, optional
        A line printed above the table (``""``: a blank line) and the HTML caption.
    """

    def __init__(self, columns: Sequence, rows: Sequence[Sequence], *, title: str | None = None):
        self.columns = [SEPARATOR if c == SEPARATOR else (str(c[0]), int(c[1]), str(c[2]))
                        for c in columns]
        self.headers = [c[0] for c in self.columns if c != SEPARATOR]
        self.rows = [tuple(row) for row in rows]
        for i, row in enumerate(self.rows):
            if len(row) != len(self.headers):
                raise ValueError(f"rows: row {i} has {len(row)} values for "
                                 f"{len(self.headers)} columns")
        cells = [self._cells(row) for row in self.rows]
        lines = [] if title is None else [title]
        lines.append(" ".join(c if c == SEPARATOR else format(c[0], f">{c[1]}")
                              for c in self.columns))
        lines += [" ".join(row).rstrip() for row in cells]
        values = [[c for c in row if c != SEPARATOR] for row in cells]
        super().__init__("\n".join(lines), html_table(self.headers, values, title))

    def _cells(self, row: tuple) -> list[str]:
        values, cells = iter(row), []
        for c in self.columns:
            cells.append(c if c == SEPARATOR else _cell(next(values), c[1], c[2]))
        return cells


class Printout(Rendered):
    """A printed report and the numbers behind it.

    Parameters
    ----------
    text : str
        What ``print`` shows (also ``str`` and ``repr``; the HTML form is the text, preformatted).
    rows : sequence of sequences
        The values behind the text, unformatted, one tuple per reported item (attribute ``rows``).
    headers : sequence of str, optional
        What each value of a row is (attribute ``headers``).
    """

    def __init__(self, text: str, rows: Sequence[Sequence], headers: Sequence[str] | None = None):
        super().__init__(text, "<pre>" + html.escape(text) + "</pre>")
        self.rows = [tuple(row) for row in rows]
        self.headers = list(headers) if headers is not None else None
