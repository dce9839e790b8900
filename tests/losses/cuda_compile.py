"""Compile the numba-cuda loss kernels for real GPU architectures on a machine without a GPU or driver.

Each kernel is built the way a launch builds it, by numba-cuda's own path: the dispatcher's ``_Kernel`` (typing,
lowering, NVVM to PTX) and the code library's ``get_cubin`` (nvJitLink linking the PTX into a cubin). Only two
things are supplied from outside: the compute capability, which numba-cuda asks the driver for while compiling
(``dispatcher.get_current_device`` and ``devices.get_context``), and the ``verbose`` link option, so that the
link log carries ptxas's resource report (registers, shared memory, stack, spills). Loading the cubin, the one
step that needs a device, is never reached.

Run as a script to print the table: ``python tests/losses/cuda_compile.py [sm_80 sm_90 ...]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
import types

import numpy as np

TARGETS = {"sm_80": (8, 0), "sm_86": (8, 6), "sm_89": (8, 9), "sm_90": (9, 0)}
# (logits dtype, gradient dtype) the backend accepts: the gradient in the logits' dtype or in fp32
# (numba_cuda.set_grad_dtype); bf16 travels as int16 bits
DTYPE_PAIRS = [("fp32", "fp32"), ("fp16", "fp16"), ("fp16", "fp32"), ("bf16", "bf16"), ("bf16", "fp32")]
_NP = {"fp32": np.float32, "fp16": np.float16, "bf16": np.int16}

# Register file and limits of compute capability 8.0-9.0 (CUDA C++ Programming Guide, "Technical Specifications
# per Compute Capability"): 64 K 32-bit registers per block, allocated per warp in units of 256; at most 1024
# threads and 48 KB of static shared memory per block.
REGS_PER_BLOCK = 65536
REG_ALLOC_UNIT = 256
MAX_BLOCK = 1024
MAX_STATIC_SMEM = 48 * 1024


@dataclasses.dataclass
class KernelReport:
    target: str
    kernel: str
    logits: str
    grad: str
    registers: int
    smem: int
    stack: int
    spill_stores: int
    spill_loads: int
    f64: int
    cubin_bytes: int

    @property
    def max_block(self) -> int:
        """Largest block (threads) these registers and this shared memory allow."""
        return max_threads_per_block(self.registers, self.smem)


def max_threads_per_block(registers: int, smem: int) -> int:
    if smem > MAX_STATIC_SMEM:
        return 0
    per_warp = -(-registers * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    warps = REGS_PER_BLOCK // max(per_warp, 1)
    return min(MAX_BLOCK, warps * 32)


def count_f64(ptx: str) -> int:
    """PTX instructions (not directives or declarations) that operate on or convert to/from float64."""
    n = 0
    for line in ptx.splitlines():
        line = line.strip()
        if not line or line.startswith((".", "//", "{", "}", "$")):
            continue
        opcode = line.split()[0] if not line.startswith("@") else line.split()[1]
        if ".f64" in opcode or "%fd" in line:
            n += 1
    return n


_PTXAS = {
    "registers": r"Used (\d+) registers",
    "smem": r"(\d+) bytes smem",
    "stack": r"(\d+) bytes stack frame",
    "spill_stores": r"(\d+) bytes spill stores",
    "spill_loads": r"(\d+) bytes spill loads",
}


def parse_ptxas(log: str) -> dict[str, int]:
    """ptxas's resource report in a verbose link log (one kernel per link)."""
    out = {}
    for key, pattern in _PTXAS.items():
        m = re.search(pattern, log)
        if key == "registers" and not m:
            raise ValueError(f"no ptxas resource report in the link log:\n{log}")
        out[key] = int(m.group(1)) if m else 0
    return out


@contextlib.contextmanager
def compile_for(cc: tuple[int, int]):
    """numba-cuda compiles for compute capability ``cc`` with no driver, and links verbosely."""
    from numba.cuda import dispatcher
    from numba.cuda.cudadrv import devices, driver

    device = types.SimpleNamespace(compute_capability=cc, id=0)
    context = types.SimpleNamespace(device=device)
    saved = (dispatcher.get_current_device, devices.get_context, driver._Linker._get_linker_options)
    link_options = driver._Linker._get_linker_options

    def verbose_options(self, ptx):
        return dataclasses.replace(link_options(self, ptx), verbose=True)

    dispatcher.get_current_device = lambda: device
    devices.get_context = lambda devnum=None: context
    driver._Linker._get_linker_options = verbose_options
    try:
        yield
    finally:
        dispatcher.get_current_device, devices.get_context, driver._Linker._get_linker_options = saved


