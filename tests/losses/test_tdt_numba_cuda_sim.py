"""TDT numba-cuda kernels in numba's CUDA simulator, against the float64 ``torch`` TDT reference.

The simulator must be switched on before numba is imported, so the cases run in one subprocess
(``tdt_sim_cases.py``) that prints JSON; these tests assert on its numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.simulator

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sim_results() -> dict:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("tdt_sim_cases.py"))],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["name"]: r for r in map(json.loads, proc.stdout.splitlines())}


# loss: fp32 accumulators against fp64 on the same rounded logits; gradient: one rounding of values of
# order 1 in the storage dtype (torch.finfo(dtype).eps), or fp32 arithmetic
@pytest.mark.parametrize(
    "name,grad_tol",
    [
        ("fp32", 1e-5),
        ("fp16", 2**-10),
        ("bf16", 2**-7),
        ("ragged_sigma_no_zero", 1e-5),
        ("one_frame_per_symbol", 1e-5),
        ("long_u", 1e-4),  # U+1 = 41 cells per diagonal striding over 4 threads
    ],
)
def test_tdt_numba_cuda_matches_reference(sim_results, name, grad_tol):
    r = sim_results[name]
    assert r["same_inf"], r
    assert r["loss_rel"] < 1e-6, r
    assert r["grad_err"] < grad_tol, r
    assert r["pad_max"] == 0.0, r


def test_tdt_fp32_gradient_storage(sim_results):
    """bf16 storage costs one bf16 rounding; fp32 storage (numba_cuda.set_grad_dtype) leaves fp32 error only."""
    r = sim_results["storage"]
    assert r["dtype_bf16"] == "torch.bfloat16" and r["dtype_fp32"] == "torch.float32"
    assert 1e-5 < r["err_bf16"] < 2**-7, r
    assert r["err_fp32"] < 1e-5, r
