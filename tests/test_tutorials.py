"""The tutorials are text (jupytext percent scripts): each one reads as a notebook and runs clean.

The same sources are rendered by the documentation build (MyST-NB); this test executes them in a
Jupyter kernel, cell by cell, as a student would, so a tutorial that stops working fails the suite.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"
SOURCES = sorted(TUTORIALS.glob("[0-9][0-9]_*.py"))
CELL_TIMEOUT_S = 600  # a guard against a hung kernel, not a speed target (about a minute each)


def test_every_tutorial_is_a_numbered_percent_script():
    assert len(SOURCES) >= 5
    for path in SOURCES:
        text = path.read_text()
        assert "formats: py:percent" in text, path.name
        notebook = jupytext.reads(text, fmt="py:percent")
        kinds = [cell.cell_type for cell in notebook.cells]
        assert kinds[0] == "markdown" and "code" in kinds, path.name
        title = notebook.cells[0].source.splitlines()[0]
        number = int(path.name[:2])
        assert re.match(rf"# Tutorial {number} — \S", title), (path.name, title)


@pytest.mark.slow
@pytest.mark.parametrize("path", SOURCES, ids=[p.stem for p in SOURCES])
def test_tutorial_executes(path):
    notebook = jupytext.read(path, fmt="py:percent")
    client = nbclient.NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(TUTORIALS)}})
    client.execute()  # raises CellExecutionError naming the failing cell
    errors = [out for cell in notebook.cells if cell.cell_type == "code"
              for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    assert not errors