def compile_kernel(kernel, args: tuple) -> tuple[str, bytes, str]:
    """(PTX, cubin, link log) of ``kernel`` (a ``cuda.jit`` dispatcher) for the argument types of ``args``."""
    import numba
    from numba.cuda import dispatcher

    argtypes = tuple(numba.typeof(a) for a in args)
    built = dispatcher._Kernel(kernel.py_func, argtypes, **kernel.targetoptions)
    lib = built._codelibrary
    ptx = lib.get_asm_str()
    cubin = lib.get_cubin()
    log = lib.get_linkerinfo(lib._ensure_cc(None))
    return ptx, bytes(getattr(cubin, "code", cubin)), log


def launch_args(logits: str, grad: str) -> dict[str, tuple]:
    """Host-side stand-ins (numpy arrays and scalars of the launch's types) for every kernel."""
    from asrprec.losses import numba_cuda

    a = lambda name: np.zeros(1, _NP[name])  # noqa: E731
    i64 = lambda: np.zeros(1, np.int64)  # noqa: E731
    work = [np.zeros(1, np.float32) for _ in range(6)]
    args = numba_cuda.kernel_args(
        a(logits), a(grad), i64(), i64(), i64(), np.zeros(1, np.float32), work,
        kind=2 if logits == "bf16" else 0, okind=2 if grad == "bf16" else 0, blank=0, T=1, U1=1, V=1,
        clamp=0.5, fastemit_lambda=0.1,
    )
    args["probe"] = (np.zeros(1, np.float32),)  # numba_cuda_probe's kernel
    from asrprec.losses import tdt_numba_cuda

    args.update(tdt_numba_cuda.tdt_kernel_args(
        a(logits), a(grad), i64(), i64(), i64(), i64(), np.zeros(1, np.float32), work + [np.zeros(1, np.float32)],
        kind=2 if logits == "bf16" else 0, okind=2 if grad == "bf16" else 0, blank=0, T=1, U1=1, V=1, D=1, sigma=0.05,
    ))
    return args


# kernels whose argument types depend on the logits dtype, and on the gradient dtype
LOGITS_TYPED = ("denominators", "gradient", "tdt_denominators", "tdt_gradient")
GRAD_TYPED = ("gradient", "tdt_gradient")


def all_kernels() -> dict:
    """The RNN-T and TDT kernels by launch name."""
    from asrprec.losses import numba_cuda, tdt_numba_cuda

    return {**numba_cuda._get_kernels(), **tdt_numba_cuda._get_kernels()}


def compile_all(targets: list[str] | None = None) -> list[KernelReport]:
    """Every kernel x (logits, gradient) dtype pair x target; a kernel whose types do not depend on a dtype is
    compiled once (its row names the dtypes as ``-``)."""
    kernels = all_kernels()
    rows = []
    for target in targets or list(TARGETS):
        seen = set()
        with compile_for(TARGETS[target]):
            for logits, grad in DTYPE_PAIRS:
                for name, args in launch_args(logits, grad).items():
                    dtypes = (logits if name in LOGITS_TYPED else "-", grad if name in GRAD_TYPED else "-")
                    if (name, dtypes) in seen:
                        continue
                    seen.add((name, dtypes))
                    ptx, cubin, log = compile_kernel(kernels[name], args)
                    rows.append(KernelReport(target, name, *dtypes, **parse_ptxas(log), f64=count_f64(ptx),
                                             cubin_bytes=len(cubin)))
    return rows


def block_sizes() -> dict[str, int]:
    """The block size each kernel is launched with by default."""
    from asrprec.losses import numba_cuda

    v, dp = numba_cuda._threads["v"], numba_cuda._threads["dp"]
    return {"denominators": v, "gradient": v, "alphas": dp, "betas": dp, "probe": 32,
            "tdt_denominators": v, "tdt_gradient": v, "tdt_alphas": dp, "tdt_betas": dp}


def table(rows: list[KernelReport]) -> str:
    blocks = block_sizes()
    lines = ["| target | kernel | logits | grad | registers | smem B | stack B | spill st/ld B | f64 instr | "
             "block used | max block |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.target} | {r.kernel} | {r.logits} | {r.grad} | {r.registers} | {r.smem} | {r.stack} | "
                     f"{r.spill_stores}/{r.spill_loads} | {r.f64} | {blocks[r.kernel]} | {r.max_block} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(compile_all(sys.argv[1:] or None)))
