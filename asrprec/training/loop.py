"""The one training loop. It never branches on precision: the policy hands it an autocast context,
a scaler (a no-op unless ``amp-fp16``) and an optimizer wrapper (fp32 master weights under ``bf16``).

Plain functions: :func:`train` (experiment folder, resume, epochs, checkpoints), :func:`train_one_epoch`,
:func:`train_step`, :func:`compute_loss`, :func:`validate`.

Under torchrun (after :func:`~asrprec.training.distributed.setup_distributed`) the same loop trains data-parallel:
the model is wrapped in DDP with summed gradients, every rank reads its own shard, the ranks agree each step on
whether to go on, skip or stop (:mod:`asrprec.training.distributed`), validation and the logged losses are summed
over ranks, and only rank 0 writes checkpoints, tensorboard and the running average.

Schedules count data, not steps (:func:`schedule_batches_per_step`): Eden's batch index, the transducer's
warm-ups and the encoder's schedules see ``adjusted_batch_count``, which grows by
``world_size × max_duration / ref_duration`` per optimizer step (icefall's ``get_adjusted_batch_count``), so
a run on more GPUs follows the same schedule per hour of audio.

Nothing is lost and nothing is silent:

* resume is exact: a checkpoint records the position in the epoch (:class:`~asrprec.training.resume.EpochProgress`)
  and the random generators; a resumed run trains the same batches with the same random numbers as an
  uninterrupted one (:mod:`asrprec.training.resume` explains how);
* a batch that cannot be used is skipped, named in the log and counted: one whose loader failed or whose cuts are
  all unreadable, one with a non-finite loss (under DDP such a step is skipped on every rank); more than ``max_skipped_fraction`` of an epoch's batches, or an
  epoch without a single trained batch, stops the run with :class:`TooManySkippedBatches` after a checkpoint;
* the epoch's checkpoint is written before validation, and validation leaves the random generators as they were
  (so it can neither lose an epoch nor change what follows); a non-finite validation loss is a warning.
"""

from __future__ import annotations

import logging
import math
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from asrprec import checkpoint as ckpt
from asrprec.models import set_batch_count, unwrap_model
from asrprec.precision import PrecisionPolicy, effective_dtypes
from asrprec.rng import get_rng_state, preserved_rng, seed_everything, set_rng_state

from .config import TrainConfig
from .distributed import (
    RankFailedError,
    all_reduce_sum,
    barrier,
    check_sharded,
    describe,
    flags_by_rank,
    gather_objects,
    get_rank,
    get_world_size,
    is_main_process,
    raise_failure,
    raise_if_any_failed,
    sum_over_ranks,
    wrap_model,
)
from .experiment import (
    ExperimentError,
    append_history,
    prepare_experiment,
    read_history,
    record_run_start,
)
from .forward import compute_loss, pad_targets
from .oom import (
    describe_batch,
    is_out_of_memory,
    out_of_memory_error,
    sampler_max_duration,
    save_batch,
    scan_pessimistic_batches,
)
from .resume import EpochProgress, batch_cut_ids, epoch_iterator
from .tb import SummaryWriterOrNull

log = logging.getLogger("asrprec.train")

__all__ = ["TrainState", "TooManySkippedBatches", "seed_everything", "pad_targets", "compute_loss",
           "optimizer_from_config", "scheduler_from_config", "validate", "train_step", "train_one_epoch", "train"]

# batch skip reasons (EpochProgress.skipped keys)
UNLOADABLE = "unloadable"
NONFINITE = "non-finite loss"
# how many skipped batches an epoch must have before the share of skipped batches is checked mid-epoch (at the
# end of an epoch it is always checked)
_MIN_SKIPS_FOR_SHARE = 3
# a loader that raised this many times in a row is broken, not serving a few bad batches
_MAX_LOADER_FAILURES_IN_A_ROW = 10


class TooManySkippedBatches(RuntimeError):
    """Too many batches of an epoch were skipped (bad data or a diverged model); a checkpoint was saved."""


@dataclass
class TrainState:
    epoch: int = 1
    batch_idx_train: int = 0
    # the batch count the schedules see (see schedule_batches_per_step); = batch_idx_train for one process
    adjusted_batch_count: float = 0.0
    best_valid_loss: float = math.inf
    best_valid_epoch: int = -1
    history: list[dict[str, Any]] = field(default_factory=list)
    progress: EpochProgress | None = None  # the position in the current epoch


