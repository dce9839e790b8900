"""The one training loop. It never branches on precision: the policy hands it an autocast context,
a scaler (a no-op unless ``amp-fp16``) and an optimizer wrapper (fp32 master weights under ``bf16``).

Plain functions: :func:`train` (experiment folder, resume, epochs, checkpoints), :func:`train_one_epoch`,
:func:`train_step`, :func:`validate`. Around them: :mod:`~asrprec.training.resume` (the train state a checkpoint
records, and exact resume), :mod:`~asrprec.training.skips` (skipped batches and their budget),
:mod:`~asrprec.training.reporting` (log lines, tensorboard), :mod:`asrprec.training.optimizers` (optimizer, schedule),
:mod:`~asrprec.training.preemption` (stopping on a signal where the run can continue exactly).

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from asrprec import checkpoint as ckpt
from asrprec.devices import get_rank, get_world_size, is_main_process
from asrprec.models import unwrap_model
from asrprec.models.compile import compile_model, compiled_graph_count, recompile_limit_hits
from asrprec.models.icefall import load_icefall_weights, parse_icefall_source, read_icefall_checkpoint
from asrprec.precision import PrecisionPolicy
from asrprec.rng import preserved_rng, seed_everything, set_rng_state

from .config import TrainConfig
from .optimizers import optimizer_from_config, scheduler_from_config
from .distributed import (
    RankFailedError,
    all_reduce_sum,
    barrier,
    check_sharded,
    flags_by_rank,
    raise_failure,
    wrap_model,
)
from asrprec.experiment import (ExperimentError, append_history, prepare_experiment, record_run_start,
                                releases_experiment_lock)
from .forward import compute_loss
from .oom import (
    describe_batch,
    is_out_of_memory,
    out_of_memory_error,
    sampler_max_duration,
    save_batch,
    scan_on_every_rank,
    scan_wanted,
)
from .reporting import (
    LOSS_COMPONENTS,
    SummaryWriterOrNull,
    add_padding,
    epoch_stats,
    log_epoch,
    log_run_start,
    log_step,
    log_valid,
    peak_memory_mb,
    write_precision,
)
from .preemption import PreemptionWatch, preempted_ranks, stop_for_preemption
from .schedules import schedule_batches_per_step, set_schedule_counts
from .resume import EpochProgress, TrainState, batch_cut_ids, checkpoint_extra, epoch_iterator, restore
from .skips import (
    NONFINITE,
    UNLOADABLE,
    dropped_cut_totals,
    record_skip,
    report_dropped_cuts,
    stop_if_loader_broken,
    stop_if_too_many_skipped,
)

log = logging.getLogger(__name__)

__all__ = ["schedule_batches_per_step", "validate", "train_step", "train_one_epoch", "train"]


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
    except Exception as e:
        # raised on every rank together: each saves its files, then all wait, so that once any rank reports,
        # every file its message names exists
        try:
            error = _failed_step_error(e, batch, policy, cfg, state, save, max_duration)
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
    except Exception as e:  # on this rank alone (the others may be waiting in the gradient all-reduce)
        error = _failed_step_error(e, batch, policy, cfg, state, save, max_duration)
        if error is e:
            raise
        raise error from e


def _failed_step_error(e: Exception, batch: dict[str, Any], policy: PrecisionPolicy, cfg: TrainConfig,
                       state: TrainState, save: Callable[..., Any], max_duration: float | None) -> Exception:
    """Save ``bad-model.pt`` (and, for an out-of-memory error, the batch); return the error to raise: ``e``, or
    :class:`~asrprec.training.oom.BatchOutOfMemory` naming the saved batch."""
    save(ckpt.BAD_MODEL_NAME, collective=False)  # the other ranks may not be failing here
    if not is_out_of_memory(e) or isinstance(e, RankFailedError):
        return e
    path = save_batch(batch, ckpt.oom_batch_path(cfg.exp_dir, state.batch_idx_train,
                                                 get_rank() if get_world_size() > 1 else None))
    if policy.device.type == "cuda":
        log.error("CUDA memory at the OOM:\n%s", torch.cuda.memory_summary(policy.device, abbreviated=True))
    return out_of_memory_error(f"training batch {state.batch_idx_train} ({describe_batch(batch)}; saved to {path})",
                               policy, e, max_duration)


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
        record_skip(progress, NONFINITE, list(batch.get("cut_ids", [])), f"the loss is not finite{where}",
                    state.batch_idx_train)
        return
    progress.steps += 1
    progress.tot_loss += info["loss"]
    progress.tot_frames += info["frames"]
    for k in LOSS_COMPONENTS:
        if k in info:
            progress.tot_parts[k] = progress.tot_parts.get(k, 0.0) + info[k]
    e.window["frames"] += batch["features"].shape[0] * batch["features"].shape[1]
    add_padding(progress.padding, batch, e.tokenizer)
    if log_now:
        log_step(info, epoch=state.epoch, batch_idx_train=state.batch_idx_train, optimizer=e.optimizer,
                 scaler=e.scaler, policy=e.policy, writer=e.writer, window=e.window)
    if cfg.valid_interval and state.batch_idx_train % cfg.valid_interval == 0:
        v = validate(e.model, e.valid_dl, e.tokenizer, e.policy)
        e.writer.add_scalar("valid/loss", v, state.batch_idx_train)
        log_valid(v, f"after batch {state.batch_idx_train}")
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
        record_skip(progress, UNLOADABLE, [], f"the loader raised {type(error).__name__}: "
                    f"{(str(error).strip().splitlines() or [''])[-1][:300]}", state.batch_idx_train)
        return
    report_dropped_cuts(batch, progress)
    if batch["features"].shape[0] == 0:
        ids = [d["cut_id"] for d in batch.get("dropped_cuts", [])]
        record_skip(progress, UNLOADABLE, ids, "no cut of the batch could be read", state.batch_idx_train)
        return
    if unusable_ranks:
        record_skip(progress, UNLOADABLE, list(batch.get("cut_ids", [])),
                    f"the batch of rank(s) {unusable_ranks} could not be loaded (skipped on every rank)",
                    state.batch_idx_train)
        return
    _train_on(batch, e)


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
    preemption: PreemptionWatch | None = None,
) -> dict[str, float]:
    """Train on ``batches`` (an iterator positioned at ``state.progress.batches_done``) until the epoch or
    ``cfg.max_batches_per_epoch`` ends; returns per-frame average training loss and the epoch's statistics.

    Under DDP the epoch ends for all ranks when any rank's shard runs out (lhotse's samplers give every rank the
    same number of batches; other loaders need not), and a batch that one rank cannot use is skipped on all.
    ``per_step``: how far the schedules' batch count moves per step (:func:`schedule_batches_per_step`).
    ``preemption``: a signal it recorded on any rank stops every rank after the step of the batch being agreed on
    (:mod:`asrprec.training.preemption`).

    Raises:
        TooManySkippedBatches: more skipped batches than ``cfg.max_skipped_fraction`` allows, or a loader that
            keeps failing (a checkpoint named in the message was saved first).
        TrainingPreempted: a preemption signal (a checkpoint named in the message was saved first).
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
            # a batch that one rank cannot use is skipped on all, and a preemption signal stops all after this step
            ended, unusable_ranks, failed_ranks, preempted = flags_by_rank(
                exhausted, not exhausted and _unusable(batch, error), error is not None,
                preemption is not None and preemption.requested)
            if ended:
                if not exhausted:
                    log.warning("rank(s) %s ran out of batches first: epoch %d ends here on every rank", ended,
                                state.epoch)
                break
            progress.batches_done += 1
            progress.last_cut_ids = batch_cut_ids(batch) if batch is not None else []
            failures_in_a_row = failures_in_a_row + 1 if failed_ranks else 0
            stop_if_loader_broken(failures_in_a_row, error, exp_dir=cfg.exp_dir,
                                  batch_idx_train=state.batch_idx_train, save=save)
            _consume(batch, error, e, [r for r in unusable_ranks if r != get_rank()])
            stop_if_too_many_skipped(progress, max_skipped_fraction=cfg.max_skipped_fraction, exp_dir=cfg.exp_dir,
                                     batch_idx_train=state.batch_idx_train, save=save, end_of_epoch=False)
            if bar is not None:
                bar.update(1)
            if preempted:
                progress.seconds = time.time() - e.t0
                stop_for_preemption(preemption, preempted, exp_dir=cfg.exp_dir, epoch=state.epoch,
                                    batch_idx_train=state.batch_idx_train, batches_done=progress.batches_done,
                                    keep_last_k=cfg.keep_last_k, save=save)
    finally:
        if bar is not None:
            bar.close()
    progress.seconds = time.time() - e.t0
    stop_if_too_many_skipped(progress, max_skipped_fraction=cfg.max_skipped_fraction, exp_dir=cfg.exp_dir,
                             batch_idx_train=state.batch_idx_train, save=save, end_of_epoch=True)
    return epoch_stats(progress)


