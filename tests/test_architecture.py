"""The house: every import of ``tokenmdp`` goes down a floor, and the README draws the same tree.

Each package's ``__init__`` docstring is its map. Its floors are written there once, in a literal
block after the line ``Floors, top to bottom::``, one floor a line, each naming the package's
modules and subpackages. This test reads those blocks and checks, over every import in
``tokenmdp/`` (module level, inside functions and under ``TYPE_CHECKING`` alike):

* every module and subpackage stands on exactly one floor of its package;
* an import between two rooms of one package goes from a higher floor to a lower one, never
  sideways or up, and no module imports the front door (``__init__``) of a package it is in;
* so there is no import circle (checked on its own as well, by strongly connected components);
* a name a module lists in ``__all__`` is defined there, or, in a package's ``__init__`` (its
  front door), somewhere below it: no name is importable from two places by accident;
* no module is longer than ``MAX_LINES`` without a reason written in :data:`LONG_MODULES`;
* the README's file tree lists every module once, in an order in which each file imports only
  files listed before it (a reading order), and nothing that does not exist.

The checker is run on planted violations too, so a broken checker cannot pass.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tokenmdp"

#: A module longer than this needs a reason in :data:`LONG_MODULES`.
MAX_LINES = 400
#: Modules over :data:`MAX_LINES`, each with the reason it is not split.
LONG_MODULES: dict[str, str] = {
    "tokenmdp/estimators/advantages/group.py":
        "five group advantages, each a function and the part that calls it: one concept",
    "tokenmdp/estimators/corrections/factor.py":
        "the factor pi_old/mu at three levels and its four parts (none, IS, TIS, MIS)",
    "tokenmdp/exact/world/mdp.py":
        "TokenMDP is one class: counts, state indexing and its documented members (their "
        "bodies are in _enumeration)",
    "tokenmdp/exact/lab/step_gradients.py":
        "StepGradients is one class, the engine of the exact lab, read top to bottom",
    "tokenmdp/exact/lattice/ground_truth.py":
        "the ground truth of one MDP by one forward and one backward recursion; what repeats "
        "is the numpydoc parameter blocks of its fourteen functions",
}


# ------------------------------------------------------------------------------ the checker
@dataclass(frozen=True)
class Import:
    source: str          # the importing module (a package's own name for its __init__)
    target: str          # the imported module or package
    line: int


def module_names(root: Path) -> dict[str, Path]:
    """Every module below ``root`` (a package folder) by its dotted name."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(root: Path) -> list[Import]:
    """Every import between modules of ``root``'s package, resolved to the module it loads."""
    modules = module_names(root)
    top = root.name

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [resolve(alias.name) for alias in node.names
                           if alias.name.split(".")[0] == top]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                if base.split(".")[0] != top:
                    continue
                # ``from package import module`` loads the module; ``from module import name``
                # the module
                targets = [resolve(f"{base}.{alias.name}") if f"{base}.{alias.name}" in modules
                           else resolve(base) for alias in node.names]
            else:
                continue
            found += [Import(name, t, node.lineno) for t in targets if t and t != name]
    return found


FLOORS_MARK = "Floors, top to bottom::"


