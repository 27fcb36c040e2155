"""Tutorial 10's zoo: every registry estimator trained and measured on one exact MDP.

* :class:`Budget` — the identical budget of every run (updates, groups, optimizer, seed);
* :func:`family` and :func:`correction_twin` — how the registry's entries group: a variant
  ``base_suffix`` belongs to the family ``base``; a variant that differs from its base only in
  the training–inference correction is its base's *twin* wherever ``μ = π_old``;
* :func:`zoo_runs`, :func:`zoo_seeds` and :func:`zoo_moments` —
  :func:`~tokenmdp.exact.analysis.training.train_exact` (on one seed, or on several) and
  :func:`~tokenmdp.exact.moments` of every entry in every scenario, a twin reusing its base's
  result where the correction factor ``π_old/μ`` is exactly 1;
* :func:`final_objectives`, :func:`seed_noise`, :func:`summary_rows` — the final ``J`` of every
  seed, the seed-to-seed noise of each scenario, and the summary table of seed means;
* :func:`monte_carlo_objective` — what an evaluation by sampling would have shown of a run;
* :func:`part_differences` — the parts in which two compositions differ (the checklist's
  "which registry entry is this closest to").

The figures are :mod:`~tokenmdp.course.tutorials.t10_figures`'. Each function computes only what
the tutorial shows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from tokenmdp import estimators
from tokenmdp.estimators import Estimator
from tokenmdp.exact import moments, sample, train_exact

__all__ = ["Budget", "correction_twin", "family", "final_objectives", "monte_carlo_objective",
           "part_differences", "seed_noise", "summary_rows", "zoo_moments", "zoo_runs",
           "zoo_seeds"]

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


def zoo_seeds(mdp, policy, names: Sequence[str], scenarios: Mapping[str, dict], budget: Budget,
              seeds: Sequence[int], reference) -> list[dict[tuple[str, str], object]]:
    """:func:`zoo_runs` once per seed: the same budget, each seed's own batches.

    Parameters
    ----------
    mdp, policy, names, scenarios, budget, reference
        As for :func:`zoo_runs` (``budget.seed`` is replaced by each seed).
    seeds : sequence of int
        The seeds of the batch generators.

    Returns
    -------
    list of dict
        One :func:`zoo_runs` result per seed, in ``seeds`` order.
    """
    return [zoo_runs(mdp, policy, names, scenarios, dataclasses.replace(budget, seed=seed),
                     reference) for seed in seeds]


def final_objectives(zoo: Sequence[Mapping]) -> dict[tuple[str, str], torch.Tensor]:
    """The final exact ``J`` of every run of :func:`zoo_seeds`, one value per seed.

    Parameters
    ----------
    zoo : sequence of mapping
        :func:`zoo_seeds`' result.

    Returns
    -------
    dict
        ``(name, scenario) → Tensor [seeds]`` (float64).
    """
    return {key: torch.tensor([runs[key].final_objective for runs in zoo], dtype=torch.float64)
            for key in zoo[0]}


def _distinct(runs: Mapping, keys: Sequence[tuple]) -> list[tuple]:
    """The first of ``keys`` (tuples of run keys) for each distinct tuple of run objects (a twin
    shares its base's run)."""
    seen, out = set(), []
    for key in keys:
        ident = tuple(id(runs[k]) for k in key)
        if ident not in seen:
            seen.add(ident)
            out.append(key)
    return out


def seed_noise(zoo: Sequence[Mapping], scenarios: Sequence[str]) -> list[tuple]:
    """The seed-to-seed noise of each scenario, pooled over its distinct runs.

    For each scenario: the number of distinct runs, the pooled seed standard deviation of the
    final ``J`` (the root of the mean over distinct runs of the seed variance, ``n − 1``
    denominator) and the standard error of a seed mean (``sd/√n``); for each scenario after the
    first, the same two numbers for ``ΔJ``, the final ``J`` minus the first scenario's on the
    same seed.

    Parameters
    ----------
    zoo : sequence of mapping
        :func:`zoo_seeds`' result (at least two seeds).
    scenarios : sequence of str
        The scenario labels, the on-policy one first.

    Returns
    -------
    list of tuple
        ``(scenario, distinct runs, sd J, s.e. J, sd ΔJ, s.e. ΔJ)``; the first scenario's
        ``ΔJ`` cells are ``""``.
    """
    if len(zoo) < 2:
        raise ValueError(f"zoo: seed noise needs two or more seeds, got {len(zoo)}")
    n, finals, first = len(zoo), final_objectives(zoo), scenarios[0]
    names = [name for name, scenario in zoo[0] if scenario == first]

    def pooled(values: list[torch.Tensor]) -> float:
        return float(torch.stack(values).var(dim=1).mean().sqrt())

    rows = []
    for scenario in scenarios:
        own = _distinct(zoo[0], [((name, scenario),) for name in names])
        sd = pooled([finals[key] for key, in own])
        if scenario == first:
            rows.append((scenario, len(own), sd, sd / n ** 0.5, "", ""))
            continue
        pairs = _distinct(zoo[0], [((name, scenario), (name, first)) for name in names])
        dsd = pooled([finals[a] - finals[b] for a, b in pairs])
        rows.append((scenario, len(own), sd, sd / n ** 0.5, dsd, dsd / n ** 0.5))
    return rows


def summary_rows(names: Sequence[str], finals: Mapping, exact: Mapping, scenarios: Sequence[str]
                 ) -> list[tuple]:
    """One row per entry: family, name, ``cos(E ĝ, ∇J)`` per scenario, the on-policy trace
    variance, the seed mean of the final on-policy ``J`` and, per other scenario, the seed mean
    of its final ``J`` minus the on-policy one (seed by seed).

    Parameters
    ----------
    names : sequence of str
        Registry names, in table order.
    finals : mapping
        :func:`final_objectives`' result.
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
        on = finals[name, scenarios[0]]
        rows.append((family(name, names), name,
                     *[exact[name, s].cosine for s in scenarios],
                     exact[name, scenarios[0]].total_variance, float(on.mean()),
                     *[float((finals[name, s] - on).mean()) for s in scenarios[1:]]))
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
