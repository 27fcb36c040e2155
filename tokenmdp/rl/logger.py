"""Where a run's per-step metrics go: ``metrics.jsonl``, TensorBoard and a progress line.

:class:`RunLogger` is what the trainer writes each step's metrics row to::

    with RunLogger(out_dir, total_steps=cfg.steps, start_step=run.step) as logger:
        for ...:
            logger.log(row)            # row = {"step": 0-based step, "reward": ..., ...}

* ``out_dir/metrics.jsonl``: one JSON object per step, flushed at once (a crash loses no finished
  step). On opening, the lines of steps ``>= start_step`` are dropped: a resumed run continues
  after its checkpoint and rewrites what followed it; ``start_step=0`` starts an empty file.
* TensorBoard, when the ``tensorboard`` package is installed (``pip install tokenmdp[tensorboard]``):
  every finite number of the row as a scalar (tag = the row's key) at global step ``row["step"]``.
  Event files go to ``out_dir`` itself, so ``tensorboard --logdir runs/`` names each run by its
  folder. A resumed run purges the events of steps ``>= start_step``, as in ``metrics.jsonl``.
* A progress line on an interactive terminal, rewritten each step: step, bar, elapsed time and
  time left, tokens per second, the latest reward, loss and held-out accuracy.

:func:`read_metrics` reads a ``metrics.jsonl`` back (the plots use it).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TextIO

__all__ = ["METRICS_FILE", "RunLogger", "read_metrics"]

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
"""Name of the per-step metrics file inside a run's folder."""

_BAR_WIDTH = 20
_SHOWN = (("reward", "reward"), ("loss", "loss"), ("eval_accuracy", "eval"))
"""Row keys the progress line shows (``eval_accuracy`` stays shown until the next evaluation)."""


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a ``metrics.jsonl`` file, in file order.

    A last line without its newline (a write cut by a crash) that is not valid JSON is dropped
    with a warning; any other malformed line raises.

    Parameters
    ----------
    path : str or Path
        The file (``out_dir/metrics.jsonl`` of a run).

    Returns
    -------
    list of dict
        One row per line: metric name → value, each with an integer ``step``.

    Raises
    ------
    ValueError
        ``path``: a line is not a JSON object with an integer ``step``.
    """
    return [row for _, row in _lines_and_rows(Path(path))]


def _lines_and_rows(path: Path) -> list[tuple[str, dict]]:
    lines = path.read_text().split("\n")
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if i == len(lines):  # the last line has no newline: a torn write
                log.warning("%s: dropped an incomplete last line (%s)", path, err)
                continue
            raise ValueError(f"path: {path} line {i} is not JSON: {err}") from None
        if not isinstance(row, dict) or not _is_int(row.get("step")):
            raise ValueError(f"path: {path} line {i} is not an object with an integer 'step'")
        out.append((line, row))
    return out


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _after_the_last_event_file(out_dir) -> None:
    """Wait, if need be, until the clock's second is past every event file's in ``out_dir``.

    TensorBoard reads a folder's event files in the order of their names,
    ``events.out.tfevents.<seconds>.<host>.<pid>.<uid>``: a writer opened in the same second as an
    earlier one of the same process could sort before it (uid ``10`` before ``9`` as text), and
    its purge of the steps after the checkpoint would then be read first and undone. A resumed
    run is opened at most once a second in practice, so this waits only in tests.
    """
    stamps = [int(p.name.split(".")[3]) for p in out_dir.glob("events.out.tfevents.*")
              if len(p.name.split(".")) > 3 and p.name.split(".")[3].isdigit()]
    while stamps and int(time.time()) <= max(stamps):
        time.sleep(0.05)


def _summary_writer_class():
    """``torch.utils.tensorboard.SummaryWriter``, or None when ``tensorboard`` is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def _si(x: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.1f}{suffix}"
    return f"{x:.0f}"


