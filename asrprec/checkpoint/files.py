"""Checkpoint file names, listing and rotation. Nothing here reads a checkpoint (that is :mod:`.io`)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path

from asrprec.atomic import TEMPORARY_GLOB
from asrprec.errors import AsrprecError

log = logging.getLogger(__name__)

#: end-of-epoch checkpoints (icefall's names), periodic mid-epoch checkpoints, and the file saved on a failure
EPOCH_PATTERN = "epoch-*.pt"
BATCH_PATTERN = "checkpoint-*.pt"
BAD_MODEL_NAME = "bad-model.pt"


class EpochSelectionError(AsrprecError, ValueError):
    """``--epoch E --avg A`` name epochs no folder holds (A < 1, E < 1, A > E); the message names the flag, the
    epochs the folder holds and the fix."""


def epoch_checkpoint_path(exp_dir: str | os.PathLike, epoch: int) -> Path:
    """``exp_dir/epoch-{epoch}.pt`` (icefall's name for end-of-epoch checkpoints)."""
    return Path(exp_dir) / f"epoch-{epoch}.pt"


def batch_checkpoint_path(exp_dir: str | os.PathLike, batch_idx_train: int) -> Path:
    """``exp_dir/checkpoint-{batch_idx_train}.pt`` (icefall's name for periodic checkpoints)."""
    return Path(exp_dir) / f"checkpoint-{batch_idx_train}.pt"


def bad_model_path(exp_dir: str | os.PathLike) -> Path:
    """``exp_dir/bad-model.pt``: the state saved when training stops on an error, for inspection."""
    return Path(exp_dir) / BAD_MODEL_NAME


def oom_batch_path(exp_dir: str | os.PathLike, batch_idx_train: int, rank: int | None = None) -> Path:
    """``exp_dir/oom-batch-{batch_idx_train}[-rank{rank}].pt``: a batch that ran out of memory, for reproduction."""
    return Path(exp_dir) / f"oom-batch-{batch_idx_train}{'' if rank is None else f'-rank{rank}'}.pt"


def checkpoint_number(p: Path) -> int | None:
    """The last number in the file's stem (the epoch or the batch), or None."""
    nums = re.findall(r"\d+", p.stem)
    return int(nums[-1]) if nums else None


def list_checkpoints(exp_dir: str | os.PathLike, pattern: str = BATCH_PATTERN) -> list[Path]:
    """Files matching ``pattern`` that carry a number, newest (largest number) first."""
    files = [(n, p) for p in Path(exp_dir).glob(pattern) if (n := checkpoint_number(p)) is not None]
    return [p for _, p in sorted(files, key=lambda x: x[0], reverse=True)]


def present_checkpoints(directory: str | os.PathLike) -> str:
    """The names of the checkpoints in ``directory`` (epochs, then batches; oldest first), for error messages."""
    names = [p.name for p in list_checkpoints(directory, EPOCH_PATTERN)[::-1]]
    names += [p.name for p in list_checkpoints(directory, BATCH_PATTERN)[::-1]]
    return ", ".join(names) or "none"


def training_checkpoints(exp_dir: str | os.PathLike) -> list[Path]:
    """Every ``epoch-N.pt`` and ``checkpoint-N.pt`` in ``exp_dir`` (a run's resumable files), sorted by name."""
    return sorted(list_checkpoints(exp_dir, EPOCH_PATTERN) + list_checkpoints(exp_dir, BATCH_PATTERN))


def remove_stale_temporaries(exp_dir: str | os.PathLike, *, rank: int = 0) -> list[Path]:
    """Delete the temporary files that writes killed mid-way left in ``exp_dir``
    (:data:`asrprec.atomic.TEMPORARY_GLOB`).

    Call it when a run starts, before anything writes into the folder: a temporary file is never a checkpoint
    (only a completed write is renamed onto a checkpoint name). Only rank 0 deletes. Returns the deleted paths.
    """
    if rank != 0 or not Path(exp_dir).is_dir():
        return []
    stale = sorted(Path(exp_dir).glob(TEMPORARY_GLOB))
    for p in stale:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    if stale:
        log.info("removed %d unfinished checkpoint write(s) from %s: %s", len(stale), exp_dir,
                 ", ".join(p.name for p in stale))
    return stale


def newer_checkpoints(exp_dir: str | os.PathLike, position: tuple[int, int, bool]) -> list[Path]:
    """The checkpoints of ``exp_dir`` written after the training ``position`` ``(batch_idx_train, epoch,
    end_of_epoch)``, told by their names: ``checkpoint-B.pt`` with B beyond the batch, ``epoch-N.pt`` with N beyond
    the epoch (or equal, when the position is within epoch N)."""
    batch, epoch, end = position
    newer = [p for p in list_checkpoints(exp_dir, BATCH_PATTERN) if checkpoint_number(p) > batch]
    newer += [p for p in list_checkpoints(exp_dir, EPOCH_PATTERN)
              if checkpoint_number(p) > epoch or (checkpoint_number(p) == epoch and not end)]
    return sorted(newer)


def keep_last_k(
    exp_dir: str | os.PathLike, pattern: str = BATCH_PATTERN, k: int = 30, *, rank: int = 0
) -> list[Path]:
    """Delete all but the ``k`` newest checkpoints matching ``pattern`` (ordered by the number in the name).

    ``k <= 0`` keeps everything (icefall's ``--keep-last-k 0``). Only rank 0 deletes. Returns the deleted paths.
    """
    if rank != 0 or k <= 0:
        return []
    doomed = list_checkpoints(exp_dir, pattern)[k:]
    for p in doomed:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    return doomed


def check_epoch_selection(exp_dir: str | os.PathLike, epoch: int, avg: int) -> None:
    """Refuse ``--epoch E --avg A`` that no folder can satisfy (epochs count from 1) with an
    :class:`EpochSelectionError` naming the flag, the epochs ``exp_dir`` holds and the fix."""
    if avg < 1:
        raise EpochSelectionError(f"--avg {avg}: the number of epochs averaged is at least 1. Fix: --avg 1 (epoch-N.pt "
                                  "alone) or --avg A to average the A epochs ending at --epoch")
    if 1 <= epoch and avg <= epoch:
        return
    have = ", ".join(p.name for p in sorted(list_checkpoints(exp_dir, EPOCH_PATTERN), key=checkpoint_number))
    present = f"present in {exp_dir}: {have or 'none'}"
    if epoch < 1:
        raise EpochSelectionError(f"--epoch {epoch}: epochs count from 1 (epoch-N.pt is written at the end of epoch N; "
                                  f"{present}). Fix: pass --epoch N of one of them")
    raise EpochSelectionError(f"--avg {avg} with --epoch {epoch} would average epochs {epoch - avg + 1}..{epoch}, but "
                              f"epochs count from 1 ({present}). Fix: --avg {epoch} or less")


def find_epoch_checkpoints(exp_dir: str | os.PathLike, epoch: int, avg: int) -> list[Path]:
    """``epoch-(epoch-avg+1).pt … epoch-{epoch}.pt`` in ``exp_dir`` (icefall's ``--epoch E --avg A``).

    Raises :class:`EpochSelectionError` (:func:`check_epoch_selection`), or FileNotFoundError naming the missing
    files and those present."""
    check_epoch_selection(exp_dir, epoch, avg)
    paths = [epoch_checkpoint_path(exp_dir, e) for e in range(epoch - avg + 1, epoch + 1)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        have = [p.name for p in sorted(list_checkpoints(exp_dir, EPOCH_PATTERN), key=checkpoint_number)]
        raise FileNotFoundError(
            f"cannot average epochs {epoch - avg + 1}..{epoch}: missing {', '.join(missing)} in {exp_dir} "
            f"(present: {', '.join(have) or 'none'}). Fix: choose --epoch/--avg within the present epochs."
        )
    return paths


