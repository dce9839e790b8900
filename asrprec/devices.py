"""Where this process runs: its rank, local rank and world size, and its device.

Under torchrun (one process per device; ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``
set) the answers come from the process group once :func:`asrprec.training.distributed.setup_distributed` has joined
it, and from torchrun's variables before; a plain ``python`` process is rank 0 of 1. Training, decoding and export
all ask here, so none of them imports another for it.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["get_local_rank", "get_rank", "get_world_size", "is_main_process", "rank_device", "resolve_device",
           "torchrun_world"]

_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def get_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def get_world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def get_local_rank() -> int:
    """This process's index on its machine (torchrun's ``LOCAL_RANK``; 0 for a single process)."""
    if get_world_size() == 1:
        return 0
    return int(os.environ.get("LOCAL_RANK", get_rank()))


def is_main_process() -> bool:
    return get_rank() == 0


def torchrun_world() -> tuple[int, int, int] | None:
    """(rank, local_rank, world_size) from torchrun's variables; None without them."""
    present = [v for v in _TORCHRUN_VARS if v in os.environ]
    if not present:
        return None
    missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise RuntimeError(
            f"distributed environment incomplete: {', '.join(present)} set but {', '.join(missing)} missing. "
            "Fix: launch with torchrun (e.g. torchrun --nproc_per_node=2 train.py ...), which sets all of "
            f"{', '.join(_TORCHRUN_VARS)}, or unset them for a single-process run")
    try:
        rank, local_rank, world = (int(os.environ[v]) for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    except ValueError:
        raise RuntimeError(f"RANK, LOCAL_RANK and WORLD_SIZE must be integers, got {os.environ['RANK']!r}, "
                           f"{os.environ['LOCAL_RANK']!r}, {os.environ['WORLD_SIZE']!r}") from None
    if not 0 <= rank < world or local_rank < 0:
        raise RuntimeError(f"inconsistent torchrun environment: RANK={rank}, LOCAL_RANK={local_rank}, "
                           f"WORLD_SIZE={world}")
    return rank, local_rank, world


def _layout() -> tuple[int, int]:
    """(local_rank, world_size): from the process group once it exists, else from torchrun's variables."""
    if get_world_size() > 1:
        return get_local_rank(), get_world_size()
    tr = torchrun_world()
    return (tr[1], tr[2]) if tr else (0, 1)


def rank_device(name: str | None = None) -> torch.device:
    """The device this process runs on: ``name`` (``cpu``, ``cuda``, ``cuda:1``; default cuda if available,
    else cpu), where ``cuda`` means ``cuda:LOCAL_RANK`` when torchrun started several processes."""
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    local_rank, world = _layout()
    if device.type != "cuda" or world == 1:
        return device
    if device.index is not None:
        raise ValueError(f"--device {name} with {world} processes: each process uses the GPU of its LOCAL_RANK. "
                         "Fix: pass --device cuda (or nothing), and choose the GPUs with CUDA_VISIBLE_DEVICES")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(f"LOCAL_RANK {local_rank} needs GPU {local_rank}, but this machine shows {count}. Fix: "
                           f"torchrun --nproc_per_node={count} or fewer (one process per GPU)")
    return torch.device("cuda", local_rank)


def resolve_device(name: str | None) -> str:
    """``name``, or cuda if available else cpu; under torchrun ``cuda`` is this process's ``cuda:LOCAL_RANK``."""
    return str(rank_device(name))
