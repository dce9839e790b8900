"""The ``numba-cuda`` backend: fused RNN-T loss kernels written with numba.cuda.

Legend: B batch, T frames, U target tokens (U+1 lattice rows), V vocabulary (blank included).

Kernels (after the layout of NeMo's ``nemo/collections/asr/parts/numba/rnnt_loss/utils/cuda_utils``,
with the differences that matter for low precision and long transcripts):

1. ``denominators`` — one block per lattice cell, threads stride over V; max and sum-exp by a
   shared-memory tree reduction in **fp32** (NeMo's scratch is in the logits' dtype; no warp
   shuffles, so the same code runs in numba's simulator); writes log-sum-exp and the blank and
   label log-probs (B, T, U+1) in fp32.
2. ``alphas`` / ``betas`` — one block per utterance; the block walks the anti-diagonals t+u = n
   and its threads *stride* over the cells of each diagonal, so U+1 may exceed the block size
   (NeMo launches one thread per u, hence its U+1 ≤ 1024 limit, NeMo #4882/#5929).
3. ``gradient`` — one block per cell, threads stride over V; the fused log-softmax gradient (see
   :mod:`asrprec.losses.numba_cpu` for the formula, FastEmit and clamp included) computed in fp32
   registers and stored in the gradient dtype: the logits' dtype by default, or fp32 after
   :func:`set_grad_dtype` (``torch.float32``). Padded cells get exact zeros.

Every accumulator, reduction scratch, α, β and cost is fp32, and so is every operation: ``clamp`` and
FastEmit's λ reach the kernels as fp32 scalars and every constant is an fp32 value, so the PTX holds no
f64 instruction (double precision runs at 1/64 of the fp32 rate on GeForce Ampere/Ada cards; the compile
test tier counts them for sm_80..sm_90 without a GPU). fp16 logits are read natively; bf16
logits are read as raw 16-bit integers (numba has no bfloat16) and converted exactly with a
table of powers of two; fp32→bf16 stores round to nearest even. Storing the gradient in fp16 adds its rounding
error (≤ 2⁻¹¹ relative, fp16's unit roundoff: about 2.4e-4 absolute for gradients of order 0.5;
``tests/losses`` measures it against an fp32-stored gradient).

With ``NUMBA_ENABLE_CUDASIM=1`` (set before numba is imported) the backend takes CPU tensors and
runs the same kernels in numba's simulator. On a GPU, torch tensors are handed over with
``cuda.as_cuda_array`` and kernels run on torch's current stream (``cuda.external_stream``).
"""

from __future__ import annotations

import functools
import math
import os

import torch

from .._optional import require

MAX_THREADS = 1024
_threads = {"v": 128, "dp": 256}  # block sizes: over V (denominators, gradient) and over u (α, β)
_grad_dtype: torch.dtype | None = None
_kernels: dict | None = None
# the device functions other kernel modules build on (the TDT kernels in tdt_numba_cuda), set by _build
device_functions: dict = {}


def _sim() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def set_threads_per_block(v: int | None = None, dp: int | None = None) -> dict:
    """Set the block sizes (powers of two ≤ 1024); returns the previous ones. Tests use tiny blocks
    (e.g. 4) in the simulator, which also exercise the striding over V and over u with U ≫ block."""
    prev = dict(_threads)
    for key, val in (("v", v), ("dp", dp)):
        if val is not None:
            if val < 1 or val > MAX_THREADS or val & (val - 1):
                raise ValueError(f"threads per block must be a power of two in [1, {MAX_THREADS}], got {val}.")
            _threads[key] = val
    return prev


def set_grad_dtype(dtype: torch.dtype | None) -> torch.dtype | None:
    """Store the gradient in ``dtype`` (``torch.float32``) instead of the logits' dtype (``None``).

    fp32 storage doubles the gradient buffer for fp16/bf16 logits. The kept gradient is then exact
    to fp32, and backward scales it by grad_output (e.g. a GradScaler's loss scale) in fp32
    *before* rounding to the logits' dtype, so tiny entries (< 6e-8, which fp16 storage flushes to
    zero) survive and large scales cannot overflow the stored buffer. Returns the previous setting.
    """
    global _grad_dtype
    if dtype not in (None, torch.float32):
        raise ValueError(f"grad dtype must be None (logits' dtype) or torch.float32, got {dtype}.")
    prev, _grad_dtype = _grad_dtype, dtype
    return prev


