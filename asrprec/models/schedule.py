"""Values that follow training progress: the batch count, scheduled floats and warm-up fractions.

The training loop writes the batch count into a model with :func:`set_batch_count`; every module with a
``batch_count`` attribute reads it from there:

* the Transducer turns it into the Conformer's model warm-up and the pruned loss's scale warm-up, both
  :func:`warmup_fraction` (k2-fsa/icefall ``egs/librispeech/ASR/pruned_transducer_stateless2/train.py``
  and ``zipformer/train.py``);
* the Zipformer's :class:`ScheduledFloat` values (dropout rates, balancer probabilities, layer skipping)
  follow it piecewise-linearly (k2-fsa/icefall ``egs/librispeech/ASR/zipformer/scaling.py``).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor, nn

from .tracing import is_tracing

__all__ = ["FloatLike", "ScheduledFloat", "hold_schedules_in_graph", "is_zero", "schedule_value", "set_batch_count",
           "warmup_fraction"]


def warmup_fraction(batch_count: float, warmup_batches: float) -> float:
    """``min(1, batch_count / warmup_batches)``: rises linearly 0 -> 1 over the warm-up, then stays at 1.

    ``warmup_batches <= 0`` means no warm-up (always 1.0).

    Raises:
        ValueError: a negative ``batch_count``.
    """
    if batch_count < 0:
        raise ValueError(f"batch_count must be >= 0, got {batch_count}")
    if warmup_batches <= 0:
        return 1.0
    return min(1.0, batch_count / warmup_batches)


class ScheduledFloat(nn.Module):
    """A float that is a piecewise-linear function of the training batch count.

    ``ScheduledFloat((0.0, 0.5), (4000.0, 0.02), default=0.0)`` goes from 0.5 at batch 0 to 0.02 at batch 4000
    and stays there. ``float(sf)`` returns ``default`` in eval mode or while ``batch_count`` is unset, as in
    icefall. It is an ``nn.Module`` (without parameters) so that ``model.train()/eval()`` and
    :func:`set_batch_count` reach it through ``model.modules()``.

    For ``torch.compile`` the current value is also kept in a 0-dim float64 tensor that changes in place
    (:meth:`as_tensor`), so a compiled graph reads it at run time instead of guarding on the batch count, and
    :attr:`settled` is the value once it can no longer change (eval mode, no batch count yet, or past the last
    point), else None: a graph specialises on it and is compiled again only when a schedule settles.
    :func:`hold_schedules_in_graph` keeps a settled training schedule a run-time tensor as well
    (:attr:`traced_constant` stays None until eval mode), so that settling compiles nothing.
    """

    def __init__(self, *points: Tuple[float, float], default: float = 0.0):
        super().__init__()
        if not points:
            raise ValueError("ScheduledFloat needs at least one (batch, value) point")
        pts = sorted((float(b), float(v)) for b, v in points)
        self.points = pts
        self.default = float(default)
        self._batch_count: Optional[float] = None
        # a plain attribute, not a buffer: no state_dict key, and model.to(dtype) leaves it float64
        self._value = torch.tensor(self.default, dtype=torch.float64)
        self.settled: Optional[float] = self.default
        self.hold_in_graph = False
        self.traced_constant: Optional[float] = self.default

    @property
    def batch_count(self) -> Optional[float]:
        return self._batch_count

    @batch_count.setter
    def batch_count(self, count: Optional[float]) -> None:
        self._batch_count = None if count is None else float(count)
        self._refresh()

    def train(self, mode: bool = True) -> "ScheduledFloat":
        super().train(mode)
        self._refresh()
        return self

    def _refresh(self) -> None:
        value = float(self)
        with torch.no_grad():
            self._value.fill_(value)
        moving = self.training and self._batch_count is not None and self._batch_count < self.points[-1][0]
        self.settled = None if moving else value
        held = self.hold_in_graph and self.training and self._batch_count is not None
        self.traced_constant = None if moving or held else value

    def as_tensor(self) -> Tensor:
        """The current value as a 0-dim float64 tensor, updated in place when the batch count or mode changes."""
        return self._value

    def value_at(self, batch_count: float) -> float:
        pts = self.points
        if batch_count <= pts[0][0]:
            return pts[0][1]
        if batch_count >= pts[-1][0]:
            return pts[-1][1]
        for (x0, y0), (x1, y1) in zip(pts[:-1], pts[1:]):
            if x0 <= batch_count <= x1:
                return y0 + (batch_count - x0) / (x1 - x0) * (y1 - y0)
        raise AssertionError("unreachable")

    def __float__(self) -> float:
        if self.batch_count is None or not self.training:
            return self.default
        return self.value_at(self.batch_count)

    def extra_repr(self) -> str:
        return f"points={self.points}, default={self.default}, batch_count={self.batch_count}"


FloatLike = Union[float, ScheduledFloat]


def schedule_value(v: FloatLike) -> Union[float, Tensor]:
    """``float(v)``; while ``torch.compile`` traces, a schedule that is still moving is given as its 0-dim tensor
    (:meth:`ScheduledFloat.as_tensor`) so that the graph is not specialised on the batch count; so is a settled one
    that :func:`hold_schedules_in_graph` holds. Callers use the result with tensor operations, and test
    ``isinstance(r, float)`` before branching on it in Python."""
    if isinstance(v, ScheduledFloat) and is_tracing():
        # never float(v) here: it reads the batch count, which a graph would then be specialised on
        return v.as_tensor() if v.traced_constant is None else v.traced_constant
    return float(v)


def hold_schedules_in_graph(module: nn.Module, hold: bool = True) -> int:
    """Make every :class:`ScheduledFloat` in ``module`` reach a compiled graph as its run-time tensor in training
    mode, moving or settled (``hold=False``: a settled one is compiled in as a constant again, the default).

    A schedule compiled in as a constant costs one recompile of the function that reads it when it settles (the
    Zipformer presets' schedules settle at five batch counts, and a short run's scaled schedules settle within its
    first epochs). Held, none is needed, but a rate that settles at 0 still draws its masks in the graph (masks that
    keep everything, so every output is unchanged) where eager mode draws nothing: from then on the compiled run's
    torch random stream, and so its later dropout masks, differ from an eager run's. Returns the number of
    schedules set. The position-score skip of the Zipformer's attention is not held by this: it decides the
    graph's structure (``settled``, see asrprec/models/zipformer/attention.py).
    """
    n = 0
    for m in module.modules():
        if isinstance(m, ScheduledFloat):
            m.hold_in_graph = hold
            m._refresh()
            n += 1
    return n


def is_zero(value: Union[float, Tensor]) -> bool:
    """True for a Python float equal to 0; a tensor from :func:`schedule_value` is never known to be zero."""
    return isinstance(value, float) and value == 0.0


def set_batch_count(model: nn.Module, batch_count: float) -> None:
    """Write ``batch_count`` (as a float) into every module of ``model`` that has a ``batch_count`` attribute:
    the Transducer (its warm-ups) and every :class:`ScheduledFloat`."""
    for m in model.modules():
        if hasattr(m, "batch_count"):
            m.batch_count = float(batch_count)
