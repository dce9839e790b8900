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

cuda = None  # numba.cuda, bound on first use: kernels must see it as a *global* (the simulator swaps it)
_kernels: dict | None = None


def _build() -> dict:
    global cuda
    _rnnt._get_kernels()  # builds the shared device functions
    cuda = _rnnt.cuda
    from numba import float32, int16

    read = _rnnt.device_functions["read"]
    bf16_bits = _rnnt.device_functions["bf16_bits"]
    logaddexp = _rnnt.device_functions["logaddexp"]
    MAX_THREADS = _rnnt.MAX_THREADS
    # fp32 constants only: a Python float literal is typed float64 and drags its arithmetic into fp64
    NEG_INF = float32(-math.inf)
    ZERO = float32(0.0)

    @cuda.jit
    def tdt_denominators(x, kind, p2, targets, tlens, ulens, blank, T, U1, V, D, sigma, lse, lb, ly, ld):
        c = cuda.blockIdx.x
        b = c // (T * U1)
        r = c - b * T * U1
        t = r // U1
        u = r - t * U1
        if t >= tlens[b] or u > ulens[b]:
            return  # block-uniform: no thread of this block reaches a barrier
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        sm = cuda.shared.array(MAX_THREADS, float32)
        base = c * (V + D)
        m = NEG_INF
        for v in range(tid, V, nt):
            m = max(m, read(x, base + v, kind, p2))
        sm[tid] = m
        cuda.syncthreads()
        s = nt // 2
        while s > 0:
            if tid < s:
                sm[tid] = max(sm[tid], sm[tid + s])
            cuda.syncthreads()
            s //= 2
        m = sm[0]
        cuda.syncthreads()
        if m == NEG_INF:
            m = ZERO
        acc = ZERO
        for v in range(tid, V, nt):
            acc += math.exp(read(x, base + v, kind, p2) - m)
        sm[tid] = acc
        cuda.syncthreads()
        s = nt // 2
        while s > 0:
            if tid < s:
                sm[tid] += sm[tid + s]
            cuda.syncthreads()
            s //= 2
        if tid == 0:
            den = m + math.log(sm[0])
            lse[c] = den
            lb[c] = read(x, base + blank, kind, p2) - den - sigma
            if u < ulens[b]:
                ly[c] = read(x, base + targets[b * (U1 - 1) + u], kind, p2) - den - sigma
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
        b = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        Tb = tlens[b]
        Ub = ulens[b]
        off = b * T * U1
        if tid == 0:
            alpha[off] = ZERO
        cuda.syncthreads()
        for n in range(1, Tb + Ub):
            u = max(0, n - Tb + 1) + tid
            umax = min(n, Ub)
            while u <= umax:
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
                u += nt
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
        b = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        Tb = tlens[b]
        Ub = ulens[b]
        off = b * T * U1
        for n in range(Tb + Ub - 1, -1, -1):
            u = max(0, n - Tb + 1) + tid
            umax = min(n, Ub)
            while u <= umax:
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
                u += nt
            cuda.syncthreads()

    @cuda.jit
    def tdt_gradient(x, kind, p2, out, okind, targets, durs, tlens, ulens, blank, T, U1, V, D, lse, lb, ly, ld,
                     alpha, beta, ll):
        c = cuda.blockIdx.x
        b = c // (T * U1)
        r = c - b * T * U1
        t = r // U1
        u = r - t * U1
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        C = V + D
        base = c * C
        Tb = tlens[b]
        Ub = ulens[b]
        L = ll[b]
        if t >= Tb or u > Ub or L == NEG_INF:
            for v in range(tid, C, nt):
                if okind == 2:
                    out[base + v] = int16(0)
                else:
                    out[base + v] = ZERO
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
        shift = NEG_INF
        if coef > ZERO:
            shift = math.log(coef) - lse[c]
        for v in range(tid, C, nt):
            if v < V:
                g = math.exp(read(x, base + v, kind, p2) + shift)
                if v == blank:
                    g -= gb
                if v == y:
                    g -= gl
            else:
                pb, py = arc_posteriors(v - V, t, u, c, Tb, Ub, U1, D, durs, lb, ly, ld, beta, a, L)
                g = math.exp(ld[c * D + v - V]) * coef - (pb + py)
            if okind == 2:
                out[base + v] = int16(bf16_bits(g))
            else:
                out[base + v] = g

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
    k = _get_kernels()
    sim = _rnnt._sim()
    if sim and logits.device.type != "cpu":
        raise ValueError("under NUMBA_ENABLE_CUDASIM=1 the numba-cuda backend takes CPU tensors.")
    if not sim and logits.device.type != "cuda":
        raise ValueError("the numba-cuda backend needs CUDA tensors. Fix: use backend='numba' on CPU.")
    x = logits.detach().contiguous()
    B, T, U1, C = x.shape
    D = len(durations)
    V = C - D
    dev = x.device
    f32 = dict(dtype=torch.float32, device=dev)
    n_cells = B * T * U1
    lse, lb, ly = (torch.zeros(n_cells, **f32) for _ in range(3))
    ld = torch.zeros(n_cells * D, **f32)
    alpha, beta, ll = torch.zeros(n_cells, **f32), torch.zeros(n_cells, **f32), torch.zeros(B, **f32)
    gdt = grad_dtype or _rnnt._grad_dtype or x.dtype
    grad = torch.empty(x.shape, dtype=gdt, device=dev) if need_grad else None
    kind = 2 if x.dtype == torch.bfloat16 else 0
    okind = 2 if gdt == torch.bfloat16 else 0
    tg = targets.reshape(-1) if targets.numel() else torch.zeros(1, dtype=torch.int64, device=dev)
    durs = torch.tensor(durations, dtype=torch.int64, device=dev)

    def arr(tensor):
        flat = tensor.reshape(-1)
        if flat.dtype == torch.bfloat16:
            flat = flat.view(torch.int16)
        return flat.numpy() if sim else cuda.as_cuda_array(flat)

    tv, dp = _rnnt._threads["v"], _rnnt._threads["dp"]
    if sim:
        cfg = lambda grid, block: (grid, block)  # noqa: E731 - the simulator has no streams
        ctx = _rnnt._nullcontext()
    else:
        stream = cuda.external_stream(torch.cuda.current_stream(dev).cuda_stream)
        cfg = lambda grid, block: (grid, block, stream)  # noqa: E731
        ctx = cuda.gpus[dev.index]
    with ctx:
        args = tdt_kernel_args(
            arr(x), arr(grad) if need_grad else None, arr(tg), arr(logit_lens), arr(target_lens), arr(durs),
            arr(_rnnt._pow2_table(dev)), [arr(a) for a in (lse, lb, ly, ld, alpha, beta, ll)],
            kind=kind, okind=okind, blank=blank, T=T, U1=U1, V=V, D=D, sigma=sigma,
        )
        k["tdt_denominators"][cfg(n_cells, tv)](*args["tdt_denominators"])
        k["tdt_alphas"][cfg(B, dp)](*args["tdt_alphas"])
        if need_grad:
            k["tdt_betas"][cfg(B, dp)](*args["tdt_betas"])
            k["tdt_gradient"][cfg(n_cells, tv)](*args["tdt_gradient"])
    return -ll, grad


