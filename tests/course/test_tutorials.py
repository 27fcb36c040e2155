"""The tutorials are text (jupytext percent scripts): each one reads as a notebook and runs clean.

The same sources are rendered by the documentation build (MyST-NB), which executes them in a
Jupyter kernel, cell by cell, as a student would, and keeps each executed notebook in its cache
(``docs/_build/.jupyter_cache``, keyed by the hash of the code cells). The tests below read the
executed notebook from that cache when the cache holds the current source (CI builds the docs
first, so each tutorial is executed once); without a matching entry they execute the tutorial
themselves. Either way a tutorial that stops working fails the suite. CI sets
``TOKENMDP_TUTORIALS_FROM_DOCS=1``, under which a tutorial missing from the cache fails.

Exercises follow one convention, so that the test can find their solutions:

* an exercise is two consecutive code cells, a **solution** cell whose first line is
  ``# Solution`` and a **check** cell whose first line is ``# Check``;
* the check cell holds only ``tokenmdp.check("<exercise>", <name>)`` calls (and comments), each
  ``<name>`` a variable that the solution cell assigns at top level;
* every tutorial has two to four exercises with a numeric answer, and every registered
  ``trNN_*`` exercise is checked in tutorial ``NN``;
* every *Predict* question of the text is answered in code: the next solution cell records the
  prediction in a variable, and its check cell checks it with a ``trNN_predict_*`` prediction
  (:class:`tokenmdp.course.exercises.Prediction`).

In the executed notebook every check cell must have printed ``<exercise>: right`` for each of
its calls: the solution's own variable passed its check. That each check rejects the plausible
wrong answers is ``tests/course/exercises/``'s part (the same ``tokenmdp.check``, which depends
on nothing in the notebook but the value it is given).
"""

from __future__ import annotations

import ast
import functools
import os
import re
import sys
from pathlib import Path

import pytest

from tokenmdp.course import exercises

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

TUTORIALS = Path(__file__).resolve().parents[2] / "tutorials"
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


SOLUTION, CHECK = "# Solution", "# Check"
EXERCISES_PER_TUTORIAL = range(2, 5)
PREDICT = re.compile(r"\*Predict\*")
#: MyST-NB's execution cache of the documentation build (docs/conf.py, nb_execution_cache_path).
DOCS_CACHE = TUTORIALS.parent / "docs" / "_build" / ".jupyter_cache"
#: ``1`` (CI, after its docs build): a tutorial missing from the docs cache fails instead of being
#: executed a second time.
FROM_DOCS_ENV = "TOKENMDP_TUTORIALS_FROM_DOCS"

def _first_line(cell) -> str:
    lines = cell.source.strip().splitlines()
    return lines[0].strip() if lines else ""


def _checked(source: str) -> list[tuple[str, str]]:
    """``(exercise, variable)`` of every ``tokenmdp.check(...)`` call of a check cell; any other
    statement is an error."""
    calls = []
    for statement in ast.parse(source).body:
        call = statement.value if isinstance(statement, ast.Expr) else None
        ok = (isinstance(call, ast.Call) and ast.unparse(call.func) == "tokenmdp.check"
              and len(call.args) == 2 and not call.keywords
              and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)
              and isinstance(call.args[1], ast.Name))
        assert ok, f"a check cell holds only tokenmdp.check(\"name\", variable): {ast.unparse(statement)}"
        calls.append((call.args[0].value, call.args[1].id))
    return calls


