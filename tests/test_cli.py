"""The command line: the main job writes its table, plot and numbers; bad options fail clearly."""

import csv
import json
import re

import pytest
import torch

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


@pytest.mark.parametrize("columns, width", [("60", 80), ("100", 100), ("300", 120)])
def test_the_estimators_table_fits_the_terminal(columns, width, capsys, monkeypatch):
    """Issue 30: 80 to 120 columns (the terminal's, clamped), every entry one line with its
    aggregation; the card and ``--wide`` hold the rest."""
    from tokenmdp import estimators
    monkeypatch.setenv("COLUMNS", columns)
    assert main(["estimators"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) == width
    for name in estimators.names():
        row = next(line for line in lines if line.split(" ", 1)[0] == name)
        assert estimators.get(name).aggregation.value in row
    assert main(["estimators", "--wide"]) == 0
    wide = capsys.readouterr().out
    assert max(len(line) for line in wide.splitlines()) > 200 and "surrogate" in wide
    with pytest.raises(SystemExit) as err:
        main(["estimators", "grpo", "--wide"])
    assert err.value.code == 2 and "--wide" in capsys.readouterr().err
    with pytest.raises(ValueError, match="width"):
        estimators.format_table(width=10)


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


# ---------------------------------------------------------------------- compare explains itself
SMALL = ["--max-len", "2"]
#: Float64 figures recomputed from other float64 figures.
RTOL = 1e-10


def _table(printed: str) -> list[list[str]]:
    """The data rows of the printed comparison table, each split on whitespace."""
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("estimator"))
    rows = []
    for line in lines[start + 2:]:
        if not line or line.startswith("no step"):
            break
        rows.append(line.split())
    return rows


def test_compare_states_the_scenario_prints_a_legend_and_separated_columns(tmp_path, capsys):
    from tokenmdp.cli import COLUMNS
    from tokenmdp.reports.comparison import LEGEND

    names = ["reinforce", "ppo", "gspo"]
    assert main(["compare", "--estimators", ",".join(names), "--out", str(tmp_path),
                 *SMALL]) == 0
    printed = capsys.readouterr().out
    flat = " ".join(printed.split())                 # the scenario sentence is wrapped
    assert "π_old is a stale copy 0.5 away from π_θ along ∇J" in flat
    assert "the sampler μ adds fixed logit noise of std 0.3 to π_old" in flat
    for column, meaning in LEGEND:
        assert f"  {column:<10} {meaning}" in printed.splitlines()
    rows = _table(printed)
    data = json.loads((tmp_path / "compare.json").read_text())["rows"]
    assert [r[0] for r in rows] == names
    for cells, row in zip(rows, data):
        assert len(cells) == len(COLUMNS)            # nothing runs together
        assert float(cells[1]) == pytest.approx(row["relative_bias"], abs=5e-5)
        assert float(cells[6]) == pytest.approx(row["mse_c_star"], rel=1e-3)
        assert cells[7] == row["method"]
    assert f"‖∇J‖² = {data[0]['no_step_mse']:.4g}" in printed


def test_compare_writes_c_star_consistent_with_its_own_moments(tmp_path, capsys):
    # c* = <E ĝ, ∇J> / (‖E ĝ‖² + tr Cov), with <E ĝ, ∇J> = cos ‖E ĝ‖ ‖∇J‖, from the other columns
    main(["compare", "--estimators", "rloo,gspo,dr_grpo", "--out", str(tmp_path), *SMALL])
    for row in csv.DictReader(open(tmp_path / "compare.csv")):
        m, g = float(row["mean_norm"]), float(row["true_gradient_norm"])
        dot, second = float(row["cosine"]) * m * g, m * m + float(row["total_variance"])
        c = max(0.0, dot / second)
        assert float(row["c_star"]) == pytest.approx(c, rel=RTOL, abs=1e-15)
        assert float(row["mse_c_star"]) == pytest.approx(c * c * second - 2 * c * dot + g * g,
                                                         rel=RTOL)
        assert float(row["no_step_mse"]) == pytest.approx(g * g, rel=RTOL)