def optimizer_from_config(model: nn.Module, cfg: TrainConfig, policy: PrecisionPolicy):
    """The optimizer ``cfg.optimizer`` names (ScaledAdam, icefall's, or AdamW), built through the policy's
    :meth:`~asrprec.precision.PrecisionPolicy.build_optimizer` (fp32 master weights under bf16)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "scaled_adam":
        from asrprec.optim import ScaledAdam

        def factory(ps):
            return ScaledAdam(ps, lr=cfg.base_lr, clipping_scale=2.0)
    else:

        def factory(ps):
            return torch.optim.AdamW(ps, lr=cfg.base_lr, weight_decay=cfg.weight_decay)

    return policy.build_optimizer(params, factory)


def scheduler_from_config(optimizer, cfg: TrainConfig):
    from asrprec.optim import Eden

    return Eden(optimizer, lr_batches=cfg.lr_batches, lr_epochs=cfg.lr_epochs, warmup_batches=cfg.warmup_batches)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


@torch.no_grad()
def validate(model: nn.Module, loader: Iterable, tokenizer, policy: PrecisionPolicy) -> float:
    """Per-frame validation loss: each rank's loader (its shard) through the bare model (a DDP forward would
    synchronise buffers, and ranks may hold different numbers of batches), summed over ranks.

    The random generators are left as they were (creating a DataLoader iterator draws from them), so validating
    or not cannot change the training that follows. Cuts the loader could not read are logged and left out.
    """
    model = unwrap_model(model)
    was_training = model.training
    model.eval()
    tot = torch.zeros(2, dtype=torch.float64)
    with preserved_rng():
        for batch in loader:
            for d in batch.get("dropped_cuts", []) if isinstance(batch, dict) else []:
                log.warning("validation: cut %s left out: %s", d["cut_id"], d["reason"])
            if batch["features"].shape[0] == 0:
                continue
            loss, info = compute_loss(model, batch, tokenizer, policy)
            tot += torch.tensor([info["loss"], info["frames"]], dtype=torch.float64)
    tot = all_reduce_sum(tot)
    model.train(was_training)
    return float(tot[0] / max(tot[1], 1.0))


def _grad_norm(model: nn.Module) -> float:
    norms = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.stack(norms).norm()) if norms else 0.0


# -- schedules and rank agreement ------------------------------------------------------------------


def schedule_batches_per_step(cfg: TrainConfig, train_dl: Any) -> float:
    """How far the schedules' batch count moves per optimizer step: ``world_size × max_duration /
    ref_duration`` (k2-fsa/icefall ``egs/librispeech/ASR/zipformer/train.py``, ``get_adjusted_batch_count``),
    with ``max_duration`` the training sampler's per-rank value. ``ref_duration=0`` takes this run's
    ``max_duration``: each step then counts ``world_size`` batches, and a single process counts its steps."""
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


def forward_on_every_rank(model: nn.Module, batch: dict[str, Any], tokenizer, policy: PrecisionPolicy,
                          what: str) -> tuple[torch.Tensor, dict[str, float], list[int]]:
    """:func:`compute_loss`, then one agreement over ranks before any gradient is exchanged: an error on one
    rank is raised on all (its own on it, :class:`RankFailedError` quoting it elsewhere). Returns the loss,
    its statistics and the ranks whose loss is not finite (the step is to be skipped on every rank then)."""
    error, loss, info = None, None, {"loss": math.nan}
    try:
        loss, info = compute_loss(model, batch, tokenizer, policy)
    except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks know
        error = e
    failed, nonfinite = flags_by_rank(error is not None, not math.isfinite(info["loss"]))
    if failed:
        raise_failure(error, failed, what)
    return loss, info, nonfinite


def _summed_over_ranks(info: dict[str, float]) -> dict[str, float]:
    keys = sorted(k for k in info if k in ("loss", "frames", "utterances", "simple_loss", "pruned_loss",
                                            "transducer_loss"))
    return {**info, **dict(zip(keys, sum_over_ranks(*(info[k] for k in keys))))}


# -- skipping batches ------------------------------------------------------------------------------


def _skip(progress: EpochProgress, reason: str, ids: list[str], detail: str, batch_idx_train: int) -> None:
    """Count a skipped batch and name it in the log."""
    progress.skipped[reason] = progress.skipped.get(reason, 0) + 1
    shown = ", ".join(ids[:8]) + (f", ... ({len(ids)} cuts)" if len(ids) > 8 else "") if ids else "cut ids unknown"
    if len(progress.skipped_examples) < 10:
        progress.skipped_examples.append(f"{ids[0] if ids else '?'} ({reason})")
    log.warning("epoch %d, batch %d of the epoch (after training batch %d): skipped, %s: %s; cuts: %s",
                progress.epoch, progress.batches_done, batch_idx_train, reason, detail, shown)


def _skip_budget_exceeded(progress: EpochProgress, cfg: TrainConfig, *, end_of_epoch: bool) -> str | None:
    """Why the run must stop because of skipped batches, or None."""
    n, done = progress.num_skipped, progress.batches_done
    counts = ", ".join(f"{reason} {k}" for reason, k in sorted(progress.skipped.items()))
    if end_of_epoch and done == 0:
        return (f"epoch {progress.epoch} had no batch at all: the training data are empty (every cut dropped by the "
                "data checks or the duration filter?)")
    if end_of_epoch and done > 0 and progress.steps == 0:
        return f"no batch of epoch {progress.epoch} could be trained: all {done} were skipped ({counts})"
    if n > cfg.max_skipped_fraction * done and (end_of_epoch or n >= _MIN_SKIPS_FOR_SHARE) and n > 0:
        return (f"{n} of the {done} batches of epoch {progress.epoch}{'' if end_of_epoch else ' so far'} were "
                f"skipped ({counts}), more than --max-skipped-fraction {cfg.max_skipped_fraction:g}")
    return None


def _report_dropped_cuts(batch: dict[str, Any], progress: EpochProgress) -> None:
    for d in batch.get("dropped_cuts", []):
        progress.dropped_cuts += 1
        log.warning("epoch %d, batch %d of the epoch: cut %s left out of its batch: %s", progress.epoch,
                    progress.batches_done, d["cut_id"], d["reason"])


def _next_batch(batches: Iterator) -> tuple[Any, BaseException | None]:
    """The next batch, or ``(None, error)`` when the loader raised for this batch (StopIteration passes)."""
    try:
        return next(batches), None
    except StopIteration:
        raise
    except Exception as e:  # a dataset or worker error for one batch: the iterator stays usable
        return None, e


# -- one step, one epoch ---------------------------------------------------------------------------


def train_step(model: nn.Module, batch: dict[str, Any], *, optimizer, scaler, policy: PrecisionPolicy, tokenizer,
               cfg: TrainConfig, state: TrainState, save: Callable[[str], Any], want_grad_norm: bool,
               averager: ckpt.RunningAverage | None = None, max_duration: float | None = None
               ) -> tuple[dict[str, float] | None, list[int]]:
    """Forward, backward and update on one batch. Returns the batch's statistics and ``[]``, or ``(None, ranks)``
    when the loss is not finite on ``ranks``: the step is then skipped on every rank (so that all ranks run the
    same collectives) and nothing was updated.

    Any other error saves ``bad-model.pt`` and propagates (an error in the forward pass on one rank is raised on
    every rank); an out-of-memory error also saves the batch and becomes
    :class:`~asrprec.training.oom.BatchOutOfMemory`.
    """
    bare = unwrap_model(model)
    try:
        loss, info, nonfinite_ranks = forward_on_every_rank(model, batch, tokenizer, policy,
                                                            f"training batch {state.batch_idx_train}")
        if nonfinite_ranks:
            optimizer.zero_grad(set_to_none=True)
            return None, nonfinite_ranks
        scaler.scale(loss).backward()
        if cfg.grad_clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        info["grad_norm"] = _grad_norm(model) if want_grad_norm else float("nan")
        scaler.step(optimizer)
        scaler.update()
        # a collapse happens on every rank at once (the summed gradients, hence the scales, are the same)
        scaler.check_health(state.batch_idx_train, on_collapse=lambda: save(ckpt.BAD_MODEL_NAME))
        optimizer.zero_grad(set_to_none=True)
        if averager is not None:
            averager.maybe_update(bare, state.batch_idx_train)
        return info, []
    except Exception as e:
        save(ckpt.BAD_MODEL_NAME, collective=False)  # the other ranks may not be failing here
        if is_out_of_memory(e) and not isinstance(e, RankFailedError):
            path = save_batch(batch, ckpt.oom_batch_path(cfg.exp_dir, state.batch_idx_train, get_rank()
                                                         if get_world_size() > 1 else None))
            if policy.device.type == "cuda":
                log.error("CUDA memory at the OOM:\n%s", torch.cuda.memory_summary(policy.device, abbreviated=True))
            raise out_of_memory_error(
                f"training batch {state.batch_idx_train} ({describe_batch(batch)}; saved to {path})", policy, e,
                max_duration) from e
        raise


def _log_step(info: dict[str, float], batch: dict[str, Any], *, optimizer, scaler, policy, state, writer, window):
    """Every rank calls this at the same steps: the losses and frames/s are those of all ranks together."""
    info = _summed_over_ranks(info)  # the global batch's loss
    window["frames"] = sum_over_ranks(window["frames"])[0]
    now = time.time()
    fps = window["frames"] / max(now - window["t"], 1e-9)
    window["frames"], window["t"] = 0.0, now
    lr = optimizer.param_groups[0]["lr"]
    per_frame = info["loss"] / max(info["frames"], 1.0)
    log.info("epoch %d batch %d: loss %.4f/frame, lr %.3g, grad scale %.3g, grad norm %.3g, %.0f frames/s",
             state.epoch, state.batch_idx_train, per_frame, lr, scaler.get_scale(), info["grad_norm"], fps)
    step = state.batch_idx_train
    writer.add_scalar("train/loss", per_frame, step)
    for k in ("simple_loss", "pruned_loss"):
        if k in info:
            writer.add_scalar(f"train/{k}", info[k] / max(info["frames"], 1.0), step)
    writer.add_scalar("train/learning_rate", lr, step)
    writer.add_scalar("train/grad_scale", scaler.get_scale(), step)
    writer.add_scalar("train/grad_norm", info["grad_norm"], step)
    writer.add_scalar("train/frames_per_second", fps, step)
    writer.add_scalar("train/peak_memory_mb", peak_memory_mb(policy.device), step)


@dataclass
class _Epoch:
    """What one epoch's loop carries besides the training state: the objects it steps and its logging window."""

    model: nn.Module
    optimizer: Any
    scheduler: Any
    scaler: Any
    policy: PrecisionPolicy
    tokenizer: Any
    valid_dl: Any
    cfg: TrainConfig
    state: TrainState
    writer: SummaryWriterOrNull
    save: Callable[[str], Any]
    averager: ckpt.RunningAverage | None
    max_duration: float | None
    t0: float
    per_step: float  # schedule batches per optimizer step (schedule_batches_per_step)
    window: dict[str, float] = field(default_factory=lambda: {"frames": 0.0, "t": time.time()})


