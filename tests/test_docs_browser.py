"""The documentation site in a real browser (headless Chromium): formulas render, tables are
spaced, figures load, nothing is fetched from the network (``docs/_ext/browser_check.py``).

The built site (``docs/_build/html``) is checked when it is there; the checker itself is tested
on a tiny site written here, each check failing on its bad page and passing on its good one.
Both need Debian's ``chromium`` (CI installs it) and skip without it. The browser reaches nothing
but 127.0.0.1: host names do not resolve and every other request ends at a local dead-end proxy.
"""

from __future__ import annotations

import importlib
import importlib.util
import struct
import sys
import zlib
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
SITE = DOCS / "_build" / "html"
sys.path.insert(0, str(DOCS / "_ext"))
browser_check = importlib.import_module("browser_check")

CHROMIUM = browser_check.find_chromium()
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install chromium; CI does)")


def _mathjax() -> Path | None:
    """The MathJax that sphinx-mathjax-offline bundles into the site (the docs extra)."""
    spec = importlib.util.find_spec("sphinx-mathjax-offline")
    folder = Path(spec.origin).parent / "static" / "mathjax" if spec and spec.origin else None
    return folder if folder and (folder / "tex-chtml.js").is_file() else None


@needs_chromium
@pytest.mark.skipif(not (SITE / "index.html").is_file(),
                    reason="the site is not built (sphinx-build ... docs docs/_build/html)")
def test_the_built_site_renders_in_a_browser():
    problems = browser_check.check(SITE)
    assert not problems, "the site in a browser:\n" + "\n".join(problems)


def _png() -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", 2, 2, 8, 0, 0, 0, 0)  # 2x2, 8-bit grey
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(b"\x00\x80\x80" * 2)) + chunk(b"IEND", b""))


MATHJAX = '<script defer src="_static/mathjax/tex-chtml.js"></script>'
STYLE = ("<style>table { border-collapse: collapse }"
         " td.spaced, th.spaced { padding: 0.2em 0.9em } td.tight { padding: 0 }</style>")
