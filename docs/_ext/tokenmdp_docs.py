"""Pages the documentation generates from the package itself, so that none of them can drift.

* ``tutorials/`` — the tutorial sources (``tutorials/NN_*.py``, jupytext percent scripts) and an
  index listing them by their titles; MyST-NB reads and executes them;
* ``estimators/`` — one card per registry entry (:func:`tokenmdp.reports.cards.card_markdown`), with its
  exact relative bias, cosine, variance and MSE on the reference MDP computed now;
* ``api/`` — one page per public module, listing exactly the names of its ``__all__``.

Every generated folder is rewritten at each build (files whose text is unchanged are left alone,
so the notebook cache and incremental builds keep working) and is ignored by git.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import shutil
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1]
ROOT = DOCS.parent

# (module, one-line description), in reading order; a name documented on an earlier page is not
# documented again (the later module only re-exports it).
API_MODULES = [
    ("tokenmdp", "the one batch type both worlds share"),
    ("tokenmdp.cli", "the tokenmdp command line"),
    ("tokenmdp.packing", "packing sequences into rows, layouts, micro-batches"),
    ("tokenmdp.distributed", "step counts over data-parallel ranks, the DDP loss scale"),
    ("tokenmdp.interop", "TokenBatch to and from Hugging Face padded tensors, logits, HF models"),
    ("tokenmdp.estimators", "advantages, surrogates, corrections, aggregation, KL; the registry"),
    ("tokenmdp.estimators.registry.lookup", "the registry: estimators by name"),
    ("tokenmdp.exact", "the enumerable token MDP: ground truth, behaviour policies, moments"),
    ("tokenmdp.exact.world.rewards", "rewards of the exact world"),
    ("tokenmdp.exact.world.budget", "the memory budget that guards the exact world's allocations"),
    ("tokenmdp.model", "the Mixture-of-Experts transformer with routing record and replay"),
    ("tokenmdp.rl", "the rollout engine, routing replay, training–inference metrics"),
    ("tokenmdp.rl.config", "every trainer option"),
    ("tokenmdp.rl.update", "one optimizer update"),
    ("tokenmdp.rl.trainer", "the training loop and SFT"),
    ("tokenmdp.rl.tasks", "verifiable tasks and the character tokenizer"),
    ("tokenmdp.rl.logger", "metrics.jsonl and TensorBoard"),
    ("tokenmdp.rl.plot", "training curves"),
    ("tokenmdp.rl.cli_commands", "the sft, train and plot commands, generated from TrainConfig"),
    ("tokenmdp.testing", "layout and micro-batch invariance checks, hypothesis strategies"),
    ("tokenmdp.reports.plots", "plots of the exact lab"),
    ("tokenmdp.reports.comparison", "the exact comparison behind tokenmdp compare"),
    ("tokenmdp.reports.hints", "the one-line hints under the compare table"),
    ("tokenmdp.reports.cards", "estimator cards"),
]




# Where each object is documented: alias name -> documented name, for the resolver below.
CANONICAL: dict[str, str] = {}
MODULE_PAGES: dict[str, str] = {}


def _record(documented: str, obj, module_name: str) -> None:
    """Let references by the defining module's name, or by a unique short name, find ``obj``."""
    CANONICAL[documented] = documented
    owner, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(owner, str) and isinstance(qualname, str):
        CANONICAL.setdefault(f"{owner}.{qualname}", documented)
        MODULE_PAGES.setdefault(owner, module_name)
    short = documented.rsplit(".", 1)[1]
    CANONICAL[short] = documented if CANONICAL.get(short, documented) == documented else ""
    if inspect.isclass(obj):  # methods and attributes: Class.member by any of the names
        for member in vars(obj):
            if not member.startswith("_"):
                for prefix in (documented, f"{owner}.{qualname}", short):
                    CANONICAL.setdefault(f"{prefix}.{member}", f"{documented}.{member}")


def _exists(module_name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module_name) is not None
    except ModuleNotFoundError:
        return False


def _resolve(app, env, node, contnode):
    """``missing-reference``: retry a tokenmdp reference under the name it is documented by."""
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"]
    domain = env.get_domain("py")
    if node["reftype"] == "mod":
        page = MODULE_PAGES.get(target)
        if page is None and target.startswith("tokenmdp.") and _exists(target):
            return contnode      # a module with no public names of its own has no page: text
        if page is None or page == target:
            return None
        return domain.resolve_xref(env, node["refdoc"], app.builder, "mod", page, node, contnode)
    documented = CANONICAL.get(target) or CANONICAL.get(target.lstrip("~."))
    if not documented and node.get("py:class"):  # :meth:`member` inside a class's docstring
        scope = f"{node.get('py:module')}.{node['py:class']}"
        documented = CANONICAL.get(f"{CANONICAL.get(scope) or scope}.{target}")
    if not documented and node.get("py:module"):  # a name of the module the docstring is in
        documented = CANONICAL.get(f"{node['py:module']}.{target}")
    if not documented or documented == target:
        return None
    return domain.resolve_xref(env, node["refdoc"], app.builder, "obj", documented, node,
                               contnode)


