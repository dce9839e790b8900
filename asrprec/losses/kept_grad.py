"""The autograd Function of every loss backend that computes its gradient in the forward pass.

The fused kernels (``numba``, ``numba-cuda``, RNN-T and TDT) and the clamped ``torch`` reference produce, in one
pass, the per-utterance costs (B,) and the gradient of cost b w.r.t. utterance b's logits (B, T, U+1, C). The
gradient is kept until backward, which multiplies row b by grad_output[b]: utterances are independent, so that
is the exact vector-Jacobian product (and ``clamp`` applies before the scaling, as torchaudio and NeMo do).
"""

from __future__ import annotations

from typing import Callable

import torch


def cost_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the returned costs: float64 for fp64 logits, else float32."""
    return torch.float64 if logits_dtype == torch.float64 else torch.float32


def scale_rows_(grad: torch.Tensor, grad_out: torch.Tensor) -> None:
    """grad[b] *= grad_out[b] in place, by Python scalars: a mixed-dtype tensor multiply (fp16 buffer ×
    fp32 grad_out) would materialise a logits-sized fp32 temporary on CPU."""
    scales = grad_out.detach().double().tolist()
    if all(s == 1.0 for s in scales):
        return
    for b, s in enumerate(scales):
        grad[b].mul_(s)


class KeptGradient(torch.autograd.Function):
    """``apply(compute, in_place, logits, *args)``, where ``compute(logits, *args, need_grad)`` returns the costs
    (B,) and the gradient; returns the costs as :func:`cost_dtype`.

    ``in_place``: backward scales the kept buffer in place (a kernel's logits-sized buffer, used once: a second
    backward through the node fails torch's saved-tensor version check instead of returning a scaled gradient);
    otherwise by an out-of-place multiply in the gradient's dtype. A gradient stored in another dtype than the
    logits' (``numba_cuda.set_grad_dtype``) is cast after scaling.
    """

    @staticmethod
    def forward(ctx, compute: Callable, in_place: bool, logits: torch.Tensor, *args):
        costs, grad = compute(logits, *args, ctx.needs_input_grad[2])
        ctx.save_for_backward(grad)
        ctx.in_place = in_place
        ctx.logits_dtype = logits.dtype
        ctx.n_args = len(args)
        return costs.to(cost_dtype(logits.dtype))

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        if ctx.in_place:
            scale_rows_(grad, grad_out)
        else:
            grad = grad * grad_out.to(grad.dtype).view(-1, *(1,) * (grad.dim() - 1))
        if grad.dtype != ctx.logits_dtype:
            grad = grad.to(ctx.logits_dtype)
        return (None, None, grad) + (None,) * ctx.n_args


def kept_gradient_costs(compute: Callable, logits: torch.Tensor, *args) -> torch.Tensor:
    """A fused backend's costs (B,) as :func:`cost_dtype`: through :class:`KeptGradient` (buffer scaled in
    place) when a gradient w.r.t. ``logits`` is wanted, else ``compute``'s costs alone (no gradient buffer)."""
    if logits.requires_grad and torch.is_grad_enabled():
        return KeptGradient.apply(compute, True, logits, *args)
    return compute(logits, *args, False)[0].to(cost_dtype(logits.dtype))


def fused_rnnt_backend(name: str, forward: Callable, doc: str) -> Callable[..., torch.Tensor]:
    """The registry function of a fused RNN-T kernel (``BackendSpec.fn``: per-utterance costs, validated inputs
    expected), given its ``forward(logits, targets, logit_lens, target_lens, blank, clamp, fastemit_lambda,
    need_grad) -> (costs, gradient or None)``."""

    def loss(logits: torch.Tensor, targets: torch.Tensor, logit_lens: torch.Tensor, target_lens: torch.Tensor, *,
             blank: int = 0, clamp: float | None = None, fastemit_lambda: float = 0.0) -> torch.Tensor:
        return kept_gradient_costs(forward, logits, targets, logit_lens, target_lens, blank, clamp, fastemit_lambda)

    loss.__name__ = loss.__qualname__ = name
    loss.__module__, loss.__doc__ = forward.__module__, doc
    return loss


def fused_tdt_backend(name: str, forward: Callable, doc: str) -> Callable[..., torch.Tensor]:
    """The TDT registry function of a fused kernel (``BackendSpec.tdt_fn``), given its ``forward(logits, targets,
    logit_lens, target_lens, durations, blank, sigma, need_grad) -> (costs, gradient or None)``."""

    def loss(logits: torch.Tensor, targets: torch.Tensor, logit_lens: torch.Tensor, target_lens: torch.Tensor, *,
             durations: tuple[int, ...], blank: int = 0, sigma: float = 0.0) -> torch.Tensor:
        return kept_gradient_costs(forward, logits, targets, logit_lens, target_lens, durations, blank, sigma)

    loss.__name__ = loss.__qualname__ = name
    loss.__module__, loss.__doc__ = forward.__module__, doc
    return loss
