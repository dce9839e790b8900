"""Zipformer activations: fp32 softmax, SwooshL/SwooshR, and Swoosh + dropout + linear fused.

Facts follow k2-fsa/icefall ``egs/librispeech/ASR/zipformer/scaling.py`` (``SwooshL``, ``SwooshR``,
``ActivationDropoutAndLinear``); the code is ours. Differences:

* Swoosh is pure PyTorch (icefall calls k2). The derivative is stored as uint8 rounded to nearest
  (icefall/k2: random dither); the largest error is 1/510 of the derivative's 1.0 range.
* Every function computes in an fp32 island (autocast off on CPU and CUDA alike, :mod:`asrprec.precision.islands`)
  and returns the input's dtype (softmax: the compute dtype), so CPU autocast and a whole-model bf16 cast work;
  icefall's CUDA-only decorators break both.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from asrprec.precision.islands import compute_dtype, fp32_island, upcast

from ..schedule import FloatLike, schedule_value
from .dropout import dropout_mask
from .linear import scaled_linear

__all__ = ["ActivationDropoutAndLinear", "SwooshL", "SwooshR", "act_dropout_linear", "softmax", "swoosh_l",
           "swoosh_r"]


class _Softmax(torch.autograd.Function):
    """Softmax computed in fp32, output in the compute dtype, only the output saved for backward."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int) -> Tensor:
        out_dtype = compute_dtype(x)
        with fp32_island():
            y = upcast(x).softmax(dim=dim).to(out_dtype)
        ctx.save_for_backward(y)
        ctx.dim, ctx.in_dtype = dim, x.dtype
        return y

    @staticmethod
    def backward(ctx, g: Tensor):
        (y,) = ctx.saved_tensors
        with fp32_island():
            yf = upcast(y)
            gf = upcast(g).to(yf.dtype)
            # y * (g - sum(g * y)), as one fused kernel
            gi = torch._softmax_backward_data(gf, yf, ctx.dim, yf.dtype)
        return gi.to(ctx.in_dtype), None


def softmax(x: Tensor, dim: int) -> Tensor:
    if not x.requires_grad:
        out_dtype = compute_dtype(x)
        with fp32_island():
            return upcast(x).softmax(dim=dim).to(out_dtype)
    return _Softmax.apply(x, dim)


# ---------------------------------------------------------------------------------------------------------------
# Swoosh activations
#   SwooshL(x) = log(1 + e^(x-4)) - 0.08 x - 0.035
#   SwooshR(x) = log(1 + e^(x-1)) - 0.08 x - 0.313261687
#   derivative: sigmoid(x - offset) - 0.08, in (-0.08, 0.92): a range of width 1, stored as uint8.

_SWOOSH = ("SwooshL", "SwooshR")
_DERIV_MIN = -0.08  # a literal where it is used in traced code (see _swoosh_constants)


def _swoosh_constants(kind: str) -> tuple[float, float]:
    """(offset, const) of ``kind``, as literals: under ``torch.compile(dynamic=True)`` dynamo turns a float read from
    a module-level table into a symbolic graph input, which it cannot lift into an autograd.Function's subgraph
    ("lift_tracked_freevar_to_input should not be called on root SubgraphTracer", torch 2.14)."""
    return (4.0, 0.035) if kind == "SwooshL" else (1.0, 0.313261687)


def _softplus(z: Tensor) -> Tensor:
    """log(1 + e^z) = relu(z) - log(sigmoid(|z|)) on the CPU, F.softplus elsewhere.

    On the CPU, torch's softplus kernel spends its time in log1p: about 6x the time of these five passes, and a
    training step of the embedded recipe 0.90x as long with them (benchmarks/RESULTS.md, "Softplus on the CPU").
    sigmoid(|z|) lies in [0.5, 1], so the log never overflows or meets 0; its absolute error is that of one float
    (6e-8). On a GPU one fused kernel beats five passes."""
    if z.device.type != "cpu":
        return F.softplus(z)
    return z.clamp_min(0.0).sub_(torch.sigmoid(z.abs()).log_())


def _swoosh_from_z(z: Tensor, kind: str) -> Tensor:
    # with z = x - offset: swoosh = softplus(z) - 0.08 z - (const + 0.08 offset); two of the passes in place
    offset, const = _swoosh_constants(kind)
    return _softplus(z).sub_(z, alpha=0.08).sub_(const + 0.08 * offset)


def _swoosh_fp32(xf: Tensor, kind: str) -> Tensor:
    return _swoosh_from_z(xf - _swoosh_constants(kind)[0], kind)


@fp32_island(output="input")
def _swoosh_no_grad(x: Tensor, kind: str) -> Tensor:
    return _swoosh_fp32(x, kind)


