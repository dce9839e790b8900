"""The training loop (plain functions), its typed config, experiment folders, and distributed training through
torchrun."""

from .config import TrainConfig
from .distributed import (
    DistributedEnv,
    RankFailedError,
    get_rank,
    get_world_size,
    is_main_process,
    setup_distributed,
    teardown_distributed,
)
from .experiment import ExperimentError, prepare_experiment, read_model_config
from .forward import compute_loss, pad_targets
from .loop import (
    TooManySkippedBatches,
    TrainState,
    optimizer_from_config,
    scheduler_from_config,
    seed_everything,
    train,
    validate,
)
from .resume import ResumeMismatchError

__all__ = [
    "DistributedEnv", "ExperimentError", "RankFailedError", "ResumeMismatchError", "TooManySkippedBatches",
    "TrainConfig", "TrainState", "compute_loss", "get_rank", "get_world_size", "is_main_process",
    "optimizer_from_config", "pad_targets", "prepare_experiment", "read_model_config", "scheduler_from_config",
    "seed_everything", "setup_distributed", "teardown_distributed", "train", "validate",
]
