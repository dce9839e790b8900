"""BiasNorm, the Zipformer's LayerNorm replacement.

Facts follow k2-fsa/icefall ``egs/librispeech/ASR/zipformer/scaling.py`` (``BiasNorm``); the code is ours.
Differences: the statistics run in an fp32 island on CPU and CUDA alike (icefall's decorators are CUDA-only), and
the mean square is clamped at 1e-20 (an all-zero frame would otherwise give 0 * inf = NaN).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from asrprec.precision.islands import compute_dtype, fp32_island, upcast

from ..tracing import is_tracing
from .grad_shaping import limit_param_value

__all__ = ["BiasNorm"]


def _bias_norm_fp32(x: Tensor, bias: Tensor, log_scale: Tensor, channel_dim: int) -> Tensor:
    xf = upcast(x)
    cd = channel_dim % x.ndim
    shape = [1] * x.ndim
    shape[cd] = -1
    b = upcast(bias).to(xf.dtype).reshape(shape)
    ms = ((xf - b) ** 2).mean(dim=cd, keepdim=True).clamp(min=1e-20)
    return xf * ms.rsqrt() * upcast(log_scale).to(xf.dtype).exp()


@fp32_island(output="input")
def _bias_norm(x: Tensor, bias: Tensor, log_scale: Tensor, channel_dim: int) -> Tensor:
    return _bias_norm_fp32(x, bias, log_scale, channel_dim)


class _BiasNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, bias: Tensor, log_scale: Tensor, channel_dim: int) -> Tensor:
        out = _bias_norm(x, bias, log_scale, channel_dim)
        # under autocast keep the recompute input in the autocast dtype (halves what BiasNorm holds; the
        # statistics are still recomputed in fp32)
        ctx.save_for_backward(x.to(compute_dtype(x)), bias, log_scale)
        ctx.x_dtype = x.dtype
        ctx.channel_dim = channel_dim
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        x, bias, log_scale = ctx.saved_tensors
        with torch.enable_grad(), fp32_island():
            xf = upcast(x.detach()).requires_grad_(True)
            bf = upcast(bias.detach()).requires_grad_(True)
            lf = upcast(log_scale.detach()).requires_grad_(True)
            out = _bias_norm_fp32(xf, bf, lf, ctx.channel_dim)
            gx, gb, gl = torch.autograd.grad(out, (xf, bf, lf), upcast(g))
        return gx.to(ctx.x_dtype), gb.to(bias.dtype), gl.to(log_scale.dtype), None


class BiasNorm(nn.Module):
    """LayerNorm replacement: ``x * exp(log_scale) / RMS(x - bias)`` over the channel dim.

    The per-channel bias only enters the RMS; ``log_scale`` is a scalar kept in [-1.5, 1.5] during training.
    Statistics in fp32 (an fp32 island), output in x's dtype; backward recomputes from the stored input.

    Shapes: x (..., C, ...) with C = ``num_channels`` at ``channel_dim`` -> the same shape and dtype.
    """

    def __init__(self, num_channels: int, channel_dim: int = -1, log_scale: float = 1.0,
                 log_scale_min: float = -1.5, log_scale_max: float = 1.5):
        super().__init__()
        self.num_channels = num_channels
        self.channel_dim = channel_dim
        self.log_scale = nn.Parameter(torch.tensor(float(log_scale)))
        self.bias = nn.Parameter(torch.zeros(num_channels))
        self.log_scale_min, self.log_scale_max = log_scale_min, log_scale_max

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[self.channel_dim] != self.num_channels:
            raise ValueError(f"BiasNorm expects {self.num_channels} channels on dim {self.channel_dim}, "
                             f"got shape {tuple(x.shape)}")
        log_scale = limit_param_value(self.log_scale, self.log_scale_min, self.log_scale_max,
                                      training=self.training)
        # a compiled graph differentiates the plain ops (AOTAutograd cannot trace the autograd.grad in
        # _BiasNormFunction's backward; its partitioner chooses what to recompute itself)
        if not torch.is_grad_enabled() or is_tracing():
            return _bias_norm(x, self.bias, log_scale, self.channel_dim)
        return _BiasNormFunction.apply(x, self.bias, log_scale, self.channel_dim)
