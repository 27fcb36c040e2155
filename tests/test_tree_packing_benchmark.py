"""Smoke run of ``benchmarks/tree_packing.py`` at tiny sizes: it runs to the end, prints its
table and both verdict lines, and the float64 equality of the packed tree holds (that figure
does not depend on the machine, unlike the speedup, which is not asserted here)."""

from __future__ import annotations

from tests.test_benchmarks import run_script


def test_tree_packing_benchmark_runs_and_the_packed_tree_is_exact():
    out = run_script("tree_packing.py", "--quick")
    lines = out.splitlines()
    assert any(line.split()[:1] == ["0.50"] for line in lines), out
    assert any("speedup at half shared" in line for line in lines), out
    equality = [line for line in lines if "float64 equality" in line]
    assert equality and equality[0].startswith("PASS"), out
    assert sum(line.startswith("float64 ") for line in lines) == 4, out
