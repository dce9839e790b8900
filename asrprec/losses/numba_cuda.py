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

import contextlib
import functools
import math
import os

import torch

from .._optional import require
from .kept_grad import fused_rnnt_backend

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
    def this_cell(T, U1):
        """The lattice cell of this block (one block per cell): its flat index c and (b, t, u)."""
        c = cuda.blockIdx.x
        b = c // (T * U1)
        r = c - b * T * U1
        t = r // U1
        return c, b, t, r - t * U1

    @cuda.jit(device=True)
    def this_utterance(tlens, ulens, T, U1):
        """The utterance of this block (one block per utterance): b, T_b, U_b and its first cell's flat index."""
        b = cuda.blockIdx.x
        return b, tlens[b], ulens[b], b * T * U1

    @cuda.jit(device=True)
    def diagonal(n, Tb, Ub):
        """The first and last u of anti-diagonal t+u = n inside a T_b x (U_b+1) lattice (threads stride over
        them, so U+1 may exceed the block size)."""
        return max(0, n - Tb + 1), min(n, Ub)

    @cuda.jit(device=True)
    def block_reduce(sm, val, take_max):
        """Max (``take_max``) or sum of every thread's ``val`` by a tree reduction in the shared array ``sm``
        (fp32, no warp shuffles, so that it runs in the simulator); every thread gets the result."""
        tid = cuda.threadIdx.x
        sm[tid] = val
        cuda.syncthreads()
        s = cuda.blockDim.x // 2
        while s > 0:
            if tid < s:
                if take_max:
                    sm[tid] = max(sm[tid], sm[tid + s])
                else:
                    sm[tid] += sm[tid + s]
            cuda.syncthreads()
            s //= 2
        out = sm[0]
        cuda.syncthreads()  # sm is free for the next reduction
        return out

    @cuda.jit(device=True)
    def log_denominator(x, base, V, kind, p2, sm):
        """log Σ_v exp(x[base + v]) over the V logits of a row, by the whole block (threads stride over V)."""
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        m = NEG_INF
        for v in range(tid, V, nt):
            m = max(m, read(x, base + v, kind, p2))
        m = block_reduce(sm, m, True)
        if m == NEG_INF:  # a row of -inf logits: avoid inf - inf
            m = ZERO
        acc = ZERO
        for v in range(tid, V, nt):
            acc += math.exp(read(x, base + v, kind, p2) - m)
        return m + math.log(block_reduce(sm, acc, False))

    @cuda.jit(device=True)
    def store(out, i, g, okind):
        """out[i] = g in the gradient's dtype (okind 2: bf16 bits in an int16 array)."""
        if okind == 2:
            out[i] = int16(bf16_bits(g))
        else:
            out[i] = g

    @cuda.jit(device=True)
    def zero_row(out, base, n, okind):
        """Exact zeros in out[base : base + n] (a padded cell's gradient), threads striding."""
        for v in range(cuda.threadIdx.x, n, cuda.blockDim.x):
            if okind == 2:
                out[base + v] = int16(0)
            else:
                out[base + v] = ZERO

    @cuda.jit(device=True)
    def token_gradient(x, base, v, kind, p2, shift, blank, gb, y, gl):
        """d cost / d z_v = softmax_v·c - [v = blank]·G_blank - [v = y]·G_label, softmax_v·c = exp(z_v + shift)."""
        g = math.exp(read(x, base + v, kind, p2) + shift)
        if v == blank:
            g -= gb
        if v == y:
            g -= gl
        return g

    @cuda.jit(device=True)
    def softmax_shift(coef, lse_c):
        """log(coef) - log-denominator, so that softmax·coef = exp(z + shift) (-inf when coef is 0)."""
        if coef > ZERO:
            return math.log(coef) - lse_c
        return NEG_INF

    @cuda.jit
    def denominators(x, kind, p2, targets, tlens, ulens, blank, T, U1, V, lse, lb, ly):
        c, b, t, u = this_cell(T, U1)
        if t >= tlens[b] or u > ulens[b]:
            return  # block-uniform: no thread of this block reaches a barrier
        sm = cuda.shared.array(MAX_THREADS, float32)
        base = c * V
        den = log_denominator(x, base, V, kind, p2, sm)
        if cuda.threadIdx.x == 0:
            lse[c] = den
            lb[c] = read(x, base + blank, kind, p2) - den
            if u < ulens[b]:
                ly[c] = read(x, base + targets[b * (U1 - 1) + u], kind, p2) - den

    @cuda.jit
    def alphas(lb, ly, tlens, ulens, T, U1, alpha, ll):
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
                if u == 0:
                    a = alpha[i - U1] + lb[i - U1]
                elif t == 0:
                    a = alpha[i - 1] + ly[i - 1]
                else:
                    a = logaddexp(alpha[i - U1] + lb[i - U1], alpha[i - 1] + ly[i - 1])
                alpha[i] = a
            cuda.syncthreads()
        if tid == 0:
            last = off + (Tb - 1) * U1 + Ub
            ll[b] = alpha[last] + lb[last]

    @cuda.jit
    def betas(lb, ly, tlens, ulens, T, U1, beta):
        b, Tb, Ub, off = this_utterance(tlens, ulens, T, U1)
        if cuda.threadIdx.x == 0:
            last = off + (Tb - 1) * U1 + Ub
            beta[last] = lb[last]
        cuda.syncthreads()
        for n in range(Tb + Ub - 2, -1, -1):
            u0, u1 = diagonal(n, Tb, Ub)
            for u in range(u0 + cuda.threadIdx.x, u1 + 1, cuda.blockDim.x):
                t = n - u
                i = off + t * U1 + u
                if t == Tb - 1:
                    bb = beta[i + 1] + ly[i]
                elif u == Ub:
                    bb = beta[i + U1] + lb[i]
                else:
                    bb = logaddexp(beta[i + U1] + lb[i], beta[i + 1] + ly[i])
                beta[i] = bb
            cuda.syncthreads()

    @cuda.jit
    def gradient(x, kind, p2, out, okind, targets, tlens, ulens, blank, T, U1, V, lse, lb, ly, alpha, beta, ll, lam, clamp):
        c, b, t, u = this_cell(T, U1)
        base = c * V
        Tb = tlens[b]
        Ub = ulens[b]
        if t >= Tb or u > Ub:
            zero_row(out, base, V, okind)
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
        shift = softmax_shift(gb + gl, lse[c])
        for v in range(cuda.threadIdx.x, V, cuda.blockDim.x):
            g = token_gradient(x, base, v, kind, p2, shift, blank, gb, y, gl)
            if clamp > ZERO:
                g = min(max(g, -clamp), clamp)
            store(out, base + v, g, okind)

    @cuda.jit
    def probe(a):
        i = cuda.grid(1)
        if i < a.size:
            a[i] = a[i] * TWO + ONE

    device_functions.update(
        read=read, bf16_bits=bf16_bits, logaddexp=logaddexp, this_cell=this_cell, this_utterance=this_utterance,
        diagonal=diagonal, log_denominator=log_denominator, store=store, zero_row=zero_row,
        token_gradient=token_gradient, softmax_shift=softmax_shift,
    )
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


