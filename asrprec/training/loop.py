"""The one training loop. It never branches on precision: the policy hands it an autocast context,
a scaler (a no-op unless ``amp-fp16``) and an optimizer wrapper (fp32 master weights under ``bf16``).

:func:`train` builds a :class:`~asrprec.training.run.Run` and walks it::

    for epoch in run.epochs():
        for batch in run.batches():  # train_one_epoch
            step(run, batch)
        end_epoch(run, stats)

:func:`step` trains on one batch (:func:`train_step`: forward, backward, update) and logs, validates and saves as
due; :func:`end_epoch` saves the epoch's checkpoint, validates and records. Around them: :mod:`.run` (the run, its
checkpoints and stops), :mod:`~asrprec.training.resume` (the train state a checkpoint records, and exact resume),
:mod:`~asrprec.training.skips` (skipped batches and their budget), :mod:`~asrprec.training.reporting` (log lines,
tensorboard), :mod:`~asrprec.training.preemption` (stopping on a signal where the run can continue exactly),
:mod:`~asrprec.training.hooks` (what a feature reports per epoch, e.g. torch.compile's graphs).

Under torchrun (after :func:`~asrprec.training.distributed.setup_distributed`) the same loop trains data-parallel:
the model is wrapped in DDP with summed gradients, every rank reads its own shard, the ranks agree each step on
whether to go on, skip or stop (:mod:`asrprec.training.distributed`), validation and the logged losses are summed
over ranks, and only rank 0 writes checkpoints, tensorboard and the running average.

Schedules count data, not steps: :func:`schedule_batches_per_step` says why and how.

The epoch's checkpoint is written before validation, and validation leaves the random generators as they were
(so it can neither lose an epoch nor change what follows); a non-finite validation loss is a warning.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Iterable

import torch
from torch import nn

from asrprec.devices import get_rank, get_world_size
from asrprec.experiment import Experiment
from asrprec.models import unwrap_model
from asrprec.precision import PrecisionPolicy
from asrprec.rng import preserved_rng

from .config import TrainConfig
from .distributed import RankFailedError, all_reduce_sum, barrier, flags_by_rank, raise_failure
from .forward import compute_loss
from .oom import describe_batch, is_out_of_memory, out_of_memory_error, save_batch
from .preemption import preempted_ranks
from .reporting import LOSS_COMPONENTS, add_padding, epoch_stats, log_epoch, log_step, log_valid, peak_memory_mb
from .resume import TrainState
from .run import BAD_MODEL, BATCH, EPOCH, Run
from .schedules import schedule_batches_per_step, set_schedule_counts
from .skips import NONFINITE, dropped_cut_totals, record_skip

log = logging.getLogger(__name__)

__all__ = ["schedule_batches_per_step", "validate", "train_step", "step", "train_one_epoch", "end_epoch", "train"]


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


# -- rank agreement ------------------------------------------------------------------


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


# -- one step, one epoch ---------------------------------------------------------------------------


def train_step(run: Run, batch: dict[str, Any], *, want_grad_norm: bool = True
               ) -> tuple[dict[str, float] | None, list[int]]:
    """Forward, backward and update on one batch. Returns the batch's statistics and ``[]``, or ``(None, ranks)``
    when the loss is not finite on ``ranks``: the step is then skipped on every rank (so that all ranks run the
    same collectives) and nothing was updated.

    Any other error saves ``bad-model.pt`` and propagates (an error in the forward pass on one rank is raised on
    every rank); an out-of-memory error also saves the batch and becomes
    :class:`~asrprec.training.oom.BatchOutOfMemory`.
    """
    model, optimizer, scaler, state = run.model, run.optimizer, run.scaler, run.state
    try:
        loss, info, nonfinite_ranks = forward_on_every_rank(model, batch, run.tokenizer, run.policy,
                                                            f"training batch {state.batch_idx_train}")
    except Exception as e:
        # raised on every rank together: each saves its files, then all wait, so that once any rank reports,
        # every file its message names exists
        try:
            error = _failed_step_error(e, run, batch)
        finally:
            barrier()
        if error is e:
            raise
        raise error from e
    try:
        if nonfinite_ranks:
            optimizer.zero_grad(set_to_none=True)
            return None, nonfinite_ranks
        scaler.scale(loss).backward()
        if run.cfg.grad_clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), run.cfg.grad_clip)
        info["grad_norm"] = _grad_norm(model) if want_grad_norm else float("nan")
        scaler.step(optimizer)
        scaler.update()
        # a collapse happens on every rank at once (the summed gradients, hence the scales, are the same)
        scaler.check_health(state.batch_idx_train, on_collapse=lambda: run.save(BAD_MODEL))
        optimizer.zero_grad(set_to_none=True)
        if run.averager is not None:
            run.averager.maybe_update(run.bare, state.batch_idx_train)
        return info, []
    except Exception as e:  # on this rank alone (the others may be waiting in the gradient all-reduce)
        error = _failed_step_error(e, run, batch)
        if error is e:
            raise
        raise error from e


def _failed_step_error(e: Exception, run: Run, batch: dict[str, Any]) -> Exception:
    """Save ``bad-model.pt`` (and, for an out-of-memory error, the batch); return the error to raise: ``e``, or
    :class:`~asrprec.training.oom.BatchOutOfMemory` naming the saved batch."""
    run.save(BAD_MODEL, collective=False)  # the other ranks may not be failing here
    if not is_out_of_memory(e) or isinstance(e, RankFailedError):
        return e
    at, policy = run.state.batch_idx_train, run.policy
    path = save_batch(batch, run.experiment.oom_batch_path(at, get_rank() if get_world_size() > 1 else None))
    if policy.device.type == "cuda":
        log.error("CUDA memory at the OOM:\n%s", torch.cuda.memory_summary(policy.device, abbreviated=True))
    return out_of_memory_error(f"training batch {at} ({describe_batch(batch)}; saved to {path})", policy, e,
                               run.max_duration)


def step(run: Run, batch: dict[str, Any]) -> None:
    """One usable batch: step (or skip it when its loss is not finite), then log, validate and save as due."""
    state, cfg, progress = run.state, run.cfg, run.state.progress
    state.batch_idx_train += 1
    state.adjusted_batch_count += state.per_step
    set_schedule_counts(run.bare, run.scheduler, state.adjusted_batch_count, cfg)
    log_now = (progress.batches_done - 1) % cfg.log_interval == 0
    info, nonfinite_ranks = train_step(run, batch, want_grad_norm=log_now)
    if info is None:
        where = "" if get_world_size() == 1 else f" on rank(s) {nonfinite_ranks} (the step is skipped on every rank)"
        record_skip(progress, NONFINITE, list(batch.get("cut_ids", [])), f"the loss is not finite{where}",
                    state.batch_idx_train)
        return
    progress.steps += 1
    progress.tot_loss += info["loss"]
    progress.tot_frames += info["frames"]
    for k in LOSS_COMPONENTS:
        if k in info:
            progress.tot_parts[k] = progress.tot_parts.get(k, 0.0) + info[k]
    run.window["frames"] += batch["features"].shape[0] * batch["features"].shape[1]
    add_padding(progress.padding, batch, run.tokenizer)
    if log_now:
        log_step(run, info)
    if cfg.valid_interval and state.batch_idx_train % cfg.valid_interval == 0:
        v = validate(run.model, run.valid_dl, run.tokenizer, run.policy)
        run.writer.add_scalar("valid/loss", v, state.batch_idx_train)
        log_valid(v, f"after batch {state.batch_idx_train}")
    if cfg.save_every_n and state.batch_idx_train % cfg.save_every_n == 0:
        progress.seconds = time.time() - run.epoch_start
        run.save(BATCH, rotate=True)


def train_one_epoch(run: Run) -> dict[str, Any]:
    """Train on the epoch's batches from its position (``state.progress.batches_done``) to its end; return its
    statistics over all ranks (:func:`~asrprec.training.reporting.epoch_stats`).

    Raises:
        TooManySkippedBatches: more than ``cfg.max_skipped_fraction`` of the epoch's batches were skipped (checked
            from the third skipped batch on, and at the end), no batch could be trained, or the loader failed
            :data:`~asrprec.training.skips.MAX_LOADER_FAILURES_IN_A_ROW` times in a row; a checkpoint was saved.
        NoTrainingBatches: the loader served no batch at all (every cut dropped, or a sampler that made no batch;
            the message says which); nothing was saved.
        TrainingPreempted: a preemption signal arrived; this batch's checkpoint was saved.
    """
    for batch in run.batches():
        step(run, batch)
    return epoch_stats(run.state.progress)


def end_epoch(run: Run, stats: dict[str, Any]) -> None:
    """Save the epoch's checkpoint, then validate (so validation can never lose the epoch), then record; stop if a
    preemption signal arrived meanwhile (and epochs remain)."""
    state = run.state
    epoch = state.epoch
    stats["dropped_cuts_by_reason"] = dropped_cut_totals(state.progress, getattr(run.train_dl, "duration_drops", None))
    state.progress.epoch_done = True
    state.history.append({"epoch": epoch, **stats})
    run.save(EPOCH)
    stats["valid_loss"] = validate(run.model, run.valid_dl, run.tokenizer, run.policy)
    stats["peak_memory_mb"] = peak_memory_mb(run.policy.device)
    for hook in run.hooks:
        hook.epoch_ended(epoch, stats)
    state.history[-1].update({k: stats[k] for k in ("valid_loss", "peak_memory_mb", "compiled_graphs") if k in stats})
    if stats["valid_loss"] < state.best_valid_loss:
        state.best_valid_loss, state.best_valid_epoch = stats["valid_loss"], epoch
    log_epoch(epoch, stats, batch_idx_train=state.batch_idx_train, writer=run.writer)
    run.experiment.record({"event": "epoch", "epoch": epoch, "batch_idx_train": state.batch_idx_train, **stats})
    if epoch < run.cfg.num_epochs and (ranks := preempted_ranks(run.preemption)):  # a signal during the epoch's end
        run.stop_for_preemption(ranks, written=run.checkpoint_path(EPOCH))


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
    checkpoints (:meth:`Run.build <asrprec.training.run.Run.build>`, then the loop of the module docstring).

    ``train_dl`` is any iterable of batch dicts; a DataLoader whose sampler offers ``set_epoch`` (a lhotse sampler)
    is shuffled per epoch and resumed mid-epoch without reading the skipped batches' data. Checkpoints go to
    ``cfg.exp_dir`` as ``epoch-N.pt`` (and ``checkpoint-<batch>.pt`` with ``save_every_n``); ``--avg`` decoding
    averages the last N epoch files. ``model_config`` (a recipe's builder arguments) is recorded as
    ``model.json``; a resume with another architecture is refused (:mod:`asrprec.experiment`).

    Under an initialised process group (torchrun + :func:`~asrprec.training.distributed.setup_distributed`)
    every rank calls this with its own shard in ``train_dl`` / ``valid_dl`` (a lhotse sampler built for
    another world size is an error); ``policy.device`` is the rank's device. Rank r seeds its random
    generators (dropout, layer skipping, SpecAugment) with ``cfg.seed + r``; DDP starts every rank from rank
    0's weights. Returns when every rank is done and rank 0's last checkpoint is on disk. The folder's lock
    (taken when the folder is prepared) is released however the run ends.

    Raises:
        ExperimentError: the folder holds another run and ``cfg.overwrite`` is off (and the other folder rules).
        FileNotFoundError / CheckpointReadError / CheckpointMismatchError: the checkpoint to resume from is
            missing, unreadable, or of another model or optimizer.
        TooManySkippedBatches / NoTrainingBatches: see :func:`train_one_epoch`.
        TrainingPreempted: one of ``cfg.preempt_signals`` arrived; the checkpoint it names was saved, and the same
            call with ``resume="auto"`` continues exactly (:mod:`asrprec.training.preemption`).
    """
    try:
        run = Run.build(model=model, policy=policy, tokenizer=tokenizer, train_dl=train_dl, valid_dl=valid_dl,
                        cfg=cfg, model_config=model_config, config_for_checkpoint=config_for_checkpoint)
        with run:
            for _ in run.epochs():
                end_epoch(run, train_one_epoch(run))
        barrier()  # rank 0's last checkpoint is written before any rank returns (and may resume from it)
        return run.state
    finally:
        Experiment(cfg.exp_dir).unlock()
