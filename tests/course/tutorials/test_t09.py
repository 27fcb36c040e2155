"""Tests of tokenmdp.course.tutorials.t09 (tutorial 9's tables and figures): each row against a direct
computation, the figure's titles, labels and legend."""

from __future__ import annotations

import math

import matplotlib
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
    left, right = fig.axes
    assert "π_θ" in left.get_title() and "μ_θ" in right.get_title()
    for ax in (left, right):
        assert ax.get_xlabel() and ax.get_ylabel() and len(ax.lines) == 3
    assert len(left.get_legend().get_texts()) == 3


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
