"""Building blocks of the "reworked" Conformer: scaled layers, BasicNorm, ActivationBalancer, DoubleSwish.

Follows the ideas of Dan Povey's k2-fsa/icefall
``egs/librispeech/ASR/pruned_transducer_stateless2/scaling.py`` (our own code; facts and formulas from
there), with one deliberate change: everything here is *device- and dtype-agnostic*. icefall decorates
its custom functions with CUDA-only autocast decorators, so they break under CPU autocast and under a
whole-model bf16 cast (``torch.cuda.amp.custom_fwd`` covers CUDA autocast only). Here

* statistics (BasicNorm's mean square, ActivationBalancer's per-channel statistics, DoubleSwish's
  derivative) are computed in fp32 islands (:mod:`asrprec.precision.islands`: autocast off on CPU *and* CUDA);
* every result, forward or backward, is returned in the dtype that came in (a bf16 tensor stays bf16,
  a float64 tensor stays float64 so ``gradcheck`` works).

Public names (stable):

``ScaledLinear``, ``ScaledConv1d``, ``ScaledConv2d``  layers whose every parameter tensor has a trainable
    scalar log-scale: effective weight = ``weight * exp(weight_scale)``, bias likewise.
``BasicNorm``           y = x * (mean(x^2) + exp(eps))^-1/2 over the channel dim, eps trainable, in log space.
``ActivationBalancer``  identity forward; backward nudges per-channel sign proportion and mean |x|.
``DoubleSwish``         x * sigmoid(x - 1), memory-lean (saves only its derivative, computed in forward).
``double_swish``        the functional form.

The model warm-up value these layers are driven with (instead of icefall's later ``ScheduledFloat``) is
:func:`asrprec.models.schedule.warmup_fraction`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from asrprec.models.tracing import is_tracing
from asrprec.precision.islands import fp32_island, upcast

__all__ = [
    "ScaledLinear",
    "ScaledConv1d",
    "ScaledConv2d",
    "BasicNorm",
    "ActivationBalancer",
    "DoubleSwish",
    "double_swish",
]


# ---------------------------------------------------------------------------------------------------
# Scaled layers
# ---------------------------------------------------------------------------------------------------


def _init_scaled(module: nn.Module, initial_scale: float) -> None:
    """Shared initialisation of a scaled layer (icefall pruned_transducer_stateless2/scaling.py).

    The raw weight is drawn uniform with std 0.1 (an RMS the ScaledAdam-style optimizer keeps roughly
    constant); the log-scale carries the magnitude, so that the *effective* weight has std
    ``initial_scale / sqrt(fan_in)`` like a default-initialised layer times ``initial_scale``.
    Biases start at zero with log-scale ``log(initial_scale)``.
    """
    if initial_scale <= 0:
        raise ValueError(f"initial_scale must be > 0, got {initial_scale}")
    weight: Tensor = module.weight  # type: ignore[assignment]
    std = 0.1
    fan_in = weight[0].numel()  # in_features (Linear) or in_channels/groups * kernel volume (Conv)
    with torch.no_grad():
        nn.init.uniform_(weight, -math.sqrt(3.0) * std, math.sqrt(3.0) * std)
        log_scale = math.log(initial_scale) + math.log(fan_in**-0.5 / std)
    module.weight_scale = nn.Parameter(torch.tensor(log_scale, dtype=weight.dtype, device=weight.device))
    if module.bias is not None:  # type: ignore[attr-defined]
        with torch.no_grad():
            module.bias.zero_()  # type: ignore[attr-defined]
        bias_log_scale = torch.tensor(math.log(initial_scale), dtype=weight.dtype, device=weight.device)
        module.bias_scale = nn.Parameter(bias_log_scale)
    else:
        module.register_parameter("bias_scale", None)


def _scaled(param: Tensor, log_scale: Tensor) -> Tensor:
    # exp() of the scalar in at least fp32 (a bf16 exp would round the scale to ~3 digits), then back
    # to the parameter's dtype so that a whole-model bf16 cast keeps bf16 weights.
    return param * upcast(log_scale).exp().to(param.dtype)


class _ScaledMixin:
    weight: Tensor
    bias: Tensor | None
    weight_scale: nn.Parameter
    bias_scale: nn.Parameter | None

    def get_weight(self) -> Tensor:
        """The effective weight ``weight * exp(weight_scale)``."""
        return _scaled(self.weight, self.weight_scale)

    def get_bias(self) -> Tensor | None:
        """The effective bias ``bias * exp(bias_scale)``, or None when the layer has no bias."""
        if self.bias is None or self.bias_scale is None:
            return None
        return _scaled(self.bias, self.bias_scale)


class ScaledLinear(_ScaledMixin, nn.Linear):
    """``nn.Linear`` with trainable scalar log-scales: y = x W'^T + b'.

    W' = W·exp(weight_scale), b' = b·exp(bias_scale); the scales are 0-dim parameters.

    Args:
        in_features, out_features, bias: as ``nn.Linear``.
        initial_scale: multiplies the initial effective weight (and sets the bias scale); e.g. 0.25 for
            output projections feeding a residual, so that new layers start small.

    Shapes: input (..., in_features) -> output (..., out_features).
    Parameters: in·out + out (bias) + 1 (weight_scale) + 1 (bias_scale, when bias).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, initial_scale: float = 1.0,
                 device=None, dtype=None) -> None:
        nn.Linear.__init__(self, in_features, out_features, bias=bias, device=device, dtype=dtype)
        _init_scaled(self, initial_scale)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.get_weight(), self.get_bias())