cuda = None  # numba.cuda, bound on first use: kernels must see it as a *global* (the simulator swaps it)


def _build() -> dict:
    global cuda
    cuda = require("numba.cuda")
    from numba import float32, int16, int32

    # Every constant is an fp32 value: numba types a Python float literal as float64, and one such operand
    # turns the arithmetic around it into fp64 instructions (1/64 of the fp32 rate on consumer GPUs).
    NEG_INF = float32(-math.inf)
    INF = float32(math.inf)
    ZERO = float32(0.0)
    HALF = float32(0.5)
    ONE = float32(1.0)
    TWO = float32(2.0)

    @cuda.jit(device=True)
    def read(x, i, kind, p2):
        """Element i of the flat logits as fp32; kind 2 = bf16 bits held in an int16 array.

        bf16 -> fp32 is exact: (mantissa with its implicit bit) × p2[e], where the 256-entry table
        p2 holds the powers of two 2^(e-134) (2^-133 for e = 0). No bit casts or ldexp, so the very
        same code runs in the simulator.
        """
        if kind == 2:
            bits = int32(x[i]) & 0xFFFF
            e = (bits >> 7) & 0xFF
            m = bits & 0x7F
            if e == 0xFF:
                val = INF if m == 0 else float32(math.nan)
            elif e == 0:
                val = float32(m) * p2[0]
            else:
                val = float32(m | 0x80) * p2[e]
            if bits & 0x8000:
                val = -val
            return val
        return float32(x[i])

    @cuda.jit(device=True)
    def bf16_bits(g):
        """fp32 value -> bf16 bit pattern (int in [-32768, 32767]), round to nearest even."""
        if g != g:
            return int32(0x7FC0)
        sign = int32(0)
        a = g
        if g < ZERO:
            sign = int32(0x8000)
            a = -g
        if a == INF:
            bits = sign | 0x7F80
        elif a == ZERO:
            bits = sign
        else:
            fr, k = math.frexp(a)  # a = fr·2^k, fr in [0.5, 1)
            e = k + 126  # biased exponent of a
            if e >= 1:
                q = fr * float32(256.0)  # 8 significant bits, exact
            else:
                q = a * float32(2.0**64) * float32(2.0**69)  # subnormal: units of 2^-133 (exact scaling)
                e = int32(0)
            mant = int32(math.floor(q))  # q < 2^9: the integer part is exact in fp32
            r = q - float32(mant)
            if r > HALF or (r == HALF and (mant & 1) == 1):
                mant += 1
            if e >= 1:
                if mant == 256:
                    mant = int32(128)
                    e += 1
                bits = (sign | 0x7F80) if e >= 255 else (sign | (e << 7) | (mant - 128))
            else:
                bits = sign | mant  # mant == 128 is exactly the smallest normal's encoding
        if bits >= 0x8000:
            bits -= 0x10000
        return int32(bits)

    @cuda.jit(device=True)
    def logaddexp(a, b):
        if a == NEG_INF:
            return b
        if b == NEG_INF:
            return a
        if a > b:
            return a + math.log1p(math.exp(b - a))
        return b + math.log1p(math.exp(a - b))

    @cuda.jit(device=True)
    def decode(c, T, U1):
        b = c // (T * U1)
        r = c - b * T * U1
        t = r // U1
        return b, t, r - t * U1

    @cuda.jit
    def denominators(x, kind, p2, targets, tlens, ulens, blank, T, U1, V, lse, lb, ly):
        c = cuda.blockIdx.x
        b, t, u = decode(c, T, U1)
        if t >= tlens[b] or u > ulens[b]:
            return  # block-uniform: no thread of this block reaches a barrier
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        sm = cuda.shared.array(MAX_THREADS, float32)
        base = c * V
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
            lb[c] = read(x, base + blank, kind, p2) - den
            if u < ulens[b]:
                ly[c] = read(x, base + targets[b * (U1 - 1) + u], kind, p2) - den

    @cuda.jit
    def alphas(lb, ly, tlens, ulens, T, U1, alpha, ll):
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
                if u == 0:
                    a = alpha[i - U1] + lb[i - U1]
                elif t == 0:
                    a = alpha[i - 1] + ly[i - 1]
                else:
                    a = logaddexp(alpha[i - U1] + lb[i - U1], alpha[i - 1] + ly[i - 1])
                alpha[i] = a
                u += nt
            cuda.syncthreads()
        if tid == 0:
            last = off + (Tb - 1) * U1 + Ub
            ll[b] = alpha[last] + lb[last]

    @cuda.jit
    def betas(lb, ly, tlens, ulens, T, U1, beta):
        b = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        Tb = tlens[b]
        Ub = ulens[b]
        off = b * T * U1
        if tid == 0:
            last = off + (Tb - 1) * U1 + Ub
            beta[last] = lb[last]
        cuda.syncthreads()
        for n in range(Tb + Ub - 2, -1, -1):
            u = max(0, n - Tb + 1) + tid
            umax = min(n, Ub)
            while u <= umax:
                t = n - u
                i = off + t * U1 + u
                if t == Tb - 1:
                    bb = beta[i + 1] + ly[i]
                elif u == Ub:
                    bb = beta[i + U1] + lb[i]
                else:
                    bb = logaddexp(beta[i + U1] + lb[i], beta[i + 1] + ly[i])
                beta[i] = bb
                u += nt
            cuda.syncthreads()

    @cuda.jit
    def gradient(x, kind, p2, out, okind, targets, tlens, ulens, blank, T, U1, V, lse, lb, ly, alpha, beta, ll, lam, clamp):
        c = cuda.blockIdx.x
        b, t, u = decode(c, T, U1)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        base = c * V
        Tb = tlens[b]
        Ub = ulens[b]
        if t >= Tb or u > Ub:
            for v in range(tid, V, nt):
                if okind == 2:
                    out[base + v] = int16(0)
                else:
                    out[base + v] = ZERO
            return
        a = alpha[c]
        L = ll[b]
        gb = ZERO
        if t + 1 < Tb:
            gb = math.exp(a + lb[c] + beta[c + U1] - L)
        elif u == Ub:
            gb = math.exp(a + lb[c] - L)
        gl = ZERO
        y = -1
        if u < Ub:
            gl = (ONE + lam) * math.exp(a + ly[c] + beta[c + 1] - L)
            y = targets[b * (U1 - 1) + u]
        coef = gb + gl
        shift = NEG_INF
        if coef > ZERO:
            shift = math.log(coef) - lse[c]
        for v in range(tid, V, nt):
            g = math.exp(read(x, base + v, kind, p2) + shift)
            if v == blank:
                g -= gb
            if v == y:
                g -= gl
            if clamp > ZERO:
                g = min(max(g, -clamp), clamp)
            if okind == 2:
                out[base + v] = int16(bf16_bits(g))
            else:
                out[base + v] = g

    @cuda.jit
    def probe(a):
        i = cuda.grid(1)
        if i < a.size:
            a[i] = a[i] * TWO + ONE

    device_functions.update(read=read, bf16_bits=bf16_bits, logaddexp=logaddexp)
    return dict(denominators=denominators, alphas=alphas, betas=betas, gradient=gradient, probe=probe, bf16_bits=bf16_bits)


