"""The command line's configuration options: a TRL or verl config as a compare row and a card;
bad input one line on stderr, exit 2, no traceback."""

from __future__ import annotations

import csv
import json

from tests.rl._cli import one_line_error, run_cli
from tokenmdp.cli import main

TRL = {"loss_type": "dr_grpo", "scale_rewards": "none", "learning_rate": 1e-6}
VERL = {"actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "sapo"}}},
        "algorithm": {"adv_estimator": "grpo"}}


def test_estimators_from_trl_prints_the_card_with_its_notes(tmp_path, capsys):
    path = tmp_path / "trl.json"
    path.write_text(json.dumps(TRL))
    assert main(["estimators", "--from-trl", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("trl:dr_grpo\n")
    assert "equals: the registry's dr_grpo" in out and "max_completion_length" in out


def test_estimators_from_verl_prints_the_card(tmp_path, capsys):
    path = tmp_path / "verl.json"
    path.write_text(json.dumps(VERL))
    assert main(["estimators", "--from-verl", str(path)]) == 0
    assert "equals: the registry's sapo" in capsys.readouterr().out


def test_compare_adds_the_configured_rows_beside_the_registrys(tmp_path, capsys):
    (tmp_path / "trl.json").write_text(json.dumps(TRL))
    (tmp_path / "verl.json").write_text(json.dumps(VERL))
    out = tmp_path / "cmp"
    assert main(["compare", "--estimators", "dr_grpo,sapo", "--max-len", "2", "--out", str(out),
                 "--trl-config", str(tmp_path / "trl.json"),
                 "--verl-config", str(tmp_path / "verl.json")]) == 0
    printed = capsys.readouterr().out
    assert "trl:dr_grpo (from a trl 1.16.0 config): equals the registry's dr_grpo" in printed
    rows = list(csv.DictReader(open(out / "compare.csv")))
    assert [r["estimator"] for r in rows] == ["dr_grpo", "sapo", "trl:dr_grpo", "verl:sapo"]
    assert rows[2]["mse"] == rows[0]["mse"] and rows[3]["mse"] == rows[1]["mse"]


def test_bad_configs_are_one_line_and_exit_2(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"loss_type": "vespo"}))
    (tmp_path / "unknown.json").write_text(json.dumps({"actor": {"clip_ratio_lo": 0.2}}))
    line = one_line_error(run_cli("estimators", "--from-trl", tmp_path / "bad.json"))
    assert "--from-trl" in line and "loss_type='vespo': no counterpart" in line
    line = one_line_error(run_cli("compare", "--estimators", "rloo", "--out", tmp_path / "o",
                                  "--verl-config", tmp_path / "unknown.json"))
    assert "--verl-config" in line and "actor.clip_ratio_lo: unknown field" in line
    assert not (tmp_path / "o").exists()                      # refused before any work
    line = one_line_error(run_cli("estimators", "grpo", "--from-trl", tmp_path / "bad.json"))
    assert "card alone" in line
    line = one_line_error(run_cli("estimators", "--from-trl", tmp_path / "missing.yaml"))
    assert "cannot read" in line