class ScaledConv1d(_ScaledMixin, nn.Conv1d):
    """``nn.Conv1d`` with trainable scalar log-scales on weight and bias (see :class:`ScaledLinear`).

    Accepts ``nn.Conv1d``'s arguments plus keyword ``initial_scale``.
    Shapes: input (B, C_in, T) -> output (B, C_out, T_out).
    """

    def __init__(self, *args, initial_scale: float = 1.0, **kwargs) -> None:
        nn.Conv1d.__init__(self, *args, **kwargs)
        _init_scaled(self, initial_scale)

    def forward(self, x: Tensor) -> Tensor:
        return self._conv_forward(x, self.get_weight(), self.get_bias())


class ScaledConv2d(_ScaledMixin, nn.Conv2d):
    """``nn.Conv2d`` with trainable scalar log-scales on weight and bias (see :class:`ScaledLinear`).

    Accepts ``nn.Conv2d``'s arguments plus keywords ``initial_scale`` and ``channels_last``.
    With ``channels_last=True`` the effective weight is laid out channels-last, so the output is too
    (the same values; only the memory layout differs): on CPU, oneDNN runs the Conformer's Conv2d front-end's
    forward+backward about 12 % faster so.
    The stored parameter keeps the default layout, so checkpoints do not depend on the flag.
    Shapes: input (B, C_in, H, W) -> output (B, C_out, H_out, W_out).
    """

    def __init__(self, *args, initial_scale: float = 1.0, channels_last: bool = False, **kwargs) -> None:
        nn.Conv2d.__init__(self, *args, **kwargs)
        _init_scaled(self, initial_scale)
        self.channels_last = channels_last

    def forward(self, x: Tensor) -> Tensor:
        weight = self.get_weight()
        if self.channels_last:
            weight = weight.contiguous(memory_format=torch.channels_last)
        return self._conv_forward(x, weight, self.get_bias())


# ---------------------------------------------------------------------------------------------------
# BasicNorm
# ---------------------------------------------------------------------------------------------------


class BasicNorm(nn.Module):
    """LayerNorm replacement without mean subtraction and with a large, trainable epsilon.

    y = x · (mean_c(x²) + exp(eps))^(−½), the mean taken over the channel dim ``channel_dim``.

    Why (icefall pruned_transducer_stateless2/scaling.py): pre-norm Transformers learn to park one
    channel at a large constant to "defeat" LayerNorm; making that ballast an explicit trainable
    epsilon (kept in log space, so it stays positive) lets the network do it without wasting a channel.
    There is no per-channel weight or bias: the surrounding scaled layers carry magnitudes.

    The statistics are computed in float32 with autocast off (an fp32 island); the result is returned
    in the input's dtype.

    Args:
        num_channels: size of the channel dim (checked).
        channel_dim: which dim holds the channels (negative counts from the end).
        eps: initial epsilon (not its log); 0.25 as in icefall.
        learn_eps: if False, eps is a fixed buffer.

    Shapes: x (..., C, ...) with C at ``channel_dim`` -> same shape and dtype.
    """

    def __init__(self, num_channels: int, channel_dim: int = -1, eps: float = 0.25, learn_eps: bool = True) -> None:
        super().__init__()
        if eps <= 0:
            raise ValueError(f"BasicNorm eps must be > 0 (it is stored as log(eps)), got {eps}")
        self.num_channels = num_channels
        self.channel_dim = channel_dim
        log_eps = torch.tensor(math.log(eps))
        if learn_eps:
            self.eps = nn.Parameter(log_eps)
        else:
            self.register_buffer("eps", log_eps)

    @fp32_island(output="input")
    def forward(self, x: Tensor) -> Tensor:
        if x.shape[self.channel_dim] != self.num_channels:
            raise ValueError(
                f"BasicNorm expected {self.num_channels} channels at dim {self.channel_dim}, "
                f"got shape {tuple(x.shape)}"
            )
        eps = self.eps.to(x.dtype).exp()
        scales = (x.pow(2).mean(dim=self.channel_dim, keepdim=True) + eps).rsqrt()
        return x * scales

    def extra_repr(self) -> str:
        return f"{self.num_channels}, channel_dim={self.channel_dim}"


