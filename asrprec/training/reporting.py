"""What training reports: the log lines and the tensorboard scalars of steps, validations and epochs.

Every rank calls the reporting functions at the same points (the losses and frames/s are those of all ranks
together, :func:`summed_over_ranks`); only rank 0's :class:`SummaryWriterOrNull` writes.
"""

from __future__ import annotations

import logging
import math
import resource
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from asrprec.precision import PrecisionPolicy, effective_dtypes

from .distributed import describe, sum_over_ranks
from .resume import EpochProgress

log = logging.getLogger(__name__)

# the per-batch statistics of compute_loss that are sums over utterances (summed over ranks before logging)
SUMMED_STATS = ("loss", "frames", "utterances", "simple_loss", "pruned_loss", "transducer_loss", "ctc_loss",
                "cr_loss")
# the loss components logged per frame besides the total (train/<name> in tensorboard, train_<name> per epoch in
# history.json): the transducer's, the CTC head's and CR-CTC's consistency term, each unscaled
LOSS_COMPONENTS = ("simple_loss", "pruned_loss", "transducer_loss", "ctc_loss", "cr_loss")
# EpochProgress.padding's sums (asrprec.data.buckets.PaddingTotals)
PADDING_SUMS = ("frames", "padded_frames", "joint", "padded_joint")


def add_padding(totals: dict[str, float], batch: dict[str, Any], tokenizer) -> None:
    """Add a training batch's padding (:func:`asrprec.data.buckets.batch_padding`) to ``totals``."""
    from asrprec.data.buckets import batch_padding

    pad = batch_padding(batch["feature_lens"], [len(t) for t in tokenizer.encode(batch["texts"])])
    for k in PADDING_SUMS:
        totals[k] = totals.get(k, 0.0) + getattr(pad, k)


class SummaryWriterOrNull:
    """A tensorboard writer that is a no-op on non-zero ranks or when disabled."""

    def __init__(self, log_dir: str | Path, enabled: bool = True):
        self._w = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._w = SummaryWriter(log_dir=str(log_dir))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        if self._w is not None:
            self._w.add_scalar(tag, value, step)

    def add_text(self, tag: str, text: str, step: int) -> None:
        if self._w is not None:
            self._w.add_text(tag, text, step)

    def close(self) -> None:
        if self._w is not None:
            self._w.close()

    def __enter__(self) -> "SummaryWriterOrNull":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def summed_over_ranks(info: dict[str, float]) -> dict[str, float]:
    """``info`` with its :data:`SUMMED_STATS` summed over ranks (every rank calls this)."""
    keys = sorted(k for k in info if k in SUMMED_STATS)
    return {**info, **dict(zip(keys, sum_over_ranks(*(info[k] for k in keys))))}


def log_run_start(model: nn.Module, policy: PrecisionPolicy) -> tuple[dict[str, Any], dict[str, Any]]:
    """Log the precision, the processes and the parameter dtypes; return the policy's description and the
    effective parameter dtypes (for the run's records and :func:`write_precision`)."""
    dtypes = effective_dtypes(model)
    desc = policy.describe()
    log.info("precision: %s", ", ".join(f"{k}={v}" for k, v in desc.items()))
    log.info("processes: %s", describe())
    log.info("parameter dtypes: %s", ", ".join(f"{k}: {v:,}" for k, v in dtypes.items()))
    return desc, dtypes


def write_precision(writer: SummaryWriterOrNull, desc: dict[str, Any], dtypes: dict[str, Any]) -> None:
    writer.add_text("precision", "\n".join(f"{k}: {v}" for k, v in {**desc, **dtypes}.items()), 0)


