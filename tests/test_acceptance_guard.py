"""The acceptance benchmark counts RL steps: a seed its wall-time guard stops has not run the
benchmark, and the result says so and does not pass, whatever the gain (issue 31)."""

from __future__ import annotations

import json

import pytest

from tests.test_benchmarks import run_script


@pytest.mark.slow
def test_a_seed_cut_by_the_wall_time_guard_fails(tmp_path):
    out = run_script("acceptance.py", "--quick", "--out", str(tmp_path), "--seeds", "0",
                     "--rl-guard-min", "1e-6")
    summary = json.loads((tmp_path / "summary.json").read_text())
    seed = summary["per_seed"][0]
    assert summary["passed"] is False and summary["cut_by_guard"] == [0], summary
    assert seed["all_steps"] is False and seed["rl_steps"] < summary["rl_steps"], seed
    assert "wall-time guard" in seed["rl_stopped"] and "cut by the wall-time guard" in out, out


@pytest.mark.slow
def test_a_seed_that_runs_every_step_is_not_cut(tmp_path):
    out = run_script("acceptance.py", "--quick", "--out", str(tmp_path), "--seeds", "0")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["cut_by_guard"] == [] and summary["per_seed"][0]["all_steps"] is True, out
    assert summary["per_seed"][0]["rl_steps"] == summary["rl_steps"] == 20, summary
