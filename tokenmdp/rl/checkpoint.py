"""The trainer's checkpoint file: written atomically and durably, read back with clear errors.

:func:`save_checkpoint` writes a temporary file next to the checkpoint, ``fsync``\\ s it, renames
it over the checkpoint (``os.replace``, atomic on POSIX) and ``fsync``\\ s the folder, so a reader
(or a run killed at any moment) sees the previous checkpoint or the new one, never half of one.
A write that fails (a full disk: ``enforce fail at inline_container.cc``, a read-only folder)
removes its temporary file, keeps the previous checkpoint and raises ``ValueError`` naming the
file.

:func:`load_checkpoint` reads a checkpoint for ``--init`` or ``--resume`` and raises
``ValueError`` with one line naming the option, the file and what is wrong (missing, a folder,
not a PyTorch checkpoint, truncated, not written by the trainer, a model of another shape).

Every checkpoint carries a SHA-256 digest of its contents (:func:`state_digest`: every tensor's
dtype, shape and bytes, every other entry's value), computed before it is written and checked
when it is read: PyTorch's zip container does not check its own CRCs, so a flipped bit in a
tensor would otherwise load as a silently different model. A checkpoint without the digest (one
written before it existed) loads unverified. :func:`load_state` puts a saved ``state_dict``
into a module or optimizer and names the entry that does not fit it.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import zipfile
from pathlib import Path

import torch

__all__ = ["CHECKPOINT", "DIGEST_KEY", "REQUIRED_KEYS", "check_model_config", "load_checkpoint",
           "load_state", "save_checkpoint", "state_digest"]

CHECKPOINT = "checkpoint.pt"
"""Name of the checkpoint inside a run's folder."""
REQUIRED_KEYS = {"init": ("model", "model_config"),
                 "resume": ("model", "reference", "optimizer", "step", "nonfinite_run", "rng",
                            "model_config", "config")}
"""Entries a checkpoint needs for ``--init`` (the weights) and for ``--resume`` (everything)."""
DIGEST_KEY = "sha256"
"""The entry holding :func:`state_digest` of the other entries."""


