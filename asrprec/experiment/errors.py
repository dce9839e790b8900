"""The errors of experiment folders: each names the file and the fix."""

from __future__ import annotations

import os
from pathlib import Path

from asrprec import checkpoint as ckpt
from asrprec.errors import AsrprecError


class ExperimentError(AsrprecError, ValueError):
    """The experiment folder cannot be used as asked; the message names the file and the fix."""


class ModelMismatchError(ExperimentError, ckpt.CheckpointMismatchError):
    """A resume with another model than the run's (a :class:`~asrprec.checkpoint.CheckpointMismatchError` too:
    the run's checkpoints do not fit it)."""


class ExperimentLockedError(ExperimentError):
    """Another training run holds the experiment folder's lock."""


class TokenizerMismatchError(ExperimentError):
    """The tokenizer given is not the one the experiment's model was trained with."""


def require_folder(path: str | os.PathLike, flag: str, fix: str = "pass a folder path (a missing one is made)") -> Path:
    """``path``, unless it (or a folder above it) is a file: then an :class:`ExperimentError` naming ``flag``, the
    file and ``fix``. Nothing is made or changed."""
    path = Path(path)
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            where = "is a file" if p == path else f"lies under {p}, which is a file"
            raise ExperimentError(f"{flag} {path} {where}, not a folder. Fix: {fix}, or move the file away")
        if p.exists():
            break
    return path