def floors(init: Path) -> list[list[str]]:
    """The floors of the package whose ``__init__.py`` is ``init``, top floor first."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    lines = doc.splitlines()
    if FLOORS_MARK not in [line.strip() for line in lines]:
        raise AssertionError(f"{init}: the docstring has no '{FLOORS_MARK}' block")
    start = [line.strip() for line in lines].index(FLOORS_MARK) + 1
    out = []
    for line in lines[start:]:
        if not line.strip():
            if out:
                break
            continue
        if not line.startswith(" "):
            break
        out.append([name.strip() for name in line.split(",") if name.strip()])
    return out


def violations(root: Path) -> list[str]:
    """What breaks the house below ``root``, one line each (empty when it stands)."""
    modules = module_names(root)
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}
    problems, floor_of = [], {}
    for package in sorted(packages):
        init = modules[package]
        children = {child.stem if child.is_file() else child.name
                    for child in init.parent.iterdir()
                    if (child.suffix == ".py" and child.name != "__init__.py")
                    or (child.is_dir() and (child / "__init__.py").exists())}
        try:
            levels = floors(init)
        except AssertionError as error:
            problems.append(str(error))
            continue
        seen = [name for level in levels for name in level]
        for name in sorted(set(seen) - children):
            problems.append(f"{package}: floor lists {name!r}, which is not in the package")
        for name in sorted(children - set(seen)):
            problems.append(f"{package}: {name!r} stands on no floor")
        for name in sorted({n for n in seen if seen.count(n) > 1}):
            problems.append(f"{package}: {name!r} stands on two floors")
        for height, level in enumerate(levels):
            for name in level:
                floor_of[f"{package}.{name}"] = height      # 0 is the top floor
    for edge in imports(root):
        src, dst = edge.source, edge.target
        where = f"{modules[src].relative_to(root.parent)}:{edge.line}"
        if src.startswith(dst + "."):
            problems.append(f"{where}: {src} imports {dst}, the front door of its own package")
            continue
        if dst.startswith(src + ".") and src in packages:
            continue                                   # a front door imports its own rooms
        a, b = src.split("."), dst.split(".")
        common = 0
        while common < min(len(a), len(b)) and a[common] == b[common]:
            common += 1
        room_a, room_b = ".".join(a[:common + 1]), ".".join(b[:common + 1])
        if room_a not in floor_of or room_b not in floor_of:
            continue                                   # reported above as on no floor
        if floor_of[room_a] >= floor_of[room_b]:       # down is a higher index (0: top)
            direction = "sideways" if floor_of[room_a] == floor_of[room_b] else "up"
            problems.append(f"{where}: {src} imports {dst}: {room_a.rsplit('.', 1)[1]} -> "
                            f"{room_b.rsplit('.', 1)[1]} goes {direction} in "
                            f"{'.'.join(a[:common])}'s floors")
    for cycle in circles(root):
        problems.append("import circle: " + " -> ".join(cycle))
    return problems


def circles(root: Path) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {name: set() for name in module_names(root)}
    for edge in imports(root):
        graph[edge.source].add(edge.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


# ------------------------------------------------------------------------------ the package
def test_every_import_goes_down_a_floor_and_there_is_no_circle():
    problems = violations(PACKAGE)
    assert not problems, "\n".join(problems)


def test_no_module_is_longer_than_the_limit_without_a_reason():
    long = {str(path.relative_to(ROOT)): len(path.read_text().splitlines())
            for path in PACKAGE.rglob("*.py")}
    over = {path: n for path, n in long.items() if n > MAX_LINES and path not in LONG_MODULES}
    assert not over, f"modules over {MAX_LINES} lines with no reason in LONG_MODULES: {over}"
    for path in LONG_MODULES:      # a reason for a module that shrank (or went) is stale
        assert long.get(path, 0) > MAX_LINES, f"LONG_MODULES: {path} is no longer over the limit"


def _public_modules():
    return [name for name in module_names(PACKAGE)
            if not any(part.startswith("_") for part in name.split(".")[1:])
            and name != "tokenmdp.model.flex"        # loaded lazily, CUDA only
            and not (name == "tokenmdp.integrations.trl_trainer"   # the optional extras
                     and importlib.util.find_spec("trl") is None)
            and not (name.startswith("tokenmdp.integrations.verl_")
                     and importlib.util.find_spec("verl") is None)]


@pytest.mark.parametrize("name", _public_modules())
def test_a_module_lists_in_all_only_what_it_defines_or_its_rooms_define(name):
    module = importlib.import_module(name)
    is_front_door = module_names(PACKAGE)[name].name == "__init__.py"
    for public in getattr(module, "__all__", ()):
        obj = getattr(module, public)
        if inspect.ismodule(obj):
            owner = obj.__name__
        elif inspect.isclass(obj) or inspect.isfunction(obj):
            owner = obj.__module__
        else:
            continue                   # constants carry no home; their module is their home
        if is_front_door:
            assert owner == name or owner.startswith(name + "."), (
                f"{name}.__all__ re-exports {public} from {owner}, outside its own rooms")
        else:
            assert owner == name, f"{name}.__all__ lists {public}, defined in {owner}"


# ------------------------------------------------------------------------------ the README
def readme_tree() -> list[str]:
    """The paths of the README's file tree (its ``## Files`` block), in their order."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"^## Files\n.*?^```\n(.*?)^```", text, flags=re.S | re.M)
    assert block, "README: no '## Files' block"
    paths = []
    for line in block.group(1).splitlines():
        if line and not line.startswith(" "):
            paths.append(line.split()[0])
    return paths


def test_the_readme_tree_lists_every_module_once_in_reading_order():
    listed = readme_tree()
    for path in listed:
        assert (ROOT / path).exists(), f"README lists {path}, which does not exist"
    modules = [p for p in listed if p.startswith("tokenmdp/") and p.endswith(".py")]
    assert len(modules) == len(set(modules)), "README lists a module twice"
    actual = {str(path.relative_to(ROOT)) for path in PACKAGE.rglob("*.py")}
    assert not actual - set(modules), f"README's tree misses {sorted(actual - set(modules))}"
    order = {path: i for i, path in enumerate(modules)}
    by_name = {name: str(path.relative_to(ROOT)) for name, path in module_names(PACKAGE).items()}
    for edge in imports(PACKAGE):
        src, dst = by_name[edge.source], by_name[edge.target]
        if src.endswith("__init__.py") and dst.startswith(src.rsplit("/", 1)[0] + "/"):
            continue                   # a front door is read before the rooms it re-exports
        assert order[dst] < order[src], (
            f"README: {src} is listed before {dst}, which it imports (line {edge.line})")


# ------------------------------------------------------------------------------ the checker fails
def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "pkg"


HOUSE = {
    "__init__.py": '"""Top.\n\nFloors, top to bottom::\n\n    top\n    low, sub\n"""\n',
    "low.py": "X = 1\n",
    "top.py": "from pkg.low import X\nfrom pkg.sub.b import Y\n",
    "sub/__init__.py": '"""Sub.\n\nFloors, top to bottom::\n\n    b\n    a\n"""\n'
                       "from pkg.sub.b import Y\n",
    "sub/a.py": "Z = 0\n",
    "sub/b.py": "from pkg.sub.a import Z\nY = Z\n",
}


def test_the_checker_passes_a_house_that_stands(tmp_path):
    assert violations(_plant(tmp_path, HOUSE)) == []


@pytest.mark.parametrize("rel, text, expected", [
    ("low.py", "from pkg.top import X\n", "goes up"),                         # up a floor
    ("low.py", "def f():\n    from pkg.sub.a import Z\n", "goes sideways"),   # lazily, sideways
    ("sub/a.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                 "    from pkg.sub.b import Y\n", "import circle"),           # type-only circle
    ("sub/a.py", "from pkg.sub import Y\n", "front door of its own package"),
    ("sub/c.py", "W = 2\n", "stands on no floor"),
])
def test_the_checker_finds_each_planted_violation(tmp_path, rel, text, expected):
    root = _plant(tmp_path, {**HOUSE, rel: text})
    assert any(expected in problem for problem in violations(root)), violations(root)
