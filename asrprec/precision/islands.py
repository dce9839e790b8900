"""fp32 islands: code that must run in float32 whatever the precision policy.

Numerically sensitive code (feature extraction, normalisation statistics, log-softmax, losses,
positional encodings, the custom autograd functions of the encoders) declares its island once, where it
is defined, with :func:`fp32_island`, used either as a decorator or as a context manager. It disables
autocast for *every* device type on which it is enabled (CPU and CUDA alike; icefall's
``torch.cuda.amp.custom_fwd`` only covers CUDA, which is why its bf16 training fails on CPU) and, as a
decorator, promotes half-precision inputs to float32.

Inside a hand-written island (an ``autograd.Function``, say) three small functions say what the
surrounding precision is and keep float64 exact for ``gradcheck``:

* :func:`upcast` / :func:`upcast_dtype`: float16/bfloat16 -> float32; float32 and float64 unchanged;
* :func:`autocast_dtype`: the dtype autocast gives matmuls on a tensor's device, or None when off;
* :func:`compute_dtype`: that dtype, or the tensor's own when autocast is off.

Modules whose *parameters* must stay float32 when a policy casts the whole model (``bf16``) are
marked with :func:`keep_fp32`; :meth:`PrecisionPolicy.prepare_model` honours the mark.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch

__all__ = [
    "AUTOCAST_DEVICES", "autocast_dtype", "autocast_without_cache", "compute_dtype", "fp32_island", "is_kept_fp32",
    "keep_fp32", "upcast", "upcast_dtype",
]

_KEEP_FP32_ATTR = "_asrprec_keep_fp32"
#: the device types whose autocast state islands read and switch off
AUTOCAST_DEVICES = ("cpu", "cuda")
_HALF = (torch.float16, torch.bfloat16)


def upcast_dtype(dtype: torch.dtype) -> torch.dtype:
    """float16/bfloat16 -> float32; every other dtype unchanged (float64 stays exact for gradcheck)."""
    return torch.float32 if dtype in _HALF else dtype


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 when it is float16/bfloat16, else ``x`` itself (no copy)."""
    return x.float() if x.dtype in _HALF else x


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast runs matmuls in on ``x``'s device, or None when autocast is off there.

    Reads the dispatcher's state, so it also sees CUDA autocast turned on for fake CUDA tensors on a
    machine without CUDA (:func:`asrprec.precision.memory.autocast_on`).
    """
    dev = x.device.type
    if dev in AUTOCAST_DEVICES and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return None


def autocast_without_cache(device_type: str) -> Any:
    """A context that keeps the autocast state in force on ``device_type`` (on with its dtype, or off) but without
    autocast's cache of cast weights: CUDA-graph capture must not keep reading cached casts, which autocast frees
    when the caller's context exits (torch.cuda.graphs documentation)."""
    if not torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=False)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on ``x`` runs in here: the autocast dtype of its device if enabled, else ``x.dtype``."""
    return autocast_dtype(x) or x.dtype


class _AutocastOff:
    """Autocast off on every device type where it is on; a no-op (no context entered) where it is off.

    ``torch.autocast(device_type, enabled=False)`` needs no device runtime, so it also switches off CUDA
    autocast that was turned on for fake tensors without CUDA.
    """

    __slots__ = ("_entered",)

    def __enter__(self) -> None:
        self._entered = [torch.autocast(device_type=dev, enabled=False)
                         for dev in AUTOCAST_DEVICES if torch.is_autocast_enabled(dev)]
        for cm in self._entered:
            cm.__enter__()

    def __exit__(self, *exc) -> bool:
        for cm in reversed(self._entered):
            cm.__exit__(*exc)
        return False


def _autocast_off() -> Any:
    """:class:`_AutocastOff`, or while ``torch.compile`` traces, the native context it amounts to: dynamo follows
    ``with torch.autocast(...)`` blocks but not a context entered by hand (a graph break per island)."""
    if not torch.compiler.is_compiling():
        return _AutocastOff()
    on = [dev for dev in AUTOCAST_DEVICES if torch.is_autocast_enabled(dev)]
    if not on:
        return contextlib.nullcontext()
    if len(on) == 1:
        return torch.autocast(device_type=on[0], enabled=False)
    return _AutocastOff()


def _to_fp32(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return upcast(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_fp32(v) for v in x)
    return x


def _first_float_dtype(args: tuple, kwargs: dict) -> torch.dtype | None:
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.dtype
    return None


def _cast_floats(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    if isinstance(x, tuple):
        return tuple(_cast_floats(v, dtype) for v in x)
    if isinstance(x, list):
        return [_cast_floats(v, dtype) for v in x]
    return x


class _Island(contextlib.ContextDecorator):
    def __init__(self, output: str = "fp32"):
        if output not in ("fp32", "input"):
            raise ValueError(f"fp32_island(output=...) must be 'fp32' or 'input', got {output!r}")
        self.output = output
        self._stack: list[_AutocastOff] = []

    def __enter__(self) -> None:
        cm = _AutocastOff()
        cm.__enter__()
        self._stack.append(cm)

    def __exit__(self, *exc) -> bool:
        return self._stack.pop().__exit__(*exc)

    def __call__(self, fn: Callable) -> Callable:  # type: ignore[override]
        output = self.output

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            in_dtype = _first_float_dtype(args, kwargs)
            with _autocast_off():
                out = fn(*_to_fp32(args), **{k: _to_fp32(v) for k, v in kwargs.items()})
            if output == "input" and in_dtype is not None:
                out = _cast_floats(out, in_dtype)
            return out

        return wrapper


def fp32_island(fn: Callable | None = None, *, output: str = "fp32"):
    """Run code in float32 with autocast disabled on CPU and CUDA.

    Usage::

        @fp32_island                      # inputs promoted to fp32, outputs stay fp32
        def log_probs(logits): ...

        @fp32_island(output="input")      # statistics in fp32, result back in the first input's dtype
        def forward(self, x): ...

        with fp32_island():               # a block: autocast off (no input casting; see upcast)
            loss = rnnt_loss(...)
    """
    island = _Island(output=output)
    if fn is not None:
        return island(fn)
    if torch.compiler.is_compiling():
        return _autocast_off()
    return island


def keep_fp32(module: torch.nn.Module) -> torch.nn.Module:
    """Mark ``module`` so that a whole-model cast (policy ``bf16``) leaves its parameters in float32."""
    setattr(module, _KEEP_FP32_ATTR, True)
    return module


def is_kept_fp32(module: torch.nn.Module) -> bool:
    return bool(getattr(module, _KEEP_FP32_ATTR, False))
