"""What a checkpoint's weights must satisfy to be loaded: the digest recorded when they were saved, and finite
values. Pure functions over a state dict; :mod:`.io` raises the errors."""

from __future__ import annotations

import hashlib
from typing import Mapping

import torch

#: the checkpoint entry holding :func:`weights_digest` of its ``model`` state dict
DIGEST_KEY = "model_sha256"


def weights_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over every tensor of ``state`` in name order: its name, dtype, shape and raw bytes. Any changed
    value, name, dtype or shape changes it; the device a tensor sits on and the map_location it is loaded to
    do not."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        if not isinstance(t, torch.Tensor):
            h.update(f"{name}|{type(t).__name__}|{t!r}\n".encode())
            continue
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        if flat.numel():
            h.update(memoryview(flat.view(torch.uint8).numpy()))
    return h.hexdigest()


def nonfinite_tensors(state: Mapping[str, torch.Tensor]) -> list[tuple[str, int, int]]:
    """``(name, non-finite elements, elements)`` for each floating tensor of ``state`` holding NaN or Inf, in name
    order."""
    found = []
    for name in sorted(state):
        t = state[name]
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
            bad = int(t.numel() - torch.isfinite(t).sum())
            if bad:
                found.append((name, bad, t.numel()))
    return found
