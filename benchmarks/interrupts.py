"""Ctrl-C on ``tokenmdp sft``, many times: does each run stop with one line, no hang, a checkpoint
that ``--resume`` continues?

Each iteration starts the issue-32 configuration (``--eval-every 1 --steps 12
--checkpoint-every 10``, TensorBoard on when installed), sends SIGINT after a random number of
metrics rows (1 to 6, seeded), waits up to ``--timeout`` seconds for it to end (longer counts as
a hang and kills it), then resumes the run to its last step. A run is *clean* when it exited 130
(or 0, if it had finished before the signal) with at most one stderr line and no traceback, and
its resume exited 0. The last line is JSON: ``{"iterations", "clean", "hung", "failed",
"failures"}``.

    OMP_NUM_THREADS=1 python benchmarks/interrupts.py --iterations 20
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARGS = ("--task", "addition", "--max-new-tokens", "4", "--d-model", "16", "--n-heads", "2",
        "--expert-hidden", "16", "--eval-size", "8", "--prompts-per-step", "8",
        "--eval-every", "1", "--steps", "12")


def _cli(*args: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "tokenmdp.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def one_run(out: Path, rows: int, timeout: float) -> str | None:
    """``None`` for a clean run, else what went wrong (``"hung"`` for a run that did not end)."""
    proc = _cli("sft", *ARGS, "--checkpoint-every", "10", "--out-dir", str(out))
    metrics = out / "metrics.jsonl"
    start = time.monotonic()
    while time.monotonic() - start < 120 and proc.poll() is None and (
            not metrics.exists() or len(metrics.read_text().splitlines()) < rows):
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return "hung"
    lines = [line for line in stderr.splitlines() if line.strip()]
    if proc.returncode not in (0, 130) or len(lines) > 1 or "Traceback" in stderr:
        return f"exit {proc.returncode}: {stderr.strip()[-300:]}"
    resumed = _cli("sft", *ARGS, "--out-dir", str(out), "--resume")
    _, stderr = resumed.communicate(timeout=600)
    return None if resumed.returncode == 0 else f"resume exit {resumed.returncode}: {stderr[-300:]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0, help="seed of the signal's timing")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds a run may take to stop after the signal")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    result = {"iterations": args.iterations, "clean": 0, "hung": 0, "failed": 0, "failures": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.iterations):
            problem = one_run(Path(tmp) / f"run{i}", rng.randint(1, 6), args.timeout)
            if problem is None:
                result["clean"] += 1
            else:
                result["hung" if problem == "hung" else "failed"] += 1
                result["failures"].append(f"run{i}: {problem}")
            print(f"run {i}: {problem or 'clean'}", flush=True)
    print(json.dumps(result))
    return 0 if result["clean"] == args.iterations else 1


if __name__ == "__main__":
    sys.exit(main())
