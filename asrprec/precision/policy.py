"""The precision policy: one named, immutable, validated object that the training loop obeys.

=============  ==================  ====================  ===========  ==============================
policy         parameters (train)  compute               grad scaler  optimizer update
=============  ==================  ====================  ===========  ==============================
``fp32``       fp32                fp32                  no-op        fp32
``amp-fp16``   fp32                autocast fp16         GradScaler   fp32
``amp-bf16``   fp32                autocast bf16         no-op        fp32
``bf16``       bf16 (whole cast)   bf16                  no-op        ``bf16_update``: fp32 master
                                                                          weights (default), ``kahan``,
                                                                          ``stochastic`` or ``none``
=============  ==================  ====================  ===========  ==============================

fp32 islands (features, log-softmax, the loss, normalisation statistics) stay fp32 under every policy
(see :mod:`asrprec.precision.islands`). A policy the hardware cannot run raises
:class:`UnsupportedPrecisionError` naming the reason; it is never silently downgraded.

Why ``bf16`` needs an update rule: bf16 has an 8-bit mantissa, so an update smaller than 2^-9 of a
weight's magnitude rounds away entirely (with Adam-style lr 1e-3..5e-2 relative updates and weights near
0.1, most late-training updates are lost). icefall's full-bf16 runs (PR #1700) lost about 5 % relative
WER. ``master`` keeps an fp32 copy in the optimizer (4 bytes per parameter plus its fp32 gradient during
the step); ``kahan`` keeps a bf16 compensation buffer (2 bytes) and ``stochastic`` rounds the fp32-computed
update stochastically (no buffer), the two remedies of Zamirai et al. (arXiv 2010.06192); ``none``
reproduces the naive behaviour for comparison. ``bf16_moments`` stores the optimizer's moment buffers in
bf16 too (not with ``master``). The rules and the bytes per parameter: :mod:`asrprec.optim.bf16_update`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, ContextManager, Iterable, Mapping

import torch

from asrprec.errors import AsrprecError
from asrprec.optim.bf16_attach import with_bf16_update
from asrprec.optim.bf16_update import UPDATES as BF16_UPDATES
from asrprec.optim.bf16_update import Bf16Update

from . import capabilities
from .islands import is_kept_fp32
from .master import MasterWeightOptimizer
from .scaler import LossScaler, NoOpScaler

POLICIES = ("fp32", "amp-fp16", "amp-bf16", "bf16")


class UnsupportedPrecisionError(AsrprecError, RuntimeError):
    """The requested precision policy cannot run on this device."""


@dataclass(frozen=True)
class PrecisionPolicy:
    """A resolved precision policy for one device. Build it with :func:`get_policy`."""

    name: str
    device: torch.device
    param_dtype: torch.dtype  # dtype of the trained parameters
    compute_dtype: torch.dtype  # dtype most matmuls/convolutions run in
    autocast_enabled: bool
    grad_scaler: bool
    bf16_update: str = "master"
    # keyword arguments of the LossScaler, read-only like every other field
    scaler_kwargs: Mapping[str, Any] = field(default_factory=dict)
    bf16_moments: bool = False  # bf16 only, not with "master": the optimizer's moment buffers in bf16

    def __post_init__(self) -> None:
        object.__setattr__(self, "scaler_kwargs", MappingProxyType(dict(self.scaler_kwargs)))

    def __getstate__(self) -> dict[str, Any]:  # a mappingproxy does not pickle; its dict does
        return {**self.__dict__, "scaler_kwargs": dict(self.scaler_kwargs)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, scaler_kwargs=MappingProxyType(dict(state["scaler_kwargs"])))

    # -- training ---------------------------------------------------------------------------------
    def autocast(self) -> ContextManager:
        """The context the forward pass and loss run in (a no-op context when autocast is off)."""
        if not self.autocast_enabled:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move ``model`` to the device and, for ``bf16``, cast it, keeping modules marked ``keep_fp32``."""
        model = model.to(self.device)
        if self.param_dtype != torch.float32:
            _cast_model(model, self.param_dtype)
        return model

    def make_scaler(self, **overrides: Any) -> LossScaler:
        """A real GradScaler (with health checks) for ``amp-fp16``; a no-op scaler otherwise."""
        kw = {**self.scaler_kwargs, **overrides}
        if self.grad_scaler:
            return LossScaler(self.device.type, **kw)
        return NoOpScaler(**{k: v for k, v in kw.items() if k in NoOpScaler.ACCEPTS})

    def build_optimizer(self, params: Iterable, factory: Callable[[Any], torch.optim.Optimizer]):
        """Build the optimizer with ``factory(params)``; under ``bf16`` make it write bf16 weights by
        ``bf16_update``: fp32 masters around any optimizer, or a rule that ScaledAdam and AdamW take
        (:func:`asrprec.optim.with_bf16_update`; other optimizers raise ValueError).

        ``params`` is anything a torch optimizer accepts (tensors or param-group dicts).
        """
        if self.param_dtype != torch.bfloat16:
            return factory(params)
        if self.bf16_update == "master":
            return MasterWeightOptimizer(params, factory)
        rule = Bf16Update(self.bf16_update, moments="bf16" if self.bf16_moments else "fp32")
        return with_bf16_update(factory(params), rule)

    # -- inference --------------------------------------------------------------------------------
    def inference_dtype(self) -> torch.dtype:
        return self.compute_dtype

    def prepare_for_inference(self, model: torch.nn.Module) -> torch.nn.Module:
        """Eval mode, no grads, and for low-precision policies a whole-model cast (NeMo PR #9198).

        Casting beats autocast at inference (no per-call weight re-casts, no fp32 ping-pong); modules
        marked ``keep_fp32`` (the feature extractor, positional tables computed in fp32) stay fp32.
        """
        model = model.to(self.device).eval()
        model.requires_grad_(False)
        dtype = self.inference_dtype()
        if dtype != torch.float32:
            _cast_model(model, dtype)
        return model

    # -- reporting --------------------------------------------------------------------------------
    def describe(self) -> dict[str, str]:
        """The effective dtypes, for the log, tensorboard and checkpoints."""
        return {
            "policy": self.name,
            "device": str(self.device),
            "param_dtype": _dt(self.param_dtype),
            "compute_dtype": _dt(self.compute_dtype),
            "autocast": str(self.autocast_enabled),
            "grad_scaler": "GradScaler" if self.grad_scaler else "none",
            "optimizer_update": (_UPDATE_WORDS[self.bf16_update] if self.param_dtype == torch.bfloat16 else "fp32"),
            "optimizer_state": "bfloat16" if self.bf16_moments else "float32",
            "loss_dtype": "float32",
        }