def _train_on(batch: dict[str, Any], e: _Epoch) -> None:
    """One usable batch: step (or skip it when its loss is not finite), then log, validate and save as due."""
    state, cfg, progress = e.state, e.cfg, e.state.progress
    bare = unwrap_model(e.model)
    state.batch_idx_train += 1
    state.adjusted_batch_count += e.per_step
    set_schedule_counts(bare, e.scheduler, state.adjusted_batch_count, cfg)
    log_now = (progress.batches_done - 1) % cfg.log_interval == 0
    info, nonfinite_ranks = train_step(e.model, batch, optimizer=e.optimizer, scaler=e.scaler, policy=e.policy,
                      tokenizer=e.tokenizer, cfg=cfg, state=state, save=e.save, averager=e.averager,
                      want_grad_norm=log_now, max_duration=e.max_duration)
    if info is None:
        where = "" if get_world_size() == 1 else f" on rank(s) {nonfinite_ranks} (the step is skipped on every rank)"
        _skip(progress, NONFINITE, list(batch.get("cut_ids", [])), f"the loss is not finite{where}",
              state.batch_idx_train)
        return
    progress.steps += 1
    progress.tot_loss += info["loss"]
    progress.tot_frames += info["frames"]
    e.window["frames"] += batch["features"].shape[0] * batch["features"].shape[1]
    if log_now:
        _log_step(info, batch, optimizer=e.optimizer, scaler=e.scaler, policy=e.policy, state=state,
                  writer=e.writer, window=e.window)
    if cfg.valid_interval and state.batch_idx_train % cfg.valid_interval == 0:
        v = validate(e.model, e.valid_dl, e.tokenizer, e.policy)
        e.writer.add_scalar("valid/loss", v, state.batch_idx_train)
        _log_valid(v, f"after batch {state.batch_idx_train}")
    if cfg.save_every_n and state.batch_idx_train % cfg.save_every_n == 0:
        progress.seconds = time.time() - e.t0
        e.save(ckpt.batch_checkpoint_path(cfg.exp_dir, state.batch_idx_train).name)
        if is_main_process():
            ckpt.keep_last_k(cfg.exp_dir, ckpt.BATCH_PATTERN, cfg.keep_last_k)


