"""Padding masks of padded batches."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["make_pad_mask"]


def make_pad_mask(lens: Tensor, max_len: int) -> Tensor:
    """(B,) integer lengths -> (B, max_len) bool mask, True at padded positions (``t >= lens[b]``)."""
    return torch.arange(max_len, device=lens.device).unsqueeze(0) >= lens.unsqueeze(1)
