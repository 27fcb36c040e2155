"""Tests of tokenmdp.course.tutorials.t09 (tutorial 9's tables and figures): each row against a direct
computation, the figure's titles, labels and legend."""

from __future__ import annotations

import math

import matplotlib
import matplotlib.legend
import pytest
import torch

from tokenmdp.course.tutorials import t09
from tokenmdp.exact import expected_length, sequence_kl
from tokenmdp.rl.replay_bias import replay_gradient

matplotlib.use("Agg")

#: Two float64 computations of one quantity.
EXACT_TOL = 1e-12


def test_the_estimator_is_unbiased_on_pi_olds_own_samples():
    world = t09.tr09_world(0.0)                      # fp64, no noise: μ = π_old
    assert replay_gradient(world, world.old, t09.tr09_estimator(), "none").relative_bias < 1e-10


def test_engine_rows_match_the_world_computed_directly():
    (row,) = t09.engine_rows({"σ = 1": dict(selection_noise=1.0)})
    world = t09.tr09_world(1.0)
    with torch.no_grad():
        kl = float(sequence_kl(world.mdp, world.mu, world.old))
        length = float(expected_length(world.mdp, world.mu))
    assert row[0] == "σ = 1" and abs(row[1] - world.flip_fraction()) < EXACT_TOL
    assert abs(row[2] - kl) < EXACT_TOL and abs(row[4] - kl / length) < EXACT_TOL
    assert row[3] < EXACT_TOL and row[5] < EXACT_TOL           # R3 removes a selection-only KL


def test_sampled_engine_stats_are_means_of_per_batch_values():
    world = t09.tr09_world(1.0)
    out = t09.sampled_engine_stats(world, precision="fp32", selection_noise=1.0, batches=3,
                                   batch_size=32)
    assert set(out) == {"mismatch", "mismatch_se", "kl", "kl_se"}
    assert 0 < out["mismatch"] < 1 and out["mismatch_se"] > 0 and out["kl"] > 0
    again = t09.sampled_engine_stats(world, precision="fp32", selection_noise=1.0, batches=3,
                                     batch_size=32)
    assert again == out                                          # seeded


def test_the_bias_grid_and_its_figure():
    grid = t09.bias_grid([1.0], [0.0, 0.1])
    assert set(grid) == {(1.0, s, r) for s in (0.0, 0.1) for r in t09.REPLAYS}
    assert torch.equal(grid[1.0, 0.0, "none"].mean, grid[1.0, 0.0, "r2"].mean)
    assert grid[1.0, 0.0, "r3"].engine_bias < 1e-12              # R3's first update: ∇J(μ)
    fig = t09.bias_figure(grid)
    top, bottom = fig.axes
    assert "π_θ" in top.get_title() and "μ_θ" in bottom.get_title()
    assert fig.get_size_inches()[0] <= 8 and top.get_position().y0 > bottom.get_position().y1
    for ax in (top, bottom):
        assert ax.get_ylabel() and len(ax.lines) == 3
    assert bottom.get_xlabel() and bottom.get_legend() is None
    legends = [a for a in top.get_children() if isinstance(a, matplotlib.legend.Legend)]
    texts = {legend.get_title().get_text(): [t.get_text() for t in legend.get_texts()]
             for legend in legends}
    assert texts == {"replay": list(t09.REPLAYS), "engine noise": ["σ = 1"]}
    assert all(t.get_fontsize() >= 9 for legend in legends for t in legend.get_texts())


def test_the_bias_grid_equals_replay_gradient_and_keeps_known_entries():
    estimator = t09.tr09_estimator()
    world = t09.tr09_world(1.0)
    known = {(1.0, 0.0, "none"): replay_gradient(world, world.old, estimator, "none")}
    grid = t09.bias_grid([1.0], [0.0, 0.1], estimator, known=known)
    assert grid[1.0, 0.0, "none"] is known[1.0, 0.0, "none"]
    for s in (0.0, 0.1):
        model = world.old if s == 0 else world.stale(s)
        for replay in t09.REPLAYS:
            want, got = replay_gradient(world, model, estimator, replay), grid[1.0, s, replay]
            for field in ("mean", "true_grad", "replayed_grad", "surrogate_grad", "engine_grad"):
                assert torch.equal(getattr(got, field), getattr(want, field)), (s, replay, field)
            assert got.variance == want.variance


def test_run_rows_summarize_the_traces():
    world = t09.tr09_world(1.0)
    rows, traces = t09.run_rows(world.mdp, world.old, t09.tr09_estimator(), minibatches=[2],
                                seeds=[0, 1], steps=2, prompts_per_step=4, selection_noise=1.0,
                                engine_seed=1)
    assert [r[:2] for r in rows] == [(2, r) for r in t09.REPLAYS]
    for row in rows:
        runs = traces[row[0], row[1]]
        finals = torch.tensor([r.J[-1] for r in runs], dtype=torch.float64)
        assert abs(row[2] - float(finals.mean())) < EXACT_TOL
        assert abs(row[3] - float(finals.std()) / math.sqrt(2)) < EXACT_TOL
        gap = [r.engine_J[-1] - r.J[-1] for r in runs]
        assert abs(row[6] - sum(gap) / 2) < EXACT_TOL
    assert rows[2][8] == 0.0                                      # R3's logged mismatch
    with pytest.raises(ValueError, match="seeds"):
        t09.run_rows(world.mdp, world.old, t09.tr09_estimator(), minibatches=[2], seeds=[0])
