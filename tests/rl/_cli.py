"""Run ``python -m tokenmdp.cli`` in a subprocess and check a one-line error (issue 16 tests)."""

import os
import subprocess
import sys

TINY_ARGS = ("--task", "addition", "--max-new-tokens", "4", "--d-model", "16", "--n-heads", "2",
             "--n-layers", "1", "--expert-hidden", "16", "--eval-size", "4",
             "--prompts-per-step", "4", "--group-size", "2", "--eval-every", "0")
"""The smallest run the trainer CLI accepts quickly."""


def run_cli(*args, cwd=None, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "tokenmdp.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def one_line_error(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    """The single stderr line of a refused command (exit ``code``, no traceback)."""
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]
