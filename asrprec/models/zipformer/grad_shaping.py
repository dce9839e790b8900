"""Zipformer gradient shaping: modules that are the identity in forward and adjust the gradient in backward.

:class:`Balancer` keeps per-channel statistics in bounds, :class:`Whiten` keeps the channel covariance close to
white, :func:`limit_param_value` keeps a parameter in a range, :func:`penalize_abs_values_gt` penalises large
values, :class:`ScaleGrad` scales the gradient. Facts follow k2-fsa/icefall ``egs/librispeech/ASR/zipformer/
scaling.py``; the code is ours. Differences: the statistics run in an fp32 island on CPU and CUDA alike
(:mod:`asrprec.precision.islands`), the Balancer's gradient is written out in closed form (:func:`balancer_grad`),
and the attention-score penalty stores an int8 sign mask instead of the scores.
"""

from __future__ import annotations

import logging
import math
import random
from typing import Optional, Tuple, Union

import torch
from torch import Tensor, nn

from asrprec.precision.islands import compute_dtype, fp32_island, upcast

from ..schedule import FloatLike, ScheduledFloat, schedule_value
from ..tracing import is_tracing, random_below

__all__ = ["Balancer", "ScaleGrad", "Whiten", "balancer_grad", "limit_param_value", "penalize_abs_values_gt",
           "whitening_metric", "whitening_schedule"]


class _LimitParamValue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, lo: float, hi: float, apply: Optional[Tensor] = None) -> Tensor:
        ctx.save_for_backward(x, apply)
        ctx.lo, ctx.hi = lo, hi
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        x, apply = ctx.saved_tensors
        # below the range, make every gradient push x up; above it, push x down.
        flip_lo = torch.logical_and(g > 0, x < ctx.lo)
        flip_hi = torch.logical_and(g < 0, x > ctx.hi)
        flip = torch.logical_or(flip_lo, flip_hi)
        if apply is not None:  # traced: the call's draw as a mask
            flip = torch.logical_and(flip, apply)
        g = torch.where(flip, -g, g)
        return g, None, None, None


def limit_param_value(x: Tensor, lo: FloatLike, hi: FloatLike, prob: float = 0.6, training: bool = True) -> Tensor:
    """Identity; in backward (on a random ``prob`` of calls) flips gradients that would push x out of [lo, hi]."""
    if not training:
        return x
    if is_tracing():
        # the same draw, applied in backward as a mask rather than by a Python branch (see random_below)
        return _LimitParamValue.apply(x, _as_tensor(lo), _as_tensor(hi), random_below(prob))
    if random.random() < prob:
        return _LimitParamValue.apply(x, lo, hi)
    return x


def _as_tensor(v: Union[FloatLike, Tensor]) -> Tensor:
    """A float or schedule as a 0-dim float64 tensor; a moving schedule gives its own tensor, which a compiled
    graph reads at run time (:func:`asrprec.models.schedule.schedule_value`)."""
    if isinstance(v, Tensor):
        return v
    r = schedule_value(v)
    return r if isinstance(r, Tensor) else torch.full((), r, dtype=torch.float64)


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
    def forward(ctx, x: Tensor, limit: float, penalty: float, apply: Optional[Tensor] = None) -> Tensor:
        sign = torch.sign(x).to(torch.int8) * (x.abs() > limit).to(torch.int8)
        if apply is not None:  # traced: the call's draw as a mask (a zero sign adds nothing)
            sign = sign * apply.to(torch.int8)
        ctx.save_for_backward(sign)
        ctx.penalty = penalty
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        (sign,) = ctx.saved_tensors
        return g + (sign.to(g.dtype) * ctx.penalty), None, None, None


def penalize_abs_values_gt(x: Tensor, limit: float, penalty: float, apply: Optional[Tensor] = None) -> Tensor:
    """Identity; backward adds ``penalty * sign(x)`` where ``|x| > limit`` (only where the 0-dim bool ``apply``
    is true, when given: a traced graph's random decision)."""
    # Like icefall, the penalty gradient is not multiplied by the loss scale (its relative weight shifts with
    # the grad scale under fp16); it is a failsafe against implausible scores, not a regulariser.
    if not x.requires_grad:
        return x
    return _PenalizeAbsGt.apply(x, limit, penalty, apply)


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
            with fp32_island():
                g = balancer_grad(x, g, limits, grad_scale, channel_dim)
        except Exception as e:  # pragma: no cover - mirrors icefall: never let a regulariser kill training
            logging.info("Balancer backward failed (%s); passing the gradient through", e)
        return g, None, None, None