def _unusable(batch: Any, error: BaseException | None) -> bool:
    return error is not None or batch["features"].shape[0] == 0


def _consume(batch: Any, error: BaseException | None, e: _Epoch, unusable_ranks: list[int]) -> None:
    """One batch from the loader: train on it, or count and name why it is skipped. ``unusable_ranks``: the ranks
    whose batch of this step could not be used (:func:`_unusable`, agreed by all ranks); the step is then skipped
    on every rank, so that all ranks run the same collectives."""
    progress, state = e.state.progress, e.state
    if error is not None:
        _skip(progress, UNLOADABLE, [], f"the loader raised {type(error).__name__}: "
              f"{(str(error).strip().splitlines() or [''])[-1][:300]}", state.batch_idx_train)
        return
    _report_dropped_cuts(batch, progress)
    if batch["features"].shape[0] == 0:
        ids = [d["cut_id"] for d in batch.get("dropped_cuts", [])]
        _skip(progress, UNLOADABLE, ids, "no cut of the batch could be read", state.batch_idx_train)
        return
    if unusable_ranks:
        _skip(progress, UNLOADABLE, list(batch.get("cut_ids", [])),
              f"the batch of rank(s) {unusable_ranks} could not be loaded (skipped on every rank)",
              state.batch_idx_train)
        return
    _train_on(batch, e)


def _stop_if_loader_broken(failures_in_a_row: int, error: BaseException | None, e: _Epoch) -> None:
    if failures_in_a_row < _MAX_LOADER_FAILURES_IN_A_ROW:
        return
    path = ckpt.batch_checkpoint_path(e.cfg.exp_dir, e.state.batch_idx_train)
    e.save(path.name)
    barrier()  # on disk before any rank exits (torchrun then ends the others)
    last = f"{type(error).__name__}: {str(error)[:300]}" if error is not None else "on another rank, see its log"
    raise TooManySkippedBatches(
        f"the training data loader failed {failures_in_a_row} times in a row (last: {last}); it is broken rather "
        f"than serving a few bad batches. Saved {path}. Fix the loader or the data, then continue with --resume "
        "latest") from error


