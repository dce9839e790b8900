"""The errors of experiment folders: each names the file and the fix."""

from __future__ import annotations

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
