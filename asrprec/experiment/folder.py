"""The :class:`Experiment`: one folder, what it holds and the records a run writes into it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from asrprec import checkpoint as ckpt
from asrprec.devices import is_main_process

from . import contents
from .contents import CONFIG_NAME, HISTORY_NAME, MODEL_NAME, TOKENIZER_NAME, RunSpec
from .lock import LOCK_NAME, lock_experiment, unlock_experiment

LOG_NAME = "train.log"
TENSORBOARD_NAME = "tensorboard"


class Experiment:
    """An experiment folder (:mod:`asrprec.experiment`): its paths, its records and its rules. Holds nothing but the
    path, so any number of objects may name one folder."""

    def __init__(self, path: str | os.PathLike):
        self.dir = Path(path)

    def __repr__(self) -> str:
        return f"Experiment({str(self.dir)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Experiment) and self.dir == other.dir

    def __hash__(self) -> int:
        return hash(self.dir)

    # -- paths -------------------------------------------------------------------------------------

    @property
    def log_path(self) -> Path:
        return self.dir / LOG_NAME

    @property
    def model_path(self) -> Path:
        return self.dir / MODEL_NAME

    @property
    def config_path(self) -> Path:
        return self.dir / CONFIG_NAME

    @property
    def history_path(self) -> Path:
        return self.dir / HISTORY_NAME

    @property
    def tokenizer_path(self) -> Path:
        return self.dir / TOKENIZER_NAME

    @property
    def lock_path(self) -> Path:
        return self.dir / LOCK_NAME

    @property
    def tensorboard_dir(self) -> Path:
        return self.dir / TENSORBOARD_NAME

    @property
    def bad_model_path(self) -> Path:
        return ckpt.bad_model_path(self.dir)

    def epoch_checkpoint(self, epoch: int) -> Path:
        """``epoch-{epoch}.pt``: the checkpoint written at the end of ``epoch``."""
        return ckpt.epoch_checkpoint_path(self.dir, epoch)

    def batch_checkpoint(self, batch_idx_train: int) -> Path:
        """``checkpoint-{batch_idx_train}.pt``: a checkpoint written within an epoch."""
        return ckpt.batch_checkpoint_path(self.dir, batch_idx_train)

    def oom_batch_path(self, batch_idx_train: int, rank: int | None = None) -> Path:
        """Where a batch that ran out of memory is saved (:func:`asrprec.checkpoint.oom_batch_path`)."""
        return ckpt.oom_batch_path(self.dir, batch_idx_train, rank)

    def checkpoints(self) -> list[Path]:
        """The run's resumable files (``epoch-N.pt`` and ``checkpoint-N.pt``), sorted by name."""
        return ckpt.training_checkpoints(self.dir)

    # -- records -----------------------------------------------------------------------------------

    def record(self, event: dict[str, Any]) -> None:
        """Append ``event`` to ``history.json`` (on rank 0; the other ranks' records are rank 0's)."""
        if is_main_process():
            contents.append_history(self.dir, event)

    def history(self) -> list[dict[str, Any]]:
        """The events of ``history.json`` (empty when there is none)."""
        return contents.read_history(self.dir)

    def model_config(self) -> dict[str, Any]:
        """``model.json`` (:func:`~asrprec.experiment.read_model_config`)."""
        return contents.read_model_config(self.dir)

    def record_start(self, *, config: dict[str, Any], model_config: dict[str, Any] | None,
                     precision: dict[str, Any], resume: dict[str, Any] | None) -> None:
        """Record that a run started or resumed (:func:`~asrprec.experiment.record_run_start`; rank 0)."""
        contents.record_run_start(self.dir, model_config=model_config, config=config, precision=precision,
                                  resume=resume, rank=0 if is_main_process() else 1)

    def keep_last(self, k: int, pattern: str = ckpt.BATCH_PATTERN) -> list[Path]:
        """Delete all but the ``k`` newest checkpoints matching ``pattern`` (rank 0; ``k <= 0`` keeps all)."""
        return ckpt.keep_last_k(self.dir, pattern, k, rank=0 if is_main_process() else 1)

    # -- a run in the folder -----------------------------------------------------------------------

    def prepare(self, cfg: RunSpec, *, rank: int = 0, model_config: dict[str, Any] | None = None) -> Path | None:
        """Make the folder ready for the run ``cfg`` describes; the checkpoint to resume from, or None
        (:func:`~asrprec.experiment.prepare_experiment`; ``cfg.exp_dir`` names this folder)."""
        if Path(cfg.exp_dir) != self.dir:
            raise ValueError(f"the run's exp_dir {cfg.exp_dir} is not this experiment's folder {self.dir}")
        return contents.prepare_experiment(cfg, rank=rank, model_config=model_config)

    def resume_checkpoint(self, cfg: RunSpec) -> Path | None:
        """The checkpoint the run ``cfg`` describes resumes from (:func:`~asrprec.experiment.resolve_resume`)."""
        return contents.resolve_resume(cfg)

    def lock(self) -> Path:
        """Take the folder's lock for this process (:func:`~asrprec.experiment.lock_experiment`)."""
        return lock_experiment(self.dir)

    def unlock(self) -> None:
        unlock_experiment(self.dir)

    def adopt_tokenizer(self, given: str | os.PathLike, model_config: dict[str, Any] | None, *, resuming: bool,
                        rank: int = 0) -> dict[str, Any] | None:
        """Copy the run's tokenizer into the folder, or check a resume's (:func:`~asrprec.experiment.adopt_tokenizer`)."""
        return contents.adopt_tokenizer(self.dir, given, model_config, resuming=resuming, rank=rank)

    def tokenizer(self, given: Any) -> Path:
        """The tokenizer to decode or export with (:func:`~asrprec.experiment.experiment_tokenizer`)."""
        return contents.experiment_tokenizer(self.dir, given)

    # -- its model ---------------------------------------------------------------------------------

    def build_model(self) -> Any:
        """The transducer ``model.json`` describes, with fresh weights."""
        return contents.build_experiment_model(self.dir)

    def load_model(self, epoch: int, avg: int = 1, use_averaged_model: bool = False, *,
                   allow_nonfinite: bool = False) -> tuple[Any, dict, str]:
        """The model with the weights ``--epoch --avg`` name (:func:`~asrprec.experiment.load_experiment_model`)."""
        return contents.load_experiment_model(self.dir, epoch, avg, use_averaged_model,
                                              allow_nonfinite=allow_nonfinite)