def train_one_epoch(
    *,
    model: nn.Module,
    optimizer,
    scheduler,
    scaler,
    policy: PrecisionPolicy,
    tokenizer,
    batches: Iterator,
    valid_dl,
    cfg: TrainConfig,
    state: TrainState,
    writer: SummaryWriterOrNull,
    save,
    averager: ckpt.RunningAverage | None = None,
    max_duration: float | None = None,
    per_step: float = 1.0,
) -> dict[str, float]:
    """Train on ``batches`` (an iterator positioned at ``state.progress.batches_done``) until the epoch or
    ``cfg.max_batches_per_epoch`` ends; returns per-frame average training loss and the epoch's statistics.

    Under DDP the epoch ends for all ranks when any rank's shard runs out (lhotse's samplers give every rank the
    same number of batches; other loaders need not), and a batch that one rank cannot use is skipped on all.
    ``per_step``: how far the schedules' batch count moves per step (:func:`schedule_batches_per_step`).

    Raises:
        TooManySkippedBatches: more skipped batches than ``cfg.max_skipped_fraction`` allows, or a loader that
            keeps failing (a checkpoint named in the message was saved first).
    """
    model.train()
    progress = state.progress
    e = _Epoch(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, policy=policy,
               tokenizer=tokenizer, valid_dl=valid_dl, cfg=cfg, state=state, writer=writer, save=save,
               averager=averager, max_duration=max_duration, t0=time.time() - progress.seconds, per_step=per_step)
    # a bar updated by hand: a tqdm-wrapped iterator would end the epoch at the first batch the loader fails on
    bar = None
    if cfg.progress_bar and is_main_process():
        from tqdm import tqdm

        bar = tqdm(desc=f"epoch {state.epoch}", mininterval=5.0, leave=False, initial=progress.batches_done)
    batches = iter(batches)
    failures_in_a_row = 0
    try:
        while not (cfg.max_batches_per_epoch and progress.batches_done >= cfg.max_batches_per_epoch):
            try:
                batch, error = _next_batch(batches)
                exhausted = False
            except StopIteration:
                batch, error, exhausted = None, None, True
            # one agreement per batch (nothing under one process): the epoch ends for all when a shard runs out,
            # and a batch that one rank cannot use is skipped on all
            ended, unusable_ranks, failed_ranks = flags_by_rank(
                exhausted, not exhausted and _unusable(batch, error), error is not None)
            if ended:
                if not exhausted:
                    log.warning("rank(s) %s ran out of batches first: epoch %d ends here on every rank", ended,
                                state.epoch)
                break
            progress.batches_done += 1
            progress.last_cut_ids = batch_cut_ids(batch) if batch is not None else []
            failures_in_a_row = failures_in_a_row + 1 if failed_ranks else 0
            _stop_if_loader_broken(failures_in_a_row, error, e)
            _consume(batch, error, e, [r for r in unusable_ranks if r != get_rank()])
            _stop_if_too_many_skipped(progress, cfg, state, save, end_of_epoch=False)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    progress.seconds = time.time() - e.t0
    _stop_if_too_many_skipped(progress, cfg, state, save, end_of_epoch=True)
    return _epoch_stats(progress)


def _epoch_stats(progress: EpochProgress) -> dict[str, Any]:
    """The epoch's statistics over all ranks (every rank calls this)."""
    tot_loss, tot_frames, dropped = sum_over_ranks(progress.tot_loss, progress.tot_frames, progress.dropped_cuts)
    return {"train_loss": tot_loss / max(tot_frames, 1.0), "epoch_seconds": progress.seconds,
            "batches": progress.batches_done, "steps": progress.steps, "skipped_batches": dict(progress.skipped),
            "dropped_cuts": int(dropped)}


def _stop_if_too_many_skipped(progress: EpochProgress, cfg: TrainConfig, state: TrainState, save,
                              *, end_of_epoch: bool) -> None:
    why = _skip_budget_exceeded(progress, cfg, end_of_epoch=end_of_epoch)
    if why is None:
        return
    name = ckpt.batch_checkpoint_path(cfg.exp_dir, state.batch_idx_train).name
    save(name)
    if is_main_process():
        append_history(cfg.exp_dir, {"event": "stopped", "epoch": progress.epoch,
                                     "batch_idx_train": state.batch_idx_train, "reason": why,
                                     "skipped_examples": progress.skipped_examples})
    barrier()  # the checkpoint is on disk before any rank exits (torchrun then ends the others)
    raise TooManySkippedBatches(
        f"{why}. Skipped batches, e.g.: {', '.join(progress.skipped_examples[:5])} (the log names every cut). "
        f"Saved {Path(cfg.exp_dir) / name}. Fix: for unreadable data, check the files (--validate-data full finds "
        "them) and fix or leave them out; for non-finite losses, check those cuts (empty or very long "
        "transcripts, corrupt features) or lower --base-lr; then continue with --resume latest (raise "
        "--max-skipped-fraction to accept more skipped batches)")


def _log_valid(value: float, when: str) -> None:
    if math.isfinite(value):
        log.info("validation loss %.4f/frame (%s)", value, when)
    else:
        log.warning("validation loss is %s (%s): the model produces non-finite losses on the dev set (diverged "
                    "weights, or dev cuts it cannot score). Fix: resume from an earlier checkpoint with a lower "
                    "--base-lr, or check the dev data (--validate-data full)", value, when)


def _scan_wanted(mode: str, policy: PrecisionPolicy, train_dl: Any) -> bool:
    """``scan_oom``: "on" always (a loader without a lhotse sampler is then an error), "off" never, "auto" on
    CUDA with a lhotse loader (a CPU run rarely hits its memory limit, and the scan costs a few steps' time)."""
    if mode == "on":
        return True
    if mode == "off" or policy.device.type != "cuda":
        return False
    return hasattr(getattr(train_dl, "sampler", None), "state_dict") and hasattr(train_dl, "dataset")


