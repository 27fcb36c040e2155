"""The tutorials are text (jupytext percent scripts): each one reads as a notebook and runs clean.

The same sources are rendered by the documentation build (MyST-NB); this test executes them in a
Jupyter kernel, cell by cell, as a student would, so a tutorial that stops working fails the suite.

Exercises follow one convention, so that the test can find their solutions:

* an exercise is two consecutive code cells, a **solution** cell whose first line is
  ``# Solution`` and a **check** cell whose first line is ``# Check``;
* the check cell holds only ``tokenmdp.check("<exercise>", <name>)`` calls (and comments), each
  ``<name>`` a variable that the solution cell assigns at top level;
* every tutorial has two to four exercises, and every registered ``trNN_*`` exercise is checked in
  tutorial ``NN``.

The notebook is executed once; after each check cell the test runs an extra cell in the same
kernel that sets each answer to every plausible wrong value of ``tests/course/exercises/test_exercises.py``'s
``WRONG`` table, runs the check cell's source again, records whether it raised an
``AssertionError``, and restores the right answer. A check that does not check, or checks another
variable than the solution's, fails the test.
"""

from __future__ import annotations

import ast
import functools
import json
import re
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
MARKER = "WRONG-ANSWER-CHECKS "
EXERCISES_PER_TUTORIAL = range(2, 5)

# Run in the notebook's kernel after a check cell: {cases} maps each checked variable to its
# wrong values, {source} is the check cell's source.
PERTURB = """\
import json as _json
_outcomes = []
for _variable, _values in {cases!r}.items():
    _right = globals()[_variable]
    for _value in _values:
        globals()[_variable] = _value
        try:
            exec({source!r}, globals())
        except AssertionError as _error:
            _outcomes.append([_variable, _value, "raised", str(_error)])
        else:
            _outcomes.append([_variable, _value, "passed", ""])
    globals()[_variable] = _right
print({marker!r} + _json.dumps(_outcomes))
"""


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
    assert len(checked) in EXERCISES_PER_TUTORIAL, (path.name, checked)
    assert len(set(checked)) == len(checked), path.name
    for name in checked:
        exercises.get(name)                               # a registered exercise
        assert name.startswith(f"tr{path.name[:2]}_"), (path.name, name)
    registered = {n for n in exercises.names() if n.startswith(f"tr{path.name[:2]}_")}
    assert registered == set(checked), (path.name, registered ^ set(checked))


@functools.cache
def _executed(path: Path):
    """The tutorial executed once, with a wrong-answer cell after each check cell (cached: the two
    tests below share one execution)."""
    from tests.course.exercises.test_exercises import WRONG

    notebook = jupytext.read(path, fmt="py:percent")
    injected = []
    for offset, (i, calls) in enumerate(exercise_cells(notebook)):
        cases = {variable: list(WRONG[name]().values()) for name, variable in calls}
        source = PERTURB.format(cases=cases, source=notebook.cells[i + offset].source,
                                marker=MARKER)
        notebook.cells.insert(i + offset + 1, nbformat.v4.new_code_cell(source))
        injected.append((i + offset + 1, calls))
    client = nbclient.NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(TUTORIALS)}})
    client.execute()  # raises CellExecutionError naming the failing cell
    return notebook, injected


@pytest.mark.slow
@pytest.mark.parametrize("path", SOURCES, ids=[p.stem for p in SOURCES])
def test_tutorial_executes(path):
    notebook, _ = _executed(path)
    errors = [out for cell in notebook.cells if cell.cell_type == "code"
              for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    assert not errors


@pytest.mark.slow
@pytest.mark.parametrize("path", SOURCES, ids=[p.stem for p in SOURCES])
def test_every_exercise_check_fails_on_a_wrong_answer(path):
    notebook, injected = _executed(path)
    assert injected, path.name
    for index, calls in injected:
        text = "".join(out.get("text", "") for out in notebook.cells[index].get("outputs", [])
                       if out.get("output_type") == "stream")
        lines = [line for line in text.splitlines() if line.startswith(MARKER)]
        assert len(lines) == 1, (path.name, index, text[-500:])
        outcomes = json.loads(lines[0][len(MARKER):])
        names = dict((variable, name) for name, variable in calls)
        assert {o[0] for o in outcomes} == set(names), (path.name, index)
        for variable, value, result, message in outcomes:
            assert result == "raised", (path.name, names[variable], value)
            assert names[variable] in message and "Hint:" in message, (path.name, message)
