"""plot_runs and `tokenmdp plot`: the panels and lines drawn are the logged data, PNGs written,
bad input named."""

import json

import matplotlib.pyplot as plt
import numpy as np
import pytest

from tokenmdp.cli import main
from tokenmdp.rl.plot import plot_runs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(path, rows):
    """A run folder written by hand (not by RunLogger): one JSON object per line."""
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def runs(tmp_path):
    """Two runs of 4 steps; eval_accuracy at steps 1 and 3 only; run b has no KL metrics, a null
    loss at step 2 and a NaN gradient norm at step 1."""
    a = _write_run(tmp_path / "a", [
        {"step": k, "reward": 0.1 * k, "loss": 1.0 - k, "train_infer_kl_k1": 0.01 * k,
         "train_infer_kl_k3": 0.02 * k, "tokens_per_s": 500.0, "skipped_updates": 0,
         **({"eval_accuracy": 0.2 * k} if k % 2 else {})} for k in range(4)])
    b = _write_run(tmp_path / "b", [
        {"step": k, "reward": 0.3 * k, "loss": None if k == 2 else 2.0 - k,
         "grad_norm": float("nan") if k == 1 else 1.0,
         **({"eval_accuracy": 0.5} if k % 2 else {})} for k in range(4)])
    return a, b


def _panels(fig):
    return {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}


def _is_png(path):
    return path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG_MAGIC


def test_one_run_writes_curves_png_of_its_data(runs):
    a, _ = runs
    fig = plot_runs(a)
    assert _is_png(a / "curves.png")
    panels = _panels(fig)
    assert list(panels) == ["reward", "eval_accuracy", "train_infer_kl_k1 / train_infer_kl_k3",
                            "loss", "tokens_per_s"]  # the default order; skipped_updates not default
    (line,) = panels["eval_accuracy"].lines
    assert list(line.get_xdata()) == [1, 3] and np.allclose(line.get_ydata(), [0.2, 0.6])
    assert line.get_marker() == "o"  # sparse: points shown
    k1, k3 = panels["train_infer_kl_k1 / train_infer_kl_k3"].lines
    assert np.allclose(k3.get_ydata(), [0.0, 0.02, 0.04, 0.06])
    assert k1.get_linestyle() != k3.get_linestyle()
    assert fig._suptitle.get_text() == "a"


def test_two_runs_one_line_each_labelled_by_folder(runs, tmp_path):
    fig = plot_runs(runs, tmp_path / "both.png")
    assert _is_png(tmp_path / "both.png")
    assert not (runs[0] / "curves.png").exists()
    panels = _panels(fig)
    assert [ln.get_label() for ln in panels["reward"].lines] == ["a", "b"]
    a_loss, b_loss = panels["loss"].lines
    assert list(b_loss.get_xdata()) == [0, 1, 3]  # the null loss is a gap
    (b_norm,) = panels["grad_norm"].lines
    assert list(b_norm.get_xdata()) == [0, 2, 3] and b_norm.get_color() == "C1"  # NaN too
    assert [ln.get_color() for ln in panels["train_infer_kl_k1 / train_infer_kl_k3"].lines] == \
        ["C0", "C0"]  # run a's colour, run b has no KL
    assert [ln.get_color() for ln in panels["loss"].lines] == ["C0", "C1"]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["a", "b"]


def test_chosen_metrics_one_panel_each_in_order(runs):
    fig = plot_runs(runs, metrics="skipped_updates, reward")
    assert list(_panels(fig)) == ["skipped_updates", "reward"]
    assert [ln.get_label() for ln in _panels(fig)["skipped_updates"].lines] == ["a"]  # b has none
    plt.close(fig)


def test_bad_input_is_named(runs, tmp_path):
    figures = plt.get_fignums()
    with pytest.raises(ValueError, match="is not a directory"):
        plot_runs(tmp_path / "missing")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="has no metrics.jsonl"):
        plot_runs([runs[0], tmp_path / "empty_dir"])
    _write_run(tmp_path / "no_rows", [])
    with pytest.raises(ValueError, match="has no rows"):
        plot_runs(tmp_path / "no_rows")
    with pytest.raises(ValueError, match="metrics: no run logged 'entropy'"):
        plot_runs(runs, metrics=["reward", "entropy"])
    with pytest.raises(ValueError, match="metrics: no metric"):
        plot_runs(runs, metrics=",")
    with pytest.raises(ValueError, match="run_dirs: no run"):
        plot_runs([])
    assert plt.get_fignums() == figures  # nothing drawn before the checks


def test_cli_plot_end_to_end(runs, tmp_path, capsys):
    out = tmp_path / "cli.png"
    assert main(["plot", str(runs[0]), str(runs[1]), "--out", str(out),
                 "--metrics", "reward,eval_accuracy"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    assert _is_png(out)
    with pytest.raises(SystemExit) as exc:
        main(["plot", str(tmp_path / "missing")])
    assert exc.value.code == 2
    assert "tokenmdp plot: error: run_dirs:" in capsys.readouterr().err