# -- checkpoints and resume ------------------------------------------------------------------------


def _extra(state: TrainState) -> dict[str, Any]:
    """What a checkpoint records of the loop besides the training objects. Collective under DDP (every rank calls
    it at the same point): the epoch's running totals are summed over ranks, and every rank's random-generator
    states are kept (``rng_by_rank``), so that each rank resumes its own random draws."""
    progress = state.progress.state_dict() if state.progress is not None else None
    extra = {"epoch": state.epoch, "batch_idx_train": state.batch_idx_train,
             "adjusted_batch_count": state.adjusted_batch_count, "world_size": get_world_size(),
             "best_valid_loss": state.best_valid_loss, "best_valid_epoch": state.best_valid_epoch,
             "history": list(state.history), "progress": progress}
    if get_world_size() > 1:
        if progress is not None:
            progress["tot_loss"], progress["tot_frames"], dropped = sum_over_ranks(
                progress["tot_loss"], progress["tot_frames"], progress["dropped_cuts"])
            progress["dropped_cuts"] = int(dropped)
        extra["rng_by_rank"] = gather_objects(get_rng_state())
    return extra


def _rank_rng(saved: dict[str, Any], extra: dict[str, Any], path: Path) -> dict | None:
    """This rank's random-generator states from a checkpoint: its own under the same number of ranks, else rank
    0's (then the resumed draws differ from an uninterrupted run's, which is said)."""
    by_rank, world = extra.get("rng_by_rank"), get_world_size()
    if isinstance(by_rank, list) and len(by_rank) == world:
        return by_rank[get_rank()]
    saved_world = int(extra.get("world_size", 1))
    if saved_world != world:
        log.warning("%s was written by %d process(es) and training continues with %d: the data shards and random "
                    "draws differ from an uninterrupted run's from here on", path, saved_world, world)
    return saved.get("rng")


def _restore(path: Path, *, model, optimizer, scheduler, scaler, averager, policy, state: TrainState,
             cfg: TrainConfig, per_step: float) -> tuple[dict | None, dict[str, Any]]:
    """Load ``path`` into the training objects and ``state``; return (its random-generator states, a record of
    the resume for the history). The generators are not restored here: the loop does it at the right moment."""
    saved = ckpt.read_checkpoint(path)
    info = ckpt.load_checkpoint(path, model=unwrap_model(model), optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                                policy=policy, restore_rng=False, checkpoint=saved)
    saved_policy = (info.get("policy") or {}).get("policy")
    if saved_policy is not None and saved_policy != policy.name:
        log.warning("%s was saved under precision %s and training continues under %s: the weights are cast to the "
                    "new policy's dtypes and the optimizer/scaler state carried over where both policies have it; "
                    "the resumed run is not the same as continuing under %s", path, saved_policy, policy.name,
                    saved_policy)
    if averager is not None:
        saved_avg = saved.get("model_avg")
        if isinstance(saved_avg, dict) and "count" in saved_avg:
            averager.load_state_dict(saved_avg)
            averager.period = cfg.average_period
        else:
            log.warning("%s holds no running average of the weights: it restarts here, so decoding with "
                        "--use-averaged-model can only average epochs trained from now on", path)
    extra = info.get("extra", {})
    state.batch_idx_train = int(extra.get("batch_idx_train", 0))
    state.adjusted_batch_count = float(extra.get("adjusted_batch_count", state.batch_idx_train * per_step))
    state.best_valid_loss = float(extra.get("best_valid_loss", math.inf))
    state.best_valid_epoch = int(extra.get("best_valid_epoch", -1))
    state.history = _resumed_history(list(extra.get("history") or []), cfg.exp_dir)
    epoch = int(extra.get("epoch", max(cfg.start_epoch - 1, 1)))
    progress = extra.get("progress")
    if progress is None:  # a checkpoint without a recorded position: an end-of-epoch one from before it was kept
        mid = path.name.startswith("checkpoint-")
        if mid:
            raise ckpt.CheckpointMismatchError(
                f"{path} records no position within epoch {epoch}, so a mid-epoch resume from it cannot be exact. "
                f"Fix: resume from the end of the previous epoch (--start-epoch {epoch})")
        progress = {"epoch": epoch, "epoch_done": True}
    state.progress = EpochProgress.from_state_dict(progress)
    if get_rank() > 0:  # the saved totals are those of all ranks together (see _extra): rank 0 carries them on
        state.progress.tot_loss = state.progress.tot_frames = 0.0
        state.progress.dropped_cuts = 0
    state.epoch = state.progress.epoch + 1 if state.progress.epoch_done else state.progress.epoch
    rng = _rank_rng(saved, extra, path)
    if rng is None:
        log.warning("%s holds no random-generator states: the resumed run's random draws (dropout, augmentation) "
                    "differ from an uninterrupted run's", path)
    where = (f"the end of epoch {state.progress.epoch}" if state.progress.epoch_done else
             f"epoch {state.epoch} after {state.progress.batches_done} batches")
    log.info("resumed from %s at training batch %d (%s)", path, state.batch_idx_train, where)
    config = dict(info.get("config") or {})
    record = {"from": str(path), "epoch": state.epoch, "batch_idx_train": state.batch_idx_train,
              "batches_done_in_epoch": 0 if state.progress.epoch_done else state.progress.batches_done,
              "saved_precision": info.get("policy"), "config": config}
    return rng, record


