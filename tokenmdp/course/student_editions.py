"""Student editions of the tutorials: every ``# Solution`` cell replaced by a stub, checks kept.

The tutorials are jupytext percent scripts (``tutorials/NN_name.py``) whose exercises are two
consecutive code cells, a solution cell whose first line is ``# Solution`` and a check cell whose
first line is ``# Check`` holding ``tokenmdp.check("<exercise>", <variable>)`` calls (see
``tests/course/test_tutorials.py``). :func:`student_edition` rewrites one script at the text level:

* a solution cell keeps its cell marker and its ``# Solution`` line; its code is replaced by a
  comment and one line ``<variable> = unsolved("<exercise>", "<variable>")`` per variable that
  its check cell checks (:func:`tokenmdp.course.exercises.unsolved`), so the check cell runs and
  fails with the exercise's hint until the student writes the solution; the names a solution
  also defines for later cells are listed in the comment and stubbed the same way, so that a
  later cell using any of them stops with "solve exercise ... first" rather than an empty
  ``AssertionError`` or a ``NameError``;
* every other cell, and the header, is kept byte for byte.

:func:`write_editions` writes the student and the full edition of every tutorial side by side
(``OUT_DIR/student`` and ``OUT_DIR/full``, as ``.py`` percent scripts and, with jupytext
installed, ``.ipynb`` notebooks); it is the ``tokenmdp tutorials --student OUT_DIR`` command.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

__all__ = ["find_tutorials", "read_tutorial", "split_cells", "student_edition", "write_editions"]

SOLUTION, CHECK = "# Solution", "# Check"
#: A cell marker of the percent format (``# %%``, ``# %% [markdown]``, ``# %% tags``, ...).
_MARKER = re.compile(r"^# %%(?![%])")
#: What a stub assigns: ``unsolved(exercise, name)``, a wrong answer to ``tokenmdp.check`` (with
#: the hint) that names the exercise when any other cell uses it.
STUB_VALUE = "unsolved("
_STUB_IMPORT = "from tokenmdp.course.exercises.registry import unsolved"


def split_cells(text: str) -> list[str]:
    """Cut a percent script into chunks, each starting at a ``# %%`` line (the first chunk is
    the header before the first cell); ``"".join(split_cells(text)) == text``.

    Parameters
    ----------
    text : str
        The script.

    Returns
    -------
    list of str
        The header (empty when the script starts with a cell) and one chunk per cell, with
        their line endings.
    """
    chunks, current = [], []
    for line in text.splitlines(keepends=True):
        if _MARKER.match(line):
            chunks.append("".join(current))
            current = []
        current.append(line)
    chunks.append("".join(current))
    return chunks


def _is_code(chunk: str) -> bool:
    first = chunk.split("\n", 1)[0]
    return bool(_MARKER.match(first)) and "[markdown]" not in first and "[md]" not in first


def _body(chunk: str) -> tuple[str, str, str]:
    """``(marker line, code, trailing blank lines)`` of a cell chunk."""
    marker, _, rest = chunk.partition("\n")
    code = rest.rstrip("\n")
    return marker + "\n", code, rest[len(code):]


def _first_line(code: str) -> str:
    lines = code.strip().splitlines()
    return lines[0].strip() if lines else ""


def _checked_variables(code: str) -> dict[str, str]:
    """``{variable: exercise}`` of the ``tokenmdp.check("name", variable)`` calls of a check
    cell, in order."""
    names: dict[str, str] = {}
    for node in ast.walk(ast.parse(code)):
        if (isinstance(node, ast.Call) and ast.unparse(node.func) == "tokenmdp.check"
                and len(node.args) == 2 and isinstance(node.args[1], ast.Name)):
            first = node.args[0]
            exercise = first.value if isinstance(first, ast.Constant) else ast.unparse(first)
            names.setdefault(node.args[1].id, str(exercise))
    if not names:
        raise ValueError("a check cell without tokenmdp.check(\"name\", variable) calls")
    return names


def _assigned(code: str) -> set[str]:
    """Names a cell binds at top level (inside with/if/for blocks too, not in functions)."""
    names, todo = set(), list(ast.parse(code).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        todo.extend(ast.iter_child_nodes(node))
    return names


def _loaded(codes: list[str]) -> set[str]:
    return {node.id for code in codes for node in ast.walk(ast.parse(code))
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}


def _stub(checked: dict[str, str], also: list[str]) -> str:
    lines = [SOLUTION,
             "# Your solution here: the exercise is described above, the next cell checks it.",
             "# Replace each unsolved(...) below by your answer (computed in code, not typed in)."]
    predictions = [name for name, ex in checked.items() if "_predict_" in ex]
    if predictions:
        lines.append(f"# Except {', '.join(predictions)}: a prediction, typed in before you compute "
                     f"(one of the options the text names).")
    if also:
        lines.append(f"# Later cells also use: {', '.join(also)} (define them here too).")
    exercise = next(iter(checked.values()))
    lines.append(_STUB_IMPORT)
    lines += [f"{name} = {STUB_VALUE}{ex!r}, {name!r})" for name, ex in checked.items()]
    lines += [f"{name} = {STUB_VALUE}{exercise!r}, {name!r})" for name in also]
    return "\n".join(lines)


def student_edition(text: str) -> str:
    """The student edition of one tutorial script: solution cells stubbed, all else kept.

    Parameters
    ----------
    text : str
        A jupytext percent script whose exercises follow the ``# Solution`` / ``# Check``
        convention (module docstring).

    Returns
    -------
    str
        The script with each solution cell's code replaced by its stub (the cell marker, the
        ``# Solution`` line and the cell's trailing blank lines kept); every other cell and the
        header unchanged, byte for byte.

    Raises
    ------
    ValueError
        A solution cell not followed by a check cell, or a check cell without
        ``tokenmdp.check("name", variable)`` calls.
    """
    chunks = split_cells(text)
    code_cells = [i for i, c in enumerate(chunks) if _is_code(c)]
    out = list(chunks)
    for position, i in enumerate(code_cells):
        marker, code, tail = _body(chunks[i])
        if _first_line(code) != SOLUTION:
            continue
        following = code_cells[position + 1] if position + 1 < len(code_cells) else None
        check_code = _body(chunks[following])[1] if following is not None else ""
        if _first_line(check_code) != CHECK:
            raise ValueError(f"cell {i}: a {SOLUTION} cell must be followed by a {CHECK} cell")
        checked = _checked_variables(check_code)
        later = _loaded([_body(chunks[j])[1] for j in code_cells[position + 2:]])
        also = sorted((_assigned(code) - set(checked)) & later)
        out[i] = marker + _stub(checked, also) + tail
    return "".join(out)


def find_tutorials(source: str | Path | None = None) -> list[Path]:
    """The numbered tutorial scripts ``NN_*.py`` of ``source``, in order.

    Parameters
    ----------
    source : str or Path, optional
        The folder (default: ``tutorials/`` of the source checkout this package runs from).

    Returns
    -------
    list of Path
        The scripts, sorted by name.

    Raises
    ------
    ValueError
        ``source`` is not a folder or holds no ``NN_*.py`` script.
    """
    folder = Path(__file__).resolve().parents[2] / "tutorials" if source is None else Path(source)
    if not folder.is_dir():
        raise ValueError(f"--source: {folder} is not a folder (pass the tutorials/ folder of a "
                         "tokenmdp checkout)")
    paths = sorted(folder.glob("[0-9][0-9]_*.py"))
    if not paths:
        raise ValueError(f"--source: no tutorial scripts NN_*.py in {folder}")
    for path in paths:
        if not path.is_file():
            raise ValueError(f"--source: {path} is not a file (a tutorial is a NN_*.py script)")
    return paths


def read_tutorial(path: str | Path) -> str:
    """The text of the tutorial script ``path``, read as UTF-8.

    Parameters
    ----------
    path : str or Path
        A ``NN_*.py`` script (:func:`find_tutorials`).

    Returns
    -------
    str

    Raises
    ------
    ValueError
        ``--source``: the file cannot be read, or is not UTF-8 text (named, with the offset).
    """
    path = Path(path)
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--source: {path} is not UTF-8 text (byte {err.object[err.start]:#04x} "
                         f"at offset {err.start})") from None
    except OSError as err:
        raise ValueError(f"--source: cannot read {path} ({err.strerror or err})") from None


def _out_folder(out_dir: str | Path, overwrite: bool) -> Path:
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"OUT_DIR: {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"OUT_DIR: {out} is not empty (pass --overwrite to replace its files)")
    return out


def write_editions(out_dir: str | Path, *, source: str | Path | None = None,
                   overwrite: bool = False, ipynb: bool = False) -> list[Path]:
    """Write the student and the full edition of every tutorial into ``out_dir``.

    ``out_dir/student/NN_name.py`` is :func:`student_edition` of each script,
    ``out_dir/full/NN_name.py`` the script itself; with ``ipynb`` each also as
    ``NN_name.ipynb`` (unexecuted, through jupytext).

    Parameters
    ----------
    out_dir : str or Path
        The destination; created if missing. Must be empty unless ``overwrite``.
    source : str or Path, optional
        The tutorials' folder (:func:`find_tutorials`).
    overwrite : bool
        Replace files of the same names in a non-empty ``out_dir`` (others are left alone).
    ipynb : bool
        Also write ``.ipynb`` notebooks (needs jupytext).

    Returns
    -------
    list of Path
        The files written, student editions first.

    Raises
    ------
    ValueError
        A non-empty ``out_dir`` without ``overwrite``, a bad ``source``, a tutorial that breaks
        the exercise convention, a folder that cannot be written, or ``ipynb`` without jupytext.
    """
    paths = find_tutorials(source)
    out = _out_folder(out_dir, overwrite)
    if ipynb:
        try:
            import jupytext
        except ImportError:
            raise ValueError("--ipynb: needs jupytext (pip install jupytext)") from None
    editions = {"student": [], "full": []}
    for path in paths:
        text = read_tutorial(path)
        try:
            editions["student"].append((path.name, student_edition(text)))
        except ValueError as err:
            raise ValueError(f"{path.name}: {err}") from None
        editions["full"].append((path.name, text))
    written = []
    try:
        for kind, files in editions.items():
            folder = out / kind
            folder.mkdir(parents=True, exist_ok=True)
            for name, text in files:
                target = folder / name
                target.write_text(text, encoding="utf-8")
                written.append(target)
                if ipynb:
                    notebook = jupytext.reads(text, fmt="py:percent")
                    jupytext.write(notebook, target.with_suffix(".ipynb"), fmt="ipynb")
                    written.append(target.with_suffix(".ipynb"))
    except OSError as err:
        raise ValueError(f"OUT_DIR: cannot write in {out} ({err.strerror or err})") from None
    return sorted(written, key=lambda p: (p.parent.name != "student", p.name))
