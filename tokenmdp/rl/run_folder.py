"""A run's folder (``out_dir``): claimed before any work, locked for the run's lifetime.

:func:`check_run_folder` decides, before anything is written, whether a run may use its folder:

* a new run (neither ``resume`` nor ``overwrite``) needs a missing or empty folder: a folder that
  already holds files is refused, so a finished run's metrics and checkpoint are never replaced
  silently;
* ``resume`` needs the folder's checkpoint (a typo in ``out_dir`` must not start from step 0);
* ``overwrite`` replaces a previous run: its checkpoint is removed when the folder is claimed
  (``metrics.jsonl`` and TensorBoard events are restarted by the logger);
* ``out_dir`` that is a file, or a folder that cannot be created or written, is refused.

:class:`RunLock` holds ``out_dir/.lock`` (an exclusive ``flock``, released by the kernel when the
process ends, even by ``SIGKILL``) for the run's lifetime, so a second run in the same folder is
refused instead of racing the first. Every refusal is a one-line ``ValueError`` naming the
option (the command line prints it and exits with status 2).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from tokenmdp.rl.checkpoint import CHECKPOINT

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; the folder checks still apply
    fcntl = None

__all__ = ["LOCK_FILE", "RunLock", "check_run_folder"]

LOCK_FILE = ".lock"
"""The lock file inside a run's folder (not counted as the folder's content)."""


def _why(err: OSError) -> str:
    return err.strerror or type(err).__name__


def check_run_folder(out_dir: str | Path, *, resume: bool, overwrite: bool) -> None:
    """Raise ``ValueError`` when a run may not start in ``out_dir`` (see the module docstring).

    Only reads: every data-parallel rank can call it before any rank writes.

    Parameters
    ----------
    out_dir : str or Path
        The run's folder.
    resume : bool
        The run continues from ``out_dir``'s checkpoint.
    overwrite : bool
        The run replaces whatever is in ``out_dir``.

    Raises
    ------
    ValueError
        Naming the option at fault (``resume``, ``overwrite`` or ``out_dir``).
    """
    out = Path(out_dir)
    if resume and overwrite:
        raise ValueError("resume, overwrite: choose one (--resume continues the run in out_dir, "
                         "--overwrite replaces it)")
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir: {out} is a file, not a folder")
    if resume:
        ckpt = out / CHECKPOINT
        if not ckpt.is_file():
            where = "the folder does not exist" if not out.exists() else f"no {CHECKPOINT} in it"
            raise ValueError(f"resume: nothing to resume in {out} ({where}); check --out-dir, "
                             "or start a new run without --resume")
        return
    if overwrite or not out.exists():
        return
    try:
        content = sorted(p.name for p in out.iterdir() if p.name != LOCK_FILE)
    except OSError as err:
        raise ValueError(f"out_dir: cannot read {out}: {_why(err)}") from None
    if content:
        shown = ", ".join(content[:3]) + (", ..." if len(content) > 3 else "")
        raise ValueError(f"out_dir: {out} is not empty ({shown}); pass --resume to continue "
                         "that run, --overwrite to replace it, or another --out-dir")


class RunLock:
    """``out_dir`` created, writable and exclusively ours until :meth:`RunLock.release` (a
    context manager). With ``overwrite``, the previous run's checkpoint is removed once the lock
    is held.

    Parameters
    ----------
    out_dir : str or Path
        The run's folder (created with its parents when missing).
    overwrite : bool, default False
        Remove the previous run's checkpoint once the lock is held.

    Raises
    ------
    ValueError
        ``out_dir``: cannot be created or written (the message says why), or another process
        holds its lock.
    """

    def __init__(self, out_dir: str | Path, *, overwrite: bool = False) -> None:
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK_FILE
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise ValueError(f"out_dir: cannot write to {self.out_dir}: {_why(err)}") from None
        while fcntl is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = os.pread(self._fd, 200, 0).decode(errors="replace").strip()
                os.close(self._fd)
                raise ValueError(f"out_dir: {self.out_dir} is in use by another run "
                                 f"({holder or 'unknown process'}); wait for it or choose "
                                 "another --out-dir") from None
            try:  # the holder may have released (and unlinked) the file we opened: ours?
                same = os.path.samestat(os.fstat(self._fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(self._fd)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        if overwrite:
            for name in (CHECKPOINT, CHECKPOINT + ".tmp"):
                (self.out_dir / name).unlink(missing_ok=True)

    def release(self) -> None:
        """Remove the lock file and release the lock. Safe to call twice."""
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)  # while still held: a waiting run sees no stale file
        os.close(self._fd)  # closing releases the flock
        self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