def _get_kernels() -> dict:
    global _kernels
    if _kernels is None:
        _kernels = _build()
    return _kernels


@functools.lru_cache(maxsize=None)
def numba_cuda_probe() -> tuple[bool, str]:
    """Compile and run a tiny kernel; ``(True, "")`` when numba-cuda works here, else ``(False, reason)``.

    A real capability test (NeMo gates on an environment variable and the numba version instead: NVIDIA/NeMo
    ``nemo/core/utils/numba_utils.py``, ``is_numba_cuda_fp16_supported``).
    Under ``NUMBA_ENABLE_CUDASIM=1`` it tests the simulator.
    """
    try:
        require("numba.cuda")
    except ImportError as e:
        return False, str(e)
    try:
        import numpy as np

        kernels = _get_kernels()

        if not _sim():
            if not torch.cuda.is_available():
                return False, "torch sees no CUDA device"
            if not cuda.is_available():
                return False, "numba.cuda finds no usable CUDA driver/device"
        a = np.arange(4, dtype=np.float32)
        d = cuda.to_device(a)
        kernels["probe"][1, 32](d)
        got = d.copy_to_host()
        if not np.array_equal(got, a * 2 + 1):
            return False, f"probe kernel returned {got.tolist()}"
    except Exception as e:  # compilation or launch failure: report, never crash the caller
        return False, f"numba.cuda probe kernel failed: {type(e).__name__}: {e}"
    return True, ""


