"""The numba-cuda kernels (RNN-T and TDT) as the real compiler builds them for Ampere (sm_80, sm_86), Ada (sm_89)
and Hopper (sm_90), with no GPU: every kernel x logits dtype x gradient dtype compiles to PTX and links to a cubin; the PTX
holds no fp64 instruction; ptxas reports no spills and a register/shared-memory use that lets every kernel launch
at the block sizes the backend uses (and at 1024 threads, the most ``set_threads_per_block`` allows).

Needs numba-cuda with NVVM, libdevice and nvJitLink (``pip install "numba-cuda[cu13]>=0.30"``, which
``scripts/run_tests.sh`` installs before this tier). Run with ``pytest -m compile -s`` to see the table.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.compile

_spec = importlib.util.spec_from_file_location("asrprec_tests_cuda_compile", Path(__file__).with_name("cuda_compile.py"))
cc = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # registered first: dataclasses need it
_spec.loader.exec_module(cc)


def _numba_cuda_installed() -> bool:
    try:
        from numba.cuda.cudadrv import driver  # noqa: F401  (numba-cuda's package, not numba's bundled stub)
        import numba_cuda  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def reports():
    if not _numba_cuda_installed():
        pytest.fail('the compile tier needs numba-cuda: pip install "numba-cuda[cu13]>=0.30" (scripts/run_tests.sh does)')
    rows = cc.compile_all()
    print("\n" + cc.table(rows))
    return rows


def test_every_kernel_dtype_and_target_compiles(reports):
    kernels = set(cc.all_kernels()) - {"bf16_bits"}  # bf16_bits is a device function
    assert {"tdt_denominators", "tdt_alphas", "tdt_betas", "tdt_gradient"} <= kernels
    for target in cc.TARGETS:
        got = {(r.kernel, r.logits, r.grad) for r in reports if r.target == target}
        assert {k for k, _, _ in got} == kernels
        for gradient, denominators in (("gradient", "denominators"), ("tdt_gradient", "tdt_denominators")):
            assert {(lg, gd) for k, lg, gd in got if k == gradient} == set(cc.DTYPE_PAIRS)
            assert {lg for k, lg, _ in got if k == denominators} == {"fp32", "fp16", "bf16"}
    assert all(r.cubin_bytes > 0 for r in reports)


def test_no_fp64_instruction(reports):
    assert [(r.target, r.kernel, r.logits, r.grad, r.f64) for r in reports if r.f64] == []


def test_no_spills_and_launchable_at_the_backend_block_sizes(reports):
    blocks = cc.block_sizes()
    for r in reports:
        assert r.spill_stores == 0 and r.spill_loads == 0, r
        assert r.max_block >= max(blocks[r.kernel], cc.MAX_BLOCK), r


def test_f64_counter_and_ptxas_parser_on_known_text():
    """The two parsers against hand-written PTX and a ptxas log (so a silent parser cannot pass the tier)."""
    ptx = "\n".join([
        ".reg .f64 %fd<3>;",  # a declaration, not an instruction
        "cvt.f64.f32 %fd1, %f1;",
        "@%p1 add.rn.f64 %fd2, %fd1, 0d3FF0000000000000;",
        "cvt.rn.f32.f64 %f2, %fd2;",
        "add.rn.f32 %f3, %f2, 0f3F800000;",
    ])
    assert cc.count_f64(ptx) == 3
    log = ("ptxas info    : Compiling entry function '_Z8gradient' for 'sm_86'\n"
           "ptxas info    : Function properties for _Z8gradient\n"
           "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 40 registers, used 1 barriers, 4096 bytes smem, 400 bytes cmem[0]")
    assert cc.parse_ptxas(log) == dict(registers=40, smem=4096, stack=8, spill_stores=4, spill_loads=12)
    # 40 registers: 1280 per warp -> 51 warps in 64 K registers -> 1024 threads (the cap); 128 -> 512
    assert cc.max_threads_per_block(40, 0) == 1024 and cc.max_threads_per_block(128, 0) == 512
    assert cc.max_threads_per_block(32, 64 * 1024) == 0