# ---------------------------------------------------------------------------------------------------
# ActivationBalancer
# ---------------------------------------------------------------------------------------------------


class _ActivationBalancerFunction(torch.autograd.Function):
    """Identity forward; backward subtracts |grad|·(per-channel factor) (icefall ActivationBalancerFunction).

    Statistics are taken in forward (only a bool sign mask and per-channel factors are saved, not x),
    in float32 with autocast off; the backward also runs in float32 and returns the incoming dtype.
    """

    @staticmethod
    def forward(ctx, x: Tensor, channel_dim: int, min_positive: float, max_positive: float,
                max_factor: float, min_abs: float, max_abs: float, scale: Tensor | None = None) -> Tensor:
        with fp32_island():
            xf = upcast(x.detach())
            sum_dims = [d for d in range(x.ndim) if d != channel_dim]
            x_pos = xf > 0
            prop_pos = x_pos.to(xf.dtype).mean(dim=sum_dims, keepdim=True)
            # sign constraint: factor > 0 pushes values up (too few positive), < 0 pushes them down.
            factor = torch.zeros_like(prop_pos)
            if min_positive > 0.0:
                factor = factor + (min_positive - prop_pos).clamp(min=0) * (max_factor / min_positive)
            if max_positive < 1.0:
                factor = factor - (prop_pos - max_positive).clamp(min=0) * (max_factor / (1.0 - max_positive))
            # magnitude constraint: +1 where mean|x| is too small (grow |x|), -1 where too large.
            mean_abs = xf.abs().mean(dim=sum_dims, keepdim=True)
            direction = (mean_abs < min_abs).to(xf.dtype) - (mean_abs > max_abs).to(xf.dtype)
            if scale is not None:  # traced: the draw as a 0/1 factor
                factor, direction = factor * scale, direction * scale
        ctx.save_for_backward(x_pos, factor, direction)
        ctx.max_factor = max_factor
        # Return a new tensor object (a view), as autograd.Function outputs must not alias un-tracked inputs.
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x_pos, factor, direction = ctx.saved_tensors
        with fp32_island():
            g = grad.to(factor.dtype)
            # sign of x times direction: moves positive values up and negative values down when |x| must grow.
            magnitude = direction * (x_pos.to(g.dtype) * 2.0 - 1.0) * ctx.max_factor
            new_grad = g - g.abs() * (factor + magnitude)
        return new_grad.to(grad.dtype), None, None, None, None, None, None, None