def _end_epoch(*, stats: dict[str, Any], model, policy, tokenizer, valid_dl, cfg, state: TrainState, writer,
               save, graphs_before: tuple[int, int] = (0, 0)) -> None:
    """Save the epoch's checkpoint, then validate (so validation can never lose the epoch), then record."""
    epoch = state.epoch
    state.progress.epoch_done = True
    state.history.append({"epoch": epoch, **stats})
    save(ckpt.epoch_checkpoint_path(cfg.exp_dir, epoch).name)
    valid_loss = validate(model, valid_dl, tokenizer, policy)
    stats["valid_loss"] = valid_loss
    stats["peak_memory_mb"] = peak_memory_mb(policy.device)
    if cfg.compile:
        stats["compiled_graphs"] = _log_compiled_graphs(epoch, graphs_before)
    state.history[-1].update({k: stats[k] for k in ("valid_loss", "peak_memory_mb", "compiled_graphs") if k in stats})
    if valid_loss < state.best_valid_loss:
        state.best_valid_loss, state.best_valid_epoch = valid_loss, epoch
    log_epoch(epoch, stats, batch_idx_train=state.batch_idx_train, writer=writer)
    if is_main_process():
        append_history(cfg.exp_dir, {"event": "epoch", "epoch": epoch, "batch_idx_train": state.batch_idx_train,
                                     **stats})


