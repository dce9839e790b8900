"""The ``numba`` backend: a fused RNN-T loss for CPU tensors, jitted with numba.

Legend: B batch, T frames, U target tokens (U+1 lattice rows), V vocabulary (blank included).

Three parallel passes, each reading the logits without ever materialising log-softmax:

1. per lattice cell (prange over (b, t) rows): log-sum-exp over V, and the blank and label
   log-probs ``lb, ly`` (B, T, U+1), all float64;
2. per utterance (prange over b): α and β in float64, and the log-likelihood ``ll``;
3. per cell: the gradient w.r.t. the logits (log-softmax fused), written straight into the only
   B·T·(U+1)·V buffer this backend allocates, in the logits' dtype; padded cells get exact zeros.

Gradient of cost_b = -(1+λ)·ll_b … w.r.t. logit z(t,u,v), per NeMo's FastEmit convention
(reference/nemo.md §1.4, §1.6): with γ_blank = exp(α(t,u)+lb(t,u)+β(t+1,u)-ll) (at the final
cell (T_b-1, U_b): exp(α+lb-ll)) and γ_label = exp(α(t,u)+ly(t,u)+β(t,u+1)-ll),

    g(v) = softmax(v)·(γ_blank + (1+λ)·γ_label) - [v = blank]·γ_blank - [v = y_{u+1}]·(1+λ)·γ_label

(λ = 0: γ_blank + γ_label = occupancy exp(α+β-ll), so the row sums to exactly zero). ``clamp``
clips g to [-clamp, clamp]. Backward multiplies the kept buffer in place by grad_output.

fp16 and bf16 logits are read as raw uint16 bits (numba has no float16/bfloat16 on CPU):
fp16 through a 65536-entry fp32 lookup table, bf16 by a 16-bit shift; the gradient is rounded
back to the logits' dtype with round-to-nearest-even. All arithmetic is fp32 (exp/softmax rows)
or float64 (denominators, α, β, posteriors); fp64 logits are handled in fp64 throughout.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from numba import njit, prange

_KIND_NATIVE, _KIND_F16, _KIND_BF16 = 0, 1, 2
_f16_lut = None


# reassociation lets the row reductions vectorise; no 'nnan'/'ninf' so ±inf logits stay correct
_FM = {"reassoc", "contract"}

@njit(inline="always")
def f32_to_f16_bits(f, u):  # f: float32 value, u: the same value's uint32 bits
    # round-to-nearest-even fp32 -> IEEE half, written after the classic bit algorithm
    sign = (u >> 16) & 0x8000
    e = u & 0x7F800000
    m = u & 0x007FFFFF
    if e >= 0x47800000:  # overflow, inf or nan
        if e == 0x7F800000 and m != 0:
            return sign | 0x7E00
        return sign | 0x7C00
    if e <= 0x38000000:  # half subnormal or zero
        if e < 0x33000000:
            return sign
        sh = 126 - (e >> 23)  # half subnormals count units of 2^-24
        m = m | 0x00800000
        rest = m & ((1 << sh) - 1)
        hm = m >> sh
        half = 1 << (sh - 1)
        if rest > half or (rest == half and (hm & 1) == 1):
            hm += 1
        return sign | hm
    hm = ((e - 0x38000000) >> 13) + (m >> 13)  # exponent and mantissa; a carry rolls into the exponent
    rest = m & 0x1FFF
    if rest > 0x1000 or (rest == 0x1000 and (hm & 1) == 1):
        hm += 1
    return sign | hm

@njit(inline="always")
def f32_to_bf16_bits(u):
    if (u & 0x7F800000) == 0x7F800000 and (u & 0x007FFFFF) != 0:
        return ((u >> 16) | 0x40) & 0xFFFF  # quiet nan
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF

@njit(inline="always")
def load_row(x, b, t, u, kind, lut, row, ubuf, fbuf):
    V = row.shape[0]
    if kind == 0:
        for v in range(V):
            row[v] = x[b, t, u, v]
    elif kind == 1:
        for v in range(V):
            row[v] = lut[np.intp(x[b, t, u, v])]
    else:
        for v in range(V):
            ubuf[v] = np.uint32(x[b, t, u, v]) << 16
        for v in range(V):
            row[v] = fbuf[v]

@njit(parallel=True, fastmath=_FM, cache=True)
def denominators(x, kind, lut, proto, targets, tlens, ulens, blank, lse, lb, ly):
    B, T, U1, V = x.shape
    for r in prange(B * T):
        b = r // T
        t = r - b * T
        if t < tlens[b]:
            row = np.empty_like(proto)
            zero = np.zeros_like(proto[:1])  # a scalar of the row dtype (keeps fp32 math fp32)
            fbuf = np.empty(V, np.float32)
            ubuf = fbuf.view(np.uint32)
            for u in range(ulens[b] + 1):
                load_row(x, b, t, u, kind, lut, row, ubuf, fbuf)
                m = row[0]
                for v in range(1, V):
                    m = max(m, row[v])
                if m == -np.inf:  # a row of -inf logits: avoid inf - inf
                    m = zero[0]
                s = 0.0
                for v in range(V):
                    s += math.exp(row[v] - m)
                den = float(m) + math.log(s)
                lse[b, t, u] = den
                lb[b, t, u] = float(row[blank]) - den
                if u < ulens[b]:
                    ly[b, t, u] = float(row[targets[b, u]]) - den

@njit(inline="always")
def logaddexp(a, b):
    if a == -np.inf:
        return b
    if b == -np.inf:
        return a
    if a > b:
        return a + math.log1p(math.exp(b - a))
    return b + math.log1p(math.exp(a - b))

@njit(parallel=True, cache=True)
def alphas_betas(lb, ly, tlens, ulens, alpha, beta, ll, need_beta):
    B = lb.shape[0]
    for b in prange(B):
        Tb = tlens[b]
        Ub = ulens[b]
        alpha[b, 0, 0] = 0.0
        for u in range(1, Ub + 1):
            alpha[b, 0, u] = alpha[b, 0, u - 1] + ly[b, 0, u - 1]
        for t in range(1, Tb):
            alpha[b, t, 0] = alpha[b, t - 1, 0] + lb[b, t - 1, 0]
            for u in range(1, Ub + 1):
                alpha[b, t, u] = logaddexp(
                    alpha[b, t - 1, u] + lb[b, t - 1, u], alpha[b, t, u - 1] + ly[b, t, u - 1]
                )
        ll[b] = alpha[b, Tb - 1, Ub] + lb[b, Tb - 1, Ub]
        if need_beta:
            beta[b, Tb - 1, Ub] = lb[b, Tb - 1, Ub]
            for u in range(Ub - 1, -1, -1):
                beta[b, Tb - 1, u] = beta[b, Tb - 1, u + 1] + ly[b, Tb - 1, u]
            for t in range(Tb - 2, -1, -1):
                beta[b, t, Ub] = beta[b, t + 1, Ub] + lb[b, t, Ub]
                for u in range(Ub - 1, -1, -1):
                    beta[b, t, u] = logaddexp(beta[b, t + 1, u] + lb[b, t, u], beta[b, t, u + 1] + ly[b, t, u])

@njit(parallel=True, fastmath=_FM, cache=True)
def gradient(x, kind, lut, proto, targets, tlens, ulens, blank, lse, lb, ly, alpha, beta, ll, lam, clamp, out):
    B, T, U1, V = x.shape
    for r in prange(B * T):
        b = r // T
        t = r - b * T
        Tb = tlens[b]
        Ub = ulens[b]
        row = np.empty_like(proto)
        sh = np.zeros_like(proto[:1])  # the shift as a row-dtype scalar, so fp32 rows stay fp32
        fbuf = np.empty(V, np.float32)
        ubuf = fbuf.view(np.uint32)
        for u in range(U1):
            if t >= Tb or u > Ub:
                for v in range(V):
                    out[b, t, u, v] = 0
                continue
            load_row(x, b, t, u, kind, lut, row, ubuf, fbuf)
            a = alpha[b, t, u]
            g_blank = 0.0
            if t + 1 < Tb:
                g_blank = math.exp(a + lb[b, t, u] + beta[b, t + 1, u] - ll[b])
            elif u == Ub:
                g_blank = math.exp(a + lb[b, t, u] - ll[b])
            g_label = 0.0
            if u < Ub:
                g_label = (1.0 + lam) * math.exp(a + ly[b, t, u] + beta[b, t, u + 1] - ll[b])
            c = g_blank + g_label
            # softmax(v)·c = exp(z_v - lse + log c), one exp per element
            sh[0] = (math.log(c) - lse[b, t, u]) if c > 0.0 else -np.inf
            shift = sh[0]
            for v in range(V):
                row[v] = math.exp(row[v] + shift)
            row[blank] -= g_blank
            if u < Ub:
                row[targets[b, u]] -= g_label
            if clamp > 0.0:
                for v in range(V):
                    row[v] = min(max(row[v], -clamp), clamp)
            if kind == 0:
                for v in range(V):
                    out[b, t, u, v] = row[v]
            else:
                for v in range(V):
                    fbuf[v] = row[v]
                if kind == 1:
                    for v in range(V):
                        out[b, t, u, v] = f32_to_f16_bits(fbuf[v], ubuf[v])
                else:
                    for v in range(V):
                        out[b, t, u, v] = f32_to_bf16_bits(ubuf[v])

@njit(parallel=True, cache=True)
def to_half_bits(f, out):  # for tests: fp32 array -> fp16 / bf16 bits
    u = f.view(np.uint32)
    for i in prange(f.size):
        out[0, i] = f32_to_f16_bits(f[i], u[i])
        out[1, i] = f32_to_bf16_bits(u[i])

_KERNELS = {
    "denominators": denominators,
    "alphas_betas": alphas_betas,
    "gradient": gradient,
    "to_half_bits": to_half_bits,
}



def _get_kernels():
    return _KERNELS


def _lut() -> np.ndarray:
    global _f16_lut
    if _f16_lut is None:
        _f16_lut = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    return _f16_lut


def _as_numpy(x: torch.Tensor) -> tuple[np.ndarray, int]:
    """A numpy view of a contiguous CPU tensor (uint16 bits for fp16/bf16) and its read kind."""
    if x.dtype == torch.float16:
        return x.view(torch.int16).numpy().view(np.uint16), _KIND_F16
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(np.uint16), _KIND_BF16
    return x.numpy(), _KIND_NATIVE


def _set_threads() -> None:
    numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))


def numba_cpu_forward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    logit_lens: torch.Tensor,
    target_lens: torch.Tensor,
    blank: int,
    clamp: float | None,
    fastemit_lambda: float,
    need_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Costs (B,) float64 and, if ``need_grad``, the gradient (B, T, U+1, V) in the logits' dtype."""
    k = _get_kernels()
    _set_threads()
    x = logits.detach()
    if not x.is_contiguous():
        x = x.contiguous()  # one copy; the kernels index a dense (B, T, U+1, V) array
    B, T, U1, V = x.shape
    xa, kind = _as_numpy(x)
    proto = np.empty(V, np.float64 if x.dtype == torch.float64 else np.float32)
    tg, tl, ul = targets.numpy(), logit_lens.numpy(), target_lens.numpy()
    f64 = dict(dtype=torch.float64)
    lse, lb, ly = torch.empty(B, T, U1, **f64), torch.empty(B, T, U1, **f64), torch.empty(B, T, U1, **f64)
    alpha, beta, ll = torch.empty(B, T, U1, **f64), torch.empty(B, T, U1, **f64), torch.empty(B, **f64)
    k["denominators"](xa, kind, _lut(), proto, tg, tl, ul, blank, lse.numpy(), lb.numpy(), ly.numpy())
    k["alphas_betas"](lb.numpy(), ly.numpy(), tl, ul, alpha.numpy(), beta.numpy(), ll.numpy(), need_grad)
    grad = None
    if need_grad:
        grad = torch.empty_like(x)  # every element is written by the kernel (zeros in padding)
        ga, _ = _as_numpy(grad)
        c = -1.0 if clamp is None else float(clamp)
        k["gradient"](
            xa, kind, _lut(), proto, tg, tl, ul, blank, lse.numpy(), lb.numpy(), ly.numpy(),
            alpha.numpy(), beta.numpy(), ll.numpy(), float(fastemit_lambda), c, ga,
        )
    return -(1.0 + fastemit_lambda) * ll, grad