def state_digest(state) -> str:
    """SHA-256 of a checkpoint's contents, the same for equal contents whatever the dict order.

    Parameters
    ----------
    state : dict
        What the trainer saves: nested dicts, lists and tuples of tensors, numbers, strings,
        booleans and None.

    Returns
    -------
    str
        The hex digest.
    """
    h = hashlib.sha256()

    def feed(obj) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous().reshape(-1)
            h.update(f"T{t.dtype}{tuple(obj.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            h.update(b"D%d" % len(obj))
            for key in sorted(obj, key=repr):
                feed(key)
                feed(obj[key])
        elif isinstance(obj, (list, tuple)):
            h.update(b"L%d" % len(obj) if isinstance(obj, list) else b"U%d" % len(obj))
            for item in obj:
                feed(item)
        else:                           # numbers, strings, booleans, None: their exact repr
            h.update(f"{type(obj).__name__}:{obj!r};".encode())

    feed(state)
    return h.hexdigest()


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform without directory descriptors: the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(state: dict, path: str | Path) -> None:
    """Write ``state`` to ``path`` atomically (temporary file, ``fsync``, ``os.replace``).

    Parameters
    ----------
    state : dict
        What ``torch.save`` writes (the trainer's model, optimizer, RNG states, step, ...).
    path : str or Path
        The checkpoint file; its folder must exist.

    Raises
    ------
    ValueError
        ``checkpoint``: the write failed (the message says why); the previous checkpoint at
        ``path`` is untouched and no temporary file is left.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    state = {**state, DIGEST_KEY: state_digest(state)}
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:  # torch.save reports a full disk as RuntimeError
        tmp.unlink(missing_ok=True)
        why = err.strerror if isinstance(err, OSError) and err.strerror else \
            str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"checkpoint: could not write {path}: {why} (the previous checkpoint, "
                         "if any, is kept)") from None
    except BaseException:  # KeyboardInterrupt mid-write: no stray temporary file either
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def load_checkpoint(path: str | Path, *, option: str, device: torch.device | str = "cpu") -> dict:
    """The trainer checkpoint at ``path``, for ``option`` ("init" or "resume").

    Parameters
    ----------
    path : str or Path
        The checkpoint file.
    option : {"init", "resume"}
        What it is read for (the entries it needs, and the name errors start with).
    device : torch.device or str, default "cpu"
        Where its tensors are loaded (``map_location``).

    Returns
    -------
    dict
        The saved state, with at least the entries of ``REQUIRED_KEYS[option]``.

    Raises
    ------
    ValueError
        ``<option>``: ``path`` is missing, a folder, unreadable, not a PyTorch checkpoint (or a
        truncated one), or lacks the entries ``option`` needs (:data:`REQUIRED_KEYS`).
    """
    path = Path(path)
    where = f"{option}: {path}"
    if not path.exists():
        raise ValueError(f"{where}: no such file")
    if path.is_dir():
        raise ValueError(f"{where}: is a folder, not a checkpoint file")
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except OSError as err:
        raise ValueError(f"{where}: cannot read it: {err.strerror or err}") from None
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError,
            KeyError, IndexError, TypeError, AttributeError):
        raise ValueError(f"{where}: not a readable PyTorch checkpoint (a truncated write, or "
                         "another kind of file)") from None
    if not isinstance(state, dict):
        raise ValueError(f"{where}: holds a {type(state).__name__}, not a trainer checkpoint")
    missing = [k for k in REQUIRED_KEYS[option] if k not in state]
    if missing:
        raise ValueError(f"{where}: not a trainer checkpoint (no {', '.join(missing)})")
    if DIGEST_KEY in state:
        saved = state.pop(DIGEST_KEY)
        if saved != state_digest(state):
            raise ValueError(f"{where}: its contents do not match the checksum written with it "
                             "(the file changed after it was written: a damaged copy or disk)")
    for key in ("step", "nonfinite_run"):
        value = state.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{where}: field {key!r} is {value!r}, expected an int >= 0")
    return state


def load_state(target, saved, *, option: str, path: str | Path, field: str) -> None:
    """``target.load_state_dict(saved)``, or ``ValueError`` naming the file and the entry.

    Parameters
    ----------
    target : torch.nn.Module or torch.optim.Optimizer
        What the entry is loaded into.
    saved : dict
        The checkpoint's entry (a ``state_dict``).
    option : str
        ``init`` or ``resume``, named by the error.
    path : str or Path
        The checkpoint, named by the error.
    field : str
        The entry's name in the checkpoint (``model``, ``optimizer``, ...).

    Raises
    ------
    ValueError
        ``<option>: <path>: field '<field>' does not fit ...`` with the first line of PyTorch's
        reason (a tensor of another shape, a missing or unexpected key, another layout).
    """
    try:
        target.load_state_dict(saved)
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as err:
        reason = str(err).strip().splitlines()
        reason = next((line.strip() for line in reason if "size mismatch" in line),
                      reason[0] if reason else type(err).__name__)
        raise ValueError(f"{option}: {path}: field {field!r} does not fit the "
                         f"{type(target).__name__}: {reason}") from None


def check_model_config(state: dict, expected: dict, *, option: str, path: str | Path) -> None:
    """Raise ``ValueError`` naming the differing model settings when the checkpoint's model is
    not of the shape ``expected`` (``dataclasses.asdict`` of the run's ``ModelConfig``).

    Parameters
    ----------
    state : dict
        A checkpoint of :func:`load_checkpoint` (its ``model_config`` entry is compared).
    expected : dict
        The run's model settings.
    option : str
        The option the checkpoint was given to (``init`` or ``resume``), named by the error.
    path : str or Path
        The checkpoint's path, named by the error.
    """
    saved = state["model_config"]
    if saved == expected:
        return
    diff = sorted(k for k in set(saved) | set(expected) if saved.get(k) != expected.get(k))
    shown = ", ".join(f"{k}={saved.get(k)!r} (run: {expected.get(k)!r})" for k in diff)
    raise ValueError(f"{option}: {path} holds a model of another shape: {shown}")
