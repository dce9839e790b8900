"""Zipformer-specific building blocks: scheduled values, Swoosh activations, BiasNorm, Balancer, Whiten.

Facts follow k2-fsa/icefall ``egs/librispeech/ASR/zipformer/scaling.py``; the code is ours. Differences:

* Every custom autograd function is autocast-device-agnostic: it reads the autocast state of the *tensor's*
  device (``torch.is_autocast_enabled(dev)`` / ``torch.get_autocast_dtype(dev)``), does its numerics with
  autocast off, and returns results in the input's (or the autocast) dtype. icefall uses CUDA-only decorators,
  which breaks CPU autocast and a whole-model bf16 cast.
* Swoosh is pure PyTorch (icefall calls k2). The derivative is stored as uint8 rounded to nearest
  (icefall/k2: random dither); the largest error is 1/510 of the derivative's 1.0 range.
* The attention-score penalty stores an int8 sign mask instead of the scores.
* BiasNorm clamps the mean square at 1e-20 (an all-zero frame would otherwise give 0 * inf = NaN).
* :class:`Linear` (an ``nn.Linear``) saves the fp32 weight, not autocast's low-precision copy of it, and
  re-casts it in backward (activation memory under AMP; same numerics).

Scheduled values (:class:`ScheduledFloat`) follow a batch count that the training loop writes with
:func:`set_batch_count` (or ``encoder.set_batch_count(n)``). Until it is written, every schedule returns its
``default``, as in icefall; in eval mode schedules always return their default.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
from typing import Iterator, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# ---------------------------------------------------------------------------------------------------------------
# autocast helpers


def _dev(x: Tensor) -> str:
    return x.device.type


def _up(x: Tensor) -> Tensor:
    """Promote half-precision tensors to fp32; fp32 and fp64 are left alone."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype a matmul on ``x`` would run in: the autocast dtype of x's device if enabled, else x.dtype."""
    dev = _dev(x)
    if dev in ("cpu", "cuda") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def _is_exporting() -> bool:
    """True inside ``torch.export`` (``torch.compiler.is_exporting``, missing from older torch versions)."""
    probe = getattr(torch.compiler, "is_exporting", None)
    return bool(probe()) if probe is not None else False


@contextlib.contextmanager
def autocast_off(x: Tensor) -> Iterator[None]:
    """Disable autocast for the device of ``x`` (a no-op on devices without autocast)."""
    dev = _dev(x)
    if dev in ("cpu", "cuda"):
        with torch.autocast(device_type=dev, enabled=False):
            yield
    else:
        yield


# ---------------------------------------------------------------------------------------------------------------
# scheduled values


class ScheduledFloat(nn.Module):
    """A float that is a piecewise-linear function of the training batch count.

    ``ScheduledFloat((0.0, 0.5), (4000.0, 0.02), default=0.0)`` goes from 0.5 at batch 0 to 0.02 at batch 4000
    and stays there. ``float(sf)`` returns ``default`` in eval mode or while ``batch_count`` is unset.
    It is an ``nn.Module`` (without parameters) so that ``model.train()/eval()`` and
    :func:`set_batch_count` reach it through ``model.modules()``.
    """

    def __init__(self, *points: Tuple[float, float], default: float = 0.0):
        super().__init__()
        if not points:
            raise ValueError("ScheduledFloat needs at least one (batch, value) point")
        pts = sorted((float(b), float(v)) for b, v in points)
        self.points = pts
        self.default = float(default)
        self.batch_count: Optional[float] = None

    def value_at(self, batch_count: float) -> float:
        pts = self.points
        if batch_count <= pts[0][0]:
            return pts[0][1]
        if batch_count >= pts[-1][0]:
            return pts[-1][1]
        for (x0, y0), (x1, y1) in zip(pts[:-1], pts[1:]):
            if x0 <= batch_count <= x1:
                return y0 + (batch_count - x0) / (x1 - x0) * (y1 - y0)
        raise AssertionError("unreachable")

    def __float__(self) -> float:
        if self.batch_count is None or not self.training:
            return self.default
        return self.value_at(self.batch_count)

    def extra_repr(self) -> str:
        return f"points={self.points}, default={self.default}, batch_count={self.batch_count}"


FloatLike = Union[float, ScheduledFloat]


