"""Smoke runs of every script in ``benchmarks/`` at tiny sizes, so none of them rots unseen.

The figures of these runs mean nothing (tiny sizes, one repeat, a loaded machine); what is
checked is that each script runs to the end and prints or writes what it promises. The GPU
checks run on the CPU with the same code (``--device cpu``: flex forward only), and each of
their checks must pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: a smoke run that takes longer than this is a hang (the slowest takes ~25 s on a quiet machine)
SMOKE_TIMEOUT_S = 300


def run_benchmark(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S)


def run_script(script: str, *args: str) -> str:
    proc = run_benchmark(script, *args)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_gpu_checks_pass_on_the_cpu():
    out = run_script("gpu_checks.py", "--device", "cpu")
    verdicts = [line.split()[0] for line in out.splitlines()
                if line.startswith(("PASS", "FAIL", "SKIP"))]
    # the generator-device check needs a second device type: skipped, and said so
    assert verdicts == ["PASS", "PASS", "PASS", "SKIP", "PASS", "PASS", "PASS"], out


def test_model_benchmark_quick():
    out = run_script("model.py", "--quick")
    for promise in ("KV cache", "packed", "routing replay overhead", "model FLOPs", "fp8",
                    "one pass"):
        assert promise in out, out


def test_model_benchmark_refuses_flex_on_the_cpu():
    proc = run_benchmark("model.py", "--attention", "flex")
    assert proc.returncode == 2 and "--attention flex" in proc.stderr


def test_losses_benchmark_small():
    out = run_script("losses.py", "--tokens", "20000", "--repeats", "1", "--threads", "1",
                     "--estimators", "reinforce,grpo,gspo,gmpo")
    for name in ("reinforce", "grpo", "gspo", "gmpo"):
        assert name in out, out
    for promise in ("+metrics", "loss only", "with head", "verl block", "target <= 1.0x"):
        assert promise in out, out
    # the kind column is measured: GSPO's and GMPO's token gradients couple their sequence
    kinds = {line.split()[0]: line.split()[1] for line in out.splitlines()
             if line.split()[:1] and line.split()[0] in ("reinforce", "grpo", "gspo", "gmpo")}
    assert kinds == {"reinforce": "token", "grpo": "token", "gspo": "sequence",
                     "gmpo": "sequence"}, out


def test_packing_benchmark_small():
    out = run_script("packing.py", "--sequences", "2000", "--repeats", "1",
                     "--memory-sequences", "200")
    assert "packed FFD" in out and "extrapolated" in out, out


def test_moments_benchmark_small():
    out = run_script("moments.py", "--vocab", "5", "--max-len", "2", "--mc-batches", "64",
                     "--estimators", "grpo,dapo", "--group-sizes", "2", "8")
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["2"], ["8"])]
    assert [r[0] for r in rows] == ["2", "8"] and "<=" in rows[1], out   # G = 8 has a target
    for promise in ("streamed sums", "batches/s", "target >= 10x", "1% standard error",
                    "auto at G = 4: chose", "same mean"):
        assert promise in out, out


def test_exact_scaling_benchmark_small():
    out = run_script("exact_scaling.py", "--lengths", "2", "3")
    rows = [line.split() for line in out.splitlines()[1:] if line[:10].strip().isdigit()]
    assert [int(r[0]) for r in rows] == [111, 1111]
    # the tree pass and the per-sequence loop agree (float64)
    assert all(float(r[-1]) < 1e-12 for r in rows), out
    assert "build + J + ∇J" in out and "target <= 1 s" in out, out
    assert "111,111,111 sequences under a 24G budget: refused" in out, out


def test_lattice_benchmark_small(tmp_path):
    figure = tmp_path / "long_responses.png"
    aggregation_figure = tmp_path / "long_responses_aggregation.png"
    out = run_script("lattice.py", "--lengths", "8", "16", "--states", "4", "--vocab", "3",
                     "--sigmas", "0.0", "0.3", "--timing-length", "32", "--skip-all",
                     "--figure", str(figure), "--aggregation-lengths", "8", "16",
                     "--group-sizes", "1", "2", "--aggregation-figure", str(aggregation_figure))
    for title in ("1. sequence IS", "2. cosine", "3. first-order gap", "5. who counts the tokens",
                  "timings at T = 32"):
        assert title in out, out
    assert figure.stat().st_size > 0 and aggregation_figure.stat().st_size > 0
    # every row of 5. is exact, and at G = 1 the token mean is the per-sequence token mean
    rows = [line.split() for line in out.splitlines() if " token-mean (DAPO) " in line
            or " seq-mean-token-mean (GRPO) " in line]
    assert rows and all("lattice" in r for r in rows if len(r) > 10), out


def test_lattice_benchmark_quick_aggregation_only():
    out = run_script("lattice.py", "--aggregation-only", "--quick")
    assert "5. who counts the tokens" in out and "timings" not in out and "figure:" not in out


@pytest.mark.slow
def test_acceptance_quick(tmp_path):
    out = run_script("acceptance.py", "--quick", "--out", str(tmp_path), "--seeds", "0", "1")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["seed"] for r in summary["per_seed"]] == [0, 1], summary
    assert "gain_points_se" in summary and "mean ± SE over seeds" in out, out
    assert (tmp_path / "curve.png").stat().st_size > 0


@pytest.mark.slow
def test_long_study_quick(tmp_path):
    out = run_script("long_study.py", "--quick", "--out", str(tmp_path))
    for name in ("results.md", "results.csv", "curves.png", "summary.png", "outcomes.json"):
        assert (tmp_path / name).stat().st_size > 0
    for part in ("off-policy N=8", "Cold starts", "Learning-rate and clip sweep",
                 "routing fp4", "minirl_seq_tis", "The exact world at the trainer's engines"):
        assert part in out, (part, out)
    # a second part's report reads both parts back
    run_script("long_study.py", "--quick", "--out", str(tmp_path), "--report-only")
    assert "Fisher p" in (tmp_path / "results.md").read_text()
    # the controls run only when named: plain SGD, and the cold starts at more steps
    out = run_script("long_study.py", "--quick", "--out", str(tmp_path), "--no-exact",
                     "--groups", "optimizer", "convergence")
    assert "Cold starts (one recipe, three SFT starts): cold start, 3 steps" in out, out
    assert out.count("| sgd minirl_len_norm lr ") == 2, out   # at the rate and at it x (L + 1)
    saved = json.loads((tmp_path / "summary.json").read_text())["configs"]
    sgd = [c for k, c in saved.items() if k.startswith("optimizer_sgd")]
    assert sgd and all((c["optimizer"], c["beta1"], c["grad_clip"]) == ("sgd", 0.0, 0.0)
                       for c in sgd)


@pytest.mark.slow
def test_rl_recipe_quick(tmp_path):
    out = run_script("rl_recipe.py", "--quick", "--out", str(tmp_path))
    saved = json.loads((tmp_path / "results.json").read_text())
    assert {r["arm"] for r in saved["results"]} == {"cold", "warm"}
    assert "Fisher p vs cold" in out and "P(all wrong)" in out, out
    again = run_script("rl_recipe.py", "--quick", "--out", str(tmp_path), "--report-only")
    assert again.split("## Collapses")[1] == out.split("## Collapses")[1]


@pytest.mark.slow
def test_replay_study_quick(tmp_path):
    run_script("replay_study.py", "--quick", "--out", str(tmp_path))
    for name in ("results.md", "results.csv", "curves.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_interrupts_benchmark_small():
    out = run_script("interrupts.py", "--iterations", "2")
    result = json.loads(out.strip().splitlines()[-1])
    assert result["clean"] == 2 and result["failures"] == [], out


def test_tutorials_benchmark_times_tutorial_one():
    out = run_script("tutorials.py", "01")
    report = json.loads(out.strip().splitlines()[-1])
    (stem,) = report["cpu_s"]
    assert stem.startswith("01_") and report["cpu_s"][stem] > 0
    assert report["ratio_to_01"][stem] == 1.0 and report["budget_cpu_s"] == 60.0


def test_tutorials_benchmark_refuses_an_unknown_number():
    proc = run_benchmark("tutorials.py", "42")
    assert proc.returncode == 2 and "no tutorial 42" in proc.stderr


def test_engine_mismatch_benchmark_quick(tmp_path):
    out = run_script("engine_mismatch.py", "--quick", "--prompts", "8", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "results.json").read_text())
    assert {(r["precision"], r["mode"]) for r in rows} >= {
        ("fp8_w8a8", "none"), ("fp4", "none"), ("fp32", "fresh"), ("fp32", "fixed"),
        ("fp32", "heavy"), ("fp32", "growing")}, rows
    assert "E[π_old/μ] ± SE" in out and (tmp_path / "results.md").stat().st_size > 0
