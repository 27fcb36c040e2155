"""Fault injection: SIGKILL ``tokenmdp sft`` during checkpoint writes, then ``--resume`` it.

Each iteration starts a fresh SFT run (a checkpoint every step) in its own folder and kills it
with ``SIGKILL``: on odd iterations the moment the temporary checkpoint file appears (a kill
inside the write), on even ones at a random moment after the first checkpoint. Then

* the checkpoint in the folder must load (:func:`tokenmdp.rl.checkpoint.load_checkpoint`): the
  previous one or the new one, never half of one;
* ``tokenmdp sft --resume`` must finish the run (exit 0; a stale lock or ``.tmp`` file left by
  the kill is no obstacle);
* the resumed run's ``metrics.jsonl`` must equal an uninterrupted run's, except the timing
  fields (the trainer's exact resume on the CPU).

Prints one JSON object: iterations, how many kills landed inside a write and how many before
the run ended, and how many iterations passed each check. ``tests/rl/test_cli_faults.py`` runs
a few iterations; run more by hand::

    python benchmarks/checkpoint_faults.py --iterations 50
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

from tokenmdp.rl.checkpoint import CHECKPOINT, load_checkpoint
from tokenmdp.rl.logger import read_metrics
from tokenmdp.rl.trainer import TIMING_FIELDS

RUN = ("sft", "--task", "addition", "--max-new-tokens", "4", "--d-model", "16", "--n-heads", "2",
       "--n-layers", "1", "--expert-hidden", "16", "--eval-size", "4", "--prompts-per-step", "4",
       "--eval-every", "0", "--checkpoint-every", "1")
POLL_S = 1e-4
"""How often the folder is polled for the temporary checkpoint file."""


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokenmdp.cli", *RUN, *args]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _rows(folder: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS}
            for r in read_metrics(folder / "metrics.jsonl")]


def _kill_during_run(folder: Path, steps: int, in_write: bool, rng: random.Random,
                     timeout_s: float) -> str:
    """Start the run and SIGKILL it; returns "in_write", "random" or "finished" (too late)."""
    proc = subprocess.Popen(_cli("--steps", str(steps), "--out-dir", str(folder)), env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt, tmp = folder / CHECKPOINT, folder / (CHECKPOINT + ".tmp")
    deadline = time.monotonic() + timeout_s
    try:
        while not ckpt.exists():  # a first checkpoint: the kill has a "previous" one to keep
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the run in {folder} wrote no checkpoint (exit {proc.poll()})")
            time.sleep(POLL_S)
        if in_write:
            while not tmp.exists() and proc.poll() is None:
                time.sleep(POLL_S)
        else:
            time.sleep(rng.uniform(0.0, 1.0))
        if proc.poll() is not None:
            return "finished"
        os.kill(proc.pid, signal.SIGKILL)
        return "in_write" if in_write else "random"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def run(iterations: int, steps: int, seed: int, root: Path, timeout_s: float = 300) -> dict:
    rng = random.Random(seed)
    reference = root / "uninterrupted"
    subprocess.run(_cli("--steps", str(steps), "--out-dir", str(reference)), env=_env(),
                   check=True, capture_output=True, timeout=timeout_s)
    expected = _rows(reference)
    counts = dict(iterations=iterations, killed_in_write=0, killed_at_random=0,
                  finished_before_kill=0, checkpoint_loaded=0, resumed=0, identical=0)
    failures = []
    for i in range(iterations):
        folder = root / f"run{i}"
        how = _kill_during_run(folder, steps, in_write=i % 2 == 1, rng=rng, timeout_s=timeout_s)
        counts[{"in_write": "killed_in_write", "random": "killed_at_random",
                "finished": "finished_before_kill"}[how]] += 1
        try:
            step = load_checkpoint(folder / CHECKPOINT, option="resume")["step"]
            counts["checkpoint_loaded"] += 1
        except ValueError as err:
            failures.append(f"run{i}: {err}")
            continue
        done = subprocess.run(_cli("--steps", str(steps), "--out-dir", str(folder), "--resume"),
                              env=_env(), capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            failures.append(f"run{i} (killed after step {step}): resume exited "
                            f"{done.returncode}: {done.stderr.strip()[-300:]}")
            continue
        counts["resumed"] += 1
        if _rows(folder) == expected:
            counts["identical"] += 1
        else:
            failures.append(f"run{i} (killed after step {step}): metrics differ from the "
                            "uninterrupted run")
    return {**counts, "steps": steps, "seed": seed, "failures": failures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--steps", type=int, default=8, help="steps of each SFT run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random kill moments")
    parser.add_argument("--out", default=None, help="folder of the runs (default: a temporary one)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out) if args.out else Path(tmp)
        result = run(args.iterations, args.steps, args.seed, root)
    print(json.dumps(result))
    return 0 if not result["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
