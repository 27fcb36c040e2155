"""tokenmdp.course.tutorials.t10 and t10_figures: families and twins against the registry's own
parts, the zoo's reuse against runs and moments computed directly, the seeds' final J, their
pooled noise, the summary rows and the Monte Carlo J against direct computations, the figures
titled, labelled and laid out for the page."""

from __future__ import annotations

import matplotlib
import pytest
import torch

from tokenmdp import estimators
from tokenmdp.course.setups import copy_task
from tokenmdp.course.tutorials import t10, t10_figures
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


def test_zoo_seeds_are_zoo_runs_with_each_seed():
    mdp, pi0 = copy_task()
    scenarios = {"on": {}, "stale": {"staleness": 1}}
    zoo = t10.zoo_seeds(mdp, pi0, ("rloo", "grpo_tis"), scenarios, BUDGET, (3, 5), reference=pi0)
    assert len(zoo) == 2
    for runs, seed in zip(zoo, (3, 5)):
        direct = train_exact(mdp, pi0, estimators.get("grpo_tis"), updates=3, group_size=2,
                             groups_per_update=2, optimizer=lambda p: torch.optim.Adam(p, lr=0.1),
                             generator=torch.Generator().manual_seed(seed), reference=pi0,
                             staleness=1)
        assert torch.equal(direct.objective, runs["grpo_tis", "stale"].objective)
    finals = t10.final_objectives(zoo)
    assert finals["rloo", "on"].dtype == torch.float64
    assert finals["rloo", "on"].tolist() == [r["rloo", "on"].final_objective for r in zoo]


def test_seed_noise_pools_the_seed_variance_over_distinct_runs():
    mdp, pi0 = copy_task()
    scenarios = {"on": {}, "stale": {"staleness": 1}}
    names = ("rloo", "grpo", "grpo_tis")                 # grpo_tis: grpo's twin in both
    zoo = t10.zoo_seeds(mdp, pi0, names, scenarios, BUDGET, (0, 1, 2), reference=pi0)
    rows = t10.seed_noise(zoo, list(scenarios))
    finals = t10.final_objectives(zoo)

    def by_hand(values):                                  # two distinct runs, n − 1 denominator
        var = [sum((v - sum(x) / 3) ** 2 for v in x) / 2 for x in values]
        return (sum(var) / len(var)) ** 0.5

    on = by_hand([finals["rloo", "on"].tolist(), finals["grpo", "on"].tolist()])
    diff = by_hand([(finals[n, "stale"] - finals[n, "on"]).tolist() for n in ("rloo", "grpo")])
    assert rows[0][:2] == ("on", 2) and rows[0][4:] == ("", "")
    assert rows[0][2] == pytest.approx(on, abs=EXACT_TOL)
    assert rows[0][3] == pytest.approx(on / 3 ** 0.5, abs=EXACT_TOL)
    assert rows[1][:2] == ("stale", 2)
    assert rows[1][4] == pytest.approx(diff, abs=EXACT_TOL)
    assert rows[1][5] == pytest.approx(diff / 3 ** 0.5, abs=EXACT_TOL)
    with pytest.raises(ValueError, match="two or more seeds"):
        t10.seed_noise(zoo[:1], list(scenarios))


def test_summary_rows_against_the_runs_and_moments():
    mdp, pi0 = copy_task()
    scenarios = {"on": {}, "stale": {"staleness": 1}}
    names = ("rloo", "grpo")
    zoo = t10.zoo_seeds(mdp, pi0, names, scenarios, BUDGET, (0, 1), reference=pi0)
    exact = t10.zoo_moments(mdp, names, {"on": {"policy": pi0}, "stale": {"policy": pi0}}, 2,
                            reference=pi0)
    rows = t10.summary_rows(names, t10.final_objectives(zoo), exact, list(scenarios))
    for row, name in zip(rows, names):
        on = [runs[name, "on"].final_objective for runs in zoo]
        stale = [runs[name, "stale"].final_objective for runs in zoo]
        assert row[:2] == (name, name)
        assert row[2] == exact[name, "on"].cosine and row[4] == exact[name, "on"].total_variance
        assert row[5] == pytest.approx(sum(on) / 2, abs=EXACT_TOL)
        assert row[6] == pytest.approx((stale[0] - on[0] + stale[1] - on[1]) / 2, abs=EXACT_TOL)


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


def test_figures_are_titled_labelled_and_fit_the_page():
    mdp, pi0 = copy_task()
    scenarios = {"on": {}, "stale": {"staleness": 1}}
    zoo = t10.zoo_seeds(mdp, pi0, ("rloo", "grpo"), scenarios, BUDGET, (0, 1), reference=pi0)
    fig = t10_figures.curves_figure(zoo, ("rloo", "grpo"), list(scenarios), baseline=2.0,
                                    noise={"on": 0.01, "stale": 0.02})
    assert fig.get_figwidth() <= 8                       # the docs' column: no shrinking
    assert [ax.get_title() for ax in fig.axes] == ["on", "stale"]
    assert all(ax.get_ylabel() == "exact J" for ax in fig.axes)
    assert fig.axes[-1].get_xlabel() == "update"
    assert all(ax.get_legend() is None for ax in fig.axes) and len(fig.legends) == 1
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()][:2] == ["rloo", "grpo"]
    assert min(t.get_fontsize() for t in legend.get_texts()) >= 9
    mean = (zoo[0]["grpo", "stale"].objective + zoo[1]["grpo", "stale"].objective) / 2
    assert fig.axes[1].lines[1].get_ydata().tolist() == pytest.approx(mean.tolist())
    run = zoo[0]["rloo", "on"]
    fig = t10_figures.monte_carlo_figure(run.objective, [(0.1, 0.01)] * len(run.objective), "x")
    ax = fig.axes[0]
    assert ax.get_title() and ax.get_xlabel() == "update" and ax.get_legend() is not None
    rows = [("rloo", "rloo", 1.0, 0.9, 0.2, 0.5, -0.1)]
    ax = t10_figures.prediction_figure(rows, ["on", "stale"]).axes[0]
    assert ax.get_title() and "cos" in ax.get_xlabel() and ax.get_legend() is not None
    offsets = [c.get_offsets().tolist() for c in ax.collections]
    assert offsets == [[[1.0, 0.5]], [[0.9, 0.4]]]        # (cosine, final J) per scenario
