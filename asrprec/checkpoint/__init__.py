"""Checkpoints: what one holds, how it is written and loaded across precision policies; file names and rotation
(:mod:`.files`), save / read / load (:mod:`.io`), averaged weights (:mod:`.averaging`).

Every entry loads with ``torch.load(weights_only=True)``; writing is atomic (:mod:`asrprec.atomic`) and only rank 0
writes. Model weights load across precision policies (cast to the current model's dtype, with a warning); optimizer
state of another policy's structure raises :class:`CheckpointMismatchError` with the fix. What a checkpoint holds,
entry by entry, and the loading rules: ``docs/reliability.md``.
"""

from asrprec.atomic import atomic_write_text

from .averaging import RunningAverage, average_between, average_checkpoints, load_decoding_weights
from .files import (
    BAD_MODEL_NAME,
    BATCH_PATTERN,
    EPOCH_PATTERN,
    EpochSelectionError,
    bad_model_path,
    batch_checkpoint_path,
    check_epoch_selection,
    checkpoint_number,
    epoch_checkpoint_path,
    find_epoch_checkpoints,
    keep_last_k,
    list_checkpoints,
    newer_checkpoints,
    oom_batch_path,
    present_checkpoints,
    remove_stale_temporaries,
    training_checkpoints,
)
from .io import (
    FORMAT_VERSION,
    CheckpointError,
    CheckpointIntegrityError,
    CheckpointMismatchError,
    CheckpointPolicyWarning,
    CheckpointReadError,
    LoadOptions,
    TrainingObjects,
    atomic_torch_save,
    checkpoint_position,
    find_latest_checkpoint,
    load_checkpoint,
    load_model_weights,
    load_module_runtime_state,
    module_runtime_state,
    NonFiniteWeightsError,
    read_checkpoint,
    save_checkpoint,
    verify_weights,
)
from .integrity import DIGEST_KEY, weights_digest

__all__ = [
    "BAD_MODEL_NAME", "BATCH_PATTERN", "CheckpointError", "CheckpointIntegrityError", "CheckpointMismatchError",
    "CheckpointPolicyWarning",
    "CheckpointReadError", "EPOCH_PATTERN", "EpochSelectionError", "FORMAT_VERSION", "RunningAverage", "atomic_torch_save",
    "atomic_write_text", "average_between", "average_checkpoints", "bad_model_path", "batch_checkpoint_path",
    "check_epoch_selection", "checkpoint_number", "checkpoint_position", "epoch_checkpoint_path", "find_epoch_checkpoints",
    "find_latest_checkpoint", "keep_last_k", "list_checkpoints", "load_checkpoint", "load_decoding_weights",
    "load_model_weights", "load_module_runtime_state", "module_runtime_state", "newer_checkpoints",
    "oom_batch_path", "present_checkpoints", "read_checkpoint", "remove_stale_temporaries", "save_checkpoint",
    "training_checkpoints", "DIGEST_KEY", "LoadOptions", "TrainingObjects", "NonFiniteWeightsError", "verify_weights", "weights_digest",
]