class _TracedBalancerFunction(torch.autograd.Function):
    """:class:`_BalancerFunction` for a compiled graph: limits (4,) and grad_scale (0-dim, 0 when the call's draw
    failed) are tensors the graph reads at run time, so changing schedules neither recompile nor branch."""

    @staticmethod
    def forward(ctx, x: Tensor, limits: Tensor, grad_scale: Tensor, channel_dim: int):
        ctx.save_for_backward(x.to(compute_dtype(x)), limits, grad_scale)
        ctx.channel_dim = channel_dim
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        x, limits, grad_scale = ctx.saved_tensors
        with fp32_island():
            g = balancer_grad(x, g, tuple(limits.unbind(0)), grad_scale, ctx.channel_dim)
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
    xf = upcast(x)
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
    gf = upcast(g)
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
        if not self.training or not x.requires_grad:
            return x
        if is_tracing():
            return self._traced(x)
        if random.random() >= float(self.prob):
            return x
        limits = (_proportion_positive_to_mean(float(self.min_positive)),
                  _proportion_positive_to_mean(float(self.max_positive)),
                  _abs_to_rms(float(self.min_abs)), _abs_to_rms(float(self.max_abs)))
        return _BalancerFunction.apply(x, limits, float(self.grad_scale), self.channel_dim)

    def _traced(self, x: Tensor) -> Tensor:
        # the same draw and limits as the eager branch, as tensors: the draw scales grad_scale to 0 or keeps it
        fire = random_below(schedule_value(self.prob))
        p = torch.stack((_as_tensor(self.min_positive), _as_tensor(self.max_positive)))
        z = 2.0 * p - 1.0
        means = 0.8139535143 * (torch.log(1 + z + 1.0e-10) - torch.log(1 - z + 1.0e-10)) / 2.0
        rms = 1.25331413732 * torch.stack((_as_tensor(self.min_abs), _as_tensor(self.max_abs)))
        grad_scale = _as_tensor(self.grad_scale) * fire.to(torch.float64)
        return _TracedBalancerFunction.apply(x, torch.cat((means, rms)), grad_scale, self.channel_dim)


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
            with torch.enable_grad(), fp32_island():
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


def _whitening_metric_grad(x: Tensor, num_groups: int) -> Tuple[Tensor, Tensor]:
    """:func:`whitening_metric` of x (N, C) and its gradient w.r.t. x, written out (a compiled graph cannot run
    ``torch.autograd.grad`` inside a backward). With xc the centred (G, N, c) groups, S_g = xc_g^T xc_g,
    d = mean diagonal of S, q = sum(S^2) / (G c): metric = q / (d^2 + eps),
    dmetric/dS = 2 S / (G c (d^2 + eps)) - 2 q d I / (G c (d^2 + eps)^2), dmetric/dxc = 2 xc dmetric/dS (S is
    symmetric), and centring subtracts the mean over N."""
    n, c = x.shape
    cpg = c // num_groups
    xg = x.reshape(n, num_groups, cpg).transpose(0, 1)
    xc = xg - xg.mean(dim=1, keepdim=True)
    cov = torch.matmul(xc.transpose(1, 2), xc)
    gc = num_groups * cpg
    mean_diag = torch.diagonal(cov, dim1=1, dim2=2).mean()
    covsq_mean_diag = (cov ** 2).sum() / gc
    den = mean_diag ** 2 + 1e-20
    metric = covsq_mean_diag / den
    eye = torch.eye(cpg, dtype=x.dtype, device=x.device)
    d_cov = (2.0 / (gc * den)) * cov - (2.0 * covsq_mean_diag * mean_diag / (gc * den * den)) * eye
    d_xc = 2.0 * torch.matmul(xc, d_cov)
    d_xg = d_xc - d_xc.mean(dim=1, keepdim=True)
    return metric, d_xg.transpose(0, 1).reshape(n, c)


