"""The training loop (plain functions), its typed config, and rank helpers for DDP."""

from .config import TrainConfig
from .distributed import get_rank, get_world_size, is_main_process, unwrap
from .loop import (
    TrainState,
    build_optimizer,
    build_scheduler,
    compute_loss,
    pad_targets,
    seed_everything,
    train,
    validate,
)

__all__ = [
    "TrainConfig", "TrainState", "build_optimizer", "build_scheduler", "compute_loss", "get_rank",
    "get_world_size", "is_main_process", "pad_targets", "seed_everything", "train", "unwrap", "validate",
]
