"""The forward pass of one training batch: token ids padded into targets, the model under the policy's autocast,
and the summed fp32 loss with its statistics. Shared by the training loop and the out-of-memory scan."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asrprec.precision import PrecisionPolicy


def pad_targets(token_ids: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists → padded (B, U) int64 targets (padding -1) and (B,) lengths."""
    lens = torch.tensor([len(t) for t in token_ids], dtype=torch.int64)
    u = int(lens.max()) if len(token_ids) else 0
    targets = torch.full((len(token_ids), max(u, 1)), -1, dtype=torch.int64)
    for i, t in enumerate(token_ids):
        if t:
            targets[i, : len(t)] = torch.tensor(t, dtype=torch.int64)
    return targets.to(device), lens.to(device)


def compute_loss(
    model: nn.Module, batch: dict[str, Any], tokenizer, policy: PrecisionPolicy
) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward one batch under the policy's autocast; return the summed fp32 loss and statistics."""
    device = policy.device
    features = batch["features"].to(device)
    feature_lens = batch["feature_lens"].to(device)
    targets, target_lens = pad_targets(tokenizer.encode(batch["texts"]), device)
    with policy.autocast():
        out = model(features, feature_lens, targets, target_lens)
    loss = out["loss"]
    frames = float(out["encoder_out_lens"].sum())
    info = {"frames": frames, "utterances": float(features.size(0)), "loss": float(loss.detach())}
    # every loss part the model reports (transducer, CTC, CR-CTC ...), summed over the batch like "loss"
    for k, v in out.items():
        if k.endswith("_loss"):
            info[k] = float(v.detach())
    return loss, info
