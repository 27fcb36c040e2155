"""The command line: the main job writes its table, plot and numbers; bad options fail clearly."""

import csv
import json

import pytest

from tokenmdp.cli import main


def test_compare_writes_table_png_csv_json(tmp_path, capsys):
    out = tmp_path / "cmp"
    rc = main(["compare", "--estimators", "reinforce,rloo,grpo", "--out", str(out),
               "--max-len", "2"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "rloo" in printed and "cosine" in printed
    rows = list(csv.DictReader(open(out / "compare.csv")))
    assert [r["estimator"] for r in rows] == ["reinforce", "rloo", "grpo"]
    data = json.loads((out / "compare.json").read_text())
    assert data["config"]["scenario"] == "both"
    # the numbers written are the numbers computed: RLOO with stale + discrepant sampling is
    # biased but not more than REINFORCE without a baseline here
    assert float(rows[1]["relative_bias"]) == pytest.approx(data["rows"][1]["relative_bias"])
    assert (out / "compare.png").stat().st_size > 10_000


def test_compare_on_policy_rloo_is_unbiased(tmp_path, capsys):
    main(["compare", "--scenario", "on-policy", "--estimators", "rloo", "--out", str(tmp_path),
          "--max-len", "2"])
    row = json.loads((tmp_path / "compare.json").read_text())["rows"][0]
    assert row["relative_bias"] < 1e-10
    assert row["cosine"] == pytest.approx(1.0, abs=1e-12)


def test_exact_and_estimators_commands_print(capsys):
    assert main(["exact", "--vocab", "3", "--max-len", "2"]) == 0
    assert "∇J" in capsys.readouterr().out
    assert main(["estimators"]) == 0
    assert "minirl" in capsys.readouterr().out


@pytest.mark.parametrize("argv, match", [
    (["compare", "--estimators", "grpoo"], "unknown estimator"),
    (["compare", "--group-size", "0"], "--group-size"),
    (["exact", "--prompts", "5"], "--prompts"),
    (["exact", "--vocab", "1"], "vocab_size"),
])
def test_bad_options_fail_with_a_clear_message(argv, match, capsys):
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2
    assert match in capsys.readouterr().err
