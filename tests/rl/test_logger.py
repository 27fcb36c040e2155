"""RunLogger: metrics.jsonl (round trip, resume truncation, per-line flush), TensorBoard read back
with TensorBoard's own reader, the progress line on a terminal, rank != 0 silent."""

import io
import json
import sys

import pytest

from tokenmdp.rl.logger import METRICS_FILE, RunLogger, read_metrics

ROWS = [{"step": k, "lr": 1e-3, "reward": 0.25 * k, "loss": None if k == 2 else -0.5 + k,
         "tokens": 100 + k, "skipped": k == 2, **({"eval_accuracy": 0.4} if k == 1 else {})}
        for k in range(5)]
"""Five steps as the trainer writes them: a null loss (every update skipped) and a bool at step 2,
``eval_accuracy`` only at step 1."""


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def _log_all(out_dir, rows, **kwargs):
    with RunLogger(out_dir, total_steps=5, tensorboard=False, **kwargs) as logger:
        for row in rows:
            logger.log(row)


def _file_rows(out_dir):
    """The file parsed line by line with json, independently of read_metrics."""
    text = (out_dir / METRICS_FILE).read_text()
    assert text == "" or text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


# ------------------------------------------------------------------------------ metrics.jsonl
def test_rows_round_trip_one_json_object_per_line(tmp_path):
    _log_all(tmp_path, ROWS)
    assert _file_rows(tmp_path) == ROWS
    assert read_metrics(tmp_path / METRICS_FILE) == ROWS


def test_resume_keeps_the_lines_before_start_step_verbatim(tmp_path):
    _log_all(tmp_path, ROWS)
    before = (tmp_path / METRICS_FILE).read_text().splitlines(keepends=True)
    resumed = [{**r, "reward": 10.0 + r["step"]} for r in ROWS[3:]]
    _log_all(tmp_path, resumed, start_step=3)
    after = (tmp_path / METRICS_FILE).read_text().splitlines(keepends=True)
    assert after[:3] == before[:3]  # steps 0, 1, 2 byte for byte
    assert _file_rows(tmp_path) == ROWS[:3] + resumed


def test_start_step_zero_starts_an_empty_file(tmp_path):
    _log_all(tmp_path, ROWS)
    RunLogger(tmp_path, total_steps=5, tensorboard=False).close()
    assert (tmp_path / METRICS_FILE).read_text() == ""
    _log_all(tmp_path / "new" / "run", ROWS[:1], start_step=4)  # no file yet: nothing to keep
    assert _file_rows(tmp_path / "new" / "run") == ROWS[:1]


def test_each_row_is_on_disk_before_the_next_step(tmp_path):
    logger = RunLogger(tmp_path, total_steps=5, tensorboard=False)
    for k, row in enumerate(ROWS[:3]):
        logger.log(row)
        assert _file_rows(tmp_path) == ROWS[:k + 1]  # read by another handle, logger still open
    logger.close()
    logger.close()  # twice is fine


def test_a_torn_last_line_is_dropped_a_bad_middle_line_raises(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1]) + "\n" + '{"step": 2, "rew')
    assert read_metrics(path) == ROWS[:2]
    _log_all(tmp_path, ROWS[2:3], start_step=2)  # a resume after a crash mid-write
    assert _file_rows(tmp_path) == ROWS[:3]
    path.write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        read_metrics(path)
    path.write_text('{"reward": 1.0}\n')
    with pytest.raises(ValueError, match="integer 'step'"):
        read_metrics(path)


def test_disabled_logger_touches_nothing(tmp_path):
    stream = FakeTTY()
    with RunLogger(tmp_path / "rank1", total_steps=5, enabled=False, tensorboard=True,
                   progress=True, stream=stream) as logger:
        for row in ROWS:
            logger.log(row)
        assert not logger.tensorboard and not logger.progress
    assert not (tmp_path / "rank1").exists()
    assert stream.getvalue() == ""


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="total_steps"):
        RunLogger(tmp_path, total_steps=-1)
    with pytest.raises(ValueError, match="start_step"):
        RunLogger(tmp_path, total_steps=5, start_step=1.5)
    with pytest.raises(ValueError, match="tensorboard"):
        RunLogger(tmp_path, total_steps=5, tensorboard="yes")
    with RunLogger(tmp_path, total_steps=5, tensorboard=False) as logger:
        with pytest.raises(ValueError, match="row: needs an integer 'step'"):
            logger.log({"reward": 1.0})
        with pytest.raises(ValueError, match="row"):
            logger.log({"step": True})
    with pytest.raises(ValueError, match="closed"):
        logger.log(ROWS[0])