class ActivationBalancer(nn.Module):
    """Identity in forward; in backward shapes gradients so each channel's statistics stay in bounds.

    For each channel c (statistics over every dim except ``channel_dim``):

    * if the proportion of positive values p_c < ``min_positive``, the gradient g becomes
      g − |g|·max_factor·(min_positive − p_c)/min_positive (a descent step then raises values);
      symmetrically above ``max_positive``;
    * if mean|x_c| < ``min_abs``, g becomes g − |g|·max_factor·sign(x) (|x| grows); if > ``max_abs``,
      g + |g|·max_factor·sign(x) (|x| shrinks).

    So gradients change by at most a factor (1 ± 2·max_factor). As in icefall (pruned_transducer_stateless2
    and later recipes) the correction is applied only on a random fraction ``prob`` of training calls,
    which keeps its cost low; in eval mode, when x does not require grad, or when the draw fails the
    module is a plain identity with no autograd node. The random draw uses torch's CPU generator (no
    device sync; reproducible under ``torch.manual_seed``).

    Works for any device and any floating dtype: statistics and the backward are computed in float32
    with autocast off, and the gradient is returned in the incoming gradient's dtype.

    Args:
        channel_dim: the channel dim (negative counts from the end).
        min_positive, max_positive: bounds on the per-channel proportion of x > 0.
        max_factor: strength of the correction (icefall: 0.01).
        min_abs, max_abs: bounds on per-channel mean |x|.
        prob: probability of applying the correction on a training call.

    Shapes: x (..., C, ...) -> the same tensor values.
    """

    def __init__(self, channel_dim: int, min_positive: float = 0.05, max_positive: float = 0.95,
                 max_factor: float = 0.01, min_abs: float = 0.2, max_abs: float = 100.0, prob: float = 0.25) -> None:
        super().__init__()
        if not 0.0 <= min_positive <= max_positive <= 1.0:
            raise ValueError(f"need 0 <= min_positive <= max_positive <= 1, got {min_positive}, {max_positive}")
        if not 0.0 <= min_abs <= max_abs:
            raise ValueError(f"need 0 <= min_abs <= max_abs, got {min_abs}, {max_abs}")
        if not 0.0 <= prob <= 1.0:
            raise ValueError(f"prob must be in [0, 1], got {prob}")
        self.channel_dim = channel_dim
        self.min_positive = min_positive
        self.max_positive = max_positive
        self.max_factor = max_factor
        self.min_abs = min_abs
        self.max_abs = max_abs
        self.prob = prob

    def forward(self, x: Tensor) -> Tensor:
        if not (self.training and x.requires_grad and torch.is_grad_enabled()) or self.prob <= 0.0:
            return x
        channel_dim = self.channel_dim % x.ndim
        if self.prob < 1.0:
            draw = torch.rand((), device="cpu")
            if is_tracing():
                # no branch on the draw in a graph: always attach the function, with the correction scaled by the
                # draw (0 leaves the gradient exactly as it is)
                scale = (draw.to(torch.float64) < self.prob).to(torch.float32)
                return _ActivationBalancerFunction.apply(x, channel_dim, self.min_positive, self.max_positive,
                                                         self.max_factor, self.min_abs, self.max_abs, scale)
            if float(draw) >= self.prob:
                return x
        return _ActivationBalancerFunction.apply(x, channel_dim, self.min_positive, self.max_positive,
                                                 self.max_factor, self.min_abs, self.max_abs)

    def extra_repr(self) -> str:
        return (f"channel_dim={self.channel_dim}, positive=[{self.min_positive}, {self.max_positive}], "
                f"abs=[{self.min_abs}, {self.max_abs}], max_factor={self.max_factor}, prob={self.prob}")


# ---------------------------------------------------------------------------------------------------
# DoubleSwish
# ---------------------------------------------------------------------------------------------------


class _DoubleSwishFunction(torch.autograd.Function):
    """x·sigmoid(x−1); the derivative is computed in forward (fp32) and saved instead of x.

    With s = sigmoid(x − 1) and y = x·s, y' = s + x·s·(1 − s) = s·(1 + x − y), so forward costs three
    extra in-place passes and backward is one multiply (about half the time of recomputing the
    sigmoid in backward; measured on CPU, tests/models/test_scaling.py checks the value with gradcheck).
    The derivative is stored in x's dtype (a bf16 derivative errs by 2^-9 relative; icefall's later
    DoubleSwish keeps only 8 bits of it). Memory is unchanged: the derivative replaces x.
    """

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        with fp32_island():
            xf = upcast(x)
            s = torch.sigmoid(xf - 1.0)
            y = xf * s
            if ctx.needs_input_grad[0]:
                deriv = xf - y
                deriv.add_(1.0).mul_(s)
                ctx.save_for_backward(deriv.to(x.dtype))
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (deriv,) = ctx.saved_tensors
        return grad * deriv  # autograd hands in a gradient of y's dtype, which is x's (and deriv's)


def double_swish(x: Tensor) -> Tensor:
    """DoubleSwish(x) = x·sigmoid(x − 1) (≈ swish(swish(x))); computed in fp32, returned in x's dtype."""
    if torch.jit.is_scripting() or torch.jit.is_tracing():
        return x * torch.sigmoid(x - 1.0)
    return _DoubleSwishFunction.apply(x)


class DoubleSwish(nn.Module):
    """Module form of :func:`double_swish`. Shapes: any -> same shape and dtype."""

    def forward(self, x: Tensor) -> Tensor:
        return double_swish(x)
