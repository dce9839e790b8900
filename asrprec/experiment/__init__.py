"""Experiment folders: one folder holds one run, and records it.

What a folder holds (besides checkpoints, ``train.log`` and ``tensorboard/``):

* ``config.json``: the configuration the run started with (training, model, data, ...), written when it starts;
* ``model.json``: the model's architecture (a recipe's builder arguments), written once the run has started or a
  resume has succeeded, and never changed to another architecture afterwards (:func:`record_model_config`);
* ``history.json``: a list of events, appended to and never rewritten from scratch: ``start``, every ``resume``
  (where from, the command, what changed), every finished ``epoch`` (losses, skipped batches), ``stopped``
  (why a run stopped on bad data), ``overwrite`` (what ``--overwrite`` deleted).

* ``bpe.model``: a copy of the run's tokenizer, whose sha256 ``model.json`` records (``"tokenizer"`` entry): a model
  is useless without the tokenizer it was trained with, and a data folder's may be re-made with other pieces
  (:func:`adopt_tokenizer`, :func:`experiment_tokenizer`);
* ``run.lock``: the lock of the run training in the folder (:func:`lock_experiment`), holding its PID, host and
  start time.

One run per folder: a training run holds an OS lock (``fcntl.flock``) on ``run.lock`` from
:func:`prepare_experiment` until :func:`asrprec.training.train` returns, or the process ends: the kernel drops it
with the process, so a run killed with ``kill -9`` or by a crash leaves no stale lock, and ``--resume auto`` after a
restart (torchrun's ``--max-restarts``, a requeue) takes it at once. A second run is refused while it is held,
naming the holder, before anything in the folder changes (so ``--overwrite`` never deletes a running job's files).
Under torchrun only rank 0 takes it: the ranks of one job are one run, and a refusal ends rank 0, on which torchrun
stops the job's other ranks. ``flock`` is reliable on one host's file systems; on a network file system shared by
several hosts it depends on the file system.

Rules (:func:`prepare_experiment`): a new run in a folder that holds another run's checkpoints is refused unless
``overwrite`` (which deletes that run's files first); resuming from a checkpoint that is not the newest in the
folder is refused unless ``overwrite`` (which deletes the newer, abandoned checkpoints), since ``--avg`` or
``--resume latest`` would later mix the two continuations; temporary files of interrupted writes are removed.
Every error names the file and the fix.

The model of an experiment is built here too (:func:`build_experiment_model`, :func:`load_experiment_model`), for
training, decoding and export alike; this package imports none of them.

:class:`Experiment` (``folder.py``) is the folder as an object; the functions below take its path and stay for
the callers that hold only a path. ``contents.py``: the records and rules; ``lock.py``: the lock; ``errors.py``.
"""

from .contents import (CONFIG_NAME, HISTORY_NAME, MODEL_NAME, MUTABLE_MODEL_KEYS, TOKENIZER_KEY, TOKENIZER_NAME,
                       RunSpec, adopt_tokenizer, append_history, build_experiment_model, check_model_config,
                       experiment_tokenizer, file_sha256, load_experiment_model, prepare_experiment, read_history,
                       read_model_config, record_model_config, record_run_start, resolve_resume)
from .errors import (ExperimentError, ExperimentLockedError, ModelMismatchError, TokenizerMismatchError,
                     require_folder)
from .folder import LOG_NAME, TENSORBOARD_NAME, Experiment
from .lock import LOCK_NAME, claim_experiment, lock_experiment, releases_experiment_lock, unlock_experiment

__all__ = [
    "CONFIG_NAME", "HISTORY_NAME", "LOCK_NAME", "LOG_NAME", "MODEL_NAME", "MUTABLE_MODEL_KEYS", "TENSORBOARD_NAME",
    "TOKENIZER_KEY", "TOKENIZER_NAME", "Experiment", "ExperimentError", "ExperimentLockedError", "ModelMismatchError",
    "RunSpec", "TokenizerMismatchError", "adopt_tokenizer", "append_history", "build_experiment_model",
    "check_model_config", "claim_experiment", "experiment_tokenizer", "file_sha256", "load_experiment_model",
    "lock_experiment", "prepare_experiment", "read_history", "read_model_config", "record_model_config", "record_run_start",
    "releases_experiment_lock", "require_folder", "resolve_resume", "unlock_experiment",
]
