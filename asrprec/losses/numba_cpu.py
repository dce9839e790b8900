"""The ``numba`` backend: a fused RNN-T loss for CPU tensors, jitted with numba.

Legend: B batch, T frames, U target tokens (U+1 lattice rows), V vocabulary (blank included).

Three parallel passes; log-softmax is never materialised:

1. per lattice cell (prange over (b, t) rows): the row max m and s = Σ_v exp(z_v - m) (one fp32
   exp per logit), the log-denominator, the blank and label log-probs ``lb, ly`` (B, T, U+1, float64).
   For fp32/fp64 logits with a gradient wanted, exp(z_v - m) is written into the gradient buffer as
   it is summed, so the softmax is never exponentiated twice;
2. per utterance (prange over b): α and β in float64, and the log-likelihood ``ll``;
3. per cell: the gradient w.r.t. the logits, in place in that buffer (the only B·T·(U+1)·V one this
   backend allocates, in the logits' dtype): fp32/fp64 by one multiply per element,
   g = buf·(c/s) minus the two one-hot terms below; fp16/bf16, whose 16-bit buffer is too coarse to
   hold exp(z - m), re-read the logits and take a second exp. Padded cells get exact zeros.

Why it is fast (a branch-free fp32 ``exp32``, LLVM's maxnum, huge pages): ``docs/losses.md``.

Gradient of cost_b = -(1+λ)·ll_b … w.r.t. logit z(t,u,v), per NeMo's FastEmit convention
(NVIDIA/NeMo ``nemo/collections/asr/parts/numba/rnnt_loss/utils/cpu_utils/cpu_rnnt.py``): with γ_blank = exp(α(t,u)+lb(t,u)+β(t+1,u)-ll) (at the final
cell (T_b-1, U_b): exp(α+lb-ll)) and γ_label = exp(α(t,u)+ly(t,u)+β(t,u+1)-ll),

    g(v) = softmax(v)·(γ_blank + (1+λ)·γ_label) - [v = blank]·γ_blank - [v = y_{u+1}]·(1+λ)·γ_label

(λ = 0: γ_blank + γ_label = occupancy exp(α+β-ll), so the row sums to exactly zero). ``clamp``
clips g to [-clamp, clamp]. Backward multiplies the kept buffer in place by grad_output.

fp16 and bf16 logits are read as raw uint16 bits (numba has no float16/bfloat16 on CPU):
fp16 through LLVM's half<->float conversions (F16C instructions where the CPU has them), bf16 by a
16-bit shift; the gradient is rounded back to the logits' dtype with round-to-nearest-even. All arithmetic is fp32 (exp/softmax rows and
their sums, vectorised so each lane sums ~V/32 terms) or float64 (log-denominators, α, β, posteriors); fp64 logits are handled in fp64 throughout.
"""

from __future__ import annotations

import math
import os

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange
from numba.core import types
from numba.extending import intrinsic, overload

from .kept_grad import fused_rnnt_backend

_KIND_NATIVE, _KIND_F16, _KIND_BF16 = 0, 1, 2


# reassociation lets the row reductions vectorise; no 'nnan'/'ninf' so ±inf logits stay correct
_FM = {"reassoc", "contract"}

# ---------------------------------------------------------------- fp32 exp that LLVM can vectorise
# math.exp on float32 lowers to a libm call per element (no SVML here), which kept the row loops
# scalar. exp32 is branch-free (selects only) so the loop vectoriser packs it: Cody-Waite range
# reduction x = n·ln2 + r, |r| ≤ ln2/2, then exp(r) by a degree-7 polynomial and 2^n spliced into the
# exponent bits. Constants are the ones in Cephes' expf.c (S. Moshier), textbook values: ln2 split
# into an exact 0.693359375 and a correction, and the minimax coefficients of (exp(r)-1-r)/r².
# Accuracy against float64 exp, 2·10^7 points: ≤ 1.02 ulp on [-87.33, 88.3] (mean 0.27 ulp; numpy's
# float32 exp: 2.5 ulp), ≤ 5.5 ulp on (88.3, 88.72] where n is capped at 127 (never reached by the
# loss: its arguments are ≤ log(1+λ)). Results below FLT_MIN (x < -87.336) are flushed to 0,
# x > 88.722 gives inf, nan stays nan.
_F = np.float32
_LOG2E, _LN2_HI, _LN2_LO = _F(1.44269504088896341), _F(0.693359375), _F(-2.12194440e-4)
_P0, _P1, _P2, _P3, _P4, _P5 = (
    _F(1.9875691500e-4), _F(1.3981999507e-3), _F(8.3334519073e-3),
    _F(4.1665795894e-2), _F(1.6666665459e-1), _F(5.0000001201e-1),
)
_XLO, _XHI, _ONE, _ZERO, _INF = _F(-87.33654), _F(88.72283), _F(1.0), _F(0.0), _F(np.inf)
_NOFF = _F(128.5)  # floor(y + 0.5) as an int truncation of y + 128.5 ≥ 0 (y ≥ -126)