def _resumed_history(history: list[dict[str, Any]], exp_dir: str) -> list[dict[str, Any]]:
    """The checkpoint's epoch records, with validation losses the folder recorded after the checkpoint was
    written (an epoch's checkpoint precedes its validation)."""
    try:
        recorded = {e.get("epoch"): e for e in read_history(exp_dir) if e.get("event") == "epoch"}
    except (OSError, ValueError):
        recorded = {}
    out = []
    for h in history:
        r = recorded.get(h.get("epoch"), {})
        out.append({**h, **{k: r[k] for k in ("valid_loss",) if k in r and "valid_loss" not in h}})
    return out


def _end_epoch(*, stats: dict[str, Any], model, policy, tokenizer, valid_dl, cfg, state: TrainState, writer,
               save) -> None:
    """Save the epoch's checkpoint, then validate (so validation can never lose the epoch), then record."""
    epoch = state.epoch
    state.progress.epoch_done = True
    state.history.append({"epoch": epoch, **stats})
    save(ckpt.epoch_checkpoint_path(cfg.exp_dir, epoch).name)
    valid_loss = validate(model, valid_dl, tokenizer, policy)
    stats["valid_loss"] = valid_loss
    stats["peak_memory_mb"] = peak_memory_mb(policy.device)
    state.history[-1].update(valid_loss=valid_loss, peak_memory_mb=stats["peak_memory_mb"])
    if valid_loss < state.best_valid_loss:
        state.best_valid_loss, state.best_valid_epoch = valid_loss, epoch
    writer.add_scalar("valid/loss", valid_loss, state.batch_idx_train)
    writer.add_scalar("train/epoch", epoch, state.batch_idx_train)
    _log_valid(valid_loss, f"epoch {epoch}")
    log.info("epoch %d done in %.1f s: train loss %.4f, valid loss %.4f (per frame), peak memory %.0f MB%s", epoch,
             stats["epoch_seconds"], stats["train_loss"], valid_loss, stats["peak_memory_mb"],
             f"; skipped batches {stats['skipped_batches']}" if stats["skipped_batches"] else "")
    if is_main_process():
        append_history(cfg.exp_dir, {"event": "epoch", "epoch": epoch, "batch_idx_train": state.batch_idx_train,
                                     **stats})


