"""Issue 16, the trainer at its edges: diverging runs stop, unreadable checkpoints and unwritable
paths are one-line errors (exit 2, no traceback), and a run killed during a checkpoint write
resumes."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmdp.rl import checkpoint
from tokenmdp.rl.checkpoint import CHECKPOINT, load_checkpoint, save_checkpoint
from tokenmdp.rl.config import TrainConfig, check_config

from ._cli import TINY_ARGS, one_line_error, run_cli

ROOT = Path(__file__).resolve().parents[2]
FLOAT_FIELDS = [f.name for f in dataclasses.fields(TrainConfig) if f.type.startswith("float")]
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


# ------------------------------------------------------------------ class 3: diverging runs
def test_diverging_rl_run_stops_with_nonfinite_error(tmp_path):
    proc = run_cli("train", *TINY_ARGS, "--task", "count", "--lr", "1e30", "--steps", "5",
                   "--out-dir", tmp_path / "d")
    line = one_line_error(proc, code=1)
    assert line.startswith("tokenmdp train: stopped:") and "not finite" in line


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_every_float_option_must_be_finite(name, bad):
    with pytest.raises(ValueError, match=f"^{name}: must be a finite number"):
        check_config(TrainConfig(**{name: bad}))


@pytest.mark.parametrize("args, option", [(("--lr", "inf"), "lr"), (("--grad-clip", "nan"),
                                                                      "grad_clip"),
                                          (("--seed", "-1"), "seed")])
def test_cli_rejects_bad_numbers_naming_the_option(tmp_path, args, option):
    line = one_line_error(run_cli("train", *TINY_ARGS, *args, "--out-dir", tmp_path / "x"))
    assert f"error: {option}:" in line
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------ class 5: bad checkpoints
@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "R"
    proc = run_cli("sft", *TINY_ARGS, "--steps", "1", "--out-dir", out)
    assert proc.returncode == 0, proc.stderr
    return out


def _bad_files(folder: Path, good: Path) -> dict:
    folder.mkdir(exist_ok=True)
    files = {"missing": folder / "missing.pt", "folder": folder}
    files["random"] = folder / "random.pt"
    files["random"].write_bytes(bytes(range(256)) * 8)
    files["text"] = folder / "notes.txt"
    files["text"].write_text("not a checkpoint\n")
    files["truncated"] = folder / "truncated.pt"
    files["truncated"].write_bytes(good.read_bytes()[:2000])
    files["other_object"] = folder / "list.pt"
    torch.save([1, 2, 3], files["other_object"])
    return files


@pytest.mark.parametrize("kind", ["missing", "folder", "random", "text", "truncated",
                                  "other_object"])
def test_unreadable_init_is_one_line(tmp_path, sft_run, kind):
    bad = _bad_files(tmp_path / "bad", sft_run / CHECKPOINT)[kind]
    line = one_line_error(run_cli("train", *TINY_ARGS, "--init", bad, "--out-dir",
                                  tmp_path / "out"))
    assert f"error: init: {bad}" in line
    assert not (tmp_path / "out").exists()  # refused before the run folder is claimed


def test_truncated_or_reshaped_resume_is_one_line(tmp_path, sft_run):
    folder = tmp_path / "R"
    folder.mkdir()
    for name in ("metrics.jsonl",):
        (folder / name).write_bytes((sft_run / name).read_bytes())
    (folder / CHECKPOINT).write_bytes((sft_run / CHECKPOINT).read_bytes()[:-100])
    line = one_line_error(run_cli("sft", *TINY_ARGS, "--steps", "2", "--resume", "--out-dir",
                                  folder))
    assert f"error: resume: {folder / CHECKPOINT}" in line and "truncated" in line
    (folder / CHECKPOINT).write_bytes((sft_run / CHECKPOINT).read_bytes())
    line = one_line_error(run_cli("sft", *TINY_ARGS, "--steps", "2", "--resume", "--d-model",
                                  "32", "--out-dir", folder))
    assert "another shape" in line and "d_model=16 (run: 32)" in line


# ------------------------------------------------------------------ class 7: unwritable paths
def test_out_dir_that_is_a_file(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    line = one_line_error(run_cli("sft", *TINY_ARGS, "--steps", "1", "--out-dir", target))
    assert "out_dir:" in line and "is a file" in line
    line = one_line_error(run_cli("sft", *TINY_ARGS, "--steps", "1", "--out-dir",
                                  target / "below"))
    assert "out_dir:" in line


@pytest.mark.skipif(IS_ROOT or not hasattr(os, "geteuid"), reason="root writes anywhere")
def test_read_only_out_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        line = one_line_error(run_cli("sft", *TINY_ARGS, "--steps", "1", "--out-dir", ro / "r"))
        assert "out_dir: cannot write" in line
    finally:
        ro.chmod(0o700)


def test_plot_out_in_a_missing_folder(tmp_path, sft_run):
    line = one_line_error(run_cli("plot", sft_run, "--out", tmp_path / "missing" / "x.png"))
    assert "does not exist" in line and "missing" in line


def test_failed_checkpoint_write_keeps_the_previous_and_no_tmp(tmp_path, monkeypatch):
    path = tmp_path / CHECKPOINT
    save_checkpoint({"model": {}, "step": 1}, path)
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(checkpoint.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    save_checkpoint({"model": {}, "step": 2}, path)
    assert synced, "the checkpoint was renamed without an fsync"

    def full_disk(obj, f, *a, **k):
        f.write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64")

    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    with pytest.raises(ValueError, match="checkpoint: could not write .*inline_container"):
        save_checkpoint({"model": {}, "step": 3}, path)
    assert torch.load(path, weights_only=True)["step"] == 2  # the previous one is kept
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT]  # no stray .tmp


def test_load_checkpoint_names_missing_entries(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"model": {}}, path)
    with pytest.raises(ValueError, match="init: .*not a trainer checkpoint \\(no model_config\\)"):
        load_checkpoint(path, option="init")


# ------------------------------------------------------------------ SIGKILL during a write
def test_sigkill_during_checkpoint_writes_then_resume():
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "checkpoint_faults.py"),
                           "--iterations", "2", "--steps", "4", "--seed", "3"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["failures"] == []
    assert result["checkpoint_loaded"] == result["resumed"] == result["identical"] == 2


# ------------------------------------------------------------------ structure
def test_trainer_does_not_import_the_cli_commands():
    import ast

    for module in ("trainer", "run_setup", "run_state", "options", "config", "checkpoint",
                   "run_folder"):
        tree = ast.parse((ROOT / "tokenmdp" / "rl" / f"{module}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert "tokenmdp.rl.cli_commands" not in imported, module
