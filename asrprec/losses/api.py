"""``rnnt_loss``: one RNN-T loss API in front of a small registry of backends.

Legend: B batch, T encoder frames, U target tokens (the lattice has U+1 rows), V vocabulary
(blank included).

Each backend is registered with the devices and logits dtypes it handles, a probe that says
whether it can run here (and why not), whether it implements ``clamp`` and FastEmit, and an install
hint. Backends return per-utterance costs (B,); reduction happens here, once, for all of them.
An explicit backend that cannot handle the request raises; ``backend="auto"`` picks the fastest
available one for the device and dtype, and never changes the precision of the computation.
(Registry shape after NVIDIA/NeMo ``nemo/collections/asr/losses/rnnt.py``.)
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from .validate import validate_rnnt_inputs

log = logging.getLogger(__name__)

_ALL_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
# the auto choices already reported: (loss, device, dtype, backend)
_AUTO_REPORTED: set[tuple[str, str, torch.dtype, str]] = set()


@dataclass(frozen=True)
class BackendSpec:
    """What a registered backend is and can do.

    ``fn(logits, targets, logit_lens, target_lens, *, blank, clamp, fastemit_lambda) -> (B,)`` costs.
    ``probe() -> (ok, reason)`` must be cheap after its first call (cache inside).
    """

    name: str
    fn: Callable[..., torch.Tensor]
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    probe: Callable[[], tuple[bool, str]]
    install_hint: str = ""
    supports_clamp: bool = True
    supports_fastemit: bool = True
    description: str = ""
    # the TDT loss, ``tdt_fn(logits, targets, logit_lens, target_lens, *, durations, blank, sigma) -> (B,)``;
    # None: this backend has none
    tdt_fn: Callable[..., torch.Tensor] | None = None
    auto_priority: dict[str, int] = field(default_factory=dict)  # device -> rank (lower first); absent: never auto


_REGISTRY: dict[str, BackendSpec] = {}


def register_backend(spec: BackendSpec, *, replace: bool = False) -> None:
    """Add a backend to the registry (``replace=True`` to override an existing name)."""
    if spec.name in _REGISTRY and not replace:
        raise ValueError(f"RNN-T loss backend {spec.name!r} is already registered. Fix: pass replace=True.")
    _REGISTRY[spec.name] = spec


def _lazy(module: str, attr: str) -> Callable:
    """A callable that imports ``asrprec.losses.<module>`` only when first called."""

    def call(*args, **kwargs):
        return getattr(importlib.import_module(f"asrprec.losses.{module}"), attr)(*args, **kwargs)

    call.__name__ = attr
    return call


def _always() -> tuple[bool, str]:
    return True, ""


@functools.lru_cache(maxsize=None)
def _probe_numba() -> tuple[bool, str]:
    try:
        importlib.import_module("numba")
    except ImportError as e:
        return False, f"numba cannot be imported ({e})"
    return True, ""


@functools.lru_cache(maxsize=None)
def _probe_module(name: str) -> tuple[bool, str]:
    from .._optional import is_available

    if not is_available(name):
        return False, f"{name} is not installed"
    try:
        importlib.import_module(name)
    except Exception as e:  # broken installs (ABI mismatch) fail here, not later
        return False, f"{name} is installed but fails to import: {e}"
    return True, ""


def _probe_numba_cuda() -> tuple[bool, str]:
    return _lazy("numba_cuda", "numba_cuda_probe")()


def _sim() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def _register_builtin() -> None:
    register_backend(
        BackendSpec(
            name="torch",
            fn=_lazy("reference", "rnnt_loss_torch"),
            tdt_fn=_lazy("tdt_reference", "tdt_loss_torch"),
            devices=("cpu", "cuda"),
            dtypes=_ALL_DTYPES,
            probe=_always,
            description="vectorised PyTorch reference (autograd; log-softmax buffer + O(B·T·U) recursion)",
            auto_priority={"cpu": 9, "cuda": 9},
        )
    )
    register_backend(
        BackendSpec(
            name="numba",
            fn=_lazy("numba_cpu", "rnnt_loss_numba"),
            tdt_fn=_lazy("tdt_numba_cpu", "tdt_loss_numba"),
            devices=("cpu",),
            dtypes=_ALL_DTYPES,
            probe=_probe_numba,
            install_hint="pip install numba",
            description="fused numba CPU kernels; gradient computed in forward in the logits' dtype",
            auto_priority={"cpu": 0},
        )
    )
    register_backend(
        BackendSpec(
            name="numba-cuda",
            fn=_lazy("numba_cuda", "rnnt_loss_numba_cuda"),
            tdt_fn=_lazy("tdt_numba_cuda", "tdt_loss_numba_cuda"),
            # under NUMBA_ENABLE_CUDASIM=1 the same kernels run in numba's simulator on CPU tensors
            devices=("cpu",) if _sim() else ("cuda",),
            dtypes=(torch.float32, torch.float16, torch.bfloat16),
            probe=_probe_numba_cuda,
            install_hint="pip install 'asrprec[cuda]'  (numba-cuda; needs an NVIDIA driver)",
            description="fused numba CUDA kernels (no U limit); fp32 accumulation, gradient in the logits' dtype",
            auto_priority={"cuda": 0},
        )
    )
    register_backend(
        BackendSpec(
            name="torchaudio",
            fn=_lazy("adapters", "rnnt_loss_torchaudio"),
            devices=("cpu", "cuda"),
            dtypes=(torch.float32, torch.float16),
            probe=functools.partial(_probe_module, "torchaudio"),
            install_hint="pip install 'asrprec[torchaudio]'",
            supports_fastemit=False,
            description="torchaudio.functional.rnnt_loss (fused log-softmax)",
            auto_priority={"cuda": 1},
        )
    )
    register_backend(
        BackendSpec(
            name="k2",
            fn=_lazy("adapters", "rnnt_loss_k2"),
            devices=("cpu", "cuda"),
            dtypes=_ALL_DTYPES,  # computed in an fp32 island (fp64 kept as fp64)
            probe=functools.partial(_probe_module, "k2"),
            install_hint="install k2 for your torch/CUDA version (https://k2-fsa.github.io/k2/installation/)",
            supports_clamp=False,
            supports_fastemit=False,
            description="k2.rnnt_loss (full lattice; fp16/bf16 promoted to fp32)",
        )
    )


_register_builtin()


def available_backends() -> list[dict]:
    """Describe every registered backend: name, available, reason (when not), devices, dtypes, install hint."""
    out = []
    for spec in _REGISTRY.values():
        ok, reason = spec.probe()
        out.append(
            {
                "name": spec.name,
                "available": ok,
                "reason": "" if ok else reason,
                "devices": spec.devices,
                "dtypes": tuple(str(d).replace("torch.", "") for d in spec.dtypes),
                "clamp": spec.supports_clamp,
                "fastemit": spec.supports_fastemit,
                "tdt": spec.tdt_fn is not None,
                "install_hint": spec.install_hint,
                "description": spec.description,
            }
        )
    return out


def _why_not(spec: BackendSpec, device: str, dtype: torch.dtype, clamp, fastemit_lambda, loss: str = "rnnt") -> str:
    """Empty string when ``spec`` can run the request, else the reason."""
    if loss == "tdt" and spec.tdt_fn is None:
        return "it does not implement the TDT loss"
    if device not in spec.devices:
        extra = " (set NUMBA_ENABLE_CUDASIM=1 to run its kernels in the simulator on CPU)" if spec.name == "numba-cuda" else ""
        return f"it runs on {', '.join(spec.devices)} tensors, not {device}{extra}"
    if dtype not in spec.dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in spec.dtypes)
        return f"it accepts {names} logits, not {str(dtype).replace('torch.', '')} (asrprec never casts silently)"
    if clamp is not None and not spec.supports_clamp:
        return "it does not implement clamp"
    if fastemit_lambda and not spec.supports_fastemit:
        return "it does not implement FastEmit (fastemit_lambda != 0)"
    ok, reason = spec.probe()
    if not ok:
        return f"it is unavailable: {reason}. Install: {spec.install_hint}"
    return ""


def resolve_backend(
    backend: str, device: str, dtype: torch.dtype, clamp=None, fastemit_lambda=0.0, *, loss: str = "rnnt"
) -> BackendSpec:
    """The backend that will run a request (``backend="auto"`` resolved), or a ValueError saying why none.

    ``loss="tdt"`` asks for a backend's TDT loss (:func:`asrprec.losses.tdt_loss`) instead of its RNN-T loss.
    """
    kind = "TDT" if loss == "tdt" else "RNN-T"
    if backend == "auto":
        ranked = sorted(
            (s for s in _REGISTRY.values() if device in s.auto_priority), key=lambda s: s.auto_priority[device]
        )
        passed_over = []
        for spec in ranked:
            why = _why_not(spec, device, dtype, clamp, fastemit_lambda, loss)
            if not why:
                _report_auto_choice(kind, device, dtype, spec, passed_over)
                return spec
            passed_over.append(f"{spec.name}: {why}")
        raise ValueError(f"no {kind} loss backend can handle {dtype} logits on {device}. Fix: use backend='torch'.")
    if backend not in _REGISTRY:
        raise ValueError(f"unknown {kind} loss backend {backend!r}. Fix: use one of {sorted(_REGISTRY)} or 'auto'.")
    spec = _REGISTRY[backend]
    why = _why_not(spec, device, dtype, clamp, fastemit_lambda, loss)
    if why:
        raise ValueError(
            f"{kind} loss backend {backend!r} cannot handle this call: {why}. "
            "Fix: pick another backend (see asrprec.losses.available_backends()) or backend='auto'."
        )
    return spec


def _report_auto_choice(kind: str, device: str, dtype: torch.dtype, spec: BackendSpec, passed_over: list[str]) -> None:
    """Log once per (loss, device, dtype) which backend ``auto`` chose; on CUDA, passing over a faster backend
    because it is not installed is a warning naming it and the extra that installs the GPU kernels."""
    key = (kind, device, dtype, spec.name)
    if key in _AUTO_REPORTED:
        return
    _AUTO_REPORTED.add(key)
    dtype_name = str(dtype).replace("torch.", "")
    log.info("%s loss backend='auto' chose %s for %s logits on %s", kind, spec.name, dtype_name, device)
    missing = [why for why in passed_over if ": it is unavailable: " in why]
    if device == "cuda" and missing:
        log.warning("the %s loss falls back to the slower %s backend on CUDA because a faster one is not installed "
                    "(%s). Fix: pip install 'asrprec[cuda]' for the numba-cuda kernels", kind, spec.name,
                    "; ".join(missing))


def rnnt_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    logit_lens: torch.Tensor,
    target_lens: torch.Tensor,
    *,
    blank: int = 0,
    reduction: str = "mean",
    backend: str = "auto",
    clamp: float | None = None,
    fastemit_lambda: float = 0.0,
) -> torch.Tensor:
    """RNN-T (transducer) loss with the log-softmax fused in.

    Legend: B batch, T encoder frames, U target tokens (U+1 lattice rows), V vocabulary (blank included).

    Args:
        logits: (B, T, U+1, V) raw joint output, fp32, fp16 or bf16 (fp64 with ``torch``/``numba``).
            Never cast by this function: the backends read low precision and compute in fp32 or better.
        targets: (B, U) integer, padded; entries beyond ``target_lens[b]`` are ignored.
        logit_lens: (B,) integer frames per utterance, 1 ≤ T_b ≤ T.
        target_lens: (B,) integer tokens per utterance, 0 ≤ U_b ≤ U.
        blank: blank id in [0, V).
        reduction: ``"mean"`` — mean over the batch of the per-utterance losses (NeMo's default
            ``mean_batch`` and torchaudio's ``mean``; *not* divided by target lengths); ``"sum"``;
            ``"none"`` — the (B,) per-utterance losses.
        backend: ``"auto"`` (CPU: numba; CUDA: numba-cuda, else torchaudio, else torch) or one of
            ``torch``, ``numba``, ``numba-cuda``, ``torchaudio``, ``k2``.
        clamp: if set (> 0), each utterance's gradient w.r.t. the logits is clamped to
            [-clamp, clamp] before it is scaled by the incoming gradient (torchaudio/NeMo semantics).
        fastemit_lambda: FastEmit λ (arXiv 2010.11148, NeMo's convention): label-emission gradient
            terms scaled by (1+λ); the returned loss is (1+λ)·NLL.

    Returns:
        float32 loss (float64 for fp64 logits): a scalar, or (B,) for ``reduction="none"``.

    Raises:
        ValueError: bad inputs (see :func:`validate_rnnt_inputs`), an unknown reduction, or a backend
            that cannot handle the device, dtype or options.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}.")
    if clamp is not None and not clamp > 0:
        raise ValueError(f"clamp must be None or > 0, got {clamp!r}. Fix: use clamp=None to disable clamping.")
    if fastemit_lambda < 0:
        raise ValueError(f"fastemit_lambda must be ≥ 0, got {fastemit_lambda}.")
    targets, logit_lens, target_lens = validate_rnnt_inputs(logits, targets, logit_lens, target_lens, blank=blank)
    spec = resolve_backend(backend, logits.device.type, logits.dtype, clamp, fastemit_lambda)
    costs = spec.fn(
        logits, targets, logit_lens, target_lens, blank=blank, clamp=clamp, fastemit_lambda=float(fastemit_lambda)
    )
    if reduction == "mean":
        return costs.mean()
    if reduction == "sum":
        return costs.sum()
    return costs
