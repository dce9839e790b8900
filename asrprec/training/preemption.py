"""Preemption: a signal asks a run to stop, and it stops where it can continue exactly.

Clusters warn a job before they kill it: SLURM sends the signal of ``--signal`` (e.g. ``--signal=B:TERM@120``),
Kubernetes sends SIGTERM and waits ``terminationGracePeriodSeconds``; torchrun passes a SIGTERM it receives on to its
workers and kills them 30 s later. On one of ``TrainConfig.preempt_signals`` every rank stops at the next step
boundary, rank 0 writes ``checkpoint-<batch>.pt`` at that batch, the history records a ``preempted`` event, and
:class:`TrainingPreempted` ends :func:`asrprec.training.train`; a recipe's ``run_main`` turns it into the exit code
:data:`PREEMPTED_EXIT_CODE`. The same command with ``--resume auto`` then continues exactly.

The handler only records the signal: a Python handler runs in the main thread between two bytecodes, possibly in
the middle of a checkpoint write, so it must not act. The loop reads the record in its one per-batch agreement
(:func:`~asrprec.training.distributed.flags_by_rank`, taken after the batch is fetched and before its step), so a
signal that reached only some ranks stops all of them after the same step, with no collective added. A second
signal while stopping is counted and otherwise ignored, so the checkpoint write completes; a SIGKILL during the
write leaves the earlier checkpoints as they were (every write is atomic, :mod:`asrprec.atomic`). A rank that never
reaches the agreement (waiting in a collective for a rank that hangs) is ended by the SIGKILL that follows the
signal; a rank whose peer died gets gloo's or NCCL's error there at once.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any, Iterable

from asrprec.devices import get_rank
from asrprec.errors import ResumableStop

from .distributed import flags_by_rank

log = logging.getLogger(__name__)

__all__ = ["PREEMPTED_EXIT_CODE", "PreemptionWatch", "TrainingPreempted", "parse_signals"]

#: exit code of a preempted run: EX_TEMPFAIL of BSD's sysexits.h, "a temporary failure; the user is invited to
#: retry" (distinct from 1, an error, and from 128 + signal, a process killed by the signal)
PREEMPTED_EXIT_CODE = 75
_UNCATCHABLE = {"SIGKILL", "SIGSTOP"}


def parse_signals(names: Iterable[str]) -> tuple[signal.Signals, ...]:
    """The signals ``names`` name (``SIGTERM``, ``TERM``, ``usr1`` ...; empty entries are ignored).

    Raises:
        ValueError: a name that is no signal on this system, or one that cannot be caught (SIGKILL, SIGSTOP).
    """
    if isinstance(names, str):
        names = names.split(",")
    out = []
    for name in names:
        key = name.strip().upper()
        if not key:
            continue
        key = key if key.startswith("SIG") else f"SIG{key}"
        if key in _UNCATCHABLE:
            raise ValueError(f"preempt_signals: {name!r} cannot be caught by a process. Fix: use SIGTERM or SIGUSR1")
        try:
            out.append(signal.Signals[key])
        except KeyError:
            raise ValueError(f"preempt_signals: {name!r} is not a signal on this system. Fix: name signals such as "
                             "SIGTERM,SIGUSR1 (an empty value turns preemption handling off)") from None
    return tuple(dict.fromkeys(out))


class TrainingPreempted(ResumableStop, RuntimeError):
    """Training stopped on a preemption signal after ``checkpoint`` was written; the process should exit with
    :data:`PREEMPTED_EXIT_CODE` and be started again with ``--resume auto``."""

    exit_code = PREEMPTED_EXIT_CODE

    def __init__(self, message: str, checkpoint: Path):
        super().__init__(message)
        self.checkpoint = checkpoint


class PreemptionWatch:
    """Inside a ``with`` block, record the first of ``signals`` received (and count later ones); the previous
    handlers come back at the end. Handlers can only be set in the main thread: elsewhere the watch stays off
    (with a warning)."""

    def __init__(self, signals: Iterable[str] | Iterable[signal.Signals]):
        self.signals = parse_signals([s.name if isinstance(s, signal.Signals) else s for s in signals])
        self.received: signal.Signals | None = None
        self.later: list[signal.Signals] = []
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
        else:
            self.later.append(signal.Signals(signum))

    def __enter__(self) -> "PreemptionWatch":
        if self.signals and threading.current_thread() is not threading.main_thread():
            log.warning("preemption signals %s are not watched: training runs outside the main thread",
                        ",".join(s.name for s in self.signals))
            return self
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous.clear()

    def describe(self) -> str:
        """What this rank received, for messages."""
        if self.received is None:
            return "nothing on this rank"
        more = f" (then {', '.join(s.name for s in self.later)}, ignored while stopping)" if self.later else ""
        return f"{self.received.name}{more}"


def preempted_ranks(watch: PreemptionWatch | None) -> list[int]:
    """The ranks that received a preemption signal (one agreement; every rank must call this at the same point)."""
    return flags_by_rank(watch is not None and watch.requested)[0]


def preempted(watch: PreemptionWatch, ranks: list[int], where: str, path: Path) -> TrainingPreempted:
    """The error that stops the run at ``where`` once ``ranks`` received a signal; ``path``: the checkpoint saved."""
    return TrainingPreempted(
        f"preempted: rank(s) {ranks} received a stop signal (rank {get_rank()}: {watch.describe()}); stopped at "
        f"{where} and saved {path}. Continue with the same command and --resume auto (or --resume latest)", Path(path))


def preempted_event(watch: PreemptionWatch, ranks: list[int], epoch: int, batch_idx_train: int) -> dict[str, Any]:
    """The ``preempted`` record of ``history.json``."""
    return {"event": "preempted", "signal": watch.describe(), "ranks": ranks, "epoch": epoch,
            "batch_idx_train": batch_idx_train}
