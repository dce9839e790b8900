"""Attaching a bf16 update rule (:mod:`asrprec.optim.bf16_update`) to an optimizer: the one place that knows
which optimizers write their weights by a rule, so the rules and the optimizers need not import each other."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim import Optimizer

from .bf16_update import AdamWBf16, Bf16Update
from .scaled_adam import ScaledAdam

__all__ = ["with_bf16_update"]


def with_bf16_update(optimizer: Optimizer, update: Bf16Update) -> Optimizer:
    """The optimizer ``optimizer`` describes, writing bf16 weights by ``update``: a :class:`ScaledAdam` takes the
    rule; a ``torch.optim.AdamW`` becomes an :class:`AdamWBf16` with the same groups and hyper-parameters.

    Raises ValueError for other optimizers (their updates would be written by torch, in bf16) and for an
    optimizer that has already stepped."""
    if any(optimizer.state.values()):
        raise ValueError("attach the bf16 update rule before the first step (the optimizer already has state)")
    if isinstance(optimizer, ScaledAdam):
        optimizer.weight_update = update
        return optimizer
    if type(optimizer) is torch.optim.AdamW:
        groups = []
        for g in optimizer.param_groups:
            if g.get("amsgrad") or g.get("maximize"):
                raise ValueError("AdamW with amsgrad or maximize has no bf16 update rule; use --bf16-update master")
            groups.append({k: v for k, v in g.items() if k in ("params", "lr", "betas", "eps", "weight_decay")
                           or k not in optimizer.defaults})
        d = optimizer.defaults
        lr = d["lr"].item() if isinstance(d["lr"], Tensor) else d["lr"]
        return AdamWBf16(groups, lr=lr, betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
                         update=update)
    raise ValueError(f"--bf16-update {update.rule} supports ScaledAdam and torch.optim.AdamW, not "
                     f"{type(optimizer).__name__}. Fix: use one of those, or --bf16-update master (fp32 master "
                     "weights work with any optimizer)")
