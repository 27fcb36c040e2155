"""Smoke run of ``benchmarks/trees.py`` (the exact part of issue 28's comparison) at its quick
size: it runs to the end, prints its markdown table with exact moments, writes the figure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: a smoke run that takes longer than this is a hang (the quick run takes ~3 s)
SMOKE_TIMEOUT_S = 300


def test_trees_benchmark_quick_prints_its_table_and_writes_the_figure(tmp_path):
    figure = tmp_path / "trees.png"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trees.py"), "--quick",
                           "--figure", str(figure)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=SMOKE_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines()
            if line.startswith("| reinforce") or line.startswith("| rloo")]
    assert {r[1].strip() for r in rows} == {"iid:4", "fixed:1x4", "fixed:2x4"}
    assert all(r[-1].strip().startswith("enumeration") for r in rows)
    # one fork level: every leaf-slot is a π sample and REINFORCE's 1/n weights are the slots'
    assert all(float(r[4]) == 0.0 for r in rows if r[0].strip() == "reinforce")
    assert figure.stat().st_size > 0
