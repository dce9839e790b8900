"""The Zipformer's 2-D convolutions as custom ops whose forward and backward run on channels-last tensors.

oneDNN's depthwise kernels are several times faster on CPU with channels-last inputs, and the Zipformer lays its
tensors out for them (the ConvNeXt in channels-last, the convolution module's (B, T, D) activations as (B, D, 1, T)).
Under ``torch.compile`` inductor decides the layouts of the tensors it hands to ``convolution`` and
``convolution_backward`` itself, and chose NCHW-like ones for these convs: on one CPU thread the ConvNeXt's
backward took 45.6 instead of 9.6 ms per call ((8, 32, 71, 19) input) and the convolution module's forward 3.1
instead of 0.22 ms (benchmarks/RESULTS.md). The front-end's other convs go through the same op for another
reason: under ``dynamic=True`` inductor's handling of ``convolution`` and ``convolution_backward`` fixed T to a
number, either as a guard (the input gradient's strides made concrete, ``guard_int_seq`` in
torch/_inductor/kernel/conv.py: every new T compiled the encoder again) or as a saved output's stride written into
the backward graph (then the next T fails its stride check). Inductor runs a custom op as it is; each makes its own
channels-last copies (none in eager mode, where the inputs already are). The aten ops and the math are those of
``F.conv2d`` and its autograd formula, so eager results are unchanged.
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ...precision.islands import compute_dtype
from ..tracing import is_exporting

__all__ = ["conv2d", "depthwise_conv2d"]

_CL = torch.channels_last


@torch.library.custom_op("asrprec::conv2d", mutates_args=())
def _forward(x: Tensor, weight: Tensor, bias: Tensor, stride_h: int, stride_w: int, pad_h: int, pad_w: int,
             groups: int) -> Tensor:
    y = F.conv2d(x.contiguous(memory_format=_CL), weight, bias, stride=(stride_h, stride_w), padding=(pad_h, pad_w),
                 groups=groups)
    return y.contiguous(memory_format=_CL)


@_forward.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor, stride_h: int, stride_w: int, pad_h: int, pad_w: int,
      groups: int) -> Tensor:
    b, _, h, w = x.shape
    kh, kw = weight.shape[-2:]
    return torch.empty((b, weight.shape[0], (h + 2 * pad_h - kh) // stride_h + 1, (w + 2 * pad_w - kw) // stride_w + 1),
                       dtype=x.dtype, device=x.device, memory_format=_CL)


@torch.library.custom_op("asrprec::conv2d_backward", mutates_args=())
def _backward(g: Tensor, x: Tensor, weight: Tensor, stride_h: int, stride_w: int, pad_h: int, pad_w: int,
              groups: int, input_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The input (empty unless ``input_grad``), weight and bias gradients; ``g``, ``x`` and ``weight`` share a
    dtype."""
    gx, gw, gb = torch.ops.aten.convolution_backward(
        g.contiguous(memory_format=_CL), x.contiguous(memory_format=_CL), weight, [weight.shape[0]],
        [stride_h, stride_w], [pad_h, pad_w], [1, 1], False, [0, 0], groups, [input_grad, True, True])
    gx = gx.contiguous(memory_format=_CL) if input_grad else x.new_empty(0)
    return gx, gw.contiguous(), gb.contiguous()


@_backward.register_fake
def _(g: Tensor, x: Tensor, weight: Tensor, stride_h: int, stride_w: int, pad_h: int, pad_w: int,
      groups: int, input_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    gx = torch.empty_like(x, memory_format=_CL) if input_grad else x.new_empty(0)
    return gx, torch.empty_like(weight), g.new_empty(weight.shape[0])


class _Conv2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor, stride: Tuple[int, int], padding: Tuple[int, int],
                groups: int) -> Tensor:
        # under autocast the conv runs in the autocast dtype, as F.conv2d would, and autograd would save the casts
        dt = compute_dtype(x)
        xc, wc = x.to(dt), weight.to(dt)
        ctx.save_for_backward(xc, wc)
        ctx.args, ctx.dtypes = (*stride, *padding, groups), (x.dtype, weight.dtype, bias.dtype)
        return _forward(xc, wc, bias.to(dt), *stride, *padding, groups)

    @staticmethod
    def backward(ctx, g: Tensor):
        x, weight = ctx.saved_tensors
        want_x = ctx.needs_input_grad[0]
        grads = _backward(g.to(x.dtype), x, weight, *ctx.args, want_x)
        gx, gw, gb = (t.to(d) for t, d in zip(grads, ctx.dtypes))
        return gx if want_x else None, gw, gb, None, None, None


def conv2d(x: Tensor, weight: Tensor, bias: Tensor, stride: Tuple[int, int] = (1, 1),
           padding: Tuple[int, int] = (0, 0), groups: int = 1) -> Tensor:
    """``F.conv2d(x, weight, bias, stride, padding, groups=groups)`` (dilation 1) for x (B, C, H, W); the output is
    channels-last. Under ``torch.export`` (ONNX export) it is ``F.conv2d`` itself: the exporters know the aten op,
    not the custom ones."""
    stride, padding = tuple(stride), tuple(padding)
    if is_exporting():
        return F.conv2d(x, weight, bias, stride=stride, padding=padding, groups=groups)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad):
        return _Conv2d.apply(x, weight, bias, stride, padding, groups)
    dt = compute_dtype(x)
    return _forward(x.to(dt), weight.to(dt), bias.to(dt), *stride, *padding, groups)


def depthwise_conv2d(x: Tensor, weight: Tensor, bias: Tensor, padding: Tuple[int, int]) -> Tensor:
    """:func:`conv2d` with ``groups`` = channels and stride 1, for weight (C, 1, kh, kw)."""
    return conv2d(x, weight, bias, (1, 1), padding, weight.shape[0])
