"""Smoke run of ``benchmarks/tree_study.py`` (issue 28): the SFT start, the chains and tree
arms, the report. Its numbers mean nothing at this size; what is checked is that the script runs
to the end and writes the table it promises."""

from __future__ import annotations

import json

from tests.test_benchmarks import run_script


def test_tree_study_quick(tmp_path):
    out = run_script("tree_study.py", "--quick", "--out", str(tmp_path),
                     "--tree-estimator-2", "tree_value_diff")
    saved = json.loads((tmp_path / "results.json").read_text())
    assert set(saved["results"]) == {"chains", "tree", "chains_small", "tree_2"}
    chains, tree = saved["results"]["chains"][0], saved["results"]["tree"][0]
    assert chains["shared"] == 0 and tree["shared"] > 0
    assert tree["generated"] > 0 and chains["generated"] > 0
    table = (tmp_path / "results.md").read_text()
    assert "| tree | grpo | 4 |" in table and "| chains_small | grpo | 3 |" in table, table
    assert "| tree_2 | tree_value_diff |" in table, table
    assert "chains' acc at the arm's tokens" in out and "effective independent leaves" in out
    assert 0 <= saved["leaf_correlation"]["pass_rate"] <= 1
    for arm in ("chains", "tree", "chains_small", "tree_2"):
        assert (tmp_path / "runs" / f"{arm}_seed0" / "metrics.jsonl").stat().st_size > 0