def check_logits_dtype(logits: torch.Tensor) -> None:
    """The kernels read fp32, fp16 and bf16 logits; fp64 is the ``torch`` backend's."""
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"numba-cuda takes fp32/fp16/bf16 logits, not {logits.dtype}. Fix: backend='torch' for fp64.")


class KernelLaunch:
    """What every launch of these kernels (and of the TDT kernels) shares: the device check, the contiguous
    logits, the gradient buffer and the dtype codes, and the hand-over of torch tensors to numba.

    ``arr(tensor)``: a flat array view for a kernel (bf16 as int16 bits): a numpy array in the simulator, a
    ``cuda.as_cuda_array`` view on a GPU. ``config(grid, block)``: the launch configuration, on torch's current
    stream on a GPU (the simulator has no streams). ``context``: the device context to launch in.
    """

    def __init__(self, logits: torch.Tensor, targets: torch.Tensor, need_grad: bool, grad_dtype: torch.dtype | None):
        self.sim = _sim()
        if self.sim and logits.device.type != "cpu":
            raise ValueError("under NUMBA_ENABLE_CUDASIM=1 the numba-cuda backend takes CPU tensors.")
        if not self.sim and logits.device.type != "cuda":
            raise ValueError("the numba-cuda backend needs CUDA tensors. Fix: use backend='numba' on CPU.")
        self.x = logits.detach().contiguous()
        self.device = dev = self.x.device
        gdt = grad_dtype or _grad_dtype or self.x.dtype
        self.grad = torch.empty(self.x.shape, dtype=gdt, device=dev) if need_grad else None
        self.kind = 2 if self.x.dtype == torch.bfloat16 else 0
        self.okind = 2 if gdt == torch.bfloat16 else 0
        self.targets = targets.reshape(-1) if targets.numel() else torch.zeros(1, dtype=torch.int64, device=dev)
        if self.sim:
            self._stream, self.context = None, contextlib.nullcontext()
        else:
            self._stream = cuda.external_stream(torch.cuda.current_stream(dev).cuda_stream)
            self.context = cuda.gpus[dev.index]

    def zeros(self, n: int) -> torch.Tensor:
        """A float32 workspace of n elements on the logits' device."""
        return torch.zeros(n, dtype=torch.float32, device=self.device)

    def arr(self, tensor: torch.Tensor):
        flat = tensor.reshape(-1)
        if flat.dtype == torch.bfloat16:
            flat = flat.view(torch.int16)
        return flat.numpy() if self.sim else cuda.as_cuda_array(flat)

    def arrays(self, logit_lens: torch.Tensor, target_lens: torch.Tensor) -> tuple:
        """(logits, gradient or None, targets, logit_lens, target_lens) as kernel arrays."""
        grad = self.arr(self.grad) if self.grad is not None else None
        return self.arr(self.x), grad, self.arr(self.targets), self.arr(logit_lens), self.arr(target_lens)

    def config(self, grid: int, block: int) -> tuple:
        return (grid, block) if self.sim else (grid, block, self._stream)


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
    check_logits_dtype(logits)
    k = _get_kernels()
    launch = KernelLaunch(logits, targets, need_grad, grad_dtype)
    B, T, U1, V = launch.x.shape
    n_cells = B * T * U1
    work = [launch.zeros(n_cells) for _ in range(5)] + [launch.zeros(B)]  # lse, lb, ly, alpha, beta, ll
    tv, dp = _threads["v"], _threads["dp"]
    with launch.context:
        args = kernel_args(
            *launch.arrays(logit_lens, target_lens), launch.arr(_pow2_table(launch.device)),
            [launch.arr(a) for a in work], kind=launch.kind, okind=launch.okind, blank=blank, T=T, U1=U1, V=V,
            clamp=clamp, fastemit_lambda=fastemit_lambda,
        )
        k["denominators"][launch.config(n_cells, tv)](*args["denominators"])
        k["alphas"][launch.config(B, dp)](*args["alphas"])
        if need_grad:
            k["betas"][launch.config(B, dp)](*args["betas"])
            k["gradient"][launch.config(n_cells, tv)](*args["gradient"])
    return -(1.0 + fastemit_lambda) * work[-1], launch.grad


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


rnnt_loss_numba_cuda = fused_rnnt_backend(
    "rnnt_loss_numba_cuda",
    numba_cuda_forward,
    """Per-utterance RNN-T costs with the numba CUDA kernels (validated inputs expected).

    Args:
        logits: (B, T, U+1, V) CUDA (or, in the simulator, CPU) fp32/fp16/bf16.
        targets: (B, U) int64. logit_lens, target_lens: (B,) int64.

    Returns:
        (B,) float32 costs; the gradient is computed in forward and kept until backward.
    """,
)
