"""The training loop (plain functions), its typed config, and distributed training through torchrun."""

from .config import TrainConfig
from .distributed import (
    DistributedEnv,
    RankFailedError,
    get_rank,
    get_world_size,
    is_main_process,
    setup_distributed,
    teardown_distributed,
    unwrap,
)
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
    "DistributedEnv", "RankFailedError", "TrainConfig", "TrainState", "build_optimizer", "build_scheduler",
    "compute_loss", "get_rank", "get_world_size", "is_main_process", "pad_targets", "seed_everything",
    "setup_distributed", "teardown_distributed", "train", "unwrap", "validate",
]
