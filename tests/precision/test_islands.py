"""fp32 islands: the one mechanism every model, loss and decoder uses to run code in float32."""

import re
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import asrprec
from asrprec.precision import autocast_dtype, compute_dtype, fp32_island, upcast, upcast_dtype
from asrprec.precision.memory import autocast_on


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_island_runs_in_fp32_under_cpu_autocast(dtype):
    a = torch.randn(16, 16)
    seen = {}

    @fp32_island
    def f(x):
        seen["autocast"] = torch.is_autocast_enabled("cpu")
        seen["in"] = x.dtype
        return x @ x  # would be low precision under autocast

    with torch.autocast("cpu", dtype=dtype):
        low = a @ a
        out = f(a.to(dtype))
        with fp32_island():
            inner = a @ a
    assert low.dtype == dtype
    assert out.dtype == torch.float32 and seen == {"autocast": False, "in": torch.float32}
    assert inner.dtype == torch.float32
    # the island's matmul is really fp32: compare to float64 (bf16/fp16 would be ~1e-2 off)
    ref = (a.to(dtype).double() @ a.to(dtype).double())
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-4)


def test_fp32_island_output_input_casts_back():
    @fp32_island(output="input")
    def norm(x):
        assert x.dtype == torch.float32
        return x / x.pow(2).mean().sqrt()

    x = torch.randn(8, dtype=torch.bfloat16)
    assert norm(x).dtype == torch.bfloat16


def test_island_functions_report_the_precision_in_force():
    for dt, up in ((torch.float16, torch.float32), (torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                   (torch.float64, torch.float64)):
        x = torch.ones(2, dtype=dt)
        assert upcast_dtype(dt) == up and upcast(x).dtype == up
        assert autocast_dtype(x) is None and compute_dtype(x) == dt
    x = torch.ones(2)
    assert upcast(x) is x  # no copy
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_dtype(x) == torch.bfloat16 and compute_dtype(x) == torch.bfloat16
        with fp32_island():
            assert autocast_dtype(x) is None and compute_dtype(x) == torch.float32
        assert torch.is_autocast_enabled("cpu")  # restored on exit


def test_island_switches_off_cuda_autocast_turned_on_for_fake_tensors():
    """On a machine without CUDA, fake CUDA tensors see CUDA autocast through autocast_on (the memory
    projection); an island must switch it off there too, as it would on a real GPU."""
    with FakeTensorMode():
        x = torch.empty(4, 8, device="cuda")
        with autocast_on("cuda", torch.float16):
            assert (x @ x.t()).dtype == torch.float16
            assert compute_dtype(x) == torch.float16
            with fp32_island():
                assert not torch.is_autocast_enabled("cuda")
                assert (x @ x.t()).dtype == torch.float32
            assert torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.float16

            @fp32_island(output="input")
            def island(v):
                assert v.dtype == torch.float32
                return v @ v.t()

            assert island(x.half()).dtype == torch.float16


def test_island_restores_autocast_when_the_body_raises():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="inside"):
            with fp32_island():
                raise RuntimeError("inside")
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_only_the_precision_package_switches_autocast():
    """Models, losses and decoders declare fp32 islands with asrprec.precision.islands, never with their own
    autocast contexts. The lean loss captures the autocast state of its forward and restores it for the
    recomputation in backward (as torch.utils.checkpoint does), which is not an island."""
    root = Path(asrprec.__file__).parent
    allowed = {"precision/islands.py", "precision/policy.py", "precision/capabilities.py", "precision/memory.py",
               "losses/lean.py"}
    pattern = re.compile(r"torch\.autocast\(|is_autocast_enabled|get_autocast_dtype|set_autocast_enabled")
    offenders = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                       if pattern.search(p.read_text()) and str(p.relative_to(root)) not in allowed)
    assert not offenders, f"autocast switched outside asrprec.precision: {offenders}; use fp32_island"
