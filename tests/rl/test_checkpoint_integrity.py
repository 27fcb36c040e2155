"""Issue 32, the trainer's checkpoints and interrupts through the real entry points: a flipped
byte, a plausible but wrong checkpoint (tensors of another shape, a step that is not a number, a
garbage generator state), a resume with nothing left to run and Ctrl-C each end in one line
that names the file and the field, and Ctrl-C leaves a checkpoint that ``--resume`` continues."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tokenmdp.rl.checkpoint import (
    CHECKPOINT,
    DIGEST_KEY,
    load_checkpoint,
    save_checkpoint,
    state_digest,
)

from ._cli import TINY_ARGS, one_line_error, run_cli


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "R"
    proc = run_cli("sft", *TINY_ARGS, "--steps", "2", "--out-dir", out)
    assert proc.returncode == 0, proc.stderr
    return out


def _copy_run(run: Path, to: Path, edit=None) -> Path:
    """A copy of the run's folder whose checkpoint is ``edit(state)`` (re-saved with a valid
    checksum: a plausible file, not a damaged one)."""
    to.mkdir()
    for item in run.iterdir():
        if item.is_file():
            (to / item.name).write_bytes(item.read_bytes())
    if edit is not None:
        state = torch.load(to / CHECKPOINT, weights_only=True)
        state.pop(DIGEST_KEY)
        edit(state)
        save_checkpoint(state, to / CHECKPOINT)
    return to


def test_the_digest_is_stored_and_follows_every_tensor_byte_and_value(tmp_path):
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 3, "rng": [{"s": (1, 2)}]}
    save_checkpoint(state, tmp_path / "c.pt")
    saved = torch.load(tmp_path / "c.pt", weights_only=True)
    assert saved[DIGEST_KEY] == state_digest(state)
    for changed in ({**state, "step": 4},
                    {**state, "model": {"w": torch.arange(6.0).reshape(3, 2)}},   # same bytes
                    {**state, "model": {"w": torch.arange(6.0).reshape(2, 3).to(torch.float64)}},
                    {**state, "rng": [{"s": [1, 2]}]}):                            # list, tuple
        assert state_digest(changed) != state_digest(state)
    w = state["model"]["w"].clone()
    w.view(torch.int32)[1, 2] ^= 1                     # one flipped bit of one float
    assert state_digest({**state, "model": {"w": w}}) != state_digest(state)
    reordered = {"step": 3, "rng": [{"s": (1, 2)}], "model": {"w": torch.arange(6.0).reshape(2, 3)}}
    assert state_digest(reordered) == state_digest(state)


def test_a_flipped_byte_in_a_tensor_is_refused_on_resume(sft_run, tmp_path):
    run = _copy_run(sft_run, tmp_path / "flip")
    data = bytearray((run / CHECKPOINT).read_bytes())
    weights = torch.load(run / CHECKPOINT, weights_only=True)["model"]
    # the raw bytes of the first large tensor stand in the file as they are in memory
    needle = next(t for t in weights.values() if t.numel() >= 64).numpy().tobytes()[:64]
    at = bytes(data).find(needle)
    assert at > 0
    data[at + 17] ^= 0x10
    (run / CHECKPOINT).write_bytes(bytes(data))
    line = one_line_error(run_cli("sft", *TINY_ARGS, "--steps", "3", "--out-dir", run,
                                  "--resume"))
    assert f"resume: {run / CHECKPOINT}" in line and "checksum" in line
    with pytest.raises(ValueError, match="checksum"):
        load_checkpoint(run / CHECKPOINT, option="init")


def _wrong_shape(state):
    name = next(k for k, v in state["model"].items() if v.dim() == 2)
    state["model"][name] = torch.zeros(3, 5)


def _garbage_rng(state):
    state["rng"][0]["numpy_rng"] = {"bit_generator": "MT19937", "state": {"key": 1}}


@pytest.mark.parametrize("edit, named", [
    (_wrong_shape, "field 'model' does not fit the MoETransformer"),
    (lambda s: s.__setitem__("step", "two"), "field 'step' is 'two', expected an int >= 0"),
    (_garbage_rng, "field 'rng[0].numpy_rng' is not a generator state"),
    (lambda s: s["rng"][0].__setitem__("sample_gen", torch.zeros(3)),
     "field 'rng[0].sample_gen' is not a generator state"),
])
def test_a_plausible_but_wrong_checkpoint_names_the_file_and_the_field(sft_run, tmp_path, edit,
                                                                     named):
    run = _copy_run(sft_run, tmp_path / "w", edit)
    line = one_line_error(run_cli("sft", *TINY_ARGS, "--steps", "3", "--out-dir", run,
                                  "--resume"))
    assert str(run / CHECKPOINT) in line and named in line, line


def test_init_from_tensors_of_another_shape_names_the_field(sft_run, tmp_path):
    run = _copy_run(sft_run, tmp_path / "i", _wrong_shape)
    line = one_line_error(run_cli("train", *TINY_ARGS, "--steps", "1", "--init",
                                  run / CHECKPOINT, "--out-dir", tmp_path / "rl"))
    assert f"init: {run / CHECKPOINT}: field 'model' does not fit" in line
    assert "size mismatch" in line


def test_resume_with_no_step_left_to_run_says_so(sft_run, tmp_path):
    run = _copy_run(sft_run, tmp_path / "done")
    line = one_line_error(run_cli("sft", *TINY_ARGS, "--steps", "1", "--out-dir", run,
                                  "--resume"))
    assert "--steps: " in line and "is at step 2, past --steps 1" in line
    assert "pass --steps > 2" in line
    before = (run / "metrics.jsonl").read_text()
    done = run_cli("sft", *TINY_ARGS, "--steps", "2", "--out-dir", run, "--resume")
    assert done.returncode == 0, done.stderr          # a finished run resumed: a no-op, said
    assert f"nothing to run: {run} is at step 2 of 2 already" in done.stdout
    assert (run / "metrics.jsonl").read_text() == before


def test_ctrl_c_writes_a_checkpoint_closes_the_logs_and_exits_with_one_line(tmp_path):
    out = tmp_path / "int"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tokenmdp.cli", "sft", *TINY_ARGS,
                             "--steps", "400", "--checkpoint-every", "100", "--out-dir",
                             str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not metrics.exists()
                                           or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.05)
    assert metrics.exists(), "the run wrote no metrics in time"
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    (line,) = [line for line in stderr.splitlines() if line.strip()]
    assert line.startswith("tokenmdp sft: stopped: interrupted at step ") and "--resume" in line
    step = int(line.split("interrupted at step ")[1].split()[0])
    assert 3 <= step < 100                  # before the first periodic checkpoint
    state = load_checkpoint(out / CHECKPOINT, option="resume")
    assert state["step"] == step
    assert len(metrics.read_text().splitlines()) == step          # the log closed, whole
    resumed = run_cli("sft", *TINY_ARGS, "--steps", str(step + 1), "--out-dir", out, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert len(metrics.read_text().splitlines()) == step + 1
