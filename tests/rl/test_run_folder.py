"""Issue 16, the run folder: a used ``--out-dir`` is refused without ``--resume`` or
``--overwrite``, ``--resume`` needs a checkpoint, and a second run in a locked folder is refused."""

import json
import subprocess
import sys

import pytest

from tokenmdp.rl.checkpoint import CHECKPOINT
from tokenmdp.rl.config import TrainConfig
from tokenmdp.rl.run_folder import LOCK_FILE, RunLock, check_run_folder
from tokenmdp.rl.trainer import train

from ._cli import TINY_ARGS, one_line_error, run_cli

TINY = dict(task="addition", max_new_tokens=4, d_model=16, n_heads=2, n_layers=1,
            expert_hidden=16, eval_size=4, prompts_per_step=4, eval_every=0)


def _rows(folder):
    return [json.loads(line) for line in open(folder / "metrics.jsonl")]


def test_used_folder_refused_then_overwritten(tmp_path):
    out = tmp_path / "R"
    first = run_cli("sft", *TINY_ARGS, "--steps", "3", "--out-dir", out)
    assert first.returncode == 0, first.stderr
    before = (out / CHECKPOINT).read_bytes()
    line = one_line_error(run_cli("sft", *TINY_ARGS, "--steps", "1", "--out-dir", out))
    assert "out_dir" in line and "--resume" in line and "--overwrite" in line
    assert len(_rows(out)) == 3 and (out / CHECKPOINT).read_bytes() == before  # untouched
    again = run_cli("sft", *TINY_ARGS, "--steps", "1", "--out-dir", out, "--overwrite")
    assert again.returncode == 0, again.stderr
    assert [r["step"] for r in _rows(out)] == [0]
    assert not (out / LOCK_FILE).exists()  # released at the end


def test_resume_without_checkpoint_refused(tmp_path):
    line = one_line_error(run_cli("sft", *TINY_ARGS, "--steps", "2", "--resume",
                                  "--out-dir", tmp_path / "typo"))
    assert line.startswith("tokenmdp sft: error: resume:") and "typo" in line
    assert not (tmp_path / "typo").exists()  # refused before anything is written
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="resume: nothing to resume"):
        train(TrainConfig(mode="sft", steps=1, resume=True, out_dir=str(tmp_path / "empty"),
                          **TINY))
    with pytest.raises(ValueError, match="resume, overwrite"):
        check_run_folder(tmp_path, resume=True, overwrite=True)


def test_empty_folder_and_lock_file_alone_are_free(tmp_path):
    check_run_folder(tmp_path, resume=False, overwrite=False)
    (tmp_path / LOCK_FILE).write_text("pid 1 on a crashed machine\n")  # a SIGKILLed run's
    check_run_folder(tmp_path, resume=False, overwrite=False)
    with RunLock(tmp_path):
        pass
    assert not (tmp_path / LOCK_FILE).exists()


def test_second_run_in_a_locked_folder_refused(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from tokenmdp.rl.run_folder import RunLock; "
         f"lock = RunLock({str(tmp_path)!r}); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match="in use by another run") as err:
            RunLock(tmp_path)
        assert f"pid {holder.pid}" in str(err.value)
        line = one_line_error(run_cli("sft", *TINY_ARGS, "--steps", "1", "--out-dir", tmp_path))
        assert "in use by another run" in line
    finally:
        holder.kill()
        holder.wait()
    with RunLock(tmp_path):  # the kernel released the killed holder's lock
        pass


def test_overwrite_removes_the_previous_checkpoint_when_claimed(tmp_path):
    (tmp_path / CHECKPOINT).write_bytes(b"an older run's")
    (tmp_path / (CHECKPOINT + ".tmp")).write_bytes(b"half")
    with RunLock(tmp_path, overwrite=True):
        assert not (tmp_path / CHECKPOINT).exists()
        assert not (tmp_path / (CHECKPOINT + ".tmp")).exists()
