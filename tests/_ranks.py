"""Run a test worker on several gloo ranks in child processes, every wait bounded.

Shared by the data-parallel tests (``tests/test_distributed.py``, ``tests/rl/test_trainer_ddp.py``).
A worker is ``fn(rank, port, out_dir)``; it joins the process group at ``tcp://127.0.0.1:port``
and writes its results under ``out_dir``. :func:`run_ranks` records a worker's traceback in
``out_dir/error{rank}.txt`` and fails the test with it, and kills workers still running at the
deadline.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import socket
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 60  # gloo gives up on a collective after this


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (for the gloo rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(rank: int, port: int, world_size: int) -> None:
    """One intra-op thread, then join the gloo group of ``world_size`` ranks."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def leave_group() -> None:
    """Leave together: gloo aborts a rank whose peer hung up in the middle of a transfer."""
    dist.barrier()
    dist.destroy_process_group()


def _guarded(fn, rank: int, port: int, out_dir: str) -> None:
    try:
        fn(rank, port, out_dir)
    except BaseException:
        Path(out_dir, f"error{rank}.txt").write_text(traceback.format_exc())
        raise


def run_ranks(fn, world_size: int, out_dir: Path, *, join_timeout_s: float) -> None:
    """Run ``fn(rank, port, str(out_dir))`` on ``world_size`` child processes and assert that all
    finished in time and without error."""
    # Fork where available: the workers inherit the imports. DDP's first construction imports
    # torch._dynamo (~2 s); importing it once here, before forking, saves it in each worker.
    # The workers run torch on one thread, so no OpenMP pool is used across the fork.
    with contextlib.suppress(ImportError):
        importlib.import_module("torch._dynamo")
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    port = free_port()
    procs = [ctx.Process(target=_guarded, args=(fn, rank, port, str(out_dir)), daemon=True)
             for rank in range(world_size)]
    for p in procs:
        p.start()
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=join_timeout_s)
    for p in procs:
        p.join(timeout=max((deadline - datetime.datetime.now()).total_seconds(), 0.1))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join(timeout=5)
    errors = "".join(f.read_text() for f in Path(out_dir).glob("error*.txt"))
    assert not hung, f"workers still running after {join_timeout_s} s were killed\n{errors}"
    assert all(p.exitcode == 0 for p in procs), f"worker failed:\n{errors}"
