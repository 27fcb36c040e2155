"""The tutorials' printouts: tables under right-aligned, fixed-width columns, and free-form reports.

Both keep their rows unformatted (numbers stay numbers, so a test compares them). A
:class:`Table` prints as aligned text (``print``, ``str``, a terminal) and shows as an HTML
``<table>`` in a notebook or the documentation; a :class:`Printout` is text laid out by its
caller, shown preformatted.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

import torch

from tokenmdp.notebook import Rendered, html_table

__all__ = ["Printout", "Table"]

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
