"""The ``numba-cuda`` TDT backend: fused TDT loss kernels written with numba.cuda.

Legend: B batch, T frames, U target tokens (U+1 lattice rows), V vocabulary (blank included), D durations.
Lattice and gradient formulas: :mod:`asrprec.losses.tdt` and :mod:`asrprec.losses.tdt_numba_cpu`.

The kernels of :mod:`asrprec.losses.numba_cuda` (same block geometry, the same bf16 reads and stores, the
same fp32-only arithmetic: zero fp64 instructions, checked by the compile test tier), with the duration
columns added:

1. ``tdt_denominators`` — one block per cell; fp32 shared-memory max / sum-exp over the V token columns,
   then the D duration log-probs (thread 0; D is a handful);
2. ``tdt_alphas`` / ``tdt_betas`` — one block per utterance walking the anti-diagonals n = t+u: a blank of
   duration d joins diagonal n to n+d, a token of duration d joins n to n+d+1, so every arc points to a
   later diagonal and each diagonal needs only finished ones. Threads stride over the cells of a diagonal,
   so U has no limit (NeMo's TDT kernels launch one thread per u: U+1 ≤ 1024);
3. ``tdt_gradient`` — one block per cell, threads stride over the V + D columns.

NeMo's TDT kernels (NVIDIA/NeMo ``nemo/collections/asr/parts/numba/rnnt_loss/utils/cuda_utils/gpu_rnnt_kernel.py``,
``compute_tdt_*_kernel``) assume durations[0] = 0 and durations[1] = 1; these take any strictly increasing set
containing 1, and fp16/bf16 logits (NeMo forces fp32).
"""

from __future__ import annotations

import math

import torch

from . import numba_cuda as _rnnt
from .kept_grad import fused_tdt_backend

cuda = None  # numba.cuda, bound on first use: kernels must see it as a *global* (the simulator swaps it)
_kernels: dict | None = None