def train(
    *,
    model: nn.Module,
    policy: PrecisionPolicy,
    tokenizer,
    train_dl,
    valid_dl,
    cfg: TrainConfig,
    config_for_checkpoint: dict[str, Any] | None = None,
    model_config: dict[str, Any] | None = None,
) -> TrainState:
    """Train ``model`` under ``policy``: prepare the experiment folder, resume if asked, run the epochs, save
    checkpoints.

    ``train_dl`` is any iterable of batch dicts; a DataLoader whose sampler offers ``set_epoch`` (a lhotse sampler)
    is shuffled per epoch and resumed mid-epoch without reading the skipped batches' data. Checkpoints go to
    ``cfg.exp_dir`` as ``epoch-N.pt`` (and ``checkpoint-<batch>.pt`` with ``save_every_n``); ``--avg`` decoding
    averages the last N epoch files. ``model_config`` (a recipe's builder arguments) is recorded as
    ``model.json``; a resume with another architecture is refused (:mod:`asrprec.training.experiment`).

    Under an initialised process group (torchrun + :func:`~asrprec.training.distributed.setup_distributed`)
    every rank calls this with its own shard in ``train_dl`` / ``valid_dl`` (a lhotse sampler built for
    another world size is an error); ``policy.device`` is the rank's device. Rank r seeds its random
    generators (dropout, layer skipping, SpecAugment) with ``cfg.seed + r``; DDP starts every rank from rank
    0's weights. Returns when every rank is done and rank 0's last checkpoint is on disk.

    Raises:
        ExperimentError: the folder holds another run and ``cfg.overwrite`` is off (and the other folder rules).
        FileNotFoundError / CheckpointReadError / CheckpointMismatchError: the checkpoint to resume from is
            missing, unreadable, or of another model or optimizer.
        TooManySkippedBatches: see :func:`train_one_epoch`.
    """
    exp_dir = Path(cfg.exp_dir)
    resume_from = prepare_experiment(cfg, rank=get_rank(), model_config=model_config)
    barrier()  # rank 0 has cleaned the folder (or refused it) before any rank goes on
    seed_everything(cfg.seed + get_rank())
    check_sharded(train_dl, "training")
    per_step = schedule_batches_per_step(cfg, train_dl)
    model = policy.prepare_model(model)
    if _scan_wanted(cfg.scan_oom, policy, train_dl):
        # before DDP: a backward pass through the bare model of a DDP wrapper leaves DDP's record of the
        # parameters used in the step wrong, and its first step then fails
        _scan_on_every_rank(model, train_dl, tokenizer, policy, cfg)
    # DDP after the cast (it broadcasts and hooks the parameters as they are) and before the optimizer (the
    # bf16 master weights copy rank 0's broadcast values)
    model = wrap_model(model, policy.device)
    dtypes = effective_dtypes(model)
    desc = policy.describe()
    log.info("precision: %s", ", ".join(f"{k}={v}" for k, v in desc.items()))
    log.info("processes: %s", describe())
    log.info("parameter dtypes: %s", ", ".join(f"{k}: {v:,}" for k, v in dtypes.items()))
    optimizer = optimizer_from_config(model, cfg, policy)
    scheduler = scheduler_from_config(optimizer, cfg)
    scaler = policy.make_scaler()
    scaler.watch(unwrap_model(model))
    state = TrainState(epoch=cfg.start_epoch)
    full_config = {"train": cfg.to_dict(), **(config_for_checkpoint or {})}
    if model_config is not None:
        full_config.setdefault("model", model_config)
    # rank 0 only: the replicas are identical, and only rank 0 saves
    averager = ckpt.RunningAverage(unwrap_model(model), cfg.average_period) \
        if cfg.average_period and is_main_process() else None

    def save(name: str, *, collective: bool = True) -> None:
        """Rank 0 writes the checkpoint. ``collective``: every rank calls this at the same point (the saved
        totals and random states then cover every rank); a save only one rank may reach passes False."""
        # no sampler state: the position is extra["progress"] (a lhotse sampler's own state runs ahead of training
        # by the batches its DataLoader workers prefetched)
        extra = _extra(state) if collective or get_world_size() == 1 else None
        if is_main_process():
            ckpt.save_checkpoint(exp_dir / name, model=unwrap_model(model), optimizer=optimizer, scheduler=scheduler,
                                 scaler=scaler, policy=policy, config=full_config, model_avg=averager,
                                 extra=extra if extra is not None else {"epoch": state.epoch,
                                                                        "batch_idx_train": state.batch_idx_train})

    rng, record = None, None
    if resume_from is not None:
        rng, record = _restore(resume_from, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                               averager=averager, policy=policy, state=state, cfg=cfg, per_step=per_step)
        if state.epoch > cfg.num_epochs:
            raise ExperimentError(f"{resume_from} ends epoch {state.epoch - 1} and --num-epochs is {cfg.num_epochs}: "
                                  "nothing to train. Fix: raise --num-epochs")
    record_run_start(exp_dir, model_config=model_config, config=full_config, precision=desc, resume=record,
                     rank=get_rank())

    with SummaryWriterOrNull(exp_dir / "tensorboard", enabled=cfg.tensorboard and is_main_process()) as writer:
        writer.add_text("precision", "\n".join(f"{k}: {v}" for k, v in {**desc, **dtypes}.items()), 0)
        for epoch in range(state.epoch, cfg.num_epochs + 1):
            state.epoch = epoch
            resumed_mid_epoch = state.progress is not None and state.progress.epoch == epoch \
                and not state.progress.epoch_done
            if not resumed_mid_epoch:
                state.progress = EpochProgress(epoch)
            scheduler.step_epoch(epoch - 1)
            if rng is not None and not resumed_mid_epoch:
                set_rng_state(rng)  # the end-of-epoch checkpoint's generators precede this epoch's iterator
                rng = None
            batches = epoch_iterator(train_dl, epoch, state.progress.batches_done,
                                     state.progress.last_cut_ids if is_main_process() else None)
            if rng is not None:
                set_rng_state(rng)  # a mid-epoch checkpoint's generators follow the positioned iterator
                rng = None
            stats = train_one_epoch(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                                    policy=policy, tokenizer=tokenizer, batches=batches, valid_dl=valid_dl,
                                    cfg=cfg, state=state, writer=writer, save=save, averager=averager,
                                    max_duration=sampler_max_duration(getattr(train_dl, "sampler", None)),
                                    per_step=per_step)
            _end_epoch(stats=stats, model=model, policy=policy, tokenizer=tokenizer, valid_dl=valid_dl, cfg=cfg,
                       state=state, writer=writer, save=save)
    barrier()  # rank 0's last checkpoint is written before any rank returns (and may resume from it)
    return state


def _scan_on_every_rank(model: nn.Module, train_dl, tokenizer, policy: PrecisionPolicy, cfg: TrainConfig) -> None:
    """The OOM scan of each rank's riskiest batches, on the model before DDP wraps it (no gradient all-reduce:
    ranks may try different numbers of batches; the memory of DDP's gradient buckets, one more copy of the
    gradients, is not included); a rank whose batch does not fit stops every rank with its message."""
    error = None
    try:
        scan_pessimistic_batches(model, train_dl, tokenizer, policy,
                                 encoder_schedule_scale=cfg.encoder_schedule_scale)
    except Exception as e:  # noqa: BLE001 - re-raised by raise_if_any_failed
        error = e
    raise_if_any_failed(error, "the out-of-memory scan of the riskiest batches")
