"""One run per folder: the OS lock (``fcntl.flock``) on ``run.lock`` a training run holds (:mod:`asrprec.experiment`
says when it is taken and dropped)."""

from __future__ import annotations

import fcntl
import functools
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable

from .errors import ExperimentLockedError, require_folder

LOCK_NAME = "run.lock"


def now() -> str:
    """The local time as the folder's records write it."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


_HELD: dict[Path, int] = {}  # folder (resolved) -> the descriptor of its locked run.lock, for this process


def lock_experiment(exp_dir: str | os.PathLike) -> Path:
    """Take the lock of ``exp_dir`` (module docstring) for this process, recording its PID, host and start time
    in ``run.lock``; a no-op when this process holds it already. Returns the lock file.

    Raises:
        ExperimentLockedError: another process holds it; the message names that process and the fix.
    """
    exp_dir = Path(exp_dir)
    key = exp_dir.resolve()
    if key in _HELD:
        return exp_dir / LOCK_NAME
    path = exp_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 4096).decode("utf-8", "replace")
        os.close(fd)
        raise ExperimentLockedError(
            f"{exp_dir} is in use by another training run ({_describe_holder(holder)}; lock {path}): two runs in "
            "one folder replace each other's checkpoints. Fix: wait for that run to end (or stop it), or train in "
            "another --exp-dir") from None
    except BaseException:
        os.close(fd)
        raise
    # Written in place, not through asrprec.atomic: a renamed replacement would be another file, unlocked. The
    # contents only describe the holder to a refused run; the lock is the flock.
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": now(),
                         "command": list(sys.argv)})
    os.ftruncate(fd, 0)
    os.pwrite(fd, record.encode(), 0)
    os.fsync(fd)
    _HELD[key] = fd
    return path


def claim_experiment(exp_dir: str | os.PathLike, *, rank: int = 0) -> Path:
    """Make the folder of a training run (refusing a path that is a file) and, on rank 0, take its lock
    (:func:`lock_experiment`): the first thing a run does there, before it opens ``train.log``, so that a refused
    second run writes nothing into the running job's folder. Returns the folder.

    Raises:
        ExperimentError: ``exp_dir`` (or a folder above it) is a file.
        ExperimentLockedError: another process holds the lock.
    """
    exp_dir = require_folder(exp_dir, "--exp-dir")
    exp_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        lock_experiment(exp_dir)
    return exp_dir


def _describe_holder(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"PID {holder['pid']} on {holder['host']}, started {holder['started']}"
    except (ValueError, KeyError, TypeError):
        return "its PID is not recorded yet"


def unlock_experiment(exp_dir: str | os.PathLike) -> None:
    """Release this process's lock of ``exp_dir`` (if it holds it); ``run.lock`` stays, unlocked."""
    fd = _HELD.pop(Path(exp_dir).resolve(), None)
    if fd is not None:
        os.close(fd)  # closing the only descriptor of the open file drops its flock


def releases_experiment_lock(run: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a function taking a ``cfg`` keyword (a :class:`RunSpec`) so that, however it ends, this process's
    lock of ``cfg.exp_dir`` is released (the training loop's: its run ends there, though the process may go on)."""

    @functools.wraps(run)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return run(*args, **kwargs)
        finally:
            unlock_experiment(kwargs["cfg"].exp_dir)

    return wrapper


def holds_lock(exp_dir: str | os.PathLike) -> bool:
    """Whether this process holds the lock of ``exp_dir``."""
    return Path(exp_dir).resolve() in _HELD