def _assigned(source: str) -> set[str]:
    """The names a cell binds in the notebook's namespace (inside ``with``/``if`` blocks too, not
    inside functions or classes)."""
    names, todo = set(), list(ast.parse(source).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        todo.extend(ast.iter_child_nodes(node))
    return names


def exercise_cells(notebook) -> list[tuple[int, list[tuple[str, str]]]]:
    """``(index of the check cell, [(exercise, variable), ...])`` of every exercise, in order;
    asserts the convention of the module docstring."""
    code = [i for i, cell in enumerate(notebook.cells) if cell.cell_type == "code"]
    found = []
    for before, i in zip(code, code[1:]):
        if _first_line(notebook.cells[i]) != CHECK:
            continue
        assert _first_line(notebook.cells[before]) == SOLUTION, f"cell {i}: a check follows a solution"
        calls = _checked(notebook.cells[i].source)
        assigned = _assigned(notebook.cells[before].source)
        for _, variable in calls:
            assert variable in assigned, f"cell {i}: {variable} is not assigned by its solution"
        assert len({v for _, v in calls}) == len(calls), f"cell {i}: one variable per exercise"
        found.append((i, calls))
    solutions = sum(_first_line(notebook.cells[i]) == SOLUTION for i in code)
    assert solutions == len(found), "every solution cell is followed by its check cell"
    return found


@pytest.mark.parametrize("path", SOURCES, ids=[p.stem for p in SOURCES])
def test_exercises_follow_the_convention(path):
    notebook = jupytext.read(path, fmt="py:percent")
    checked = [name for _, calls in exercise_cells(notebook) for name, _ in calls]
    values = [name for name in checked if name in exercises.names("value")]
    assert len(values) in EXERCISES_PER_TUTORIAL, (path.name, values)
    assert len(set(checked)) == len(checked), path.name
    for name in checked:
        exercises.get(name)                               # a registered exercise
        assert name.startswith(f"tr{path.name[:2]}_"), (path.name, name)
    registered = {n for n in exercises.names() if n.startswith(f"tr{path.name[:2]}_")}
    assert registered == set(checked), (path.name, registered ^ set(checked))


def _from_docs_cache(notebook):
    """The docs build's executed copy of ``notebook`` (matched by the hash of its code cells),
    or None when the cache is missing or holds another version of the source."""
    if not DOCS_CACHE.is_dir():
        return None
    from jupyter_cache import get_cache

    try:
        _, merged = get_cache(DOCS_CACHE).merge_match_into_notebook(notebook)
    except KeyError:
        return None
    return merged


@functools.cache
def _executed(path: Path):
    """``(executed notebook, where it was executed)``: the docs build's cached execution when it
    holds this source, else an execution here (cached: the tests below share one)."""
    notebook = jupytext.read(path, fmt="py:percent")
    cached = _from_docs_cache(notebook)
    if cached is not None:
        return cached, "docs cache"
    if os.environ.get(FROM_DOCS_ENV) == "1":
        pytest.fail(f"{path.name}: not in the docs build's execution cache {DOCS_CACHE} although "
                    f"{FROM_DOCS_ENV}=1: build the docs from this source first")
    client = nbclient.NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(TUTORIALS)}})
    client.execute()  # raises CellExecutionError naming the failing cell
    return notebook, "executed here"


@pytest.mark.parametrize("path", SOURCES, ids=[p.stem for p in SOURCES])
def test_every_predict_question_is_checked(path):
    """Each *Predict* in the text opens a question; the next check cells answer them in order
    with predictions (``trNN_predict_*``); none is left open, none is checked before it is
    asked."""
    notebook = jupytext.read(path, fmt="py:percent")
    checks = dict(exercise_cells(notebook))
    open_questions, answered = 0, []
    for i, cell in enumerate(notebook.cells):
        if cell.cell_type == "markdown":
            open_questions += len(PREDICT.findall(cell.source))
        for name, _ in checks.get(i, []):
            if isinstance(exercises.get(name), exercises.Prediction):
                assert open_questions > 0, f"{path.name}: {name} checked before a *Predict*"
                open_questions -= 1
                answered.append(name)
    assert open_questions == 0, f"{path.name}: {open_questions} *Predict* question(s) unchecked"
    assert all(name.startswith(f"tr{path.name[:2]}_predict_") for name in answered), answered


@pytest.mark.slow
@pytest.mark.parametrize("path", SOURCES, ids=[p.stem for p in SOURCES])
def test_tutorial_executes(path):
    notebook, _ = _executed(path)
    errors = [out for cell in notebook.cells if cell.cell_type == "code"
              for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    assert not errors
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(cell.get("execution_count") for cell in code), "a cell never ran"


@pytest.mark.slow
@pytest.mark.parametrize("path", SOURCES, ids=[p.stem for p in SOURCES])
def test_every_check_cell_passed_its_solution(path):
    notebook, _ = _executed(path)
    for index, calls in exercise_cells(notebook):
        text = "".join(out.get("text", "") for out in notebook.cells[index].get("outputs", [])
                       if out.get("output_type") == "stream")
        for name, variable in calls:
            assert f"{name}: right" in text, (path.name, index, name, variable, text[-300:])


def test_the_docs_cache_serves_only_the_same_source(tmp_path, monkeypatch):
    """A cached execution is reused for the tutorial it was made from, not for an edited one;
    under the CI switch a tutorial missing from the cache fails instead of running twice."""
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    monkeypatch.setattr(sys.modules[__name__], "DOCS_CACHE", tmp_path / "cache")
    source = SOURCES[0]
    executed = jupytext.read(source, fmt="py:percent")
    for cell in executed.cells:
        if cell.cell_type == "code":
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="ran\n")]
            cell.execution_count = 1
    get_cache(tmp_path / "cache").cache_notebook_bundle(
        CacheBundleIn(executed, str(source)), check_validity=False)
    first = next(i for i, cell in enumerate(executed.cells) if cell.cell_type == "code")
    same = _from_docs_cache(jupytext.read(source, fmt="py:percent"))
    assert same is not None and same.cells[first].outputs[0]["text"] == "ran\n"
    edited = jupytext.read(source, fmt="py:percent")
    edited.cells[first].source += "\n# edited"
    assert _from_docs_cache(edited) is None
    monkeypatch.setenv(FROM_DOCS_ENV, "1")
    monkeypatch.setattr(sys.modules[__name__], "DOCS_CACHE", tmp_path / "no_cache")
    with pytest.raises(pytest.fail.Exception, match="not in the docs build's execution cache"):
        _executed.__wrapped__(source)