def numba_cuda_forward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    logit_lens: torch.Tensor,
    target_lens: torch.Tensor,
    blank: int,
    clamp: float | None,
    fastemit_lambda: float,
    need_grad: bool,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Costs (B,) fp32 and, if ``need_grad``, the gradient (B, T, U+1, V) (logits' dtype, or ``grad_dtype``)."""
    k = _get_kernels()
    sim = _sim()
    if sim and logits.device.type != "cpu":
        raise ValueError("under NUMBA_ENABLE_CUDASIM=1 the numba-cuda backend takes CPU tensors.")
    if not sim and logits.device.type != "cuda":
        raise ValueError("the numba-cuda backend needs CUDA tensors. Fix: use backend='numba' on CPU.")
    x = logits.detach().contiguous()
    B, T, U1, V = x.shape
    dev = x.device
    f32 = dict(dtype=torch.float32, device=dev)
    n_cells = B * T * U1
    lse, lb, ly = torch.zeros(n_cells, **f32), torch.zeros(n_cells, **f32), torch.zeros(n_cells, **f32)
    alpha, beta, ll = torch.zeros(n_cells, **f32), torch.zeros(n_cells, **f32), torch.zeros(B, **f32)
    gdt = grad_dtype or _grad_dtype or x.dtype
    grad = torch.empty(x.shape, dtype=gdt, device=dev) if need_grad else None
    kind = 2 if x.dtype == torch.bfloat16 else 0
    okind = 2 if gdt == torch.bfloat16 else 0
    tg = targets.reshape(-1) if targets.numel() else torch.zeros(1, dtype=torch.int64, device=dev)

    def arr(tensor):
        flat = tensor.reshape(-1)
        if flat.dtype == torch.bfloat16:
            flat = flat.view(torch.int16)
        return flat.numpy() if sim else cuda.as_cuda_array(flat)

    tv, dp = _threads["v"], _threads["dp"]
    if sim:
        cfg = lambda grid, block: (grid, block)  # noqa: E731 - the simulator has no streams
        ctx = _nullcontext()
    else:
        stream = cuda.external_stream(torch.cuda.current_stream(dev).cuda_stream)
        cfg = lambda grid, block: (grid, block, stream)  # noqa: E731
        ctx = cuda.gpus[dev.index]
    with ctx:
        args = kernel_args(
            arr(x), arr(grad) if need_grad else None, arr(tg), arr(logit_lens), arr(target_lens),
            arr(_pow2_table(dev)), [arr(a) for a in (lse, lb, ly, alpha, beta, ll)],
            kind=kind, okind=okind, blank=blank, T=T, U1=U1, V=V, clamp=clamp, fastemit_lambda=fastemit_lambda,
        )
        k["denominators"][cfg(n_cells, tv)](*args["denominators"])
        k["alphas"][cfg(B, dp)](*args["alphas"])
        if need_grad:
            k["betas"][cfg(B, dp)](*args["betas"])
            k["gradient"][cfg(n_cells, tv)](*args["gradient"])
    return -(1.0 + fastemit_lambda) * ll, grad


def kernel_args(x, grad, targets, logit_lens, target_lens, p2, work, *, kind: int, okind: int, blank: int, T: int,
                U1: int, V: int, clamp: float | None, fastemit_lambda: float) -> dict[str, tuple]:
    """The argument tuple of each kernel launch (arrays as given: device arrays, or numpy arrays for typing).

    ``work`` = (lse, lb, ly, alpha, beta, ll). Integers stay Python ints (int64 indices); ``clamp`` and
    ``fastemit_lambda`` become ``numpy.float32``, so the kernels see fp32 scalars (a Python float would make
    numba compile the gradient's arithmetic in fp64). One function for the launches and for
    ``tests/losses`` compiling the same signatures without a GPU.
    """
    import numpy as np

    lse, lb, ly, alpha, beta, ll = work
    return {
        "denominators": (x, kind, p2, targets, logit_lens, target_lens, blank, T, U1, V, lse, lb, ly),
        "alphas": (lb, ly, logit_lens, target_lens, T, U1, alpha, ll),
        "betas": (lb, ly, logit_lens, target_lens, T, U1, beta),
        "gradient": (
            x, kind, p2, grad, okind, targets, logit_lens, target_lens, blank, T, U1, V,
            lse, lb, ly, alpha, beta, ll, np.float32(fastemit_lambda), np.float32(-1.0 if clamp is None else clamp),
        ),
    }


@functools.lru_cache(maxsize=None)
def _pow2_table(device: torch.device) -> torch.Tensor:
    """p2[e] = 2^(e-134) (e ≥ 1), p2[0] = 2^-133: exponent scales for exact bf16 -> fp32 reads."""
    e = torch.arange(256, dtype=torch.float64)
    e[0] = 1
    return torch.pow(2.0, e - 134).to(device=device, dtype=torch.float32)


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class _NumbaCudaRNNT(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, logit_lens, target_lens, blank, clamp, fastemit_lambda):
        costs, grad = numba_cuda_forward(
            logits, targets, logit_lens, target_lens, blank, clamp, fastemit_lambda, ctx.needs_input_grad[0]
        )
        ctx.save_for_backward(grad)
        ctx.logits_dtype = logits.dtype
        return costs

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        _scale_rows_(grad, grad_out)  # in place, used once (see numba_cpu)
        if grad.dtype != ctx.logits_dtype:
            # fp32-stored gradient: autograd needs the input's dtype; the cast happens after scaling
            return grad.to(ctx.logits_dtype), None, None, None, None, None, None
        return grad, None, None, None, None, None, None


def rnnt_loss_numba_cuda(
    logits: torch.Tensor,
    targets: torch.Tensor,
    logit_lens: torch.Tensor,
    target_lens: torch.Tensor,
    *,
    blank: int = 0,
    clamp: float | None = None,
    fastemit_lambda: float = 0.0,
) -> torch.Tensor:
    """Per-utterance RNN-T costs with the numba CUDA kernels (validated inputs expected).

    Args:
        logits: (B, T, U+1, V) CUDA (or, in the simulator, CPU) fp32/fp16/bf16.
        targets: (B, U) int64. logit_lens, target_lens: (B,) int64.

    Returns:
        (B,) float32 costs; the gradient is computed in forward and kept until backward.
    """
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"numba-cuda takes fp32/fp16/bf16 logits, not {logits.dtype}. Fix: backend='torch' for fp64.")
    need = logits.requires_grad and torch.is_grad_enabled()
    if not need:
        return numba_cuda_forward(logits, targets, logit_lens, target_lens, blank, clamp, fastemit_lambda, False)[0]
    return _NumbaCudaRNNT.apply(logits, targets, logit_lens, target_lens, blank, clamp, fastemit_lambda)


def _scale_rows_(grad: torch.Tensor, grad_out: torch.Tensor) -> None:
    """grad[b] *= grad_out[b] in place, by Python scalars: a mixed-dtype tensor multiply (fp16 buffer ×
    fp32 grad_out) would materialise a logits-sized fp32 temporary on CPU."""
    scales = grad_out.detach().double().tolist()
    if all(s == 1.0 for s in scales):
        return
    for b, s in enumerate(scales):
        grad[b].mul_(s)