def test_c_star_minimizes_the_mse_over_a_grid_of_rescalings():
    from tokenmdp import estimators
    from tokenmdp.reports.comparison import Setup, build_lab, measure, rescaled_mse

    lab = build_lab(Setup(max_len=2, method="exact"))
    for name in ("grpo", "rloo", "gspo"):                # gspo: cosine < 0, so c* = 0
        m = measure(lab, estimators.get(name))
        trace, mean, g = float(m.covariance.trace()), m.mean, m.true_gradient
        grid = torch.linspace(0.0, 2.0, 200_001, dtype=torch.float64)
        # E‖c ĝ − ∇J‖² = c² tr Cov + ‖c E ĝ − ∇J‖², from the covariance matrix
        mse = grid**2 * trace + ((grid[:, None] * mean - g) ** 2).sum(1)
        best = int(mse.argmin())
        c, mse_c = rescaled_mse(m)
        assert c == pytest.approx(float(grid[best]), abs=2e-5)
        assert mse_c == pytest.approx(float(mse[best]), rel=1e-9)
        assert mse_c <= float(g @ g) * (1 + 1e-12)       # never worse than no step at all
        if m.cosine > 0:                                 # the variance matters: not Moments.scale
            assert abs(c - m.scale) > 1e-3


def test_compare_help_shows_the_real_defaults(capsys):
    with pytest.raises(SystemExit) as err:
        main(["compare", "--help"])
    assert err.value.code == 0
    # one block of help text per option, whitespace normalized
    lines = [" ".join(b.split()) for b in re.split(r"\n(?=\s+-)", capsys.readouterr().out)]
    expected = {"--reward": "random", "--scenario": "both", "--stale-distance": "0.5",
                "--noise": "0.3", "--group-size": "4", "--vocab": "3", "--max-len": "3",
                "--prompts": "2", "--policy": "tabular", "--method": "auto", "--threads": "1"}
    for option, default in expected.items():
        line = next(x for x in lines if x.startswith(option))
        assert f"(default: {default})" in line, line


def test_hints_name_the_clip_band_downhill_steps_and_the_raw_mse_winner(tmp_path, capsys):
    main(["compare", "--out", str(tmp_path), *SMALL])
    flat = " ".join(capsys.readouterr().out.split())
    assert "hint: gspo: 100% of the sequences sampled from μ have π_θ/π_old outside the clip band " \
           "[1−0.0003, 1+0.0004]" in flat
    assert "hint: cosine < 0 for gspo" in flat
    assert "hint: dr_grpo has the lowest raw MSE only because its mean gradient is" in flat


def test_clip_band_share_matches_the_ground_truth_sequence_ratios():
    from tokenmdp import estimators
    from tokenmdp.exact import sequence_logprobs, sequence_probs
    from tokenmdp.reports.comparison import Setup, build_lab
    from tokenmdp.reports.hints import clip_band_share

    lab = build_lab(Setup(max_len=2, stale_distance=0.002))   # about half the sequences out
    mdp = lab.mdp
    enum = mdp.enumerate()
    # GSPO's ratio exp(mean_t log r_t) from the ground truth's sequence log-probs
    log_ratio = sequence_logprobs(mdp, lab.policy) - sequence_logprobs(mdp, lab.old)
    s = (log_ratio / enum.length).exp().detach()
    mu = sequence_probs(mdp, lab.behavior).detach() * mdp.prompt_probs[enum.prompt_index]
    est = estimators.get("gspo")
    lo, hi = 1 - est.surrogate.eps_low, 1 + est.surrogate.eps_high
    share, dev, unit = clip_band_share(lab, est)
    assert unit == "sequences"
    assert 0.1 < share < 0.9
    assert share == pytest.approx(float(mu @ ((s < lo) | (s > hi)).double() / mu.sum()), rel=1e-12)
    assert dev == pytest.approx(float(mu @ (s - 1).abs() / mu.sum()), rel=1e-12)
    assert clip_band_share(lab, estimators.get("rloo")) is None      # no band
    assert clip_band_share(lab, estimators.get("ppo"))[2] == "tokens"


