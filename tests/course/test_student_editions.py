"""Student editions: solution cells stubbed, every other cell byte for byte, the checks bite on
the stubs; ``tokenmdp tutorials --student OUT_DIR`` writes both editions and refuses to overwrite.

The full editions are the tutorials themselves (checked here to be byte-identical copies), which
``tests/course/test_tutorials.py`` already executes: they are not executed again here.
"""

from __future__ import annotations

import pytest

from tokenmdp import cli
from tokenmdp.course.exercises import Unsolved, UnsolvedError
from tokenmdp.course.student_editions import (
    STUB_VALUE,
    find_tutorials,
    split_cells,
    student_edition,
    write_editions,
)

jupytext = pytest.importorskip("jupytext")

SOURCES = find_tutorials()
#: Tutorials whose stubbed exercises are executed in-process (their expected values are exact
#: and cheap to compute).
EXECUTED = ("01_", "06_")


def _is_solution(chunk: str) -> bool:
    lines = chunk.split("\n")
    return not lines[0].startswith("# %% [") and len(lines) > 1 and lines[1].strip() == "# Solution"


@pytest.mark.parametrize("path", SOURCES, ids=[p.stem for p in SOURCES])
def test_every_cell_but_the_solutions_is_kept_byte_for_byte(path):
    text = path.read_text(encoding="utf-8")
    student = student_edition(text)
    original, stubbed = split_cells(text), split_cells(student)
    assert "".join(original) == text and len(original) == len(stubbed)
    solutions = 0
    for before, after in zip(original, stubbed):
        if _is_solution(before):
            solutions += 1
            assert after != before and after.startswith("# %%\n# Solution\n")
            assert after.endswith("\n") and STUB_VALUE in after
        else:
            assert after == before
    assert solutions >= 2


@pytest.mark.parametrize("path", SOURCES, ids=[p.stem for p in SOURCES])
def test_a_student_edition_keeps_the_exercise_convention_and_leaks_no_solution(path):
    from tests.course.test_tutorials import exercise_cells

    text = path.read_text(encoding="utf-8")
    full = jupytext.reads(text, fmt="py:percent")
    student = jupytext.reads(student_edition(text), fmt="py:percent")
    assert [c.cell_type for c in full.cells] == [c.cell_type for c in student.cells]
    found = exercise_cells(student)                 # the same convention, the same checks
    assert [calls for _, calls in found] == [calls for _, calls in exercise_cells(full)]
    for index, calls in found:
        stub = student.cells[index - 1].source
        assert stub != full.cells[index - 1].source
        code = [line for line in stub.splitlines() if line and not line.startswith("#")]
        assert code[0].startswith("from tokenmdp.course.exercises") and "import unsolved" in code[0]
        assert code[1:1 + len(calls)] == [f"{variable} = {STUB_VALUE}{exercise!r}, {variable!r})"
                                          for exercise, variable in calls]
        assert all(STUB_VALUE in line for line in code[1:])          # the later names too


def _stubbed_exercises(path):
    notebook = jupytext.reads(student_edition(path.read_text(encoding="utf-8")), fmt="py:percent")
    from tests.course.test_tutorials import exercise_cells

    return [(notebook.cells[i - 1].source, notebook.cells[i].source, calls)
            for i, calls in exercise_cells(notebook)]


@pytest.mark.parametrize("path", [p for p in SOURCES if p.name.startswith(EXECUTED)],
                         ids=lambda p: p.stem)
def test_the_checks_fail_on_the_stubs(path):
    exercises = _stubbed_exercises(path)
    assert exercises
    for stub, check, calls in exercises:
        namespace = {}
        exec("import tokenmdp", namespace)
        exec(stub, namespace)
        for exercise, variable in calls:
            assert isinstance(namespace[variable], Unsolved)
            assert namespace[variable].exercise == exercise
        with pytest.raises(AssertionError) as info:
            exec(check, namespace)
        message = str(info.value)
        assert calls[0][0] in message and "Hint:" in message and "got nan" in message
        assert "stub" in message


def test_the_stub_names_what_later_cells_use():
    text = ("# %%\nx = 1\n\n# %%\n# Solution\nanswer = x + 1\nhelper = 2\ntemp = 3\n\n"
            "# %%\n# Check\ntokenmdp.check(\"tr99_x\", answer)\n\n# %%\nprint(helper)\n")
    student = student_edition(text)
    assert "# Later cells also use: helper (define them here too).\n" in student
    assert ("answer = unsolved('tr99_x', 'answer')\nhelper = unsolved('tr99_x', 'helper')\n\n"
            "# %%\n# Check") in student
    assert "temp" not in student and student.startswith("# %%\nx = 1\n\n")


