"""Trees against i.i.d. groups at equal generated-token budget: :func:`compare_at_budget`.

A step that generates ``c`` tokens on average can be repeated ``B / c`` times on a budget of
``B`` tokens; the mean of those steps keeps the step's bias and divides its covariance by
``B / c`` (:func:`~tokenmdp.exact.branching.moments.at_budget`). So at equal budget a tree wins
when its variance *per generated token* (``tr Cov · c``) is lower, unless its bias (which no
budget removes) costs more. Each row carries the step's own moments and the moments at the
budget; the best rescaling ``c*`` and ``MSE(c*)`` of the latter are what
``tokenmdp.reports.comparison.summary_row`` adds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from tokenmdp.exact.branching.moments import TreeMoments, TreeWorkspace, at_budget
from tokenmdp.tree_schedules import as_schedule

__all__ = ["BudgetRow", "compare_at_budget"]


class BudgetRow(NamedTuple):
    """One estimator on one kind of draw (:func:`compare_at_budget`).

    Parameters
    ----------
    estimator : str
        The registry name.
    draw : str
        ``iid:G`` or the schedule's text form.
    step : TreeMoments
        One step's moments and cost.
    budget : TreeMoments
        The mean of ``budget / step.generated_tokens`` steps.
    """

    estimator: str
    draw: str
    step: TreeMoments
    budget: TreeMoments


def compare_at_budget(workspace: TreeWorkspace, estimators: Sequence[str], draws: Sequence,
                      *, budget: float | None = None, method: str = "auto",
                      num_samples: int | None = None,
                      generator: torch.Generator | np.random.Generator | None = None
                      ) -> list[BudgetRow]:
    """Every estimator on every draw, each also at one budget of generated tokens.

    Parameters
    ----------
    workspace : TreeWorkspace
        The policies and the sampler.
    estimators : sequence of str
        Registry names.
    draws : sequence of int or schedule
        An int ``G``: an i.i.d. group of ``G`` (``workspace.iid``); a schedule: one tree.
    budget : float, optional
        Generated tokens (default: the cost of the first draw).
    method, num_samples, generator
        For the trees (:meth:`TreeWorkspace.moments`); an i.i.d. group is always exact.

    Returns
    -------
    list of BudgetRow
        Estimator-major, in the order given.
    """
    if isinstance(estimators, str):
        raise TypeError("estimators: expected a sequence of registry names, got a str")
    rows = []
    for name in estimators:
        for draw in draws:
            if isinstance(draw, int) and not isinstance(draw, bool):
                step = workspace.iid(name, draw, method="exact")
            else:
                step = workspace.moments(name, as_schedule(draw), method=method,
                                         num_samples=num_samples, generator=generator)
            if budget is None:
                budget = step.generated_tokens
            rows.append(BudgetRow(name, step.label, step, at_budget(step, budget)))
    return rows