@intrinsic
def _times_pow2(typingctx, p, n):
    """p · 2^n for a float32 p in [0.5, 2) and an integer n with the result normal: n added to the exponent bits."""
    if p != types.float32 or not isinstance(n, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        k = args[1]
        k = builder.trunc(k, i32) if n.bitwidth > 32 else builder.sext(k, i32) if n.bitwidth < 32 else k
        bits = builder.add(builder.bitcast(args[0], i32), builder.shl(k, ir.Constant(i32, 23)))
        return builder.bitcast(bits, ir.FloatType())

    return types.float32(types.float32, n), codegen


# 'contract' only (FMA): reassociation would undo the two-part range reduction
@njit(fastmath={"contract"}, inline="always")
def _exp_reduced(xc, n):
    """exp(xc) for xc in [_XLO, _XHI] and n = floor(xc·log2(e) + 0.5) + 128 (≤ 255): xc - (n-128)·ln2 in two
    parts, the polynomial, and 2^(n-128) spliced into the exponent bits."""
    nf = _F(n) - _F(128.0)
    r = xc - nf * _LN2_HI
    r = r - nf * _LN2_LO
    p = ((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5
    p = (p * r) * r + r + _ONE
    return _times_pow2(p, n - 128)


@njit(fastmath={"contract"}, inline="never")
def exp32(x):
    xc = x if x > _XLO else _XLO
    xc = xc if xc < _XHI else _XHI
    n = np.int32(xc * _LOG2E + _NOFF)  # = floor(xc·log2(e) + 0.5) + 128
    n = n if n < np.int32(255) else np.int32(255)  # exp(88.72) still finite: n ≤ 127
    y = _exp_reduced(xc, n)
    y = _ZERO if x < _XLO else y
    y = _INF if x > _XHI else y
    return x if x != x else y


@njit(fastmath={"contract"}, inline="never")
def exp32_nonpos(x):
    """exp32 for x ≤ 0 or nan (the softmax numerators exp(z - max)): no overflow handling needed."""
    xc = x if x > _XLO else _XLO
    n = np.int32(xc * _LOG2E + _NOFF)  # = floor(xc·log2(e) + 0.5) + 128, in [2, 128]
    y = _exp_reduced(xc, n)
    y = _ZERO if x < _XLO else y
    return x if x != x else y


@intrinsic
def half_bits_to_f32(typingctx, h):
    """IEEE half bits (uint16) -> float32, exact: LLVM's fpext half->float (one vcvtph2ps per 8 lanes
    with F16C, a library call without it)."""
    if not (isinstance(h, types.Integer) and h.bitwidth == 16):
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(h), codegen


@intrinsic
def f32_to_f16_bits(typingctx, f):
    """float32 -> IEEE half bits (uint16), round-to-nearest-even (LLVM fptrunc; vcvtps2ph with F16C)."""
    if f != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(f), codegen


@njit(inline="always")
def f32_to_bf16_bits(u):
    if (u & 0x7F800000) == 0x7F800000 and (u & 0x007FFFFF) != 0:
        return ((u >> 16) | 0x40) & 0xFFFF  # quiet nan
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF

@njit(inline="always")
def load_row(x, b, t, u, kind, row, ubuf, fbuf):
    V = row.shape[0]
    if kind == 0:
        for v in range(V):
            row[v] = x[b, t, u, v]
    elif kind == 1:
        for v in range(V):
            row[v] = half_bits_to_f32(x[b, t, u, v])
    else:
        for v in range(V):
            ubuf[v] = np.uint32(x[b, t, u, v]) << 16
        for v in range(V):
            row[v] = fbuf[v]

@intrinsic
def fmaxnum(typingctx, a, b):
    """LLVM's maxnum (IEEE maxNum: a nan operand yields the other one). Unlike a compare-and-select,
    the loop vectoriser packs a maxnum reduction without any fast-math flags."""
    if not (isinstance(a, types.Float) and a == b):
        return None

    def codegen(context, builder, sig, args):
        ft = args[0].type
        fn = builder.module.declare_intrinsic("llvm.maxnum", [ft], ir.FunctionType(ft, [ft, ft]))
        return builder.call(fn, args)

    return a(a, b), codegen


@njit(inline="never")
def row_max(xr):
    # a nan logit is skipped here but still reaches the cost through the exp-sum (exp(nan) = nan)
    m = xr[0]
    for v in range(1, xr.shape[0]):
        m = fmaxnum(m, xr[v])
    return m


def cast_like(a, x):
    return a.dtype.type(x)


@overload(cast_like, inline="always")
def _cast_like_impl(a, x):
    if a.dtype == types.float32:
        return lambda a, x: np.float32(x)
    return lambda a, x: np.float64(x)


def _exp_of_row_dtype(exp_fp32):
    """A function numba inlines as ``exp_fp32`` for float32 arguments and as libm's exp otherwise (fp64 rows
    keep libm's exp: the fp64 path is for tests, not speed)."""

    def fn(x):
        return math.exp(x)

    @overload(fn, inline="always")
    def _impl(x):
        if x == types.float32:
            return lambda x: exp_fp32(x)
        return lambda x: math.exp(x)

    return fn


fexp = _exp_of_row_dtype(exp32)
fexp_nonpos = _exp_of_row_dtype(exp32_nonpos)


@njit(fastmath=_FM, inline="never")
def exp_sum(xr, m, er):
    """er[v] = exp(xr[v] - m) (when er is xr-sized) and returns Σ_v exp(xr[v] - m), in xr's dtype."""
    s = m - m  # a zero of the row dtype: keeps fp32 arithmetic fp32
    if er.shape[0] == xr.shape[0]:
        for v in range(xr.shape[0]):
            e = fexp_nonpos(xr[v] - m)
            er[v] = e
            s += e
    else:
        for v in range(xr.shape[0]):
            s += fexp_nonpos(xr[v] - m)
    return s


@njit(inline="always")
def cell_stats(xr, er, b, t, u, targets, ulens, blank, lse, sums, lb, ly):
    m = row_max(xr)
    if m == -np.inf:  # a row of -inf logits: avoid inf - inf
        m = _ZERO  # float32 zero; unifies to float64 for fp64 rows
    s = exp_sum(xr, m, er)
    den = float(m) + math.log(float(s))
    lse[b, t, u] = den
    sums[b, t, u] = s
    lb[b, t, u] = float(xr[blank]) - den
    if u < ulens[b]:
        ly[b, t, u] = float(xr[targets[b, u]]) - den


@njit(parallel=True, cache=True)
def native_denominators(x, targets, tlens, ulens, blank, lse, sums, lb, ly, out, store):
    """Pass 1 for fp32/fp64 logits. With ``store``, exp(x - max) goes into ``out`` (the gradient buffer)
    so that pass 3 needs one multiply per element and no second exp."""
    B, T, U1, V = x.shape
    for r in prange(B * T):
        b = r // T
        t = r - b * T
        if t < tlens[b]:
            none = np.empty(0, x.dtype)  # a C-contiguous stand-in (a slice would type as layout 'A' and stop vectorisation)
            for u in range(ulens[b] + 1):
                if store:
                    cell_stats(x[b, t, u], out[b, t, u], b, t, u, targets, ulens, blank, lse, sums, lb, ly)
                else:
                    cell_stats(x[b, t, u], none, b, t, u, targets, ulens, blank, lse, sums, lb, ly)


@njit(parallel=True, cache=True)
def half_denominators(x, kind, targets, tlens, ulens, blank, lse, sums, lb, ly):
    """Pass 1 for fp16/bf16 (uint16 bits) logits: each row is decoded to fp32 once."""
    B, T, U1, V = x.shape
    for r in prange(B * T):
        b = r // T
        t = r - b * T
        if t < tlens[b]:
            row = np.empty(V, np.float32)
            fbuf = np.empty(V, np.float32)
            ubuf = fbuf.view(np.uint32)
            none = np.empty(0, np.float32)
            for u in range(ulens[b] + 1):
                load_row(x, b, t, u, kind, row, ubuf, fbuf)
                cell_stats(row, none, b, t, u, targets, ulens, blank, lse, sums, lb, ly)


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

@njit(inline="always")
def posteriors(b, t, u, Tb, Ub, lb, ly, alpha, beta, ll, lam):
    """(γ_blank, (1+λ)·γ_label) of cell (t, u), float64."""
    a = alpha[b, t, u]
    g_blank = 0.0
    if t + 1 < Tb:
        g_blank = math.exp(a + lb[b, t, u] + beta[b, t + 1, u] - ll[b])
    elif u == Ub:
        g_blank = math.exp(a + lb[b, t, u] - ll[b])
    g_label = 0.0
    if u < Ub:
        g_label = (1.0 + lam) * math.exp(a + ly[b, t, u] + beta[b, t, u + 1] - ll[b])
    return g_blank, g_label


@njit(fastmath=_FM, inline="never")
def finish_row(g, k, blank, gb, target, gl, clamp):
    """g <- g·k, minus the two posterior terms, clamped; g holds exp(z - max) (or exp(z - lse + log c)
    with k = 1) on entry. k, gb, gl are float64 and rounded to g's dtype once."""
    kk = cast_like(g, k)
    for v in range(g.shape[0]):
        g[v] = g[v] * kk
    g[blank] -= gb
    if target >= 0:
        g[target] -= gl
    if clamp > 0.0:
        c = cast_like(g, clamp)
        for v in range(g.shape[0]):
            g[v] = min(max(g[v], -c), c)


@njit(parallel=True, cache=True)
def native_gradient(targets, tlens, ulens, blank, sums, lb, ly, alpha, beta, ll, lam, clamp, out):
    """Pass 3 for fp32/fp64: ``out`` holds exp(z - max) from pass 1 in the live cells;
    g = exp(z - max)·(γ_blank + (1+λ)γ_label)/Σexp(z - max) - the one-hot terms. Padding -> 0."""
    B, T, U1, V = out.shape
    for r in prange(B * T):
        b = r // T
        t = r - b * T
        Tb = tlens[b]
        Ub = ulens[b]
        for u in range(U1):
            g = out[b, t, u]
            if t >= Tb or u > Ub:
                for v in range(V):
                    g[v] = 0
                continue
            gb, gl = posteriors(b, t, u, Tb, Ub, lb, ly, alpha, beta, ll, lam)
            finish_row(g, (gb + gl) / sums[b, t, u], blank, gb, targets[b, u] if u < Ub else -1, gl, clamp)


@njit(fastmath=_FM, inline="never")
def exp_shift(row, shift):
    for v in range(row.shape[0]):
        row[v] = fexp(row[v] + shift)


@njit(inline="always")
def store_half(out, b, t, u, start, row, rbits, kind):
    """out[b, t, u, start + v] = row[v] as fp16 (kind 1) or bf16 bits (``rbits``: row's uint32 view), rounded to
    nearest even."""
    if kind == 1:
        for v in range(row.shape[0]):
            out[b, t, u, start + v] = f32_to_f16_bits(row[v])
    else:
        for v in range(row.shape[0]):
            out[b, t, u, start + v] = f32_to_bf16_bits(rbits[v])


@njit(parallel=True, cache=True)
def half_gradient(x, kind, targets, tlens, ulens, blank, lse, lb, ly, alpha, beta, ll, lam, clamp, out):
    """Pass 3 for fp16/bf16: the output buffer is 16-bit, too coarse to keep exp(z - max) in, so the
    row is decoded again and softmax·c = exp(z - lse + log c) recomputed (one fp32 exp per element)."""
    B, T, U1, V = x.shape
    for r in prange(B * T):
        b = r // T
        t = r - b * T
        Tb = tlens[b]
        Ub = ulens[b]
        row = np.empty(V, np.float32)
        rbits = row.view(np.uint32)
        fbuf = np.empty(V, np.float32)
        ubuf = fbuf.view(np.uint32)
        for u in range(U1):
            if t >= Tb or u > Ub:
                for v in range(V):
                    out[b, t, u, v] = 0
                continue
            load_row(x, b, t, u, kind, row, ubuf, fbuf)
            gb, gl = posteriors(b, t, u, Tb, Ub, lb, ly, alpha, beta, ll, lam)
            c = gb + gl
            shift = _F(math.log(c) - lse[b, t, u]) if c > 0.0 else -_INF
            exp_shift(row, shift)
            finish_row(row, 1.0, blank, gb, targets[b, u] if u < Ub else -1, gl, clamp)
            store_half(out, b, t, u, 0, row, rbits, kind)


@njit(parallel=True, cache=True)
def to_half_bits(f, out):  # for tests: fp32 array -> fp16 / bf16 bits
    u = f.view(np.uint32)
    for i in prange(f.size):
        out[0, i] = f32_to_f16_bits(f[i])
        out[1, i] = f32_to_bf16_bits(u[i])

_KERNELS = {
    "native_denominators": native_denominators,
    "half_denominators": half_denominators,
    "alphas_betas": alphas_betas,
    "native_gradient": native_gradient,
    "half_gradient": half_gradient,
    "exp32": exp32,
    "to_half_bits": to_half_bits,
}



def _get_kernels():
    return _KERNELS


def _as_numpy(x: torch.Tensor) -> tuple[np.ndarray, int]:
    """A numpy view of a contiguous CPU tensor (uint16 bits for fp16/bf16) and its read kind."""
    if x.dtype == torch.float16:
        return x.view(torch.int16).numpy().view(np.uint16), _KIND_F16
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(np.uint16), _KIND_BF16
    return x.numpy(), _KIND_NATIVE


_NP_BITS = {torch.float16: np.int16, torch.bfloat16: np.int16}


def _empty_grad(x: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor like ``x``, allocated by numpy rather than torch.

    The gradient buffer is fresh memory on every call, and first-touch page faults on 4 KiB pages
    cost about as much as the whole loss at these sizes (~0.45 s for 660 MB here). numpy marks large
    allocations MADV_HUGEPAGE (numpy >= 1.18 on Linux >= 4.6; see numpy.core.multiarray
    ._set_madvise_hugepage), so with transparent huge pages in "madvise" or "always" mode the buffer is
    faulted in 2 MiB pages; elsewhere this is an ordinary allocation.
    """
    if x.dtype in _NP_BITS:
        return torch.from_numpy(np.empty(x.shape, _NP_BITS[x.dtype])).view(x.dtype)
    return torch.from_numpy(np.empty(x.shape, np.float64 if x.dtype == torch.float64 else np.float32))


def _set_threads() -> None:
    """Size numba's thread pool to torch's intra-op thread count before the first parallel launch.

    numba launches NUMBA_NUM_THREADS threads (default: the CPU count) on its first parallel call and
    ``numba.set_num_threads`` only masks how many of them work (numba docs, "Setting the Number of
    Threads"). With the OpenMP threading layer the launch also calls omp_set_num_threads(pool size),
    which raises torch's own OpenMP thread count above ``torch.set_num_threads`` for the rest of the
    process. So, unless the user chose NUMBA_NUM_THREADS in the environment, the pool is capped to
    torch's count while it is not yet launched; the variable is set through the environment and
    ``numba.config.reload_config`` (the documented route) so a later config reload keeps it.
    """
    from numba.np.ufunc import parallel

    if not parallel._is_initialized and "NUMBA_NUM_THREADS" not in os.environ:
        n = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
        os.environ["NUMBA_NUM_THREADS"] = str(n)
        numba.config.reload_config()
        parallel.NUM_THREADS = n  # the pool size parallel.py read from config at import
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
    tg, tl, ul = targets.numpy(), logit_lens.numpy(), target_lens.numpy()
    f64 = dict(dtype=torch.float64)
    # per-cell float64 workspaces, 7·8 bytes a cell (≤ 3% of the logits for V ≥ 500 fp32 / 1000 fp16)
    lse, sums, lb, ly = (torch.empty(B, T, U1, **f64) for _ in range(4))
    alpha, beta, ll = torch.empty(B, T, U1, **f64), torch.empty(B, T, U1, **f64), torch.empty(B, **f64)
    wa = [a.numpy() for a in (lse, sums, lb, ly)]
    grad = _empty_grad(x) if need_grad else None  # every element is written (zeros in padding)
    ga = _as_numpy(grad)[0] if need_grad else np.empty((1, 1, 1, 0), xa.dtype)
    if kind == _KIND_NATIVE:
        k["native_denominators"](xa, tg, tl, ul, blank, *wa, ga, need_grad)
    else:
        k["half_denominators"](xa, kind, tg, tl, ul, blank, *wa)
    k["alphas_betas"](lb.numpy(), ly.numpy(), tl, ul, alpha.numpy(), beta.numpy(), ll.numpy(), need_grad)
    if need_grad:
        c = -1.0 if clamp is None else float(clamp)
        lam = float(fastemit_lambda)
        ab = (alpha.numpy(), beta.numpy(), ll.numpy(), lam, c, ga)
        if kind == _KIND_NATIVE:
            k["native_gradient"](tg, tl, ul, blank, wa[1], wa[2], wa[3], *ab)
        else:
            k["half_gradient"](xa, kind, tg, tl, ul, blank, wa[0], wa[2], wa[3], *ab)
    return -(1.0 + fastemit_lambda) * ll, grad


rnnt_loss_numba = fused_rnnt_backend(
    "rnnt_loss_numba",
    numba_cpu_forward,
    """Per-utterance RNN-T costs on CPU (validated inputs expected).

    Args:
        logits: (B, T, U+1, V) CPU fp64/fp32/fp16/bf16. targets: (B, U) int64.
        logit_lens, target_lens: (B,) int64.

    Returns:
        (B,) costs, float32 (float64 for fp64 logits). The gradient is computed in forward and kept
        (one buffer of the logits' size and dtype) until backward.
    """,
)