@pytest.mark.parametrize("text, match", [
    ("# %%\n# Solution\nanswer = 1\n", "followed by a # Check"),
    ("# %%\n# Solution\nanswer = 1\n# %%\nprint(answer)\n", "followed by a # Check"),
    ("# %%\n# Solution\nanswer = 1\n# %%\n# Check\nprint(answer)\n", "tokenmdp.check"),
])
def test_a_broken_convention_is_refused(text, match):
    with pytest.raises(ValueError, match=match):
        student_edition(text)


def test_write_editions_puts_both_side_by_side(tmp_path):
    written = write_editions(tmp_path / "course", ipynb=True)
    for path in SOURCES:
        full = tmp_path / "course" / "full" / path.name
        assert full.read_bytes() == path.read_bytes()     # the tested tutorials themselves
        student = tmp_path / "course" / "student" / path.name
        assert student.read_text(encoding="utf-8") == student_edition(path.read_text("utf-8"))
        notebook = jupytext.read(student.with_suffix(".ipynb"))
        assert any(STUB_VALUE in cell.source for cell in notebook.cells)
    assert len(written) == 4 * len(SOURCES) and written[0].parent.name == "student"


def test_cli_writes_lists_and_refuses_a_non_empty_folder(tmp_path, capsys):
    out = tmp_path / "editions"
    assert cli.main(["tutorials", "--student", str(out)]) == 0
    assert f"wrote {len(SOURCES)} student-edition files" in capsys.readouterr().out
    assert sorted(p.name for p in (out / "student").iterdir()) == [p.name for p in SOURCES]
    with pytest.raises(SystemExit) as err:
        cli.main(["tutorials", "--student", str(out)])
    assert err.value.code == 2
    message = capsys.readouterr().err
    assert message.count("\n") == 1 and "not empty" in message and "--overwrite" in message
    assert "Traceback" not in message
    (out / "student" / SOURCES[0].name).write_text("edited by the teacher")
    assert cli.main(["tutorials", "--student", str(out), "--overwrite"]) == 0
    assert (out / "student" / SOURCES[0].name).read_text() != "edited by the teacher"
    assert cli.main(["tutorials"]) == 0
    listing = capsys.readouterr().out
    assert all(p.name in listing for p in SOURCES) and "# Tutorial 6 — " in listing


@pytest.mark.parametrize("argv, match", [
    (["tutorials", "--overwrite"], "only with --student"),
    (["tutorials", "--source", "no/such/folder"], "--source"),
])
def test_cli_bad_options_fail_with_one_line(argv, match, capsys, tmp_path):
    with pytest.raises(SystemExit) as err:
        cli.main(argv)
    assert err.value.code == 2
    message = capsys.readouterr().err
    assert match in message and message.count("\n") == 1


def test_cli_refuses_a_file_as_out_dir_and_an_empty_source(tmp_path, capsys):
    target = tmp_path / "a_file"
    target.write_text("x")
    for argv, match in ((["tutorials", "--student", str(target)], "not a folder"),
                        (["tutorials", "--student", str(tmp_path / "o"), "--source",
                          str(tmp_path / "o2")], "--source")):
        (tmp_path / "o2").mkdir(exist_ok=True)
        with pytest.raises(SystemExit) as err:
            cli.main(argv)
        assert err.value.code == 2 and match in capsys.readouterr().err


def test_a_later_cell_using_a_stubbed_answer_names_the_exercise_to_solve_first():
    """Issue 30: tutorial 6's GSPO cell asserts on exercise 3's answer; in the student edition it
    stops with "solve exercise tr06_gspo_cosine first", not an empty AssertionError."""
    path = next(p for p in SOURCES if p.name.startswith("06_"))
    cells = split_cells(student_edition(path.read_text(encoding="utf-8")))
    stub = next(c for c in cells if "gspo_cosine = unsolved(" in c)
    namespace = {}
    exec(stub.split("\n", 1)[1], namespace)
    with pytest.raises(UnsolvedError, match="tr06_gspo_cosine.*solve that exercise first"):
        exec("assert abs(0.5 - gspo_cosine) < 3 * 0.1", namespace)
    for use in ("float(gspo_cosine)", "gspo_cosine * 2", "gspo_cosine.item()", "-gspo_cosine",
                "gspo_cosine < 1", "bool(gspo_cosine)", "f'{gspo_cosine:.3f}'"):
        with pytest.raises(UnsolvedError):
            exec(use, namespace)
    assert "unsolved" in repr(namespace["gspo_cosine"])
