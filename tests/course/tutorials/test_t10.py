"""tokenmdp.course.tutorials.t10: families and twins against the registry's own parts, the zoo's reuse
against runs and moments computed directly, the summary rows and the Monte Carlo J against
direct computations, the figures titled and labelled."""

from __future__ import annotations

import matplotlib
import pytest
import torch

from tokenmdp import estimators
from tokenmdp.course.setups import copy_task
from tokenmdp.course.tutorials import t10
from tokenmdp.estimators import NoCorrection, TruncatedIS
from tokenmdp.exact import inference_copy, moments, objective, sequence_probs, train_exact

matplotlib.use("Agg")

EXACT_TOL = 1e-12
BUDGET = t10.Budget(updates=3, group_size=2, groups_per_update=2, lr=0.1, seed=0)
NAMES = ("rloo", "grpo", "grpo_tis", "grpo_opsm", "minirl", "minirl_no_is", "minirl_len_norm")


def _engine(policy):
    return inference_copy(policy, noise_std=0.5, generator=torch.Generator().manual_seed(1))


def test_family_is_the_longest_registered_prefix():
    names = ("gspo", "gspo_token", "gspo_token_tis", "gspo_tis", "dppo_kl")
    assert t10.family("gspo_token_tis", names) == "gspo_token"
    assert t10.family("gspo_tis", names) == "gspo"
    assert t10.family("gspo", names) == "gspo"
    assert t10.family("dppo_kl", names) == "dppo_kl"         # "dppo" is not registered


def test_correction_twins_differ_from_their_base_only_in_the_correction():
    names = estimators.names()
    for name in names:
        base = t10.correction_twin(name, names)
        if base is None:
            continue
        mine, theirs = estimators.get(name), estimators.get(base)
        assert mine.correction != theirs.correction
        for part in ("surrogate", "advantage", "aggregation", "kl"):
            assert getattr(mine, part) == getattr(theirs, part), (name, part)
    assert t10.correction_twin("grpo_tis", names) == "grpo"
    assert t10.correction_twin("minirl_len_norm", names) is None      # another aggregation
    assert t10.correction_twin("grpo_opsm", names) is None            # another surrogate
    assert t10.correction_twin("rloo", names) is None


def test_zoo_runs_reuse_only_where_the_sampler_is_pi_old():
    mdp, pi0 = copy_task()
    scenarios = {"on": {}, "stale": {"staleness": 1}, "engine": {"engine": _engine}}
    runs = t10.zoo_runs(mdp, pi0, NAMES, scenarios, BUDGET, reference=pi0)
    assert runs["grpo_tis", "on"] is runs["grpo", "on"]
    assert runs["grpo_tis", "stale"] is runs["grpo", "stale"]
    assert runs["grpo_tis", "engine"] is not runs["grpo", "engine"]
    assert runs["minirl_no_is", "on"] is runs["minirl", "on"]
    for name in ("grpo_tis", "minirl_len_norm"):
        for scenario, kwargs in scenarios.items():
            direct = train_exact(mdp, pi0, estimators.get(name), updates=3, group_size=2,
                                 groups_per_update=2,
                                 optimizer=lambda p: torch.optim.Adam(p, lr=0.1),
                                 generator=torch.Generator().manual_seed(0), reference=pi0,
                                 **kwargs)
            assert torch.equal(direct.objective, runs[name, scenario].objective)


def test_zoo_moments_reuse_and_match_direct_moments():
    mdp, pi0 = copy_task()
    pi1 = train_exact(mdp, pi0, estimators.get("rloo"), updates=2, group_size=2, lr=1.0,
                      generator=torch.Generator().manual_seed(3)).policy
    pairs = {"on": {"policy": pi0}, "stale": {"policy": pi1, "behavior": pi0},
             "engine": {"policy": pi0, "old": pi0, "behavior": _engine(pi0)}}
    out = t10.zoo_moments(mdp, NAMES, pairs, 2, reference=pi0)
    assert out["grpo_tis", "stale"] is out["grpo", "stale"]
    assert out["grpo_tis", "engine"] is not out["grpo", "engine"]
    for scenario, kw in pairs.items():
        direct = moments(mdp, kw["policy"], estimators.get("grpo_tis"), group_size=2,
                         behavior=kw.get("behavior"), old=kw.get("old"), reference=pi0,
                         method="enumeration")
        assert (direct.mean - out["grpo_tis", scenario].mean).abs().max() < 1e-10


