"""Sphinx configuration of the tokenmdp documentation site.

Build: ``pip install -e ".[docs]"`` then ``sphinx-build -W --keep-going -b html docs docs/_build/html``
(CI does this). ``TOKENMDP_DOCS_EXECUTE=0`` skips executing the tutorials and the estimator cards'
live rows, for a fast check of the prose and the references.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import tokenmdp

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
EXECUTE = os.environ.get("TOKENMDP_DOCS_EXECUTE", "1") != "0"

project = "tokenmdp"
author = "The tokenmdp developers"
copyright = "2026, the tokenmdp developers"
release = version = tokenmdp.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "numpydoc",
    "sphinx_copybutton",
    "sphinx_design",
    "sphinx-mathjax-offline",  # MathJax 3 bundled into _static: formulas render offline
    "tokenmdp_docs",  # tutorials, estimator cards and API pages generated at build time
]

exclude_patterns = ["_build", "_ext", "_templates", "conf.py", "**.ipynb_checkpoints"]
templates_path = ["_templates"]
html_static_path = ["_static"]
html_css_files = ["tokenmdp.css"]

# -- MyST and MyST-NB ---------------------------------------------------------------------------
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
# The tutorials are jupytext percent scripts: the same reader as the test suite's.
nb_custom_formats = {".py": ["jupytext.reads", {"fmt": "py:percent"}]}
nb_execution_mode = "cache" if EXECUTE else "off"
nb_execution_cache_path = str(DOCS / "_build" / ".jupyter_cache")
nb_execution_timeout = 600
nb_execution_raise_on_error = True  # a tutorial that fails to execute fails the build
nb_execution_show_tb = True
nb_merge_streams = True

# -- API reference ------------------------------------------------------------------------------
autosummary_generate = True
autosummary_imported_members = True
autodoc_typehints = "none"  # types are in the numpy-style docstrings
autodoc_default_options = {"members": True, "inherited-members": False, "show-inheritance": True}
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False
# Every documented object: a docstring (GL08), its parameters documented (PR01) and, when it
# returns something, a Returns section (RT01). A missing section fails the build.
numpydoc_validation_checks = {"GL08", "PR01", "RT01"}
# Hypothesis's @composite wrappers hide their source from the validator (their docstrings render);
# TreeMoments adds fields to Moments, whose parameters its docstring names rather than repeats.
numpydoc_validation_exclude = {
    r"^tokenmdp\.testing\.(tree_strategies\.)?(estimators|layouts|mdps|micro_batch_splits|response_trees|"
    r"tree_batches|tree_packings|tree_splits)$",
    r"^tokenmdp\.exact\.branching\.(moments\.)?TreeMoments$"}
add_module_names = False
python_use_unqualified_type_names = True

# Nitpicky: every reference to tokenmdp must resolve. References into other libraries cannot
# (their inventories would have to be downloaded), so those, and only those, are ignored.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|numpy|np|matplotlib|hypothesis|argparse|pathlib|collections|typing|"
               r"dataclasses|enum|abc|os|io|contextlib|functools|types|trl|transformers|datasets)(\..*)?"),
    (r"py:.*", r"(int|float|str|bool|bytes|object|None|list|tuple|dict|set|Callable|Sequence|"
               r"Mapping|Iterable|Iterator|Any|Path|Tensor|Generator|Enum|ABC|Protocol|"
               r"NamedTuple|Exception|ValueError|TypeError|RuntimeError)"),
    # nn.Module.forward's docstring, inherited by the models' forward methods
    (r"py:class", r"Module"),
    # TRL's trainer, the base of tokenmdp.integrations.trl_trainer's subclass (the trl extra)
    (r"py:class", r"GRPOTrainer"),
]

# -- HTML -----------------------------------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = "tokenmdp"
html_theme_options = {
    "navbar_align": "left",
    "show_toc_level": 2,
    "navigation_with_keys": False,
    # the left sidebar lists the current section's pages only, not every module below it: an
    # API page carried the whole module tree (117 KB each)
    "collapse_navigation": True,
    "navigation_depth": 2,
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
    "secondary_sidebar_items": ["page-toc"],
}
# no left sidebar where it would be empty (top-level leaf pages) or only repeat the module list
# for each of the ~500 one-name API pages (half of each page's bytes); their module page links
# them all
html_sidebars = {"index": [], "getting_started": [], "benchmarks": [], "api/generated/*": []}
html_show_sourcelink = False
html_copy_source = False      # no _sources/ copy of every page (nothing links to it)
