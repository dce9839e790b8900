"""Rank helpers so logging, saving and validation are DDP-ready (torchrun sets RANK/WORLD_SIZE)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def get_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def get_world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def is_main_process() -> bool:
    return get_rank() == 0


def unwrap(model: nn.Module) -> nn.Module:
    """The bare model inside a DistributedDataParallel wrapper (or the model itself)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks (identity without a process group)."""
    if get_world_size() > 1:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t