# ------------------------------------------------------------------------------ progress line
def test_progress_line_on_a_terminal(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    stream = FakeTTY()
    logger = RunLogger(tmp_path, total_steps=5, tensorboard=False, stream=stream)
    assert logger.progress
    for row in ROWS[:3]:
        logger.log({**row, "tokens_per_s": 2500.0})
    assert "\n" not in stream.getvalue()  # one line, rewritten
    logger.close()
    out = stream.getvalue()
    assert out.endswith("\n") and out.count("\n") == 1
    frames = out[:-1].split("\r")[1:]
    assert [f.split()[1] for f in frames] == ["1/5", "2/5", "3/5"]
    assert "[####" in frames[0] and "2.5k tok/s" in frames[0] and "reward 0 " in frames[0]
    assert "eval" not in frames[0] and "eval 0.4" in frames[1]
    assert "eval 0.4" in frames[2]  # the latest held-out accuracy stays shown
    assert "loss 0.5" in frames[1] and "loss 0.5" in frames[2]  # step 2's loss is null
    assert "reward 0.5" in frames[2]
    assert all(len(f) >= len(prev) for prev, f in zip(frames, frames[1:]))  # padded over the last


def test_progress_line_fits_the_terminal(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "30")
    stream = FakeTTY()
    _log_all(tmp_path, ROWS, stream=stream)
    frames = stream.getvalue().rstrip("\n").split("\r")[1:]
    assert len(frames) == 5 and all(len(f) <= 29 for f in frames)


def test_no_progress_line_off_a_terminal(tmp_path):
    stream = io.StringIO()
    _log_all(tmp_path, ROWS, stream=stream)
    assert stream.getvalue() == ""
    _log_all(tmp_path, ROWS, stream=stream, progress=True)  # forced on
    assert stream.getvalue().count("step ") == 5
    tty = FakeTTY()
    _log_all(tmp_path, ROWS, stream=tty, progress=False)  # forced off
    assert tty.getvalue() == ""


def test_progress_defaults_to_stderr(tmp_path, monkeypatch):
    fake = FakeTTY()
    monkeypatch.setattr(sys, "stderr", fake)
    _log_all(tmp_path, ROWS[:1])
    assert fake.getvalue().startswith("\rstep 1/5")


# ------------------------------------------------------------------------------ TensorBoard
def _scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars_read_back_by_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    rows = [{**r, "nan_metric": float("nan"), "task": "addition"} for r in ROWS]
    with RunLogger(tmp_path, total_steps=5, tensorboard=True) as logger:
        assert logger.tensorboard
        for row in rows:
            logger.log(row)
    scalars = _scalars(tmp_path)
    # not step, not the bool, not the string, not NaN; null loss skipped at its step
    assert set(scalars) == {"lr", "reward", "loss", "tokens", "eval_accuracy"}
    assert scalars["reward"] == [(k, pytest.approx(0.25 * k)) for k in range(5)]
    assert scalars["loss"] == [(k, pytest.approx(-0.5 + k)) for k in (0, 1, 3, 4)]
    assert scalars["tokens"] == [(k, 100 + k) for k in range(5)]
    assert scalars["eval_accuracy"] == [(1, pytest.approx(0.4))]


def test_tensorboard_resume_replaces_the_steps_after_the_checkpoint(tmp_path):
    pytest.importorskip("tensorboard")
    with RunLogger(tmp_path, total_steps=5, tensorboard=True) as logger:
        for k in range(5):
            logger.log({"step": k, "reward": float(k)})
    with RunLogger(tmp_path, total_steps=5, start_step=3, tensorboard=True) as logger:
        for k in (3, 4):
            logger.log({"step": k, "reward": 10.0 + k})
    assert _scalars(tmp_path)["reward"] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]


def test_without_tensorboard_installed(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # the import now fails
    with RunLogger(tmp_path, total_steps=5) as logger:  # None: silently off
        assert not logger.tensorboard
        logger.log(ROWS[0])
    assert _file_rows(tmp_path) == ROWS[:1]
    assert not list(tmp_path.glob("events.out.tfevents.*"))
    with pytest.raises(ValueError, match="tensorboard: True needs the tensorboard package"):
        RunLogger(tmp_path / "tb", total_steps=5, tensorboard=True)
    assert not (tmp_path / "tb").exists()


def test_a_resumed_writer_sorts_after_the_first_even_in_the_same_second(tmp_path, monkeypatch):
    """TensorBoard orders event files by name, whose last field is a process-wide counter: with
    the counter at 9 and then 10 in the same second, the resumed file would sort first and its
    purge be undone (seen when a test suite had opened ten writers before)."""
    pytest.importorskip("tensorboard")
    from tensorboard.summary.writer import event_file_writer

    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(9))
    with RunLogger(tmp_path, total_steps=3, tensorboard=True) as logger:
        for k in range(3):
            logger.log({"step": k, "reward": float(k)})
    with RunLogger(tmp_path, total_steps=3, start_step=1, tensorboard=True) as logger:
        for k in (1, 2):
            logger.log({"step": k, "reward": 10.0 + k})
    assert _scalars(tmp_path)["reward"] == [(0, 0.0), (1, 11.0), (2, 12.0)]
