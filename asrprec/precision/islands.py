"""fp32 islands: code that must run in float32 whatever the precision policy.

Numerically sensitive code (feature extraction, normalisation statistics, log-softmax, losses,
positional encodings) declares its island once, where it is defined, with :func:`fp32_island`,
used either as a decorator or as a context manager. It disables autocast for *every* device type
(CPU and CUDA alike; icefall's ``torch.cuda.amp.custom_fwd`` only covers CUDA, which is why its
bf16 training fails on CPU) and, as a decorator, promotes floating inputs to float32.

Modules whose *parameters* must stay float32 when a policy casts the whole model (``bf16``) are
marked with :func:`keep_fp32`; :meth:`PrecisionPolicy.prepare_model` honours the mark.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch

_KEEP_FP32_ATTR = "_asrprec_keep_fp32"
_AUTOCAST_DEVICES = ("cpu", "cuda")


@contextlib.contextmanager
def _autocast_off() -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for dev in _AUTOCAST_DEVICES:
            if dev == "cuda" and not torch.cuda.is_available():
                continue
            stack.enter_context(torch.autocast(device_type=dev, enabled=False))
        yield


def _to_fp32(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype in (torch.float16, torch.bfloat16):
        return x.float()
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
        self._stack: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        cm = _autocast_off()
        cm.__enter__()
        self._stack.append(cm)  # type: ignore[arg-type]

    def __exit__(self, *exc) -> bool:
        cm = self._stack.pop()
        return bool(cm.__exit__(*exc))  # type: ignore[union-attr]

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

        @fp32_island(output="input")      # statistics in fp32, result back in the input's dtype
        def forward(self, x): ...

        with fp32_island():               # a block: autocast off (no input casting)
            loss = rnnt_loss(...)
    """
    island = _Island(output=output)
    if fn is not None:
        return island(fn)
    return island


def keep_fp32(module: torch.nn.Module) -> torch.nn.Module:
    """Mark ``module`` so that a whole-model cast (policy ``bf16``) leaves its parameters in float32."""
    setattr(module, _KEEP_FP32_ATTR, True)
    return module


def is_kept_fp32(module: torch.nn.Module) -> bool:
    return bool(getattr(module, _KEEP_FP32_ATTR, False))
