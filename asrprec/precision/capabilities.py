"""Hardware capability probes for the precision policies.

Each probe *runs* a tiny operation instead of trusting a flag or an environment variable, and returns
the reason when it fails. Tests replace :func:`probe` (``monkeypatch.setattr``) to emulate hardware.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Capabilities:
    """What one device can do; every ``*_why`` is the reason when the matching flag is False."""

    device_type: str
    bf16: bool
    bf16_why: str
    fp16: bool
    fp16_why: str
    grad_scaler: bool
    grad_scaler_why: str


def _try(fn) -> tuple[bool, str]:
    try:
        fn()
        return True, ""
    except Exception as e:  # the probe reports any failure as a reason
        return False, f"{type(e).__name__}: {e}"


class _ProbeSGD:
    """The least a GradScaler steps: ``param_groups`` and ``step()`` (p -= 0.1·grad).

    Not a ``torch.optim.Optimizer``: building one imports torch._dynamo (~2 s on CPU), which a decode script
    would otherwise pay for the probe alone.
    """

    def __init__(self, p: torch.nn.Parameter) -> None:
        self.param_groups = [{"params": [p]}]
        self.stepped = False

    @torch.no_grad()
    def step(self) -> None:
        for p in self.param_groups[0]["params"]:
            p.add_(p.grad, alpha=-0.1)
        self.stepped = True


@functools.lru_cache(maxsize=None)
def probe(device_type: str) -> Capabilities:
    """Probe ``device_type`` ("cpu" or "cuda") by running tiny autocast matmuls and a grad-scaler step."""
    if device_type == "cuda" and not torch.cuda.is_available():
        why = "torch.cuda.is_available() is False (no CUDA GPU or a CPU-only torch build)"
        return Capabilities("cuda", False, why, False, why, False, why)

    def mm(dtype: torch.dtype) -> None:
        a = torch.randn(8, 8, device=device_type)
        with torch.autocast(device_type=device_type, dtype=dtype):
            c = a @ a
        if c.dtype != dtype:
            raise RuntimeError(f"autocast produced {c.dtype}, not {dtype}")
        if not torch.isfinite(c.float()).all():
            raise RuntimeError("non-finite result")

    def bf16() -> None:
        if device_type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
            major, minor = torch.cuda.get_device_capability()
            raise RuntimeError(
                f"this GPU (compute capability {major}.{minor}) has no native bf16; Ampere (8.0) or newer is needed"
            )
        mm(torch.bfloat16)
        torch.ones(4, device=device_type, dtype=torch.bfloat16).sum()

    def scaler() -> None:
        # the probe may run where autograd is off (a decode script's no_grad/inference_mode); it needs a backward
        with torch.inference_mode(False), torch.enable_grad():
            p = torch.nn.Parameter(torch.ones(2, device=device_type))
            opt = _ProbeSGD(p)
            s = torch.amp.GradScaler(device_type, init_scale=2.0)
            s.scale(p.sum()).backward()
            s.step(opt)
            s.update()
            if not opt.stepped or not torch.allclose(p.detach(), torch.full_like(p, 0.9)):
                raise RuntimeError("the grad scaler did not unscale the gradient and step")

    ok_bf16, why_bf16 = _try(bf16)
    ok_fp16, why_fp16 = _try(lambda: mm(torch.float16))
    ok_gs, why_gs = _try(scaler)
    return Capabilities(device_type, ok_bf16, why_bf16, ok_fp16, why_fp16, ok_gs, why_gs)
