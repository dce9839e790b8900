"""Zipformer linear layers: ``nn.Linear`` whose autocast path keeps no cast copy of the weight, and icefall's
scaled initialisation.

Facts follow k2-fsa/icefall ``egs/librispeech/ASR/zipformer/scaling.py`` (``ScaledLinear``); the code is ours.
Difference: :class:`Linear` (an ``nn.Linear``) saves the fp32 weight, not autocast's low-precision copy of it, and
re-casts it in backward (activation memory under AMP; same numerics).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from asrprec.precision.islands import autocast_dtype, fp32_island

__all__ = ["Linear", "linear", "scaled_linear"]


class _AutocastLinear(torch.autograd.Function):
    """``F.linear`` in the autocast dtype that keeps no cast copy of the weight for backward.

    Under autocast, ``F.linear`` saves the low-precision copy of the weight it made (one per Linear per step, as
    many bytes as the model's Linear weights in that dtype). Here only the input (in the compute dtype, as
    autocast saves it) and the fp32 parameter itself are saved; backward casts the weight again. Same numerics as
    autocast: matmuls in the compute dtype, gradients returned in the parameters' dtype.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], cdtype: torch.dtype) -> Tensor:
        with fp32_island():
            xc = x.to(cdtype)
            out = F.linear(xc, weight.to(cdtype), None if bias is None else bias.to(cdtype))
        ctx.save_for_backward(xc, weight)
        ctx.has_bias, ctx.x_dtype = bias is not None, x.dtype
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        xc, weight = ctx.saved_tensors
        gx = gw = gb = None
        with fp32_island():
            g = g.to(xc.dtype)
            if ctx.needs_input_grad[0]:
                gx = torch.matmul(g, weight.to(xc.dtype)).to(ctx.x_dtype)
            g2 = g.reshape(-1, g.shape[-1])
            if ctx.needs_input_grad[1]:
                gw = torch.mm(g2.t(), xc.reshape(-1, xc.shape[-1])).to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                gb = g2.sum(dim=0, dtype=torch.float32).to(weight.dtype)
        return gx, gw, gb, None


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear``; under autocast (with grad) routed through :class:`_AutocastLinear` (no saved weight copy)."""
    cdtype = autocast_dtype(x)
    if cdtype is not None and weight.dtype != cdtype and torch.is_grad_enabled() \
            and (x.requires_grad or weight.requires_grad):
        return _AutocastLinear.apply(x, weight, bias, cdtype)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state dict) whose autocast path saves no cast copy of the weight."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def scaled_linear(in_features: int, out_features: int, bias: bool = True, initial_scale: float = 1.0) -> nn.Linear:
    """``nn.Linear`` whose initial weight is multiplied by ``initial_scale`` and bias drawn from ±0.1·scale
    (icefall scaling.py ``ScaledLinear``: no extra parameters)."""
    lin = Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(initial_scale)
        if bias:
            nn.init.uniform_(lin.bias, -0.1 * initial_scale, 0.1 * initial_scale)
    return lin