def _compile_marks() -> tuple[int, int]:
    """(graphs compiled, functions past the recompile limit) so far, for :func:`_log_compiled_graphs`."""
    return compiled_graph_count(), len(recompile_limit_hits())


def _log_compiled_graphs(epoch: int, before: tuple[int, int]) -> int:
    """Log the graphs torch.compile made during ``epoch`` (training and validation, first compiles and recompiles)
    and warn, naming them, about functions that reached dynamo's recompile limit: past it they run eager."""
    new = compiled_graph_count() - before[0]
    logging.info("torch.compile: %d graphs compiled during epoch %d (%d in all)", new, epoch, before[0] + new)
    hits = list(dict.fromkeys(recompile_limit_hits()[before[1]:]))
    if hits:
        log.warning("torch.compile: %s reached dynamo's recompile limit during epoch %d and run%s eager from there "
                    "on. TORCH_LOGS=recompiles names the guards that fail: if they are bounded (schedules settling, "
                    "train/eval, batch sizes of 1), raise --compile-recompile-limit; if they follow every shape, "
                    "--compile-dynamic true keeps every (B, T) in one graph (docs/compile.md).", "; ".join(hits),
                    epoch, "" if len(hits) > 1 else "s")
    return new


def _load_initial_weights(model: nn.Module, cfg: TrainConfig) -> None:
    """``--init-from``: an asrprec checkpoint of this architecture, or an icefall one (``icefall:FILE``)."""
    icefall = parse_icefall_source(cfg.init_from)
    if icefall is not None:
        state, _ = read_icefall_checkpoint(icefall, cfg.icefall_args or None)
        load_icefall_weights(model, state, source=icefall)
        return
    weights = ckpt.read_checkpoint(cfg.init_from, allow_nonfinite=cfg.allow_nonfinite)["model"]
    ckpt.load_model_weights(model, weights, source=f"--init-from {cfg.init_from}",
                            fix="pass a checkpoint of a run with this model's flags (its model.json)")


