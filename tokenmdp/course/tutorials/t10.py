"""Tutorial 10's zoo: every registry estimator trained and measured on one exact MDP.

* :class:`Budget` — the identical budget of every run (updates, groups, optimizer, seed);
* :func:`family` and :func:`correction_twin` — how the registry's entries group: a variant
  ``base_suffix`` belongs to the family ``base``; a variant that differs from its base only in
  the training–inference correction is its base's *twin* wherever ``μ = π_old``;
* :func:`zoo_runs` and :func:`zoo_moments` — :func:`~tokenmdp.exact.analysis.training.train_exact` and
  :func:`~tokenmdp.exact.moments` of every entry in every scenario, a twin reusing its base's
  result where the correction factor ``π_old/μ`` is exactly 1;
* :func:`summary_rows`, :func:`curves_figure`, :func:`prediction_figure` — the summary table,
  the ``J`` curves and the exact cosine against the final ``J``;
* :func:`monte_carlo_objective`, :func:`monte_carlo_figure` — what an evaluation by sampling
  would have shown of a run;
* :func:`part_differences` — the parts in which two compositions differ (the checklist's
  "which registry entry is this closest to").

Each function computes only what the tutorial shows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import torch

from tokenmdp import estimators
from tokenmdp.course.display import finish
from tokenmdp.estimators import Estimator
from tokenmdp.exact import moments, sample, train_exact

__all__ = ["Budget", "correction_twin", "curves_figure", "family", "monte_carlo_figure",
           "monte_carlo_objective", "part_differences", "prediction_figure", "summary_rows",
           "zoo_moments", "zoo_runs"]

#: The parts of an :class:`~tokenmdp.estimators.Estimator`, in the checklist's order.
PARTS = ("surrogate", "correction", "advantage", "aggregation", "kl")


@dataclasses.dataclass(frozen=True)
class Budget:
    """The budget every estimator gets: the same updates, batches, optimizer and seed.

    Parameters
    ----------
    updates : int
        Sampled updates per run.
    group_size : int
        ``G``, responses per prompt.
    groups_per_update : int
        Groups per batch.
    lr : float
        Adam's learning rate.
    seed : int
        Seed of every run's batch generator.
    """

    updates: int
    group_size: int
    groups_per_update: int
    lr: float
    seed: int

    def run(self, mdp, policy, estimator: Estimator, reference, **scenario):
        """:func:`~tokenmdp.exact.analysis.training.train_exact` with this budget (Adam, a fresh
        seeded generator).

        Parameters
        ----------
        mdp, policy, estimator, reference
            As for :func:`~tokenmdp.exact.analysis.training.train_exact`.
        **scenario
            ``staleness=`` and/or ``engine=``.

        Returns
        -------
        ExactTrainingRun
        """
        return train_exact(mdp, policy, estimator, updates=self.updates,
                           group_size=self.group_size, groups_per_update=self.groups_per_update,
                           optimizer=lambda p: torch.optim.Adam(p, lr=self.lr),
                           generator=torch.Generator().manual_seed(self.seed),
                           reference=reference, **scenario)


def family(name: str, names: Sequence[str]) -> str:
    """The family of registry entry ``name``: the longest other name ``base`` with ``name``
    starting ``base_`` (``"grpo_tis"`` → ``"grpo"``), else ``name`` itself.

    Parameters
    ----------
    name : str
        A registry name.
    names : sequence of str
        All registry names.

    Returns
    -------
    str
    """
    bases = [n for n in names if name.startswith(n + "_")]
    return max(bases, key=len) if bases else name


def correction_twin(name: str, names: Sequence[str]) -> str | None:
    """The family base whose estimator equals ``name``'s but for the correction, or None.

    The correction multiplies each token's term by a function of ``π_old/μ`` that is 1 at
    ``π_old/μ = 1`` (truncated, masked, geometric IS), so wherever the sampler is ``π_old``
    the twin's updates and moments are its base's, bit for bit.

    Parameters
    ----------
    name : str
        A registry name.
    names : sequence of str
        All registry names.

    Returns
    -------
    str or None
    """
    base = family(name, names)
    if base == name:
        return None
    mine, theirs = estimators.get(name), estimators.get(base)
    same = mine.replace(name=theirs.name, correction=theirs.correction) == theirs
    return base if same else None


def _reuse(name: str, names: Sequence[str], samples_from_old: bool) -> str:
    twin = correction_twin(name, names) if samples_from_old else None
    return name if twin is None else twin


def zoo_runs(mdp, policy, names: Sequence[str], scenarios: Mapping[str, dict], budget: Budget,
             reference) -> dict[tuple[str, str], object]:
    """Every entry trained with ``budget`` in every scenario (a twin reuses its base's run where
    the scenario has no engine).

    Parameters
    ----------
    mdp, policy, reference
        As for :func:`~tokenmdp.exact.analysis.training.train_exact`.
    names : sequence of str
        Registry names (bases before their variants, as :func:`tokenmdp.estimators.names`).
    scenarios : mapping of str to dict
        Scenario label → keyword arguments of :func:`~tokenmdp.exact.analysis.training.train_exact`
        (``staleness``, ``engine``).
    budget : Budget

    Returns
    -------
    dict
        ``(name, scenario) → ExactTrainingRun``.
    """
    runs = {}
    for scenario, kwargs in scenarios.items():
        for name in names:
            source = _reuse(name, names, "engine" not in kwargs)
            if (source, scenario) in runs:
                runs[name, scenario] = runs[source, scenario]
            else:
                runs[name, scenario] = budget.run(mdp, policy, estimators.get(name), reference,
                                                  **kwargs)
    return runs


def zoo_moments(mdp, names: Sequence[str], pairs: Mapping[str, dict], group_size: int,
                reference) -> dict[tuple[str, str], object]:
    """Exact :func:`~tokenmdp.exact.moments` of every entry at each scenario's policies.

    Parameters
    ----------
    mdp, reference
        As for :func:`~tokenmdp.exact.moments`.
    names : sequence of str
        Registry names.
    pairs : mapping of str to dict
        Scenario label → ``policy``, ``behavior`` and ``old`` of
        :func:`~tokenmdp.exact.moments` (``behavior`` None: on-policy).
    group_size : int

    Returns
    -------
    dict
        ``(name, scenario) → Moments``.
    """
    out = {}
    for scenario, kw in pairs.items():
        from_old = kw.get("old") is None or kw.get("old") is kw.get("behavior")
        for name in names:
            source = _reuse(name, names, from_old)
            if (source, scenario) in out:
                out[name, scenario] = out[source, scenario]
            else:
                out[name, scenario] = moments(mdp, kw["policy"], estimators.get(name),
                                              group_size=group_size, behavior=kw.get("behavior"),
                                              old=kw.get("old"), reference=reference,
                                              method="exact")
    return out


def summary_rows(names: Sequence[str], runs: Mapping, exact: Mapping, scenarios: Sequence[str]
                 ) -> list[tuple]:
    """One row per entry: family, name, ``cos(E ĝ, ∇J)`` per scenario, the on-policy trace
    variance, the final on-policy ``J`` and, per other scenario, its final ``J`` minus that.

    Parameters
    ----------
    names : sequence of str
        Registry names, in table order.
    runs : mapping
        :func:`zoo_runs`' result.
    exact : mapping
        :func:`zoo_moments`' result (the same scenario labels).
    scenarios : sequence of str
        The scenario labels, the on-policy one first.

    Returns
    -------
    list of tuple
    """
    rows = []
    for name in names:
        on = runs[name, scenarios[0]].final_objective
        rows.append((family(name, names), name,
                     *[exact[name, s].cosine for s in scenarios],
                     exact[name, scenarios[0]].total_variance, on,
                     *[runs[name, s].final_objective - on for s in scenarios[1:]]))
    return rows


def monte_carlo_objective(mdp, policy, n: int, generator: torch.Generator
                          ) -> tuple[float, float]:
    """``J`` estimated from ``n`` sampled responses: their mean reward and its standard error.

    Parameters
    ----------
    mdp : TokenMDP
    policy : PrefixPolicy
    n : int
        Responses (each with its own prompt draw).
    generator : torch.Generator

    Returns
    -------
    (float, float)
        The mean reward and ``sd / √n``.
    """
    rewards = sample(mdp, policy, n, generator=generator).reward
    return float(rewards.mean()), float(rewards.std() / n ** 0.5)


def monte_carlo_figure(exact: torch.Tensor, estimates: Sequence[tuple[float, float]], label: str):
    """The exact ``J`` curve of a run beside Monte Carlo evaluations with ±2 s.e. bars.

    Parameters
    ----------
    exact : Tensor ``[updates + 1]``
        the ``objective`` of an :class:`~tokenmdp.exact.analysis.training.ExactTrainingRun`.
    estimates : sequence of (float, float)
        :func:`monte_carlo_objective` of each ``π_t``.
    label : str
        The estimator, for the title.

    Returns
    -------
    matplotlib.figure.Figure
    """
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = range(len(exact))
    ax.plot(steps, exact.numpy(), "k-", lw=1.6, label="exact J (no evaluation noise)")
    ax.errorbar(steps, [m for m, _ in estimates], yerr=[2 * s for _, s in estimates], fmt="o",
                color="C1", ms=4, capsize=2, label=f"Monte Carlo J, {label} (±2 s.e.)")
    finish(ax, title="One training run, evaluated exactly and by sampling", xlabel="update",
           ylabel="J")
    return fig


def prediction_figure(rows: Sequence[tuple], scenarios: Sequence[str]):
    """Each entry's exact ``cos(E ĝ, ∇J)`` at the start against its final ``J``, per scenario.

    Parameters
    ----------
    rows : sequence of tuple
        :func:`summary_rows`' rows (cosines from column 2, the on-policy ``J`` and the
        differences after the variance).
    scenarios : sequence of str
        The scenario labels, as for :func:`summary_rows`.

    Returns
    -------
    matplotlib.figure.Figure
    """
    k = len(scenarios)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, scenario in enumerate(scenarios):
        cos = [r[2 + i] for r in rows]
        final = [r[3 + k] + (r[3 + k + i] if i else 0.0) for r in rows]
        ax.scatter(cos, final, s=18, color=f"C{i}", label=scenario, alpha=0.8)
    finish(ax, title="The exact cosine at the start, against the final J",
           xlabel="cos(E[ĝ], ∇J) at the start (exact)", ylabel="exact J after the run")
    return fig


def curves_figure(runs: Mapping, names: Sequence[str], scenarios: Sequence[str], *,
                  baseline: float | None = None):
    """The exact ``J`` after every update, one panel per scenario, one line per entry.

    Parameters
    ----------
    runs : mapping
        :func:`zoo_runs`' result.
    names : sequence of str
        The entries to draw.
    scenarios : sequence of str
        The panels.
    baseline : float, optional
        A horizontal reference line (for example the optimum of ``J``).

    Returns
    -------
    matplotlib.figure.Figure
    """
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.2 * len(scenarios), 3.8),
                             sharey=True)
    for ax, scenario in zip(axes, scenarios):
        for i, name in enumerate(names):
            curve = runs[name, scenario].objective
            ax.plot(range(len(curve)), curve.numpy(), color=f"C{i % 10}",
                    ls="-" if i < 10 else "--", lw=1.4, label=name)
        if baseline is not None:
            ax.axhline(baseline, color="0.6", lw=0.8, ls=":", label="max J")
        finish(ax, title=scenario, xlabel="update", ylabel="exact J",
               legend=ax is axes[-1])
    fig.suptitle("Exact J after every sampled update, identical budgets")
    fig.tight_layout()
    return fig


def part_differences(a: Estimator, b: Estimator) -> list[tuple[str, str, str]]:
    """The parts in which two compositions differ, as ``(part, a's, b's)`` descriptions.

    Parameters
    ----------
    a, b : Estimator

    Returns
    -------
    list of (str, str, str)
        One entry per differing part of ``PARTS``, in that order.
    """
    def describe(est, part):
        value = getattr(est, part)
        if value is None:
            return "none"
        return value.value if part == "aggregation" else value.describe()

    return [(part, describe(a, part), describe(b, part)) for part in PARTS
            if getattr(a, part) != getattr(b, part)]
