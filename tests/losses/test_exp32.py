"""The numba backend's vectorisable float32 exp against float64 exp (a textbook reference)."""

import numpy as np
import pytest

numba_cpu = pytest.importorskip("asrprec.losses.numba_cpu")
from numba import njit  # noqa: E402


@njit
def _apply(fn_id, x, out):
    for i in range(x.size):
        out[i] = numba_cpu.exp32(x[i]) if fn_id == 0 else numba_cpu.exp32_nonpos(x[i])




@pytest.mark.parametrize("fn_id,lo,hi", [(0, -87.0, 88.0), (1, -87.0, 0.0)])
def test_exp32_within_about_one_ulp(fn_id, lo, hi):
    x = np.concatenate([np.linspace(lo, hi, 200_001, dtype=np.float32),
                        np.random.default_rng(0).uniform(lo, hi, 200_000).astype(np.float32)])
    out = np.empty_like(x)
    _apply(fn_id, x, out)
    ref = np.exp(x.astype(np.float64))
    ulp = np.spacing(ref.astype(np.float32)).astype(np.float64)
    err = np.abs(out.astype(np.float64) - ref) / ulp
    assert err.max() <= 1.1, err.max()


def test_exp32_special_values():
    x = np.array([np.nan, -np.inf, -200.0, 0.0, 200.0, np.inf], dtype=np.float32)
    out = np.empty_like(x)
    _apply(0, x, out)
    assert np.isnan(out[0])
    assert out[1] == 0.0 and out[2] == 0.0 and out[3] == 1.0
    assert np.isinf(out[4]) and np.isinf(out[5])