def _build() -> dict:
    global cuda
    _rnnt._get_kernels()  # builds the shared device functions
    cuda = _rnnt.cuda
    from numba import float32

    f = _rnnt.device_functions
    read, logaddexp, this_cell, this_utterance = f["read"], f["logaddexp"], f["this_cell"], f["this_utterance"]
    diagonal, log_denominator, store, zero_row = f["diagonal"], f["log_denominator"], f["store"], f["zero_row"]
    token_gradient, softmax_shift = f["token_gradient"], f["softmax_shift"]
    MAX_THREADS = _rnnt.MAX_THREADS
    # fp32 constants only: a Python float literal is typed float64 and drags its arithmetic into fp64
    NEG_INF = float32(-math.inf)
    ZERO = float32(0.0)

    @cuda.jit
    def tdt_denominators(x, kind, p2, targets, tlens, ulens, blank, T, U1, V, D, sigma, lse, lb, ly, ld):
        c, b, t, u = this_cell(T, U1)
        if t >= tlens[b] or u > ulens[b]:
            return  # block-uniform: no thread of this block reaches a barrier
        sm = cuda.shared.array(MAX_THREADS, float32)
        base = c * (V + D)
        den = log_denominator(x, base, V, kind, p2, sm)
        if cuda.threadIdx.x == 0:
            lse[c] = den
            lb[c] = read(x, base + blank, kind, p2) - den - sigma
            if u < ulens[b]:
                ly[c] = read(x, base + targets[b * (U1 - 1) + u], kind, p2) - den - sigma
            # the D duration logits: a handful, log-softmaxed by this one thread
            dm = NEG_INF
            for j in range(D):
                dm = max(dm, read(x, base + V + j, kind, p2))
            if dm == NEG_INF:
                dm = ZERO
            ds = ZERO
            for j in range(D):
                ds += math.exp(read(x, base + V + j, kind, p2) - dm)
            dden = dm + math.log(ds)
            for j in range(D):
                ld[c * D + j] = read(x, base + V + j, kind, p2) - dden

    @cuda.jit
    def tdt_alphas(lb, ly, ld, durs, tlens, ulens, T, U1, D, alpha, ll):
        b, Tb, Ub, off = this_utterance(tlens, ulens, T, U1)
        tid = cuda.threadIdx.x
        if tid == 0:
            alpha[off] = ZERO
        cuda.syncthreads()
        for n in range(1, Tb + Ub):
            u0, u1 = diagonal(n, Tb, Ub)
            for u in range(u0 + tid, u1 + 1, cuda.blockDim.x):
                t = n - u
                i = off + t * U1 + u
                a = NEG_INF
                for j in range(D):
                    d = durs[j]
                    if t >= d:
                        k = i - d * U1  # (t-d, u)
                        if d > 0:
                            a = logaddexp(a, alpha[k] + lb[k] + ld[k * D + j])
                        if u > 0:
                            a = logaddexp(a, alpha[k - 1] + ly[k - 1] + ld[(k - 1) * D + j])
                alpha[i] = a
            cuda.syncthreads()
        if tid == 0:
            total = NEG_INF
            for j in range(D):
                d = durs[j]
                if d > 0 and Tb >= d:
                    k = off + (Tb - d) * U1 + Ub
                    total = logaddexp(total, alpha[k] + lb[k] + ld[k * D + j])
            ll[b] = total

    @cuda.jit(device=True)
    def arc_posteriors(j, t, u, i, Tb, Ub, U1, D, durs, lb, ly, ld, beta, a, L):
        """(blank, label) posteriors of leaving cell i = (t, u) with duration index j."""
        d = durs[j]
        e = t + d
        pb = ZERO
        if d > 0:
            if e < Tb:
                pb = math.exp(a + lb[i] + ld[i * D + j] + beta[i + d * U1] - L)
            elif e == Tb and u == Ub:
                pb = math.exp(a + lb[i] + ld[i * D + j] - L)
        py = ZERO
        if u < Ub and e < Tb:
            py = math.exp(a + ly[i] + ld[i * D + j] + beta[i + d * U1 + 1] - L)
        return pb, py

    @cuda.jit
    def tdt_betas(lb, ly, ld, durs, tlens, ulens, T, U1, D, beta):
        b, Tb, Ub, off = this_utterance(tlens, ulens, T, U1)
        for n in range(Tb + Ub - 1, -1, -1):
            u0, u1 = diagonal(n, Tb, Ub)
            for u in range(u0 + cuda.threadIdx.x, u1 + 1, cuda.blockDim.x):
                t = n - u
                i = off + t * U1 + u
                v = NEG_INF
                for j in range(D):
                    d = durs[j]
                    e = t + d
                    if d > 0:
                        if e < Tb:
                            v = logaddexp(v, beta[i + d * U1] + lb[i] + ld[i * D + j])
                        elif e == Tb and u == Ub:
                            v = logaddexp(v, lb[i] + ld[i * D + j])
                    if u < Ub and e < Tb:
                        v = logaddexp(v, beta[i + d * U1 + 1] + ly[i] + ld[i * D + j])
                beta[i] = v
            cuda.syncthreads()

    @cuda.jit
    def tdt_gradient(x, kind, p2, out, okind, targets, durs, tlens, ulens, blank, T, U1, V, D, lse, lb, ly, ld,
                     alpha, beta, ll):
        c, b, t, u = this_cell(T, U1)
        C = V + D
        base = c * C
        Tb = tlens[b]
        Ub = ulens[b]
        L = ll[b]
        if t >= Tb or u > Ub or L == NEG_INF:
            zero_row(out, base, C, okind)
            return
        a = alpha[c]
        gb = ZERO
        gl = ZERO
        for j in range(D):
            pb, py = arc_posteriors(j, t, u, c, Tb, Ub, U1, D, durs, lb, ly, ld, beta, a, L)
            gb += pb
            gl += py
        y = -1
        if u < Ub:
            y = targets[b * (U1 - 1) + u]
        coef = gb + gl
        shift = softmax_shift(coef, lse[c])
        for v in range(cuda.threadIdx.x, C, cuda.blockDim.x):
            if v < V:
                g = token_gradient(x, base, v, kind, p2, shift, blank, gb, y, gl)
            else:
                pb, py = arc_posteriors(v - V, t, u, c, Tb, Ub, U1, D, durs, lb, ly, ld, beta, a, L)
                g = math.exp(ld[c * D + v - V]) * coef - (pb + py)
            store(out, base + v, g, okind)

    return dict(tdt_denominators=tdt_denominators, tdt_alphas=tdt_alphas, tdt_betas=tdt_betas,
                tdt_gradient=tdt_gradient)