def set_batch_count(model: nn.Module, batch_count: float) -> None:
    """Write ``batch_count`` into every :class:`ScheduledFloat` (and any module with a ``batch_count``)."""
    for m in model.modules():
        if hasattr(m, "batch_count"):
            m.batch_count = float(batch_count)


# ---------------------------------------------------------------------------------------------------------------
# small autograd helpers


class _LimitParamValue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, lo: float, hi: float) -> Tensor:
        ctx.save_for_backward(x)
        ctx.lo, ctx.hi = lo, hi
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        (x,) = ctx.saved_tensors
        # below the range, make every gradient push x up; above it, push x down.
        flip_lo = torch.logical_and(g > 0, x < ctx.lo)
        flip_hi = torch.logical_and(g < 0, x > ctx.hi)
        g = torch.where(torch.logical_or(flip_lo, flip_hi), -g, g)
        return g, None, None


def limit_param_value(x: Tensor, lo: float, hi: float, prob: float = 0.6, training: bool = True) -> Tensor:
    """Identity; in backward (on a random ``prob`` of calls) flips gradients that would push x out of [lo, hi]."""
    if training and random.random() < prob:
        return _LimitParamValue.apply(x, lo, hi)
    return x


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, alpha: float) -> Tensor:
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g * ctx.alpha, None


class ScaleGrad(nn.Module):
    """Identity forward; multiplies the gradient by ``alpha`` (keeps fp16 grads of the first conv in range)."""

    def __init__(self, alpha: float):
        super().__init__()
        self.alpha = alpha

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or not x.requires_grad:
            return x
        return _ScaleGrad.apply(x, self.alpha)


class _PenalizeAbsGt(torch.autograd.Function):
    """Identity; backward adds the gradient of ``penalty * relu(|x| - limit).sum()``."""

    @staticmethod
    def forward(ctx, x: Tensor, limit: float, penalty: float) -> Tensor:
        sign = torch.sign(x).to(torch.int8) * (x.abs() > limit).to(torch.int8)
        ctx.save_for_backward(sign)
        ctx.penalty = penalty
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        (sign,) = ctx.saved_tensors
        return g + (sign.to(g.dtype) * ctx.penalty), None, None


def penalize_abs_values_gt(x: Tensor, limit: float, penalty: float) -> Tensor:
    # Like icefall, the penalty gradient is not multiplied by the loss scale (its relative weight shifts with
    # the grad scale under fp16); it is a failsafe against implausible scores, not a regulariser.
    if not x.requires_grad:
        return x
    return _PenalizeAbsGt.apply(x, limit, penalty)