class _NumbaCudaTDT(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, logit_lens, target_lens, durations, blank, sigma):
        costs, grad = tdt_numba_cuda_forward(
            logits, targets, logit_lens, target_lens, durations, blank, sigma, ctx.needs_input_grad[0]
        )
        ctx.save_for_backward(grad)
        ctx.logits_dtype = logits.dtype
        return costs

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        _rnnt._scale_rows_(grad, grad_out)  # in place, used once (see numba_cpu)
        if grad.dtype != ctx.logits_dtype:
            return grad.to(ctx.logits_dtype), None, None, None, None, None, None
        return grad, None, None, None, None, None, None


def tdt_loss_numba_cuda(
    logits: torch.Tensor,
    targets: torch.Tensor,
    logit_lens: torch.Tensor,
    target_lens: torch.Tensor,
    *,
    durations: tuple[int, ...],
    blank: int = 0,
    sigma: float = 0.0,
) -> torch.Tensor:
    """Per-utterance TDT costs with the numba CUDA kernels (validated inputs expected).

    Args:
        logits: (B, T, U+1, V+D) CUDA (or, in the simulator, CPU) fp32/fp16/bf16.
        targets: (B, U) int64. logit_lens, target_lens: (B,) int64. durations, blank, sigma: see
            :func:`asrprec.losses.tdt_loss`.

    Returns:
        (B,) float32 costs; the gradient is computed in forward and kept until backward.
    """
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"numba-cuda takes fp32/fp16/bf16 logits, not {logits.dtype}. Fix: backend='torch' for fp64.")
    if not (logits.requires_grad and torch.is_grad_enabled()):
        return tdt_numba_cuda_forward(logits, targets, logit_lens, target_lens, durations, blank, sigma, False)[0]
    return _NumbaCudaTDT.apply(logits, targets, logit_lens, target_lens, durations, blank, sigma)
