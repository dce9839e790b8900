"""The bare model inside the wrappers that training puts around it (DDP, DataParallel, ``torch.compile``)."""

from __future__ import annotations

from torch import nn

__all__ = ["unwrap_model"]


def unwrap_model(model: nn.Module) -> nn.Module:
    """The bare model under DDP / DataParallel (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model