class _Softmax(torch.autograd.Function):
    """Softmax computed in fp32, output in the compute dtype, only the output saved for backward."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int) -> Tensor:
        out_dtype = compute_dtype(x)
        with autocast_off(x):
            y = _up(x).softmax(dim=dim).to(out_dtype)
        ctx.save_for_backward(y)
        ctx.dim, ctx.in_dtype = dim, x.dtype
        return y

    @staticmethod
    def backward(ctx, g: Tensor):
        (y,) = ctx.saved_tensors
        with autocast_off(y):
            yf = _up(y)
            gf = _up(g).to(yf.dtype)
            # y * (g - sum(g * y)), as one fused kernel
            gi = torch._softmax_backward_data(gf, yf, ctx.dim, yf.dtype)
        return gi.to(ctx.in_dtype), None


def softmax(x: Tensor, dim: int) -> Tensor:
    if not x.requires_grad:
        out_dtype = compute_dtype(x)
        with autocast_off(x):
            return _up(x).softmax(dim=dim).to(out_dtype)
    return _Softmax.apply(x, dim)


# ---------------------------------------------------------------------------------------------------------------
# Swoosh activations
#   SwooshL(x) = log(1 + e^(x-4)) - 0.08 x - 0.035
#   SwooshR(x) = log(1 + e^(x-1)) - 0.08 x - 0.313261687
#   derivative: sigmoid(x - offset) - 0.08, in (-0.08, 0.92): a range of width 1, stored as uint8.

_SWOOSH = {"SwooshL": (4.0, 0.035), "SwooshR": (1.0, 0.313261687)}
_DERIV_MIN = -0.08


def _swoosh_from_z(z: Tensor, kind: str) -> Tensor:
    # with z = x - offset: swoosh = softplus(z) - 0.08 z - (const + 0.08 offset); two of the passes in place
    offset, const = _SWOOSH[kind]
    return F.softplus(z).sub_(z, alpha=0.08).sub_(const + 0.08 * offset)


def _swoosh_fp32(xf: Tensor, kind: str) -> Tensor:
    return _swoosh_from_z(xf - _SWOOSH[kind][0], kind)


def _swoosh_deriv_fp32(xf: Tensor, kind: str) -> Tensor:
    offset, _ = _SWOOSH[kind]
    return torch.sigmoid(xf - offset).sub_(0.08)


class _SwooshFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, kind: str) -> Tensor:
        with autocast_off(x):
            z = _up(x) - _SWOOSH[kind][0]  # shared by the value and the derivative
            if ctx.needs_input_grad[0]:
                # d - _DERIV_MIN = sigmoid(x - offset) in [0, 1]: quantise it directly (no clamp needed);
                # + 0.5 then truncation in the uint8 cast = round half up
                ctx.save_for_backward(torch.sigmoid(z).mul_(255.0).add_(0.5).to(torch.uint8))
            y = _swoosh_from_z(z, kind)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, g: Tensor):
        (q,) = ctx.saved_tensors
        with autocast_off(g):
            gi = q.float().mul_(1.0 / 255.0).add_(_DERIV_MIN).mul_(g)
        return gi.to(g.dtype), None


def swoosh_l(x: Tensor) -> Tensor:
    """SwooshL(x) = log(1+e^(x-4)) - 0.08x - 0.035, computed in fp32, returned in x.dtype."""
    if not x.requires_grad:
        with autocast_off(x):
            return _swoosh_fp32(_up(x), "SwooshL").to(x.dtype)
    return _SwooshFunction.apply(x, "SwooshL")


def swoosh_r(x: Tensor) -> Tensor:
    """SwooshR(x) = log(1+e^(x-1)) - 0.08x - 0.313261687, computed in fp32, returned in x.dtype."""
    if not x.requires_grad:
        with autocast_off(x):
            return _swoosh_fp32(_up(x), "SwooshR").to(x.dtype)
    return _SwooshFunction.apply(x, "SwooshR")


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
    def forward(ctx, x, weight, bias, kind: str, p: float, shared_dim: int):
        cdtype = compute_dtype(x)
        with autocast_off(x):
            y = _swoosh_fp32(_up(x), kind)
            mask = None
            if p > 0.0:
                shape = list(x.shape)
                shape[shared_dim] = 1
                mask = ((torch.rand(shape, device=x.device) > p).to(cdtype)) * (1.0 / (1.0 - p))
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
        with autocast_off(x):
            z = _up(x) - _SWOOSH[ctx.kind][0]  # shared by the derivative and the recomputed activation
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
                gb = _up(g2).sum(dim=0).to(bias.dtype)
            if ctx.needs_input_grad[0]:
                gx = d.mul_(g @ weight.to(cdtype)).to(x.dtype)
        return gx, gw, gb, None, None, None


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
        p = float(self.dropout_p) if self.training else 0.0
        return act_dropout_linear(x, self.weight, self.bias, self.activation, p, self.dropout_shared_dim)


def act_dropout_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, dropout_p: float = 0.0,
                       dropout_shared_dim: int = 0) -> Tensor:
    """Functional form of :class:`ActivationDropoutAndLinear`: ``linear(dropout(swoosh(x)), weight, bias)``."""
    return _ActDropLinear.apply(x, weight, bias, activation, dropout_p, dropout_shared_dim)


class _AutocastLinear(torch.autograd.Function):
    """``F.linear`` in the autocast dtype that keeps no cast copy of the weight for backward.

    Under autocast, ``F.linear`` saves the low-precision copy of the weight it made (one per Linear per step, as
    many bytes as the model's Linear weights in that dtype). Here only the input (in the compute dtype, as
    autocast saves it) and the fp32 parameter itself are saved; backward casts the weight again. Same numerics as
    autocast: matmuls in the compute dtype, gradients returned in the parameters' dtype.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], cdtype: torch.dtype) -> Tensor:
        with autocast_off(x):
            xc = x.to(cdtype)
            out = F.linear(xc, weight.to(cdtype), None if bias is None else bias.to(cdtype))
        ctx.save_for_backward(xc, weight)
        ctx.has_bias, ctx.x_dtype = bias is not None, x.dtype
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        xc, weight = ctx.saved_tensors
        gx = gw = gb = None
        with autocast_off(g):
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
    dev = _dev(x)
    if dev in ("cpu", "cuda") and torch.is_autocast_enabled(dev) and torch.is_grad_enabled() \
            and (x.requires_grad or weight.requires_grad):
        cdtype = torch.get_autocast_dtype(dev)
        if weight.dtype != cdtype:
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


