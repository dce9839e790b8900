"""Checkpoints: what one holds, how it is written and loaded across precision policies; file names and rotation
(:mod:`.files`), save / read / load (:mod:`.io`), averaged weights (:mod:`.averaging`).

What a checkpoint holds (one ``torch.save`` dict; every entry loads with ``torch.load(weights_only=True)``)::

    format_version   int
    model            state_dict of the unwrapped model (DDP ``.module`` / ``torch.compile`` ``_orig_mod`` removed)
    model_avg        optional running average of the weights (icefall's ``model_avg``): :class:`RunningAverage`'s
                     {"weights": float64 state_dict, "count": snapshots, "period": batches between them}
    optimizer        optimizer.state_dict()           optimizer_kind  "master" (bf16 fp32-master wrapper) | "plain"
    scheduler        scheduler.state_dict()           scaler          scaler.state_dict()
    sampler          optional sampler.state_dict()    config          dict (the run's configuration)
    policy           policy.describe() (policy name + effective dtypes)
    rng              python / numpy / torch CPU / torch CUDA generator states (:mod:`asrprec.rng`)
    model_sha256     sha256 of ``model`` (names, dtypes, shapes, bytes), verified on reading (:mod:`.integrity`)
    runtime_state    optional state modules keep outside their state_dict (:func:`module_runtime_state`)
    extra            dict of counters (epoch, batch_idx_train, best losses...); the training loop adds
                     ``progress`` (the position within the epoch, :class:`asrprec.training.resume.EpochProgress`)
                     and ``history`` (the epochs' records)

Writing is atomic (:mod:`asrprec.atomic`): a failure at any point leaves the previous checkpoint untouched and no
temporary file behind. Only rank 0 writes (``rank`` argument), so DDP training can call these functions on every
rank.

Loading across precision policies (rule):

* **model weights** always load: each tensor is copied into the current model's parameter, i.e. cast to the
  current model's dtype (fp32 checkpoint → bf16-cast model rounds to bf16; bf16 → fp32 widens exactly);
  a warning says the policy changed.
* **optimizer state** of the ``bf16`` policy's fp32-master-weights wrapper and of a plain optimizer are
  different structures; loading one into the other raises :class:`CheckpointMismatchError` whose message
  gives the fix (resume under the saved policy, or pass ``optimizer=None`` to load weights only and restart
  the optimizer).
* **scaler state** loads into whatever scaler the current policy made (a no-op scaler ignores a GradScaler's
  scale; a GradScaler that finds no saved scale keeps its initial one).
"""

from asrprec.atomic import atomic_write_text

from .averaging import RunningAverage, average_between, average_checkpoints, load_decoding_weights
from .files import (
    BAD_MODEL_NAME,
    BATCH_PATTERN,
    EPOCH_PATTERN,
    bad_model_path,
    batch_checkpoint_path,
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
    "CheckpointReadError", "EPOCH_PATTERN", "FORMAT_VERSION", "RunningAverage", "atomic_torch_save",
    "atomic_write_text", "average_between", "average_checkpoints", "bad_model_path", "batch_checkpoint_path",
    "checkpoint_number", "checkpoint_position", "epoch_checkpoint_path", "find_epoch_checkpoints",
    "find_latest_checkpoint", "keep_last_k", "list_checkpoints", "load_checkpoint", "load_decoding_weights",
    "load_model_weights", "load_module_runtime_state", "module_runtime_state", "newer_checkpoints",
    "oom_batch_path", "present_checkpoints", "read_checkpoint", "remove_stale_temporaries", "save_checkpoint",
    "training_checkpoints", "DIGEST_KEY", "LoadOptions", "TrainingObjects", "NonFiniteWeightsError", "verify_weights", "weights_digest",
]