def test_summary_rows_against_the_runs_and_moments():
    mdp, pi0 = copy_task()
    scenarios = {"on": {}, "stale": {"staleness": 1}}
    names = ("rloo", "grpo")
    runs = t10.zoo_runs(mdp, pi0, names, scenarios, BUDGET, reference=pi0)
    exact = t10.zoo_moments(mdp, names, {"on": {"policy": pi0}, "stale": {"policy": pi0}}, 2,
                            reference=pi0)
    rows = t10.summary_rows(names, runs, exact, list(scenarios))
    for row, name in zip(rows, names):
        on = runs[name, "on"].final_objective
        assert row[:2] == (name, name)
        assert row[2] == exact[name, "on"].cosine and row[4] == exact[name, "on"].total_variance
        assert row[5] == on and row[6] == runs[name, "stale"].final_objective - on


def test_monte_carlo_objective_is_the_mean_reward_of_the_samples():
    mdp, pi0 = copy_task()
    mean, se = t10.monte_carlo_objective(mdp, pi0, 4000, torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = float(objective(mdp, pi0))
        p = (mdp.prompt_probs[mdp.terminal_prompt_index] * sequence_probs(mdp, pi0))
        sd = float((p * (mdp.rewards - exact) ** 2).sum().sqrt())
    assert abs(mean - exact) < 4 * se
    assert se == pytest.approx(sd / 4000 ** 0.5, rel=0.1)


def test_part_differences_name_exactly_the_changed_parts():
    grpo = estimators.get("grpo")
    assert t10.part_differences(grpo, grpo) == []
    changed = grpo.replace(correction=TruncatedIS(cap=2.0), kl=None)
    diff = t10.part_differences(changed, grpo)
    assert [d[0] for d in diff] == ["correction", "kl"]
    assert diff[1] == ("kl", "none", grpo.kl.describe())
    assert t10.part_differences(changed.replace(correction=NoCorrection()), grpo)[0][0] == "kl"


def test_figures_are_titled_and_labelled():
    mdp, pi0 = copy_task()
    scenarios = {"on": {}, "stale": {"staleness": 1}}
    runs = t10.zoo_runs(mdp, pi0, ("rloo", "grpo"), scenarios, BUDGET, reference=pi0)
    fig = t10.curves_figure(runs, ("rloo", "grpo"), list(scenarios), baseline=2.0)
    assert [ax.get_title() for ax in fig.axes] == ["on", "stale"]
    assert all(ax.get_xlabel() == "update" and ax.get_ylabel() == "exact J" for ax in fig.axes)
    assert fig.axes[-1].get_legend() is not None
    run = runs["rloo", "on"]
    fig = t10.monte_carlo_figure(run.objective, [(0.1, 0.01)] * len(run.objective), "x")
    ax = fig.axes[0]
    assert ax.get_title() and ax.get_xlabel() == "update" and ax.get_legend() is not None
    rows = [("rloo", "rloo", 1.0, 0.9, 0.2, 0.5, -0.1)]
    ax = t10.prediction_figure(rows, ["on", "stale"]).axes[0]
    assert ax.get_title() and "cos" in ax.get_xlabel() and ax.get_legend() is not None
    offsets = [c.get_offsets().tolist() for c in ax.collections]
    assert offsets == [[[1.0, 0.5]], [[0.9, 0.4]]]        # (cosine, final J) per scenario
