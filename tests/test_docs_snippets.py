"""The Python snippets of the Concepts and Guides pages run, in order, one namespace per page.

Every ```` ```python ```` block of ``docs/concepts/*.md`` and ``docs/guides/*.md`` is executed
top to bottom in a fresh namespace per page, as a reader who pastes them one after the other
would, so a guide cannot rot unseen. The snippets check their own claims with ``assert``.
Blocks in other languages (``bash``, ``text``) are not run. A block whose first line is
``# needs the NAME extra ...`` runs only where the package ``NAME`` is installed (``verl``: CI runs
it in the verl extra's own environment, ``.ci/run``).
"""

from __future__ import annotations

import importlib.util
import re
import time
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted([*DOCS.glob("concepts/*.md"), *DOCS.glob("guides/*.md")])
#: A page's snippets together should take seconds; this bound only catches a hang or a
#: snippet that grew into a benchmark (on a loaded 2-core machine).
PAGE_TIME_LIMIT_S = 60.0

_FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_NEEDS = re.compile(r"^# needs the (?P<extra>\w+) extra\b")


def needed_extra(source: str) -> str | None:
    """The extra a snippet's first line says it needs (``# needs the verl extra``), if any."""
    match = _NEEDS.match(source)
    return match.group("extra") if match else None


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line number of the first line, source)`` of every fenced block whose info string is
    exactly ``python``, including blocks nested in a backtick directive (```` ````{note} ````);
    the contents of other code blocks are not searched."""
    blocks: list[tuple[int, str]] = []
    stack: list[str] = []          # open directive fences, whose contents are markdown
    code: tuple[str, str, int, list[str]] | None = None   # an open code block
    for number, line in enumerate(text.splitlines(), start=1):
        match = _FENCE.match(line.strip())
        if code is not None:
            fence, info, first, body = code
            if match and match.group("fence") == fence and not match.group("info").strip():
                if info == "python":
                    blocks.append((first, "".join(f"{b}\n" for b in body)))
                code = None
            else:
                body.append(line)
            continue
        if not match:
            continue
        fence, info = match.group("fence"), match.group("info").strip()
        if stack and fence == stack[-1] and not info:
            stack.pop()
        elif info.startswith("{") and not info.startswith("{code"):
            stack.append(fence)
        else:
            code = (fence, info, number + 1, [])
    return blocks


def test_python_blocks_finds_only_python_fences():
    text = ("intro\n```python\nx = 1\n```\n```bash\nls\n```\n````{note}\n```python\ny = 2\n```\n"
            "````\n```{code-block} python\nz = 3\n```\n")
    assert python_blocks(text) == [(3, "x = 1\n"), (10, "y = 2\n")]


def test_needed_extra_reads_the_first_line_only():
    assert needed_extra('# needs the verl extra: pip install "tokenmdp[verl]"\nx = 1\n') == "verl"
    assert needed_extra("x = 1\n# needs the verl extra\n") is None


def test_pages_have_snippets():
    # the guides exist to be run: each must hold at least one snippet
    guides = [p for p in PAGES if p.parent.name == "guides" and p.name != "index.md"]
    assert guides, "no guide pages found"
    for page in guides:
        if page.name != "teaching.md":
            assert python_blocks(page.read_text()), f"{page.name} has no python snippet"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_page_snippets_run(page: Path, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # snippets that write files write them here
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    start = time.perf_counter()
    for line, source in python_blocks(page.read_text()):
        extra = needed_extra(source)
        if extra is not None and importlib.util.find_spec(extra) is None:
            continue                   # the extra is not installed here
        code = compile(source, f"{page.relative_to(DOCS)}:{line}", "exec")
        exec(code, namespace)  # noqa: S102 - the documentation's own snippets
    assert time.perf_counter() - start < PAGE_TIME_LIMIT_S
