"""Shared by the tutorial builders (``_build_0N.py``): collect cells, write a notebook.

Each builder calls ``md(...)`` and ``code(...)`` in reading order, then ``write(path)``, which
saves the notebook without outputs (the test suite executes it with ``pytest --nbmake``).
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook


class NotebookBuilder:
    """The cells of one notebook, in order."""

    def __init__(self) -> None:
        self.cells: list[tuple[str, str]] = []

    def md(self, text: str) -> None:
        """Append a markdown cell."""
        self.cells.append(("md", text.strip("\n")))

    def code(self, text: str) -> None:
        """Append a code cell."""
        self.cells.append(("code", text.strip("\n")))

    def build(self) -> nbformat.NotebookNode:
        """The notebook, validated, with a Python 3 kernel and no outputs."""
        nb = new_notebook()
        nb.cells = [new_markdown_cell(src) if kind == "md" else new_code_cell(src)
                    for kind, src in self.cells]
        for i, cell in enumerate(nb.cells):  # stable ids: regenerating changes no line
            cell["id"] = f"cell-{i:03d}"
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                     "language": "python"}
        nb.metadata["language_info"] = {"name": "python"}
        nbformat.validate(nb)
        return nb

    def write(self, path: Path) -> None:
        """Write the notebook to ``path`` and say so."""
        notebook = self.build()
        nbformat.write(notebook, path)
        print(f"wrote {path} ({len(notebook.cells)} cells)")