class _SwooshFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, kind: str) -> Tensor:
        with fp32_island():
            z = upcast(x) - _swoosh_constants(kind)[0]  # shared by the value and the derivative
            if ctx.needs_input_grad[0]:
                # d - _DERIV_MIN = sigmoid(x - offset) in [0, 1]: quantise it directly (no clamp needed);
                # + 0.5 then truncation in the uint8 cast = round half up
                ctx.save_for_backward(torch.sigmoid(z).mul_(255.0).add_(0.5).to(torch.uint8))
            y = _swoosh_from_z(z, kind)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, g: Tensor):
        (q,) = ctx.saved_tensors
        with fp32_island():
            gi = q.float().mul_(1.0 / 255.0).add_(-0.08).mul_(g)  # + _DERIV_MIN
        return gi.to(g.dtype), None


def _swoosh(x: Tensor, kind: str) -> Tensor:
    return _SwooshFunction.apply(x, kind) if x.requires_grad else _swoosh_no_grad(x, kind)


def swoosh_l(x: Tensor) -> Tensor:
    """SwooshL(x) = log(1+e^(x-4)) - 0.08x - 0.035, computed in fp32, returned in x.dtype."""
    return _swoosh(x, "SwooshL")


def swoosh_r(x: Tensor) -> Tensor:
    """SwooshR(x) = log(1+e^(x-1)) - 0.08x - 0.313261687, computed in fp32, returned in x.dtype."""
    return _swoosh(x, "SwooshR")


class SwooshL(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return swoosh_l(x)


class SwooshR(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return swoosh_r(x)


class _ActDropLinear(torch.autograd.Function):
    """y = Linear(dropout(swoosh(x))), saving only x (and the dropout mask); backward recomputes swoosh.

    Follows the idea of icefall ``ActivationDropoutAndLinearFunction`` (scaling.py); the matmuls run in the
    compute dtype (autocast dtype of x's device, else x's dtype), the activation in fp32.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, kind: str, mask: Optional[Tensor]):
        cdtype = compute_dtype(x)
        with fp32_island():
            y = _swoosh_fp32(upcast(x), kind)
            if mask is not None:
                y = y * mask
            y = y.to(cdtype)
            out = F.linear(y, weight.to(cdtype), None if bias is None else bias.to(cdtype))
        ctx.save_for_backward(x, weight, bias, mask)
        ctx.kind, ctx.cdtype = kind, cdtype
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        x, weight, bias, mask = ctx.saved_tensors
        cdtype = ctx.cdtype
        gx = gw = gb = None
        with fp32_island():
            z = upcast(x) - _swoosh_constants(ctx.kind)[0]  # shared by the derivative and the recomputed activation
            d = torch.sigmoid(z).sub_(0.08)
            if mask is not None:
                d = d * mask
            g = g.to(cdtype)
            g2 = g.reshape(-1, g.shape[-1])
            if ctx.needs_input_grad[1]:
                y = _swoosh_from_z(z, ctx.kind)
                if mask is not None:
                    y = y * mask
                y = y.to(cdtype)
                gw = (g2.t() @ y.reshape(-1, y.shape[-1])).to(weight.dtype)
            if bias is not None and ctx.needs_input_grad[2]:
                gb = upcast(g2).sum(dim=0).to(bias.dtype)
            if ctx.needs_input_grad[0]:
                gx = d.mul_(g @ weight.to(cdtype)).to(x.dtype)
        return gx, gw, gb, None, None


class ActivationDropoutAndLinear(nn.Module):
    """Swoosh activation, dropout (mask shared along ``dropout_shared_dim``), then a linear layer, fused so that
    only the pre-activation input is stored for backward. Parameters are those of ``nn.Linear(in, out)``."""

    def __init__(self, in_channels: int, out_channels: int, activation: str = "SwooshL", dropout_p: FloatLike = 0.0,
                 dropout_shared_dim: int = 0, bias: bool = True, initial_scale: float = 1.0):
        super().__init__()
        if activation not in _SWOOSH:
            raise ValueError(f"activation must be one of {sorted(_SWOOSH)}, got {activation!r}")
        lin = scaled_linear(in_channels, out_channels, bias=bias, initial_scale=initial_scale)
        self.weight = lin.weight
        self.bias = lin.bias
        self.activation = activation
        self.dropout_p = dropout_p
        self.dropout_shared_dim = dropout_shared_dim

    def forward(self, x: Tensor) -> Tensor:
        p = schedule_value(self.dropout_p) if self.training else 0.0
        return act_dropout_linear(x, self.weight, self.bias, self.activation, p, self.dropout_shared_dim)


def act_dropout_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str,
                       dropout_p: Union[float, Tensor] = 0.0, dropout_shared_dim: int = 0) -> Tensor:
    """Functional form of :class:`ActivationDropoutAndLinear`: ``linear(dropout(swoosh(x)), weight, bias)``.
    ``dropout_p`` may be a 0-dim tensor (a moving schedule while compiling)."""
    mask = dropout_mask(x, dropout_p, dropout_shared_dim, compute_dtype(x))
    return _ActDropLinear.apply(x, weight, bias, activation, mask)