# ---------------------------------------------------------------------------------------------------------------
# BiasNorm


class _BiasNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, bias: Tensor, log_scale: Tensor, channel_dim: int) -> Tensor:
        with autocast_off(x):
            out = _bias_norm_fp32(x, bias, log_scale, channel_dim).to(x.dtype)
        # under autocast keep the recompute input in the autocast dtype (halves what BiasNorm holds; the
        # statistics are still recomputed in fp32)
        ctx.save_for_backward(x.to(compute_dtype(x)), bias, log_scale)
        ctx.x_dtype = x.dtype
        ctx.channel_dim = channel_dim
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        x, bias, log_scale = ctx.saved_tensors
        with torch.enable_grad(), autocast_off(x):
            xf = _up(x.detach()).requires_grad_(True)
            bf = _up(bias.detach()).requires_grad_(True)
            lf = _up(log_scale.detach()).requires_grad_(True)
            out = _bias_norm_fp32(xf, bf, lf, ctx.channel_dim)
            gx, gb, gl = torch.autograd.grad(out, (xf, bf, lf), _up(g))
        return gx.to(ctx.x_dtype), gb.to(bias.dtype), gl.to(log_scale.dtype), None


def _bias_norm_fp32(x: Tensor, bias: Tensor, log_scale: Tensor, channel_dim: int) -> Tensor:
    xf = _up(x)
    cd = channel_dim % x.ndim
    shape = [1] * x.ndim
    shape[cd] = -1
    b = _up(bias).to(xf.dtype).reshape(shape)
    ms = ((xf - b) ** 2).mean(dim=cd, keepdim=True).clamp(min=1e-20)
    return xf * ms.rsqrt() * _up(log_scale).to(xf.dtype).exp()


