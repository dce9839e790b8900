"""The optimizer and the learning-rate schedule a :class:`~asrprec.training.TrainConfig` names (training's
choice among :mod:`asrprec.optim`, which knows nothing of training).

The schedule is Eden (k2-fsa/icefall ``egs/librispeech/ASR/zipformer/optim.py``) for both optimizers:
``lr = base_lr · ((b²+lr_batches²)/lr_batches²)^-¼ · ((e²+lr_epochs²)/lr_epochs²)^-¼ · warm-up``, with ``b``
the adjusted batch count (:func:`asrprec.training.schedules.schedule_batches_per_step`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from asrprec.optim import Eden, ScaledAdam

from .config import TrainConfig

if TYPE_CHECKING:
    from asrprec.precision import PrecisionPolicy

__all__ = ["optimizer_from_config", "scheduler_from_config"]


def optimizer_from_config(model: nn.Module, cfg: TrainConfig, policy: PrecisionPolicy):
    """The optimizer ``cfg.optimizer`` names (ScaledAdam, icefall's, or AdamW), built through the policy's
    :meth:`~asrprec.precision.PrecisionPolicy.build_optimizer` (fp32 master weights under bf16); ScaledAdam's
    update compiled with ``cfg.compile`` and ``cfg.compile_optimizer``."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "scaled_adam":

        def factory(ps):
            opt = ScaledAdam(ps, lr=cfg.base_lr, clipping_scale=2.0)
            if cfg.compile and cfg.compile_optimizer:  # here, inside any policy wrapper (the bf16 fp32 masters)
                opt.compile(backend=cfg.compile_backend, mode=cfg.compile_mode)
            return opt
    else:

        def factory(ps):
            return torch.optim.AdamW(ps, lr=cfg.base_lr, weight_decay=cfg.weight_decay)

    return policy.build_optimizer(params, factory)


def scheduler_from_config(optimizer, cfg: TrainConfig) -> Eden:
    """Eden over ``optimizer`` with ``cfg``'s ``lr_batches``, ``lr_epochs`` and ``warmup_batches``."""
    return Eden(optimizer, lr_batches=cfg.lr_batches, lr_epochs=cfg.lr_epochs, warmup_batches=cfg.warmup_batches)
