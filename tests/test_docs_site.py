"""The documentation's generated pages cover the package, and the offline check catches fetches.

The site itself is built by CI (``sphinx-build -W``); these tests guard what the build cannot see:
that a public module or name added to the package reaches the API reference, that every registry
entry gets a card, and that ``check_site`` rejects a page that would load something from the
network.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
import re
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
sys.path.insert(0, str(DOCS / "_ext"))
site_gen = pytest.importorskip("tokenmdp_docs")
check_site = importlib.import_module("check_site")

import tokenmdp  # noqa: E402
from tokenmdp import estimators  # noqa: E402

# The attention module that is loaded lazily, on CUDA only.
NOT_IN_API = {"tokenmdp.model.flex"}
if importlib.util.find_spec("trl") is None:   # the optional extras are not installed
    NOT_IN_API.add("tokenmdp.integrations.trl_trainer")
if importlib.util.find_spec("verl") is None:
    NOT_IN_API.update({"tokenmdp.integrations.verl_losses", "tokenmdp.integrations.verl_plugin"})


def _public_modules_with_all():
    found = []
    for info in pkgutil.walk_packages(tokenmdp.__path__, "tokenmdp."):
        if any(part.startswith("_") for part in info.name.split(".")) or \
                info.name in NOT_IN_API:
            continue
        module = importlib.import_module(info.name)
        if hasattr(module, "__all__"):
            found.append(info.name)
    return found


def test_every_public_module_is_in_the_api_reference_or_reexported_by_its_front_door():
    listed = {name for name, _ in site_gen.api_modules()}
    for name in _public_modules_with_all():
        if name in listed or name in NOT_IN_API:
            continue
        parts = name.split(".")
        doors = [importlib.import_module(".".join(parts[:i])) for i in range(1, len(parts))]
        exported = {n for door in doors for n in getattr(door, "__all__", ())}
        module = importlib.import_module(name)
        missing = [n for n in module.__all__ if n not in exported]
        assert not missing, f"{name}: {missing} are neither on an API page nor re-exported"


def test_api_pages_list_exactly_each_modules_public_names(tmp_path, monkeypatch):
    monkeypatch.setattr(site_gen, "DOCS", tmp_path)
    site_gen.write_api_pages()
    documented = set()
    for module_name, _ in site_gen.api_modules():
        page = (tmp_path / "api" / f"{module_name.replace('.', '_')}.md").read_text()
        # a package's map without public names of its own has no autosummary block
        block = page.split(".. autosummary::", 1)[1].split("```", 1)[0] \
            if ".. autosummary::" in page else ""
        listed = set(re.findall(r"^   (\w+)$", block, flags=re.M))
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if name.startswith("__") or inspect.ismodule(obj):
                continue
            assert name in listed or f"`{name}`" in page, (module_name, name)
            documented.add(f"{module_name}.{name}")
        public = set(getattr(module, "__all__", ()))
        assert listed <= public, (module_name, listed - public)
    index = (tmp_path / "api" / "index.md").read_text()
    assert all(name.replace(".", "_") in index for name, _ in site_gen.api_modules())
    assert "tokenmdp.exact.gradient" in documented and "tokenmdp.TokenBatch" in documented


def test_every_registry_entry_gets_a_card_page(tmp_path, monkeypatch):
    monkeypatch.setattr(site_gen, "DOCS", tmp_path)
    site_gen.write_estimator_cards(live=False)
    pages = {p.stem for p in (tmp_path / "estimators").glob("*.md")}
    every = estimators.names(trees=None)              # the tree entries get cards too
    assert set(estimators.names(trees=True)) < set(every)
    assert pages == set(every) | {"index"}
    index = (tmp_path / "estimators" / "index.md").read_text()
    assert all(f"\n{name}\n" in index for name in every)  # in the toctree
    grpo = (tmp_path / "estimators" / "grpo.md").read_text()
    entry = estimators.registry.lookup._entry("grpo")
    assert grpo.startswith("# ") and entry.formula in grpo and entry.paper in grpo


def test_tutorial_pages_are_the_sources_themselves(tmp_path, monkeypatch):
    monkeypatch.setattr(site_gen, "DOCS", tmp_path)
    site_gen.write_tutorials()
    sources = sorted((site_gen.ROOT / "tutorials").glob("[0-9][0-9]_*.py"))
    for src in sources:
        assert (tmp_path / "tutorials" / src.name).read_text() == src.read_text()
    index = (tmp_path / "tutorials" / "index.md").read_text()
    assert all(src.stem in index for src in sources)


def _page(tmp_path, body: str) -> Path:
    site = tmp_path / "site"
    (site / "_static" / "mathjax").mkdir(parents=True)
    (site / "_static" / "mathjax" / "tex-chtml.js").write_text("")
    (site / "index.html").write_text(f"<html><head>{body}</head><body></body></html>")
    return site


def test_offline_check_accepts_local_assets_and_links_to_papers(tmp_path):
    site = _page(tmp_path, '<script src="_static/mathjax/tex-chtml.js"></script>'
                           '<span class="math">x</span><a href="https://arxiv.org/abs/1">paper</a>')
    assert check_site.check(site) == []


@pytest.mark.parametrize("body", [
    '<script src="https://cdn.example/mathjax.js"></script>',
    '<link rel="stylesheet" href="//fonts.example/css">',
    '<img src="http://example/x.png">',
    '<span class="math">x</span>',  # formulas without the bundled MathJax
])
def test_offline_check_rejects_network_fetches_and_missing_mathjax(tmp_path, body):
    assert check_site.check(_page(tmp_path, body))


def test_the_site_check_refuses_a_heavy_site_and_doctrees_inside(tmp_path, monkeypatch):
    """Issue 30: a lean site (under 40 MiB, doctrees built elsewhere with ``-d``)."""
    assert check_site.SITE_LIMIT == 40 * 1024 ** 2
    site = _page(tmp_path, "")
    assert check_site.check(site) == []
    monkeypatch.setattr(check_site, "SITE_LIMIT", 1000)
    (site / "big.bin").write_bytes(b"0" * 2000)
    (site / ".doctrees").mkdir()
    problems = check_site.check(site)
    assert any("over" in p for p in problems) and any(".doctrees" in p for p in problems)


def test_the_build_keeps_only_the_mathjax_the_pages_load(tmp_path):
    """The bundled MathJax loses its other combined bundles and the SVG output; what
    ``tex-chtml.js`` loads (its folders, the CHTML fonts) stays."""
    import types
    folder = tmp_path / "_static" / "mathjax"
    for name in ("tex-chtml.js", "tex-svg.js", "mml-chtml.js", "loader.js", "output/svg.js",
                 "output/svg/fonts/a.js", "output/chtml/fonts/woff-v2/x.woff", "input/tex.js",
                 "sre/x.js"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("x")
    app = types.SimpleNamespace(outdir=str(tmp_path), builder=types.SimpleNamespace(format="html"))
    site_gen._slim_mathjax(app, None)
    left = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert left == ["input/tex.js", "loader.js", "output/chtml/fonts/woff-v2/x.woff", "sre/x.js",
                    "tex-chtml.js"]
