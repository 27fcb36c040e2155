"""The registry's machinery: :class:`Entry`, registration, and the variant rule.

Entries live in ``registry.classic`` (the classic estimators and their
``±tis`` / ``±mis`` variants), ``registry.zoo`` (the newer surrogates), ``registry.baselines``
(the newer advantages) and ``registry.trees`` (estimators that need a tree batch);
:mod:`~tokenmdp.estimators.registry.lookup` looks them up by name.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from tokenmdp.estimators.estimator import Estimator

__all__ = ["Entry"]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One registry entry: how to build the estimator and where it comes from.

    Parameters
    ----------
    name : str
        The registry name (``"grpo"``).
    build : callable
        ``build() -> Estimator``: a fresh estimator with the paper's defaults.
    formula : str
        The loss as a formula in plain text.
    paper : str
        The paper (arXiv id or venue) the estimator comes from.
    aliases : str
        The names and options other frameworks use for it.
    """

    name: str
    build: Callable[[], Estimator]
    formula: str
    paper: str
    aliases: str

    @functools.cached_property
    def needs_tree(self) -> bool:  # numpydoc ignore=RT01
        """True when the estimator's advantage reads a tree batch's node ids
        (``token_extras['tree_node']``, :mod:`tokenmdp.trees`) and refuses a plain batch."""
        return bool(getattr(self.build().advantage, "needs_tree", False))


_ENTRIES: dict[str, Entry] = {}


def _register(name: str, *, formula: str, paper: str, aliases: str):
    def decorate(factory: Callable[[], Estimator]) -> Callable[[], Estimator]:
        factory.__doc__ = (f"{(factory.__doc__ or '').rstrip()}\n\n    Formula: {formula}\n\n"
                           f"    Paper: {paper}\n\n    Other names: {aliases}\n")
        _ENTRIES[name] = Entry(name, factory, formula, paper, aliases)
        return factory
    return decorate


def _variant(base: str, suffix: str, summary: str, aliases: str, *, formula: str | None = None,
             **changes) -> None:
    """Register ``base_suffix``: ``base`` with ``changes`` and its own ``formula`` (a formula
    that starts with ";" is appended to the base's: what the change does to each term)."""
    parent = _ENTRIES[base]
    if formula is None:
        raise ValueError(f"formula: the variant {base}_{suffix} must state its formula")
    if formula.startswith(";"):
        formula = parent.formula + formula

    def factory() -> Estimator:
        return parent.build().replace(name=f"{base}_{suffix}", **changes)
    factory.__name__ = factory.__qualname__ = f"{base}_{suffix}"
    factory.__doc__ = f"{base} with {summary}."
    _register(f"{base}_{suffix}", formula=formula, paper=parent.paper,
              aliases=aliases)(factory)

