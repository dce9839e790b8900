"""numba-cuda kernels in numba's CUDA simulator, against the float64 ``torch`` reference.

The simulator must be switched on before numba is imported, so the cases run in one subprocess
(``sim_cases.py``) that prints JSON; these tests assert on its numbers. Tiny shapes and 4-thread
blocks keep the whole run to a few tens of seconds.
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
        [sys.executable, str(Path(__file__).with_name("sim_cases.py"))],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["name"]: r for r in map(json.loads, proc.stdout.splitlines())}


def test_probe_passes_in_simulator(sim_results):
    assert sim_results["probe"]["ok"], sim_results["probe"]["reason"]


# loss tolerance: fp32 accumulators (the reference sees the same rounded logits in fp64);
# gradient tolerance: the storage dtype's rounding of values of order 1
@pytest.mark.parametrize(
    "name,grad_tol",
    [
        ("fp32", 1e-5),
        ("fp16", 5e-4),  # fp16 spacing at 0.5..1 is 2^-11 ≈ 4.9e-4; round-to-nearest halves it
        ("bf16", 4e-3),  # bf16 spacing at 0.5..1 is 2^-8 ≈ 3.9e-3
        ("ragged_blank_last", 1e-5),
        ("clamp_fastemit", 1e-5),
        ("long_u", 1e-4),  # U+1 = 41 cells per diagonal striding over 4 threads
    ],
)
def test_numba_cuda_matches_reference(sim_results, name, grad_tol):
    r = sim_results[name]
    assert r["loss_rel"] < 1e-6, r
    assert r["grad_err"] < grad_tol, r
    assert r["pad_max"] == 0.0, r


def test_clamp_bounds_gradient(sim_results):
    assert sim_results["clamp_fastemit"]["grad_max"] <= 0.1 + 1e-7


def test_fp16_gradient_storage_error(sim_results):
    """fp16 storage costs about one fp16 rounding (≈2.4e-4 here); fp32 storage leaves only fp32 error."""
    r = sim_results["storage"]
    assert r["dtype_fp16"] == "torch.float16" and r["dtype_fp32"] == "torch.float32"
    assert 1e-5 < r["err_fp16"] < 5e-4, r
    assert r["err_fp32"] < 1e-5, r