def test_hints_find_coinciding_estimators_and_a_discrepancy_dominated_bias():
    from tokenmdp.reports.comparison import Setup, build_lab, timed_row
    from tokenmdp.reports.hints import hints

    # on-policy: nothing clips, so PPO and DAPO (one prompt per batch: batch = group statistics)
    # have the same moments; GRPO's KL term keeps it apart
    lab = build_lab(Setup(max_len=2, scenario="on-policy"))
    names = ["ppo", "dapo", "grpo"]
    found = hints(lab, names, [timed_row(lab, n)[1] for n in names])
    assert any(h.startswith("ppo = dapo: identical moments") for h in found)
    assert not any("grpo:" in h or "= grpo" in h for h in found)
    # discrepancy only: sampling from π_old = π_θ RLOO is unbiased, so all its bias is μ's
    lab = build_lab(Setup(max_len=2, scenario="discrepancy", noise=1.0))
    names = ["rloo", "sequence_is"]
    found = hints(lab, names, [timed_row(lab, n)[1] for n in names])
    assert any(h.startswith("rloo: its bias is mostly the training–inference discrepancy")
               for h in found)
    assert not any(h.startswith("sequence_is:") for h in found)     # IS removes μ's part


def test_compare_monte_carlo_rows_print_standard_errors(tmp_path, capsys):
    main(["compare", "--estimators", "rloo", "--method", "monte_carlo", "--samples", "64",
          "--out", str(tmp_path), *SMALL])
    printed = capsys.readouterr().out
    row = json.loads((tmp_path / "compare.json").read_text())["rows"][0]
    cells = _table(printed)[0]
    assert cells[1] == f"{row['relative_bias']:.4f}±{row['relative_bias_se']:.2g}"
    assert cells[4] == f"{row['mse']:.4g}±{row['mse_se']:.2g}"
    assert cells[7] == "monte_carlo"


# ---------------------------------------------------------------------- estimator cards
def test_estimators_name_prints_its_card_with_a_reference_row(capsys):
    from tokenmdp import estimators
    from tokenmdp.reports.cards import reference_rows

    assert main(["estimators", "grpo"]) == 0
    printed = capsys.readouterr().out
    flat = " ".join(printed.split())
    doc = estimators.describe("grpo")
    formula = next(line for line in doc.splitlines() if "Formula:" in line).split("Formula: ")[1]
    assert " ".join(formula.split()) in flat
    assert "Shao et al. (DeepSeekMath), arXiv 2402.03300" in flat
    assert "verl adv_estimator=grpo" in flat and "TRL loss_type='grpo'" in flat
    assert "ref_logprob" in printed
    row = reference_rows(["grpo"])["grpo"]
    assert f"{row['relative_bias']:.4f}" in printed and f"{row['mse_c_star']:.4g}" in printed


def test_unknown_estimator_name_gets_the_registry_hint(capsys):
    with pytest.raises(SystemExit) as err:
        main(["estimators", "grpoo"])
    assert err.value.code == 2
    message = capsys.readouterr().err
    assert message.count("\n") == 1 and "did you mean grpo" in message


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("argv, match", [
    (["compare", "--threads", "0"], "--threads"),
    (["compare", "--threads", "-2"], "--threads"),
    (["compare", "--prompts", "3"], "--prompts"),
    (["compare", "--estimators", ","], "--estimators"),
    (["exact", "--show", "-1"], "--show"),
])
def test_more_bad_options_fail_with_one_line_naming_the_option(argv, match, capsys):
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2
    message = capsys.readouterr().err
    assert match in message and message.count("\n") == 1


def test_compare_out_must_be_a_folder_it_can_create(tmp_path, capsys):
    existing = tmp_path / "a_file"
    existing.write_text("x")
    for out in (existing, existing / "below"):        # a file; a folder that cannot be made
        with pytest.raises(SystemExit) as err:
            main(["compare", "--estimators", "rloo", "--out", str(out), *SMALL])
        assert err.value.code == 2
        message = capsys.readouterr().err
        assert "--out" in message and message.count("\n") == 1
    assert existing.read_text() == "x"


def test_the_console_entry_point_fails_cleanly_in_a_subprocess():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "tokenmdp.cli", "compare", "--threads", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "--threads" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_each_table_summary_is_a_whole_first_sentence():
    """The summary ends at a sentence's full stop, not inside "(Yao et al. 2025)" or at "i.e."."""
    from tokenmdp.estimators.registry.lookup import _ENTRIES, _summary
    for entry in _ENTRIES.values():
        summary = _summary(entry)
        assert summary.endswith(".") and summary.count("(") == summary.count(")"), summary
        assert not summary.endswith(("al.", "i.e.", "e.g.")), summary
    assert _summary(_ENTRIES["ppo_tis"]).endswith("(Yao et al. 2025).")