class _NumbaRNNT(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, logit_lens, target_lens, blank, clamp, fastemit_lambda):
        costs, grad = numba_cpu_forward(
            logits, targets, logit_lens, target_lens, blank, clamp, fastemit_lambda, ctx.needs_input_grad[0]
        )
        ctx.save_for_backward(grad)
        return costs.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        # in place: the buffer is used once (a second backward through this node fails torch's
        # saved-tensor version check instead of silently returning a scaled gradient)
        _scale_rows_(grad, grad_out)
        return grad, None, None, None, None, None, None


def rnnt_loss_numba(
    logits: torch.Tensor,
    targets: torch.Tensor,
    logit_lens: torch.Tensor,
    target_lens: torch.Tensor,
    *,
    blank: int = 0,
    clamp: float | None = None,
    fastemit_lambda: float = 0.0,
) -> torch.Tensor:
    """Per-utterance RNN-T costs on CPU (validated inputs expected).

    Args:
        logits: (B, T, U+1, V) CPU fp64/fp32/fp16/bf16. targets: (B, U) int64.
        logit_lens, target_lens: (B,) int64.

    Returns:
        (B,) costs, float32 (float64 for fp64 logits). The gradient is computed in forward and kept
        (one buffer of the logits' size and dtype) until backward.
    """
    need = logits.requires_grad and torch.is_grad_enabled()
    if not need:
        costs, _ = numba_cpu_forward(logits, targets, logit_lens, target_lens, blank, clamp, fastemit_lambda, False)
        return costs.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    return _NumbaRNNT.apply(logits, targets, logit_lens, target_lens, blank, clamp, fastemit_lambda)


def _scale_rows_(grad: torch.Tensor, grad_out: torch.Tensor) -> None:
    """grad[b] *= grad_out[b] in place, by Python scalars: a mixed-dtype tensor multiply (fp16 buffer ×
    fp32 grad_out) would materialise a logits-sized fp32 temporary on CPU."""
    scales = grad_out.detach().double().tolist()
    if all(s == 1.0 for s in scales):
        return
    for b, s in enumerate(scales):
        grad[b].mul_(s)

