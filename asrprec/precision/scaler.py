"""Loss scalers with a health watch.

:class:`LossScaler` wraps ``torch.amp.GradScaler`` for ``amp-fp16``; :class:`NoOpScaler` has the same
interface and does nothing but skip non-finite steps, so the training loop never branches on precision.

Health (icefall keeps the same thresholds, k2-fsa/icefall ``egs/librispeech/ASR/zipformer/train.py``, but only says
"grad_scale is too small"):

* after an overflow step the scaler records *which modules* produced non-finite gradients;
* below ``warn_floor`` it logs them, once per ``warn_every`` steps;
* small scales are pushed back up periodically (icefall's forced doubling), since GradScaler alone only
  grows after ``growth_interval`` clean steps;
* below ``abort_floor`` it calls ``on_collapse`` (the loop saves a checkpoint there) and raises
  :class:`GradScaleCollapse` whose message says what to do.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch

from asrprec.errors import AsrprecError

log = logging.getLogger(__name__)


class GradScaleCollapse(AsrprecError, RuntimeError):
    """fp16 training diverged: the grad scale fell below the abort floor."""


def nonfinite_grad_modules(model: torch.nn.Module, limit: int = 10) -> list[str]:
    """Names of parameters whose gradient holds inf/NaN (at most ``limit``)."""
    bad = []
    for name, p in model.named_parameters():
        if p.grad is not None and not torch.isfinite(p.grad).all():
            bad.append(name)
            if len(bad) >= limit:
                break
    return bad


class NoOpScaler:
    """Scaler interface without scaling; skips an optimizer step whose gradients are not finite."""

    ACCEPTS = ("max_consecutive_skips",)

    def __init__(self, max_consecutive_skips: int = 20):
        self.max_consecutive_skips = max_consecutive_skips
        self.consecutive_skips = 0
        self.total_skips = 0
        self.last_bad: list[str] = []
        self._model: torch.nn.Module | None = None

    enabled = False

    def watch(self, model: torch.nn.Module) -> None:
        """Tell the scaler which model to blame when gradients are not finite."""
        self._model = model

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_(self, optimizer) -> None:
        pass

    def step(self, optimizer) -> bool:
        """Run ``optimizer.step()`` unless a gradient is non-finite; return whether it ran."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        finite = bool(torch.isfinite(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])).all()) if grads else True
        if finite:
            optimizer.step()
            self.consecutive_skips = 0
            return True
        self.consecutive_skips += 1
        self.total_skips += 1
        self.last_bad = nonfinite_grad_modules(self._model) if self._model is not None else []
        log.warning("non-finite gradients, optimizer step skipped (%d in a row); from: %s",
                    self.consecutive_skips, ", ".join(self.last_bad) or "unknown")
        return False

    def update(self) -> None:
        pass

    def get_scale(self) -> float:
        return 1.0

    def check_health(self, batch_idx: int, on_collapse: Callable[[], None] | None = None) -> None:
        if self.consecutive_skips >= self.max_consecutive_skips:
            if on_collapse is not None:
                on_collapse()
            raise GradScaleCollapse(
                f"{self.consecutive_skips} consecutive steps had non-finite gradients (last from: "
                f"{', '.join(self.last_bad) or 'unknown'}). Training has diverged. What to do: resume from the "
                "last good checkpoint with a lower --base-lr, check the data for corrupt/empty utterances, or "
                "try --precision fp32 to see whether precision is the cause."
            )

    def state_dict(self) -> dict:
        return {"consecutive_skips": self.consecutive_skips, "total_skips": self.total_skips}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive_skips = state.get("consecutive_skips", 0)
        self.total_skips = state.get("total_skips", 0)


class LossScaler(NoOpScaler):
    """``torch.amp.GradScaler`` plus health checks (for ``amp-fp16``)."""

    ACCEPTS = NoOpScaler.ACCEPTS + ("init_scale", "warn_floor", "abort_floor", "growth_interval", "warn_every")
    enabled = True

    def __init__(
        self,
        device_type: str,
        *,
        init_scale: float = 2.0**10,
        warn_floor: float = 0.01,
        abort_floor: float = 1e-5,
        growth_interval: int = 2000,
        warn_every: int = 50,
        max_consecutive_skips: int = 10**9,
    ):
        super().__init__(max_consecutive_skips)
        self.gs = torch.amp.GradScaler(device_type, init_scale=init_scale, growth_interval=growth_interval)
        self.warn_floor = warn_floor
        self.abort_floor = abort_floor
        self.warn_every = warn_every
        self._last_warn = -(10**9)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.gs.scale(loss)

    def unscale_(self, optimizer) -> None:
        self.gs.unscale_(optimizer)

    def step(self, optimizer) -> bool:
        before = self.gs.get_scale()
        self.gs.step(optimizer)
        self._stepped_scale = before
        return True

    def update(self) -> None:
        before = self.gs.get_scale()
        self.gs.update()
        if self.gs.get_scale() < before:  # an overflow step was skipped
            self.consecutive_skips += 1
            self.total_skips += 1
            if self._model is not None:
                self.last_bad = nonfinite_grad_modules(self._model)
        else:
            self.consecutive_skips = 0

    def get_scale(self) -> float:
        return float(self.gs.get_scale())

    def check_health(self, batch_idx: int, on_collapse: Callable[[], None] | None = None) -> None:
        """Call after ``update()`` and before ``zero_grad()`` (so offending gradients are still there)."""
        scale = self.get_scale()
        # icefall's periodic doubling of small scales (zipformer/train.py); GradScaler alone would wait
        # growth_interval clean steps.
        if (batch_idx % 25 == 0 and scale < 2.0) or (batch_idx % 100 == 0 and scale < 8.0) or (
            batch_idx % 400 == 0 and scale < 32.0
        ):
            self.gs.update(scale * 2.0)
            scale *= 2.0
        if scale < self.abort_floor or not math.isfinite(scale):
            if on_collapse is not None:
                on_collapse()
            raise GradScaleCollapse(
                f"fp16 grad scale collapsed to {scale:.3g} (< {self.abort_floor:g}): gradients overflow fp16 on "
                f"every step. Non-finite gradients last came from: {', '.join(self.last_bad) or 'unknown'}. "
                "A checkpoint was saved. What to do: (1) switch to --precision amp-bf16 (or bf16) if the hardware "
                "has bf16 — it has fp32's range and needs no scaler; (2) otherwise resume from the last checkpoint "
                "with a lower --base-lr (e.g. by 0.005 steps); (3) inspect the named modules for exploding "
                "activations (data with very long or empty utterances is a common cause)."
            )
        if scale < self.warn_floor and batch_idx - self._last_warn >= self.warn_every:
            self._last_warn = batch_idx
            log.warning(
                "grad scale is small (%.3g < %g): recent non-finite gradients came from %s", scale, self.warn_floor,
                ", ".join(self.last_bad) or "unknown modules",
            )

    def state_dict(self) -> dict:
        return {**super().state_dict(), "grad_scaler": self.gs.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "grad_scaler" in state:
            self.gs.load_state_dict(state["grad_scaler"])