@releases_experiment_lock  # taken by prepare_experiment; held until the run returns or fails
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
    ``model.json``; a resume with another architecture is refused (:mod:`asrprec.experiment`).

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
        TrainingPreempted: one of ``cfg.preempt_signals`` arrived; the checkpoint it names was saved, and the same
            call with ``resume="auto"`` continues exactly (:mod:`asrprec.training.preemption`).
    """
    exp_dir = Path(cfg.exp_dir)
    resume_from = prepare_experiment(cfg, rank=get_rank(), model_config=model_config)
    barrier()  # rank 0 has cleaned the folder (or refused it) before any rank goes on
    seed_everything(cfg.seed + get_rank())
    check_sharded(train_dl, "training")
    per_step = schedule_batches_per_step(cfg, train_dl)
    if cfg.init_from and resume_from is None:
        # before the policy's cast: the bf16 policy's master weights are made from the weights loaded here
        _load_initial_weights(model, cfg)
        logging.info("initialised the weights from %s (fine-tuning: new optimizer and schedule)", cfg.init_from)
    model = policy.prepare_model(model)
    if scan_wanted(cfg.scan_oom, policy, train_dl):
        # before DDP: a backward pass through the bare model of a DDP wrapper leaves DDP's record of the
        # parameters used in the step wrong, and its first step then fails
        scan_on_every_rank(model, train_dl, tokenizer, policy, encoder_schedule_scale=cfg.encoder_schedule_scale)
    if cfg.compile:  # in place, before DDP: DDP wraps the model that holds the compiled encoder
        compile_model(model, parts=("encoder", "joiner") if cfg.compile_joiner else ("encoder",),
                      dynamic=cfg.compile_dynamic, backend=cfg.compile_backend, mode=cfg.compile_mode,
                      recompile_limit=cfg.compile_recompile_limit, regions=cfg.compile_regions,
                      schedules=cfg.compile_schedules)
    # DDP after the cast (it broadcasts and hooks the parameters as they are) and before the optimizer (the
    # bf16 master weights copy rank 0's broadcast values)
    model = wrap_model(model, policy.device)
    desc, dtypes = log_run_start(model, policy)
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
        extra = checkpoint_extra(state) if collective or get_world_size() == 1 else None
        if is_main_process():
            ckpt.save_checkpoint(exp_dir / name, ckpt.TrainingObjects(model=unwrap_model(model), optimizer=optimizer,
                                 scheduler=scheduler, scaler=scaler, model_avg=averager), policy=policy,
                                 config=full_config, extra=extra if extra is not None else {"epoch": state.epoch,
                                                                        "batch_idx_train": state.batch_idx_train})

    rng, record = None, None
    if resume_from is not None:
        rng, record = restore(resume_from, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                              averager=averager, policy=policy, state=state, cfg=cfg, per_step=per_step)
        if state.epoch > cfg.num_epochs:
            raise ExperimentError(f"{resume_from} ends epoch {state.epoch - 1} and --num-epochs is {cfg.num_epochs}: "
                                  "nothing to train. Fix: raise --num-epochs")
    record_run_start(exp_dir, model_config=model_config, config=full_config, precision=desc, resume=record,
                     rank=get_rank())

    with PreemptionWatch(cfg.preempt_signals) as watch, \
            SummaryWriterOrNull(exp_dir / "tensorboard", enabled=cfg.tensorboard and is_main_process()) as writer:
        write_precision(writer, desc, dtypes)
        graphs_before = _compile_marks() if cfg.compile else (0, 0)
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
            duration_drops = getattr(train_dl, "duration_drops", None)
            if duration_drops is not None:
                duration_drops.start_pass()
            batches = epoch_iterator(train_dl, epoch, state.progress.batches_done,
                                     state.progress.last_cut_ids if is_main_process() else None)
            if rng is not None:
                set_rng_state(rng)  # a mid-epoch checkpoint's generators follow the positioned iterator
                rng = None
            stats = train_one_epoch(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                                    policy=policy, tokenizer=tokenizer, batches=batches, valid_dl=valid_dl,
                                    cfg=cfg, state=state, writer=writer, save=save, averager=averager,
                                    max_duration=sampler_max_duration(getattr(train_dl, "sampler", None)),
                                    per_step=per_step, preemption=watch)
            stats["dropped_cuts_by_reason"] = dropped_cut_totals(state.progress, duration_drops)
            _end_epoch(stats=stats, model=model, policy=policy, tokenizer=tokenizer, valid_dl=valid_dl, cfg=cfg,
                       state=state, writer=writer, save=save, graphs_before=graphs_before)
            graphs_before = _compile_marks() if cfg.compile else (0, 0)
            if epoch < cfg.num_epochs and (ranks := preempted_ranks(watch)):  # a signal during the epoch's end
                stop_for_preemption(watch, ranks, exp_dir=cfg.exp_dir, epoch=epoch,
                                    batch_idx_train=state.batch_idx_train, batches_done=state.progress.batches_done,
                                    keep_last_k=cfg.keep_last_k, save=save,
                                    path=ckpt.epoch_checkpoint_path(cfg.exp_dir, epoch))
    barrier()  # rank 0's last checkpoint is written before any rank returns (and may resume from it)
    return state

