"""The training loop (plain functions), its typed config, experiment folders, and distributed training through
torchrun."""

from asrprec.devices import get_rank, get_world_size, is_main_process

from .config import TrainConfig, TrainingConfig
from .distributed import DistributedEnv, RankFailedError, setup_distributed, teardown_distributed
from .optimizers import optimizer_from_config, scheduler_from_config
from asrprec.rng import seed_everything

from asrprec.experiment import ExperimentError, prepare_experiment, read_model_config
from .forward import compute_loss, pad_targets
from .loop import train, validate
from .recipe import train_experiment
from .preemption import PREEMPTED_EXIT_CODE, TrainingPreempted
from .resume import ResumeMismatchError, TrainState
from .skips import NoTrainingBatches, TooManySkippedBatches

__all__ = [
    "PREEMPTED_EXIT_CODE", "DistributedEnv", "ExperimentError", "NoTrainingBatches", "RankFailedError",
    "ResumeMismatchError", "TooManySkippedBatches", "TrainConfig", "TrainState", "TrainingConfig", "TrainingPreempted",
    "compute_loss", "get_rank", "get_world_size", "is_main_process",
    "optimizer_from_config", "pad_targets", "prepare_experiment", "read_model_config", "scheduler_from_config",
    "seed_everything", "setup_distributed", "teardown_distributed", "train", "train_experiment", "validate",
]