class BiasNorm(nn.Module):
    """LayerNorm replacement: ``x * exp(log_scale) / RMS(x - bias)`` over the channel dim.

    The per-channel bias only enters the RMS; ``log_scale`` is a scalar kept in [-1.5, 1.5] during training.
    Statistics in fp32 (an fp32 island), output in x's dtype; backward recomputes from the stored input.
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
        if not torch.is_grad_enabled():
            with autocast_off(x):
                return _bias_norm_fp32(x, self.bias, log_scale, self.channel_dim).to(x.dtype)
        return _BiasNormFunction.apply(x, self.bias, log_scale, self.channel_dim)


# ---------------------------------------------------------------------------------------------------------------
# Balancer


def _abs_to_rms(v: float) -> float:
    # for Gaussian data, E|x| = v  ->  rms = sqrt(pi/2) * v
    return 1.25331413732 * v


def _proportion_positive_to_mean(p: float) -> float:
    # mean/stddev such that P(x > 0) = p for Gaussian data: sqrt(2)*erfinv(2p-1), approximated as in icefall
    # (0.8139535143 * atanh) so the limits match its behaviour.
    z = -1.0 + 2.0 * p
    eps = 1.0e-10
    return 0.8139535143 * (math.log(1 + z + eps) - math.log(1 - z + eps)) / 2.0


class _BalancerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, limits: Tuple[float, float, float, float], grad_scale: float, channel_dim: int):
        ctx.save_for_backward(x.to(compute_dtype(x)))  # statistics only: the autocast dtype is precise enough
        ctx.config = (limits, grad_scale, channel_dim)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        (x,) = ctx.saved_tensors
        limits, grad_scale, channel_dim = ctx.config
        try:
            with autocast_off(x):
                g = balancer_grad(x, g, limits, grad_scale, channel_dim)
        except Exception as e:  # pragma: no cover - mirrors icefall: never let a regulariser kill training
            logging.info("Balancer backward failed (%s); passing the gradient through", e)
        return g, None, None, None


def balancer_grad(x: Tensor, g: Tensor, limits: Tuple[float, float, float, float], grad_scale: float,
                  channel_dim: int) -> Tensor:
    """The Balancer's backward: ``g + |g| * grad_scale * lg / rms(lg)`` (rms per channel), where lg is the
    gradient w.r.t. x of ``sum_c |m_c - clamp(m_c, min_mean, max_mean)| + |log(clamp(r_c, min_rms, max_rms) / r_c)|``
    with m_c = mean/stddev and r_c = RMS of channel c (icefall scaling.py ``BalancerFunction``).

    icefall gets lg by running autograd through those statistics (~20 passes over x). Per channel lg is affine in
    x, lg = A + B x, so it is written out here (4 elementwise passes plus two per-channel means):
    with N elements per channel, s_m = sign of the mean violation, s_r = sign of the RMS violation,
    dL/dmean = s_m (1 + m^2) / std and dL/d(mean x^2) = -s_m m / (2 std^2) + s_r / (2 rms^2), so
    N lg = s_m (1 + m^2) / std + (-s_m m / std^2 + s_r / rms^2) x = s_m (1 - m y) / std + s_r x / rms^2 with
    y = (x - mean) / std. N cancels against rms(lg), and since mean(y) = 0, mean(y^2) = 1 and
    mean((1 - m y) x) = 0, N^2 rms(lg)^2 = s_m^2 (1 + m^2) / std^2 + s_r^2 / rms^2 (no extra pass). fp32 statistics.
    """
    min_mean, max_mean, min_rms, max_rms = limits
    xf = _up(x)
    cd = channel_dim % x.ndim
    dims = [i for i in range(x.ndim) if i != cd]
    # two plain reductions: torch.var_mean (Welford) is ~10x slower on CPU than mean and mean of squares
    mean = xf.mean(dim=dims, keepdim=True)
    msq = (xf * xf).mean(dim=dims, keepdim=True).clamp(min=1e-20)
    var = (msq - mean * mean).clamp(min=1e-20)
    std, rms = var.sqrt(), msq.sqrt()
    m = mean / std
    s_m = (m > max_mean).to(m.dtype) - (m < min_mean).to(m.dtype)
    s_r = (rms > max_rms).to(m.dtype) - (rms < min_rms).to(m.dtype)
    a = s_m * (1.0 + m * m) / std
    b = s_r / msq - s_m * m / var
    lg_ms = s_m.abs() * (1.0 + m * m) / var + s_r.abs() / msq
    # channels within their limits have a = b = 0 and get no extra term
    k = torch.where(lg_ms > 0, grad_scale * lg_ms.clamp(min=1e-30).rsqrt(), torch.zeros_like(lg_ms))
    gf = _up(g)
    return gf.addcmul(gf.abs(), torch.addcmul(a * k, b * k, xf)).to(g.dtype)


class Balancer(nn.Module):
    """Identity in forward; on a random fraction ``prob`` of training calls its backward adds a small gradient
    term (``grad_scale`` times |grad|) that pushes each channel's mean/std ratio and RMS into the bounds implied by
    ``min/max_positive`` and ``min/max_abs``. (icefall scaling.py ``Balancer``.)"""

    def __init__(self, num_channels: int, channel_dim: int, min_positive: FloatLike = 0.05,
                 max_positive: FloatLike = 0.95, min_abs: FloatLike = 0.2, max_abs: FloatLike = 100.0,
                 grad_scale: FloatLike = 0.04, prob: Optional[FloatLike] = None):
        super().__init__()
        if prob is None:
            prob = ScheduledFloat((0.0, 0.5), (8000.0, 0.125), default=0.4)
        self.num_channels, self.channel_dim = num_channels, channel_dim
        self.min_positive, self.max_positive = min_positive, max_positive
        self.min_abs, self.max_abs = min_abs, max_abs
        self.grad_scale, self.prob = grad_scale, prob

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or not x.requires_grad or random.random() >= float(self.prob):
            return x
        limits = (_proportion_positive_to_mean(float(self.min_positive)),
                  _proportion_positive_to_mean(float(self.max_positive)),
                  _abs_to_rms(float(self.min_abs)), _abs_to_rms(float(self.max_abs)))
        return _BalancerFunction.apply(x, limits, float(self.grad_scale), self.channel_dim)


# ---------------------------------------------------------------------------------------------------------------
# Whiten


def whitening_metric(x: Tensor, num_groups: int) -> Tensor:
    """>= 1; equals 1 when the (centred) channel covariance within each group is a multiple of the identity."""
    x = x.reshape(-1, x.shape[-1])
    n, c = x.shape
    cpg = c // num_groups
    x = x.reshape(n, num_groups, cpg).transpose(0, 1)
    x = x - x.mean(dim=1, keepdim=True)
    cov = torch.matmul(x.transpose(1, 2), x)
    mean_diag = torch.diagonal(cov, dim1=1, dim2=2).mean()
    covsq_mean_diag = (cov ** 2).sum() / (num_groups * cpg)
    return covsq_mean_diag / (mean_diag ** 2 + 1e-20)


class _WhitenFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, module: "Whiten") -> Tensor:
        ctx.save_for_backward(x.to(compute_dtype(x)))  # statistics only
        ctx.module = module
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        (x,) = ctx.saved_tensors
        w = ctx.module
        try:
            with torch.enable_grad(), autocast_off(x):
                xf = x.detach().float().requires_grad_(True)
                metric = whitening_metric(xf, w.num_groups)
                if metric.item() < float(w.whitening_limit):
                    w.prob = w.min_prob
                    return g, None
                w.prob = w.max_prob
                (pg,) = torch.autograd.grad(metric, xf)
                scale = w.grad_scale * (g.float().norm() / (pg.norm() + 1e-20))
                return (g.float() + pg * scale).to(g.dtype), None
        except Exception as e:  # pragma: no cover
            logging.info("Whiten backward failed (%s); passing the gradient through", e)
            return g, None


class Whiten(nn.Module):
    """Identity in forward; in backward (with probability between ``prob[0]`` and ``prob[1]``, raised while the
    limit is exceeded) adds the gradient of the whitening metric, scaled to ``grad_scale`` times |grad|, when the
    metric is above ``whitening_limit``. (icefall scaling.py ``Whiten``.)"""

    def __init__(self, num_groups: int, whitening_limit: FloatLike, prob: Tuple[float, float], grad_scale: float):
        super().__init__()
        self.num_groups = num_groups
        self.whitening_limit = whitening_limit
        self.min_prob, self.max_prob = prob
        self.prob = self.max_prob
        self.grad_scale = grad_scale

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or not x.requires_grad or self.grad_scale == 0 or random.random() > self.prob:
            return x
        if x.shape[-1] % self.num_groups != 0:
            raise ValueError(f"Whiten: {x.shape[-1]} channels not divisible into {self.num_groups} groups")
        return _WhitenFunction.apply(x, self)


def whitening_schedule(x: float, ratio: float = 2.0) -> ScheduledFloat:
    return ScheduledFloat((0.0, x), (20000.0, ratio * x), default=x)


# ---------------------------------------------------------------------------------------------------------------
# dropout variants and small utilities


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


def convert_num_channels(x: Tensor, num_channels: int) -> Tensor:
    """Truncate or zero-pad the last dim of x to ``num_channels``."""
    c = x.shape[-1]
    if num_channels <= c:
        return x[..., :num_channels]
    pad = torch.zeros(*x.shape[:-1], num_channels - c, dtype=x.dtype, device=x.device)
    return torch.cat((x, pad), dim=-1)


class ChunkCausalDepthwiseConv1d(nn.Module):
    """Depthwise Conv1d usable in chunked streaming: a causal conv over the left half of the kernel plus a
    full-kernel conv applied within each chunk (so nothing right of the chunk is seen), scaled by learned
    per-position corrections near chunk edges. (icefall scaling.py ``ChunkCausalDepthwiseConv1d``.)

    Input/output (B, C, T)."""

    def __init__(self, channels: int, kernel_size: int, initial_scale: float = 1.0, bias: bool = True):
        super().__init__()
        if kernel_size % 2 != 1:
            raise ValueError(f"kernel_size must be odd, got {kernel_size}")
        half = (kernel_size + 1) // 2
        self.causal_conv = nn.Conv1d(channels, channels, groups=channels, kernel_size=half, bias=True)
        self.chunkwise_conv = nn.Conv1d(channels, channels, groups=channels, kernel_size=kernel_size,
                                        padding=kernel_size // 2, bias=bias)
        # row 0: corrections near the chunk's left edge; row 1: near its right edge (added to a scale of 1).
        self.chunkwise_conv_scale = nn.Parameter(torch.zeros(2, channels, kernel_size))
        self.kernel_size = kernel_size
        with torch.no_grad():
            self.causal_conv.weight.mul_(initial_scale)
            self.chunkwise_conv.weight.mul_(initial_scale)
            nn.init.uniform_(self.causal_conv.bias, -0.1 * initial_scale, 0.1 * initial_scale)

    def _chunk_scale(self, chunk_size: int, dtype: torch.dtype) -> Tensor:
        left, right = self.chunkwise_conv_scale[0], self.chunkwise_conv_scale[1]
        k = self.kernel_size
        if chunk_size < k:
            left, right = left[:, :chunk_size], right[:, -chunk_size:]
        else:
            pad = torch.zeros(left.shape[0], chunk_size - k, device=left.device, dtype=left.dtype)
            left, right = torch.cat((left, pad), dim=-1), torch.cat((pad, right), dim=-1)
        return (1.0 + left + right).to(dtype)

    def forward(self, x: Tensor, chunk_size: int = -1) -> Tensor:
        b, c, t = x.shape
        left_pad = self.kernel_size // 2
        if chunk_size < 0 or chunk_size > t:
            chunk_size = t
        right_pad = -t % chunk_size
        x = F.pad(x, (left_pad, right_pad))
        x_causal = self.causal_conv(x[..., : left_pad + t])
        xc = x[..., left_pad:]
        n = xc.shape[2] // chunk_size
        xc = xc.reshape(b, c, n, chunk_size).permute(0, 2, 1, 3).reshape(b * n, c, chunk_size)
        xc = self.chunkwise_conv(xc)
        xc = xc * self._chunk_scale(chunk_size, xc.dtype)
        xc = xc.reshape(b, n, c, chunk_size).permute(0, 2, 1, 3).reshape(b, c, n * chunk_size)[..., :t]
        return xc + x_causal

    def streaming_forward(self, x: Tensor, cache: Tensor) -> Tuple[Tensor, Tensor]:
        """One whole chunk x (B, C, T) after ``cache`` (B, C, kernel_size // 2), the frames just before it.

        Returns the same (B, C, T) as :meth:`forward` gives for this chunk inside a longer input, and the new
        cache: the last kernel_size // 2 frames of cache + x."""
        left_pad = self.kernel_size // 2
        x_full = torch.cat((cache.to(x.dtype), x), dim=2)
        x_causal = self.causal_conv(x_full)
        xc = self.chunkwise_conv(x) * self._chunk_scale(x.shape[2], x.dtype)
        return xc + x_causal, x_full[..., x_full.shape[2] - left_pad:]


class _BypassFunction(torch.autograd.Function):
    """out = src_orig + (src - src_orig) * scale, saving the difference in the compute dtype (not fp32 under
    autocast) and the scale; used by BypassModule (icefall computes it with plain ops, which keep an fp32 copy)."""

    @staticmethod
    def forward(ctx, src_orig: Tensor, src: Tensor, scale: Tensor) -> Tensor:
        diff = src - src_orig
        out = src_orig + diff * scale
        ctx.save_for_backward(diff.to(compute_dtype(src)), scale)
        ctx.dtypes = (src_orig.dtype, src.dtype)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        diff, scale = ctx.saved_tensors
        g_orig = g_src = g_scale = None
        with autocast_off(g):
            gs = g * scale.to(g.dtype)
            if ctx.needs_input_grad[1]:
                g_src = gs.to(ctx.dtypes[1])
            if ctx.needs_input_grad[0]:
                g_orig = (g - gs).to(ctx.dtypes[0])
            if ctx.needs_input_grad[2]:
                prod = _up(g) * _up(diff).to(_up(g).dtype)
                dims = tuple(range(prod.ndim - scale.ndim))
                if scale.ndim == 2:  # (B, C) against (T, B, C)
                    dims = (0,)
                g_scale = prod.sum(dim=dims).to(scale.dtype)
        return g_orig, g_src, g_scale


def bypass(src_orig: Tensor, src: Tensor, scale: Tensor) -> Tensor:
    if not torch.is_grad_enabled():
        return src_orig + (src - src_orig) * scale
    return _BypassFunction.apply(src_orig, src, scale)