#: page -> (body, must show formulas)
PAGES = {
    "math_good.html": (MATHJAX + '<p>The mean <span class="math notranslate nohighlight">'
                       r"\(\hat g = \frac{1}{n}\sum_i g_i\)</span> and</p>"
                       r'<div class="math notranslate nohighlight">\[x^2\]</div>'
                       "<pre>price = '$5 and $6'  # code keeps its dollars</pre>", True),
    "math_raw_dollar.html": (MATHJAX + "<p>The mean $x$ of the batch.</p>", False),
    "math_no_mathjax.html": (r'<p>The mean <span class="math">\(x\)</span>.</p>', False),
    "math_expected.html": ("<p>No formula here although one was expected.</p>", True),
    "math_tex_error.html": (MATHJAX + r'<p><span class="math">\(\frac{1}\)</span></p>', False),
    "table_good.html": (STYLE + '<table class="tokenmdp-table"><tr><th class="spaced">a</th>'
                        '<th class="spaced">b</th></tr><tr><td class="spaced">1</td>'
                        '<td class="spaced">2</td></tr></table>', False),
    "table_tight.html": (STYLE + '<table class="docutils"><tr><td class="tight">1</td>'
                         '<td class="tight">2</td></tr></table>', False),
    "image_good.html": ('<img src="dot.png" alt="dot">', False),
    "image_missing.html": ('<img src="missing.png" alt="missing">', False),
    "image_broken.html": ('<img src="broken.png" alt="broken">', False),
    "network_good.html": ('<script src="local.js"></script><p>Read the <a '
                          'href="https://arxiv.org/abs/1">paper</a>.</p>', False),
    "network_script.html": ('<script src="http://example.com/x.js"></script><p>hi</p>', False),
    "network_worker.html": ("<script>new Worker('worker.js')</script><p>hi</p>", False),
}


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> dict[str, list[str]]:
    """The checker's problems on each page of a tiny site (one browser for them all)."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium; CI does)")
    mathjax = _mathjax()
    if mathjax is None:
        pytest.skip("sphinx-mathjax-offline is not installed (pip install -e '.[docs]')")
    site = tmp_path_factory.mktemp("site")
    (site / "_static").mkdir()
    (site / "_static" / "mathjax").symlink_to(mathjax, target_is_directory=True)
    (site / "dot.png").write_bytes(_png())
    (site / "broken.png").write_bytes(b"not a png")
    (site / "local.js").write_text("document.title = 'local';\n")
    (site / "worker.js").write_text("fetch('http://example.org/from-a-worker').catch(() => 0);\n")
    for name, (body, _) in PAGES.items():
        (site / name).write_text(f"<!DOCTYPE html><html><head><title>t</title></head>"
                                 f"<body>{body}</body></html>")
    problems = browser_check.check(site, [(name, math) for name, (_, math) in PAGES.items()])
    by_page = {name: [] for name in PAGES}
    for line in problems:
        page, _, what = line.partition(": ")
        by_page.setdefault(page, []).append(what)
    return by_page


def _only(found, page: str, *parts: str) -> None:
    problems = found[page]
    assert problems, f"{page}: no problem found"
    for problem in problems:
        assert any(part in problem for part in parts), f"{page}: unexpected {problem!r}"


@needs_chromium
@pytest.mark.parametrize("page", [name for name in PAGES if name.endswith("_good.html")])
def test_the_good_pages_pass(found, page):
    assert found[page] == []


@needs_chromium
def test_raw_tex_and_unrendered_formulas_fail(found):
    _only(found, "math_raw_dollar.html", "raw TeX in the text: The mean $x$")
    assert any("raw TeX" in p for p in found["math_no_mathjax.html"])
    assert any("formula not rendered" in p for p in found["math_no_mathjax.html"])
    assert any("no MathJax output" in p for p in found["math_no_mathjax.html"])
    _only(found, "math_expected.html", "formulas but no MathJax output")
    _only(found, "math_tex_error.html", "formula with a TeX error")


@needs_chromium
def test_a_table_without_cell_padding_fails(found):
    _only(found, "table_tight.html", "table 1 (docutils, first cell '1'): 2 of 2 cells with under")


@needs_chromium
def test_an_image_that_does_not_load_fails(found):
    _only(found, "image_missing.html", "image not loaded: missing.png",
          "a local file failed to load: missing.png (404)")
    _only(found, "image_broken.html", "image not loaded: broken.png")


@needs_chromium
def test_a_request_off_the_machine_fails_and_goes_nowhere(found):
    _only(found, "network_script.html", "fetches from the network: http://example.com/x.js")
    _only(found, "network_worker.html",
          "fetches from the network: http://example.org/from-a-worker")


def test_pages_missing_from_the_site_are_reported_without_a_browser(tmp_path):
    assert browser_check.check(tmp_path, [("nope.html", True)], binary="/nonexistent") == [
        "nope.html: missing from the site"]


def test_the_representative_pages_cover_each_kind_of_page():
    paths = [page for page, _ in browser_check.PAGES]
    assert "index.html" in paths and "getting_started.html" in paths
    for folder in ("concepts/", "tutorials/", "estimators/", "api/"):
        assert any(path.startswith(folder) for path in paths), folder
    assert len(paths) <= 8  # a quick check: one or two of each


def test_only_loopback_counts_as_local():
    assert browser_check._is_loopback("http://127.0.0.1:8000/x.js")
    assert browser_check._is_loopback("data:image/png;base64,AAAA")
    assert not browser_check._is_loopback("https://cdn.example/x.js")
    assert not browser_check._is_loopback("http://localhost:8000/x.js")
    assert browser_check.proxy_host("CONNECT fonts.example:443 HTTP/1.1") == "fonts.example"
    assert browser_check.proxy_host("GET http://1.2.3.4/x HTTP/1.1") == "1.2.3.4"