_UPDATE_WORDS = {"master": "fp32 master weights", "kahan": "bf16 + Kahan compensation (bf16)",
                 "stochastic": "bf16, stochastic rounding", "none": "bf16 (naive, round to nearest)"}


def _dt(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def _cast_model(model: torch.nn.Module, dtype: torch.dtype) -> None:
    kept = [m for m in model.modules() if is_kept_fp32(m)]
    model.to(dtype)
    for m in kept:
        m.float()


def effective_dtypes(model: torch.nn.Module) -> dict[str, int]:
    """Number of parameter elements per dtype (what really happened to the model)."""
    out: dict[str, int] = {}
    for p in model.parameters():
        out[_dt(p.dtype)] = out.get(_dt(p.dtype), 0) + p.numel()
    return out


def get_policy(
    name: str,
    device: str | torch.device = "cpu",
    *,
    bf16_update: str = "master",
    bf16_moments: bool = False,
    **scaler_kwargs: Any,
) -> PrecisionPolicy:
    """Resolve the policy ``name`` for ``device``; raise with the reason if this hardware cannot run it.

    Args:
        name: ``"fp32"``, ``"amp-fp16"``, ``"amp-bf16"`` or ``"bf16"``.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
        bf16_update: for ``bf16`` only: ``"master"`` (fp32 master weights, default), ``"kahan"``,
            ``"stochastic"`` or ``"none"`` (naive bf16 updates, for comparison); see
            :mod:`asrprec.optim.bf16_update`.
        bf16_moments: for ``bf16`` with ``kahan``, ``stochastic`` or ``none``: keep the optimizer's moment
            buffers in bf16 (stochastically rounded).
        scaler_kwargs: passed to :class:`~asrprec.precision.scaler.LossScaler` (``init_scale``,
            ``warn_floor``, ``abort_floor``...).
    """
    if name not in POLICIES:
        hint = ""
        low = name.lower().replace("_", "-")
        if low in ("fp16", "float16", "half"):
            hint = " (fp16 training needs a grad scaler: use 'amp-fp16')"
        elif low in ("bfloat16", "full-bf16"):
            hint = " (use 'bf16' for a whole-model cast or 'amp-bf16' for autocast)"
        elif low in POLICIES:
            hint = f" (did you mean {low!r}?)"
        raise ValueError(f"unknown precision policy {name!r}{hint}; choose one of {', '.join(POLICIES)}")
    if bf16_update not in BF16_UPDATES:
        raise ValueError(f"bf16_update must be one of {BF16_UPDATES}, got {bf16_update!r}")
    if name != "bf16" and (bf16_update != "master" or bf16_moments):
        raise ValueError(f"--bf16-update {bf16_update}{' --bf16-moments' if bf16_moments else ''} applies to the "
                         f"bf16 policy only (policy {name!r} trains fp32 weights with an fp32 optimizer). Fix: use "
                         "--precision bf16, or drop the flag")
    if bf16_moments and bf16_update == "master":
        raise ValueError("bf16_moments needs --bf16-update kahan, stochastic or none: fp32 master weights keep "
                         "the inner optimizer in fp32")
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise UnsupportedPrecisionError(f"device {device} is not supported; use 'cpu' or 'cuda'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedPrecisionError(
            f"device {device} was requested but torch.cuda.is_available() is False (no GPU, or a CPU-only torch "
            "build). Fix: pass --device cpu, or install a CUDA build of torch."
        )
    caps = capabilities.probe(device.type)
    where = "this GPU" if device.type == "cuda" else "this CPU/torch build"

    def need(ok: bool, why: str, what: str, fix: str) -> None:
        if not ok:
            raise UnsupportedPrecisionError(
                f"precision policy {name!r} cannot run on {device}: {what} is not supported on {where} ({why}). "
                f"Fix: {fix}. asrprec never switches precision silently."
            )

    if name == "fp32":
        return PrecisionPolicy(name, device, torch.float32, torch.float32, False, False, bf16_update, scaler_kwargs)
    if name == "amp-fp16":
        need(caps.fp16, caps.fp16_why, "fp16 autocast", "use --precision fp32 or amp-bf16, or upgrade torch")
        need(caps.grad_scaler, caps.grad_scaler_why, "the fp16 grad scaler", "use --precision fp32 or amp-bf16")
        return PrecisionPolicy(name, device, torch.float32, torch.float16, True, True, bf16_update, scaler_kwargs)
    fix = "use --precision amp-fp16 (GPUs before Ampere) or fp32"
    need(caps.bf16, caps.bf16_why, "bfloat16", fix)
    if name == "amp-bf16":
        return PrecisionPolicy(name, device, torch.float32, torch.bfloat16, True, False, bf16_update, scaler_kwargs)
    return PrecisionPolicy(name, device, torch.bfloat16, torch.bfloat16, False, False, bf16_update, scaler_kwargs,
                           bf16_moments=bf16_moments)
