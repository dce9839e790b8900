"""Eden learning-rate schedule (k2-fsa/icefall ``egs/librispeech/ASR/zipformer/optim.py``; code is ours).

    lr = base_lr * ((b^2 + B^2) / B^2)^(-1/4) * ((e^2 + E^2) / E^2)^(-1/4) * w(b)

b = batch index (``step_batch``), e = epoch (``step_epoch``; icefall calls ``step_epoch(epoch - 1)`` at the
start of each epoch), B = ``lr_batches``, E = ``lr_epochs``, and w rises linearly from ``warmup_start`` to 1 over
``warmup_batches`` batches. icefall Zipformer: B=7500, E=3.5, warmup 500 batches from 0.1 (train.py since
PR #1862). Each group's base lr is its ``initial_lr`` (set from ``lr`` when the scheduler is made).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from torch.optim import Optimizer


def eden_factor(batch: float, epoch: float, lr_batches: float, lr_epochs: float, warmup_batches: float,
                warmup_start: float) -> float:
    """The multiplier applied to base lr at (batch, epoch)."""
    f = ((batch ** 2 + lr_batches ** 2) / lr_batches ** 2) ** -0.25
    f *= ((epoch ** 2 + lr_epochs ** 2) / lr_epochs ** 2) ** -0.25
    if batch < warmup_batches:
        f *= warmup_start + (1.0 - warmup_start) * (batch / warmup_batches)
    return f


class Eden:
    """Eden schedule. ``step_batch(b=None)`` (b=None: advance by one), ``step_epoch(e=None)``, ``get_last_lr()``,
    ``state_dict()`` / ``load_state_dict()``."""

    def __init__(self, optimizer: Optimizer, lr_batches: float = 7500.0, lr_epochs: float = 3.5,
                 warmup_batches: float = 500.0, warmup_start: float = 0.1):
        if lr_batches <= 0 or lr_epochs <= 0:
            raise ValueError(f"lr_batches and lr_epochs must be positive, got {lr_batches}, {lr_epochs}")
        if warmup_batches < 0 or not 0 <= warmup_start <= 1:
            raise ValueError(f"need warmup_batches >= 0 and 0 <= warmup_start <= 1, got {warmup_batches}, "
                             f"{warmup_start}")
        self.optimizer = optimizer
        for g in optimizer.param_groups:
            g.setdefault("initial_lr", g["lr"])
        self.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
        self.lr_batches, self.lr_epochs = float(lr_batches), float(lr_epochs)
        self.warmup_batches, self.warmup_start = float(warmup_batches), float(warmup_start)
        self.batch = 0
        self.epoch = 0
        self._set_lrs()

    def get_lr(self) -> List[float]:
        f = eden_factor(self.batch, self.epoch, self.lr_batches, self.lr_epochs, self.warmup_batches,
                        self.warmup_start)
        return [b * f for b in self.base_lrs]

    def _set_lrs(self) -> None:
        lrs = self.get_lr()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        self._last_lr = lrs

    def get_last_lr(self) -> List[float]:
        return list(self._last_lr)

    def step_batch(self, batch: Optional[int] = None) -> None:
        self.batch = self.batch + 1 if batch is None else batch
        self._set_lrs()

    def step_epoch(self, epoch: Optional[float] = None) -> None:
        self.epoch = self.epoch + 1 if epoch is None else epoch
        self._set_lrs()

    def state_dict(self) -> Dict[str, Any]:
        return {"base_lrs": self.base_lrs, "batch": self.batch, "epoch": self.epoch,
                "lr_batches": self.lr_batches, "lr_epochs": self.lr_epochs,
                "warmup_batches": self.warmup_batches, "warmup_start": self.warmup_start}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        self._set_lrs()