class _TracedWhitenFunction(torch.autograd.Function):
    """:class:`_WhitenFunction` for a compiled graph: ``apply`` (0-dim bool: the call's draw and a metric above
    the limit, decided in forward) masks the added gradient instead of a Python branch on ``metric.item()``."""

    @staticmethod
    def forward(ctx, x: Tensor, apply: Tensor, num_groups: int, grad_scale: float) -> Tensor:
        ctx.save_for_backward(x.to(compute_dtype(x)), apply)
        ctx.num_groups, ctx.grad_scale = num_groups, grad_scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        x, apply = ctx.saved_tensors
        with fp32_island():
            _, pg = _whitening_metric_grad(x.float().reshape(-1, x.shape[-1]), ctx.num_groups)
            pg = pg.reshape(x.shape)
            gf = g.float()
            scale = ctx.grad_scale * (gf.norm() / (pg.norm() + 1e-20))
            out = torch.where(apply, gf + pg * scale, gf).to(g.dtype)
        return out, None, None, None


class Whiten(nn.Module):
    """Identity in forward; in backward (with probability between ``prob[0]`` and ``prob[1]``, raised while the
    limit is exceeded) adds the gradient of the whitening metric, scaled to ``grad_scale`` times |grad|, when the
    metric is above ``whitening_limit``. (icefall scaling.py ``Whiten``.)"""

    def __init__(self, num_groups: int, whitening_limit: FloatLike, prob: Tuple[float, float], grad_scale: float):
        super().__init__()
        self.num_groups = num_groups
        self.whitening_limit = whitening_limit
        self.min_prob, self.max_prob = prob
        self._prob_value = float(self.max_prob)
        # the same probability as a 0-dim float64 tensor that a compiled graph reads and updates in place (not a
        # buffer: no dtype cast, no state_dict key); made by prepare_for_tracing(), so that eager code, and a fake-
        # tensor memory projection, keep reading a Python float
        self._prob: Optional[Tensor] = None
        self.grad_scale = grad_scale

    def prepare_for_tracing(self) -> None:
        """Hold the probability as a tensor from now on (:func:`asrprec.models.compile.compile_model` calls it)."""
        if self._prob is None:
            self._prob = torch.tensor(self._prob_value, dtype=torch.float64)

    @property
    def prob(self) -> float:
        return float(self._prob) if self._prob is not None else self._prob_value

    @prob.setter
    def prob(self, value: float) -> None:
        if self._prob is not None:
            self._prob.fill_(float(value))
        else:
            self._prob_value = float(value)

    def runtime_state_dict(self) -> dict:
        """``prob`` changes in every backward and is no parameter or buffer; checkpoints keep it here
        (:func:`asrprec.checkpoint.module_runtime_state`) so that a resumed run whitens on the same steps."""
        return {"prob": float(self.prob)}

    def load_runtime_state_dict(self, state: dict) -> None:
        self.prob = float(state["prob"])

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or not x.requires_grad or self.grad_scale == 0:
            return x
        if is_tracing():
            return self._traced(x)
        if random.random() > self.prob:
            return x
        if x.shape[-1] % self.num_groups != 0:
            raise ValueError(f"Whiten: {x.shape[-1]} channels not divisible into {self.num_groups} groups")
        return _WhitenFunction.apply(x, self)

    def _traced(self, x: Tensor) -> Tensor:
        # Eager mode measures the metric in backward and sets prob there; the graph measures it in forward (same
        # input, same value) and sets prob at once. Either way the next forward sees the new prob.
        if x.shape[-1] % self.num_groups != 0:
            raise ValueError(f"Whiten: {x.shape[-1]} channels not divisible into {self.num_groups} groups")
        self.prepare_for_tracing()  # already done by compile_model; a no-op then
        fire = torch.full((), random.random(), dtype=torch.float64) <= self._prob  # eager skips when r > prob
        with torch.no_grad(), fp32_island():
            xs = x.detach().to(compute_dtype(x)).float().reshape(-1, x.shape[-1])
            metric = whitening_metric(xs, self.num_groups).double()
            over = metric >= _as_tensor(self.whitening_limit)
            new_prob = torch.where(over, _as_tensor(self.max_prob), _as_tensor(self.min_prob))
            self._prob.copy_(torch.where(fire, new_prob, self._prob))
        return _TracedWhitenFunction.apply(x, torch.logical_and(fire, over), self.num_groups, self.grad_scale)


def whitening_schedule(x: float, ratio: float = 2.0) -> ScheduledFloat:
    return ScheduledFloat((0.0, x), (20000.0, ratio * x), default=x)
