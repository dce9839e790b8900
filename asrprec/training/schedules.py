"""The adjusted batch count: how far training has come, in the units every schedule counts (Eden's learning rate,
the transducer's warm-ups, the encoder's ``ScheduledFloat`` values)."""

from __future__ import annotations

from typing import Any

from torch import nn

from asrprec.devices import get_world_size
from asrprec.models import set_batch_count

from .config import TrainConfig
from .oom import sampler_max_duration

__all__ = ["schedule_batches_per_step", "set_schedule_counts"]


def schedule_batches_per_step(cfg: TrainConfig, train_dl: Any) -> float:
    """How far the schedules' batch count moves per optimizer step: ``world_size × max_duration / ref_duration``.

    This is the one statement of why schedules count data, not steps. The schedules (Eden's batch index, the
    transducer's loss-scale and model warm-ups, the encoder's own schedules) see ``adjusted_batch_count``, which
    grows by this much per step (k2-fsa/icefall ``egs/librispeech/ASR/zipformer/train.py``,
    ``get_adjusted_batch_count``, which applies it to the encoder's schedules only); ``max_duration`` is the
    training sampler's per-rank value. So N GPUs at the same per-rank ``max_duration`` move N times faster per
    step, at the same pace per hour of audio. ``ref_duration=0`` takes this run's ``max_duration``: a step counts
    ``world_size`` batches, and a single process counts its optimizer steps. A set ``ref_duration`` (icefall:
    600 s) also keeps the schedules per hour of audio across a change of ``max_duration``; ``lr_batches`` and
    ``loss_warmup_batches`` are then in batches of ``ref_duration`` seconds.
    """
    world = get_world_size()
    if not cfg.ref_duration:
        return float(world)
    max_duration = sampler_max_duration(getattr(train_dl, "sampler", None))
    if max_duration is None:
        raise ValueError(f"ref_duration={cfg.ref_duration:g} needs the training sampler's max_duration, and this "
                         "loader's sampler has none (a lhotse sampler has). Fix: use a lhotse sampler, or "
                         "ref_duration=0 to count batches")
    return world * max_duration / cfg.ref_duration


def set_schedule_counts(model: nn.Module, scheduler, batch_count: float, cfg: TrainConfig) -> None:
    """Tell Eden, the model's warm-ups and (× ``encoder_schedule_scale``) the encoder's schedules where
    training is, in adjusted batches."""
    set_batch_count(model, batch_count)
    if cfg.encoder_schedule_scale != 1.0 and hasattr(model, "encoder"):
        set_batch_count(model.encoder, batch_count * cfg.encoder_schedule_scale)
    scheduler.step_batch(batch_count)
