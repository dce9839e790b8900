"""Dropout with a scheduled rate (k2-fsa/icefall ``egs/librispeech/ASR/zipformer/scaling.py`` ``Dropout2``,
``Dropout3``; the code is ours)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..schedule import FloatLike

__all__ = ["Dropout2", "Dropout3"]


class Dropout2(nn.Module):
    """Dropout with a (possibly scheduled) rate."""

    def __init__(self, p: FloatLike):
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, p=float(self.p), training=self.training)


class Dropout3(nn.Module):
    """Dropout whose mask is shared along ``shared_dim`` (e.g. the time axis)."""

    def __init__(self, p: FloatLike, shared_dim: int):
        super().__init__()
        self.p, self.shared_dim = p, shared_dim

    def forward(self, x: Tensor) -> Tensor:
        p = float(self.p)
        if not self.training or p == 0.0:
            return x
        shape = list(x.shape)
        shape[self.shared_dim] = 1
        mask = (torch.rand(shape, device=x.device) > p).to(x.dtype) * (1.0 / (1.0 - p))
        return x * mask
