"""Dropout with a scheduled rate (k2-fsa/icefall ``egs/librispeech/ASR/zipformer/scaling.py`` ``Dropout2``,
``Dropout3``; the code is ours)."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor, nn

from ..schedule import FloatLike, is_zero, schedule_value

__all__ = ["Dropout2", "Dropout3", "dropout_mask"]


def dropout_mask(x: Tensor, p: Union[float, Tensor], shared_dim: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None) -> Optional[Tensor]:
    """The scaled keep-mask ``(u > p) / (1 - p)`` for ``x`` (``u`` uniform, one draw per element, or shared along
    ``shared_dim``), in ``dtype`` (default x's); None when ``p`` is 0.

    ``p`` may be a 0-dim tensor (a moving schedule while compiling, :func:`asrprec.models.schedule.schedule_value`).
    Drawn with ``torch.rand`` in eager and compiled code alike, so a compiled graph that falls back to eager random
    ops (inductor's ``fallback_random``) drops the same elements as an eager run with the same seed.
    """
    if is_zero(p):
        return None
    shape = list(x.shape)
    if shared_dim is not None:
        shape[shared_dim] = 1
    return (torch.rand(shape, device=x.device) > p).to(dtype or x.dtype) * (1.0 / (1.0 - p))


class Dropout2(nn.Module):
    """Dropout with a (possibly scheduled) rate."""

    def __init__(self, p: FloatLike):
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        mask = dropout_mask(x, schedule_value(self.p)) if self.training else None
        return x if mask is None else x * mask


class Dropout3(nn.Module):
    """Dropout whose mask is shared along ``shared_dim`` (e.g. the time axis)."""

    def __init__(self, p: FloatLike, shared_dim: int):
        super().__init__()
        self.p, self.shared_dim = p, shared_dim

    def forward(self, x: Tensor) -> Tensor:
        mask = dropout_mask(x, schedule_value(self.p), self.shared_dim) if self.training else None
        return x if mask is None else x * mask