def _get_kernels() -> dict:
    global _kernels
    if _kernels is None:
        _kernels = _build()
    return _kernels


def tdt_kernel_args(x, grad, targets, logit_lens, target_lens, durs, p2, work, *, kind: int, okind: int, blank: int,
                    T: int, U1: int, V: int, D: int, sigma: float) -> dict[str, tuple]:
    """The argument tuple of each kernel launch (device arrays, or numpy arrays for typing in the compile tier).

    ``work`` = (lse, lb, ly, ld, alpha, beta, ll). ``sigma`` becomes ``numpy.float32`` so that the kernels
    see an fp32 scalar (a Python float would compile its arithmetic in fp64).
    """
    import numpy as np

    lse, lb, ly, ld, alpha, beta, ll = work
    return {
        "tdt_denominators": (x, kind, p2, targets, logit_lens, target_lens, blank, T, U1, V, D, np.float32(sigma),
                             lse, lb, ly, ld),
        "tdt_alphas": (lb, ly, ld, durs, logit_lens, target_lens, T, U1, D, alpha, ll),
        "tdt_betas": (lb, ly, ld, durs, logit_lens, target_lens, T, U1, D, beta),
        "tdt_gradient": (x, kind, p2, grad, okind, targets, durs, logit_lens, target_lens, blank, T, U1, V, D,
                         lse, lb, ly, ld, alpha, beta, ll),
    }


def tdt_numba_cuda_forward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    logit_lens: torch.Tensor,
    target_lens: torch.Tensor,
    durations: tuple[int, ...],
    blank: int,
    sigma: float,
    need_grad: bool,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Costs (B,) fp32 (+inf when infeasible) and, if ``need_grad``, the gradient (B, T, U+1, V+D) in the
    logits' dtype (or ``grad_dtype``, or the setting of :func:`asrprec.losses.numba_cuda.set_grad_dtype`)."""
    _rnnt.check_logits_dtype(logits)
    k = _get_kernels()
    launch = _rnnt.KernelLaunch(logits, targets, need_grad, grad_dtype)
    B, T, U1, C = launch.x.shape
    D = len(durations)
    n_cells = B * T * U1
    lse, lb, ly, alpha, beta = (launch.zeros(n_cells) for _ in range(5))
    work = [lse, lb, ly, launch.zeros(n_cells * D), alpha, beta, launch.zeros(B)]  # ld: (B·T·(U+1), D)
    durs = torch.tensor(durations, dtype=torch.int64, device=launch.device)
    tv, dp = _rnnt._threads["v"], _rnnt._threads["dp"]
    with launch.context:
        x, grad, tg, tl, ul = launch.arrays(logit_lens, target_lens)
        args = tdt_kernel_args(
            x, grad, tg, tl, ul, launch.arr(durs), launch.arr(_rnnt._pow2_table(launch.device)),
            [launch.arr(a) for a in work], kind=launch.kind, okind=launch.okind, blank=blank, T=T, U1=U1, V=C - D,
            D=D, sigma=sigma,
        )
        k["tdt_denominators"][launch.config(n_cells, tv)](*args["tdt_denominators"])
        k["tdt_alphas"][launch.config(B, dp)](*args["tdt_alphas"])
        if need_grad:
            k["tdt_betas"][launch.config(B, dp)](*args["tdt_betas"])
            k["tdt_gradient"][launch.config(n_cells, tv)](*args["tdt_gradient"])
    return -work[-1], launch.grad


tdt_loss_numba_cuda = fused_tdt_backend(
    "tdt_loss_numba_cuda",
    tdt_numba_cuda_forward,
    """Per-utterance TDT costs with the numba CUDA kernels (validated inputs expected).

    Args:
        logits: (B, T, U+1, V+D) CUDA (or, in the simulator, CPU) fp32/fp16/bf16.
        targets: (B, U) int64. logit_lens, target_lens: (B,) int64. durations, blank, sigma: see
            :func:`asrprec.losses.tdt_loss`.

    Returns:
        (B,) float32 costs; the gradient is computed in forward and kept until backward.
    """,
)