def _write(path: Path, text: str, keep: set[Path]) -> None:
    keep.add(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def _prune(folder: Path, keep: set[Path]) -> None:
    for path in folder.rglob("*"):
        if path.is_file() and path not in keep:
            path.unlink()


def _title(source: str) -> str:
    match = re.search(r"^# # (.+)$", source, flags=re.M)
    if match is None:
        raise ValueError("tutorial source without a '# # Title' line")
    return match.group(1)


def write_tutorials() -> None:
    out, keep = DOCS / "tutorials", set()
    sources = sorted((ROOT / "tutorials").glob("[0-9][0-9]_*.py"))
    entries = []
    for src in sources:
        text = src.read_text()
        _write(out / src.name, text, keep)
        entries.append((src.stem, _title(text)))
    lines = ["# Tutorials", "",
             "Each tutorial asks one question and answers it exactly, next to a Monte Carlo",
             "estimate. They are plain-text notebooks (jupytext percent scripts) in the",
             "repository's `tutorials/` folder: open them in JupyterLab with jupytext",
             "(`pip install -e \".[notebooks]\"`, then `jupyter lab tutorials/`), or run one as a",
             "script with `python tutorials/01_the_exact_token_mdp.py`. The pages below were",
             "executed when this site was built.", ""]
    lines += [f"{i}. {{doc}}`{title} <{stem}>`" for i, (stem, title) in enumerate(entries, 1)]
    lines += ["", "```{toctree}", ":hidden:", ":maxdepth: 1", ""]
    lines += [stem for stem, _ in entries] + ["```", ""]
    _write(out / "index.md", "\n".join(lines), keep)
    _prune(out, keep)


def write_estimator_cards(live: bool) -> None:
    from tokenmdp import estimators
    from tokenmdp.reports import cards

    out, keep = DOCS / "estimators", set()
    names = estimators.names(trees=None)           # every entry, the tree entries included
    rows = cards.reference_rows(names) if live else {}
    for name in names:
        _write(out / f"{name}.md", cards.card_markdown(name, rows.get(name)), keep)
    lines = ["# Estimator cards", "",
             "One card per entry of the registry ({py:func}`tokenmdp.estimators.names`),",
             "generated from the registry itself when this site was built: summary, the loss",
             "as math composed from the estimator's parts (with the registry's plain-text",
             "formula), paper, components and defaults, the names other frameworks use, and the exact",
             "figures on the reference MDP. The same card in a terminal:",
             "`tokenmdp estimators NAME`.", ""]
    if live:
        lines += [cards.REFERENCE.description if hasattr(cards.REFERENCE, "description")
                  else str(cards.REFERENCE), ""]
        lines += ["| estimator | rel. bias | cosine | total variance | MSE |",
                  "|---|---:|---:|---:|---:|"]
        for name in names:
            if name in rows:
                r = rows[name]
                lines.append(f"| {{doc}}`{name}` | {r['relative_bias']:.4f} | {r['cosine']:.4f} "
                             f"| {r['total_variance']:.4g} | {r['mse']:.4g} |")
        lines.append("")
    trees = estimators.names(trees=True)
    if trees:
        lines += ["The entries for branching (tree) rollouts need a tree batch "
                  "({py:mod}`tokenmdp.trees`), so the reference's independent groups give them no "
                  "row; their exact bias and variance over tree draws are on "
                  "{doc}`/concepts/branching`: " + ", ".join(f"{{doc}}`{n}`" for n in trees)
                  + ".", ""]
    else:
        lines += ["(This build skipped the live figures: `TOKENMDP_DOCS_EXECUTE=0`.)", ""]
    lines += ["```{toctree}", ":hidden:", ":maxdepth: 1", ""] + list(names) + ["```", ""]
    _write(out / "index.md", "\n".join(lines), keep)
    _prune(out, keep)


NOT_IN_API = {"tokenmdp.model.flex"}  # loaded lazily, on CUDA only
if importlib.util.find_spec("trl") is None:   # the optional extras are not installed
    NOT_IN_API.add("tokenmdp.integrations.trl_trainer")
if importlib.util.find_spec("verl") is None:
    NOT_IN_API.update({"tokenmdp.integrations.verl_losses", "tokenmdp.integrations.verl_plugin"})


def api_modules() -> list[tuple[str, str]]:
    """:data:`API_MODULES`, then every other package (its page shows its map, the docstring) and
    every other public module whose ``__all__`` has a name that no package above it re-exports
    (its front door), so a new module cannot be left out of the reference."""
    import pkgutil

    import tokenmdp

    modules, listed = list(API_MODULES), {name for name, _ in API_MODULES}
    for info in pkgutil.walk_packages(tokenmdp.__path__, "tokenmdp."):
        name = info.name
        if name in listed or name in NOT_IN_API or any(p.startswith("_") for p in name.split(".")):
            continue
        module = importlib.import_module(name)
        parts = name.split(".")
        doors = [importlib.import_module(".".join(parts[:i])) for i in range(1, len(parts))]
        exported = {n for door in doors for n in getattr(door, "__all__", ())}
        if info.ispkg or any(n not in exported for n in getattr(module, "__all__", ())):
            blurb = (inspect.getdoc(module) or name).split("\n")[0].rstrip(".")
            modules.append((name, blurb))
    return modules


def write_api_pages() -> None:
    out, keep = DOCS / "api", set()
    seen: dict[int, str] = {}
    index = ["# API reference", "",
             "Every public name of every public module: exactly the names in each module's",
             "`__all__`. A name re-exported by a later module is documented once, where it",
             "first appears below.", "", "| module | |", "|---|---|"]
    pages = []
    for module_name, blurb in api_modules():
        module = importlib.import_module(module_name)
        MODULE_PAGES[module_name] = module_name
        names, again = [], []
        for name in getattr(module, "__all__", ()):
            if name.startswith("__"):
                continue
            obj = getattr(module, name)
            if inspect.ismodule(obj):  # a submodule (tokenmdp.exact.world.rewards) has its own page
                continue
            key = id(obj)
            if key in seen and not isinstance(obj, (int, float, str, tuple)):
                again.append((name, seen[key]))
                CANONICAL.setdefault(f"{module_name}.{name}", seen[key])
                continue
            seen.setdefault(key, f"{module_name}.{name}")
            _record(f"{module_name}.{name}", obj, module_name)
            names.append(name)
        # tokenmdp.exact.moments is a module and the function it defines: index the function
        no_index = ["   :no-index:"] if module_name in CANONICAL else []
        lines = [f"# `{module_name}`", "", "```{eval-rst}", f".. automodule:: {module_name}",
                 "   :no-members:", *no_index, ""]
        if names:                                    # a package's map may list no names
            lines += [f".. currentmodule:: {module_name}", "", ".. autosummary::",
                      "   :toctree: generated", "", *[f"   {name}" for name in names]]
        lines += ["```", ""]
        if again:
            lines += ["Also re-exported here: " + ", ".join(
                f"`{name}` ({{py:obj}}`{target}`)" for name, target in again) + ".", ""]
        page = module_name.replace(".", "_")
        _write(out / f"{page}.md", "\n".join(lines), keep)
        index.append(f"| {{doc}}`{module_name} <{page}>` | {blurb} |")
        pages.append(page)
    index += ["", "```{toctree}", ":hidden:", ":maxdepth: 1", ""] + pages + ["```", ""]
    _write(out / "index.md", "\n".join(index), keep)
    # autosummary writes api/generated/ itself, after this; stubs of names gone must not stay
    shutil.rmtree(out / "generated", ignore_errors=True)
    _prune(out, keep)


def _generate(app, config=None) -> None:
    live = os.environ.get("TOKENMDP_DOCS_EXECUTE", "1") != "0"
    write_tutorials()
    write_estimator_cards(live)
    write_api_pages()


#: The MathJax files the pages load (``tex-chtml.js``, which loads its components from the
#: folders on demand) and what those load; every other combined bundle and the SVG output are
#: removed from the built site (about 20 MB of one output format the site does not use).
MATHJAX_KEEP = {"tex-chtml.js", "loader.js", "startup.js", "core.js"}
MATHJAX_UNUSED = ("output/svg", "output/svg.js")


def _slim_mathjax(app, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    folder = Path(app.outdir) / "_static" / "mathjax"
    if not (folder / "tex-chtml.js").is_file():
        return
    for bundle in folder.glob("*.js"):
        if bundle.name not in MATHJAX_KEEP:
            bundle.unlink()
    for name in MATHJAX_UNUSED:
        path = folder / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def setup(app):
    app.connect("config-inited", _generate)  # before the sources are discovered
    app.connect("build-finished", _slim_mathjax)
    app.connect("missing-reference", _resolve)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
