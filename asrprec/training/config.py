"""Typed training configuration (a dataclass; unknown keys are an error)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from asrprec.config import strict_from_dict

OPTIMIZERS = ("scaled_adam", "adamw")
SCAN_OOM_MODES = ("auto", "on", "off")


@dataclass
class TrainConfig:
    """Everything the training loop needs besides the model, data and policy.

    The learning-rate schedule is Eden (k2-fsa/icefall ``egs/librispeech/ASR/zipformer/optim.py``) for both optimizers:
    ``lr = base_lr · ((b²+lr_batches²)/lr_batches²)^-¼ · ((e²+lr_epochs²)/lr_epochs²)^-¼ · warm-up``.
    """

    exp_dir: str
    num_epochs: int = 10
    start_epoch: int = 1
    start_batch: int = 0  # resume mid-epoch from checkpoint-<start_batch>.pt
    # resume from "latest" (the newest complete checkpoint in exp_dir) or from a checkpoint file; "" = no
    resume: str = ""
    # a new run may replace another run's files in exp_dir (and a resume may delete newer checkpoints)
    overwrite: bool = False
    # stop (with a checkpoint and an error) when more than this share of an epoch's batches were skipped
    # (non-finite loss, unreadable data); a whole epoch of skipped steps always stops
    max_skipped_fraction: float = 0.1
    optimizer: str = "scaled_adam"
    base_lr: float = 0.045
    weight_decay: float = 0.0  # adamw only
    lr_batches: float = 7500.0
    lr_epochs: float = 3.5
    warmup_batches: int = 500
    # The schedules (Eden's batch index, the transducer's loss-scale and model warm-ups, the encoder's own
    # schedules) see the adjusted batch count, which grows by world_size × max_duration / ref_duration per
    # optimizer step (icefall's get_adjusted_batch_count, k2-fsa/icefall egs/librispeech/ASR/zipformer/train.py,
    # which applies it to the encoder's schedules only). ref_duration = 0 takes the run's own per-rank
    # max_duration: a step counts world_size batches, so a single process counts its optimizer steps (as
    # before) and N GPUs at the same per-rank max-duration move N times faster per step, i.e. at the same
    # pace per hour of audio. Set ref_duration (icefall: 600 s) to also make a change of max-duration keep
    # the schedules per hour of audio; lr_batches and loss_warmup_batches are then in batches of
    # ref_duration seconds.
    ref_duration: float = 0.0
    # The encoder's own schedules (Zipformer dropout / layer-skip / balancer limits, written for batch counts
    # in the thousands) see the adjusted batch count × this. A tiny corpus trained for ~1,500 batches wants
    # > 1 to leave the heavy early regularisation; icefall's LibriSpeech setting is ref_duration=0 with
    # max_duration/600 here, or ref_duration=600 with 1 here.
    encoder_schedule_scale: float = 1.0
    grad_clip: float = 0.0  # global-norm clip for adamw; ScaledAdam clips by itself (median-based)
    log_interval: int = 20
    valid_interval: int = 0  # batches between validations; 0 = at the end of each epoch only
    save_every_n: int = 0  # batches between mid-epoch checkpoints; 0 = epoch checkpoints only
    keep_last_k: int = 5
    # running mean of the weights every N batches, stored in each checkpoint for decoding with
    # --use-averaged-model (icefall's model_avg, average_period 200); 0 = off
    average_period: int = 200
    max_batches_per_epoch: int = 0  # 0 = the whole epoch (smoke tests set a few)
    seed: int = 42
    tensorboard: bool = True
    progress_bar: bool = True
    # forward+backward on the riskiest batches before the first epoch (asrprec.training.oom):
    # "auto" = on CUDA with a lhotse loader, "on", "off"
    scan_oom: str = "auto"

    def __post_init__(self) -> None:
        if self.ref_duration < 0:
            raise ValueError(f"ref_duration must be >= 0 seconds (0 = this run's max_duration), got {self.ref_duration}")
        if not self.encoder_schedule_scale > 0:
            raise ValueError(f"encoder_schedule_scale must be > 0, got {self.encoder_schedule_scale}")
        if self.scan_oom not in SCAN_OOM_MODES:
            raise ValueError(f"scan_oom must be one of {SCAN_OOM_MODES}, got {self.scan_oom!r}")
        if self.average_period < 0:
            raise ValueError(f"average_period must be >= 0 (0 = no running average), got {self.average_period}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.num_epochs < 1 or self.start_epoch < 1:
            raise ValueError("num_epochs and start_epoch must be >= 1")
        if self.start_epoch > self.num_epochs:
            raise ValueError(f"start_epoch {self.start_epoch} > num_epochs {self.num_epochs}: nothing to train")
        if self.start_batch < 0:
            raise ValueError(f"start_batch must be >= 0 (0 = not a mid-epoch resume), got {self.start_batch}")
        given = [name for name, on in (("--resume", bool(self.resume)), ("--start-batch", self.start_batch > 0),
                                       ("--start-epoch", self.start_epoch > 1)) if on]
        if self.resume and len(given) > 1:
            raise ValueError(f"{' and '.join(given)} each name a checkpoint to resume from; pass only one")
        if not 0.0 <= self.max_skipped_fraction <= 1.0:
            raise ValueError(f"max_skipped_fraction must be in [0, 1] (a share of an epoch's batches), got "
                             f"{self.max_skipped_fraction}")
        if self.max_batches_per_epoch < 0:
            raise ValueError(f"max_batches_per_epoch must be >= 0 (0 = the whole epoch), got "
                             f"{self.max_batches_per_epoch}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        """Build from a plain dict (e.g. a checkpoint's config); unknown keys are an error naming them."""
        return strict_from_dict(cls, d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