def log_step(run: Any, info: dict[str, float]) -> None:
    """One step's log line and scalars. ``run``: the :class:`~asrprec.training.run.Run` (its state, optimizer,
    scaler, policy, writer, and ``window``: the frames trained since the last log line and its time, reset here;
    typed loosely since the run is built on this module). Every rank calls this at the same steps."""
    epoch, batch_idx_train, window = run.state.epoch, run.state.batch_idx_train, run.window
    optimizer, scaler, writer = run.optimizer, run.scaler, run.writer
    info = summed_over_ranks(info)  # the global batch's loss
    window["frames"] = sum_over_ranks(window["frames"])[0]
    now = time.time()
    fps = window["frames"] / max(now - window["t"], 1e-9)
    window["frames"], window["t"] = 0.0, now
    lr = optimizer.param_groups[0]["lr"]
    per_frame = info["loss"] / max(info["frames"], 1.0)
    parts = "".join(f", {k.removesuffix('_loss')} {info[k] / max(info['frames'], 1.0):.4f}"
                    for k in LOSS_COMPONENTS if k in info)
    log.info("epoch %d batch %d: loss %.4f/frame%s, lr %.3g, grad scale %.3g, grad norm %.3g, %.0f frames/s",
             epoch, batch_idx_train, per_frame, parts, lr, scaler.get_scale(), info["grad_norm"], fps)
    step = batch_idx_train
    writer.add_scalar("train/loss", per_frame, step)
    for k in LOSS_COMPONENTS:
        if k in info:
            writer.add_scalar(f"train/{k}", info[k] / max(info["frames"], 1.0), step)
    writer.add_scalar("train/learning_rate", lr, step)
    writer.add_scalar("train/grad_scale", scaler.get_scale(), step)
    writer.add_scalar("train/grad_norm", info["grad_norm"], step)
    writer.add_scalar("train/frames_per_second", fps, step)
    writer.add_scalar("train/peak_memory_mb", peak_memory_mb(run.policy.device), step)


def log_valid(value: float, when: str) -> None:
    """The validation loss; a non-finite one is a warning saying what to check."""
    if math.isfinite(value):
        log.info("validation loss %.4f/frame (%s)", value, when)
    else:
        log.warning("validation loss is %s (%s): the model produces non-finite losses on the dev set (diverged "
                    "weights, or dev cuts it cannot score). Fix: resume from an earlier checkpoint with a lower "
                    "--base-lr, or check the dev data (--validate-data full)", value, when)


def epoch_stats(progress: EpochProgress) -> dict[str, Any]:
    """The epoch's statistics over all ranks (every rank calls this)."""
    names = sorted(progress.tot_parts)
    tot_loss, tot_frames, dropped, *parts = sum_over_ranks(progress.tot_loss, progress.tot_frames,
                                                           progress.dropped_cuts,
                                                           *(progress.tot_parts[k] for k in names),
                                                           *(progress.padding.get(k, 0.0) for k in PADDING_SUMS))
    parts, (frames, padded_frames, joint, padded_joint) = parts[:len(names)], parts[len(names):]
    return {"train_loss": tot_loss / max(tot_frames, 1.0),
            "padding_frames": padded_frames / frames if frames else 0.0,
            "padding_joint": padded_joint / joint if joint else 0.0,
            **{f"train_{k}": v / max(tot_frames, 1.0) for k, v in zip(names, parts)},
            "epoch_seconds": progress.seconds, "batches": progress.batches_done, "steps": progress.steps,
            "skipped_batches": dict(progress.skipped), "dropped_cuts": int(dropped)}


def log_epoch(epoch: int, stats: dict[str, Any], *, batch_idx_train: int, writer: SummaryWriterOrNull) -> None:
    """The end-of-epoch line and scalars (``stats``: :func:`epoch_stats` with ``valid_loss`` and
    ``peak_memory_mb``)."""
    writer.add_scalar("valid/loss", stats["valid_loss"], batch_idx_train)
    writer.add_scalar("train/epoch", epoch, batch_idx_train)
    log_valid(stats["valid_loss"], f"epoch {epoch}")
    log.info("epoch %d done in %.1f s: train loss %.4f, valid loss %.4f (per frame), peak memory %.0f MB%s", epoch,
             stats["epoch_seconds"], stats["train_loss"], stats["valid_loss"], stats["peak_memory_mb"],
             f"; skipped batches {stats['skipped_batches']}" if stats["skipped_batches"] else "")
    if "padding_frames" in stats:
        log.info("epoch %d padding: %.1f %% of the frames, %.1f %% of the joint cells (T x (U+1)) are padding", epoch,
                 100 * stats["padding_frames"], 100 * stats["padding_joint"])
        writer.add_scalar("train/padding_frames", stats["padding_frames"], batch_idx_train)
        writer.add_scalar("train/padding_joint", stats["padding_joint"], batch_idx_train)