class RunLogger:
    """Per-step metrics of a run: ``metrics.jsonl``, TensorBoard scalars and a progress line.

    A context manager; the file (and TensorBoard writer) are opened by the constructor and
    closed by :meth:`close` or on leaving the ``with`` block.

    Parameters
    ----------
    out_dir : path
        The run's folder (created if missing); ``metrics.jsonl`` and the event files go there.
    total_steps : int
        Steps of the whole run (the progress line's ``k/total`` and its time left).
    start_step : int
        The first step this logger will see: lines of ``metrics.jsonl`` with ``step >=
        start_step`` are dropped on opening (0: the file starts empty).
    enabled : bool
        False (the non-zero ranks of a data-parallel run): every method does nothing and no file
        is opened.
    progress : bool, optional
        Draw the progress line on ``stream``; None: when ``stream`` is a terminal.
    tensorboard : bool, optional
        Write TensorBoard scalars; None: when ``tensorboard`` is installed; True: required.
    stream : text stream, optional
        Where the progress line goes (default ``sys.stderr``).

    Raises
    ------
    ValueError
        ``total_steps`` or ``start_step`` negative; ``tensorboard=True`` without the
        ``tensorboard`` package.
    """

    def __init__(self, out_dir: str | Path, *, total_steps: int, start_step: int = 0,
                 enabled: bool = True, progress: bool | None = None,
                 tensorboard: bool | None = None, stream: TextIO | None = None) -> None:
        if not _is_int(total_steps) or total_steps < 0:
            raise ValueError(f"total_steps: must be an integer >= 0, got {total_steps!r}")
        if not _is_int(start_step) or start_step < 0:
            raise ValueError(f"start_step: must be an integer >= 0, got {start_step!r}")
        if tensorboard not in (None, True, False):
            raise ValueError(f"tensorboard: must be None, True or False, got {tensorboard!r}")
        self.out_dir = Path(out_dir)
        self.total_steps, self.start_step, self.enabled = total_steps, start_step, enabled
        self.path = self.out_dir / METRICS_FILE
        self._file = self._writer = None
        self._stream = None
        self._last_shown: dict[str, float] = {}
        self._line_len = 0
        self._t0 = time.perf_counter()
        if not enabled:
            return
        writer_cls = None
        if tensorboard is not False:
            writer_cls = _summary_writer_class()
            if writer_cls is None and tensorboard:
                raise ValueError("tensorboard: True needs the tensorboard package "
                                 "(pip install tensorboard, or tokenmdp[tensorboard])")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._truncate()
        self._file = open(self.path, "a")
        try:  # purge_step: TensorBoard drops the events of earlier writers from this step on
            if writer_cls is not None:
                _after_the_last_event_file(self.out_dir)
                self._writer = writer_cls(log_dir=str(self.out_dir), purge_step=start_step)
        except BaseException:
            self.close()
            raise
        stream = sys.stderr if stream is None else stream
        if progress is None:
            progress = bool(getattr(stream, "isatty", lambda: False)())
        self._stream = stream if progress else None

    @property
    def tensorboard(self) -> bool:
        """Whether TensorBoard scalars are being written."""
        return self._writer is not None

    @property
    def progress(self) -> bool:
        """Whether the progress line is being drawn."""
        return self._stream is not None

    def _truncate(self) -> None:
        """Keep the rows of steps ``< start_step``; atomic (a crash leaves the old file or the new)."""
        if not self.path.exists():
            return
        kept = []
        if self.start_step > 0:
            kept = [line for line, row in _lines_and_rows(self.path) if row["step"] < self.start_step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def log(self, row: dict) -> None:
        """Append ``row`` (with an integer ``step``) to every enabled destination.

        Parameters
        ----------
        row : dict
            Metric name → value (JSON-serializable; numbers also go to TensorBoard).

        Raises
        ------
        ValueError
            ``row``: not a dict with an integer ``step``.
        """
        if not self.enabled:
            return
        if self._file is None:
            raise ValueError("row: this RunLogger is closed")
        if not isinstance(row, dict) or not _is_int(row.get("step")):
            raise ValueError(f"row: needs an integer 'step', got {row!r:.80}")
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        step = row["step"]
        if self._writer is not None:
            for key, value in row.items():
                if key != "step" and _is_number(value):
                    self._writer.add_scalar(key, value, global_step=step)
            self._writer.flush()
        if self._stream is not None:
            self._draw(row)

    def _draw(self, row: dict) -> None:
        """Rewrite the progress line (``\\r``, padded over the previous one)."""
        for key, _ in _SHOWN:
            if _is_number(row.get(key)):
                self._last_shown[key] = row[key]
        done = row["step"] + 1
        total = max(self.total_steps, done)
        filled = round(_BAR_WIDTH * done / total) if total else _BAR_WIDTH
        elapsed = time.perf_counter() - self._t0
        this_run = done - self.start_step  # steps this logger has seen: the rate of this session
        left = elapsed / this_run * (total - done) if this_run > 0 else math.nan
        clock = f"{_clock(elapsed)}<{_clock(left) if math.isfinite(left) else '?'}"
        parts = [f"step {done}/{total} [{'#' * filled}{'.' * (_BAR_WIDTH - filled)}] {clock}"]
        if _is_number(row.get("tokens_per_s")):
            parts.append(f"{_si(row['tokens_per_s'])} tok/s")
        parts += [f"{name} {self._last_shown[key]:.4g}" for key, name in _SHOWN
                  if key in self._last_shown]
        line = "  ".join(parts)[:shutil.get_terminal_size().columns - 1]  # a wrapped line breaks \r
        self._stream.write("\r" + line.ljust(self._line_len))
        self._stream.flush()
        self._line_len = len(line)

    def close(self) -> None:
        """Flush and close everything; end the progress line. Safe to call twice."""
        if self._stream is not None and self._line_len:
            self._stream.write("\n")
            self._stream.flush()
        self._stream = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
