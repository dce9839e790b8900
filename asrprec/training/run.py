"""A training run as one object: :class:`Run` holds what the loop steps (model, optimizer, schedule, scaler,
running average, precision policy, tokenizer, data), the train state, the experiment folder, the tensorboard writer
and the hooks; it is built once (:meth:`Run.build`), then hands the loop its epochs and batches, saves checkpoints
and stops.

Every rank builds its own Run and walks the same epochs and batches: each batch is agreed on by all ranks
(:func:`~asrprec.training.distributed.flags_by_rank`), so they skip, stop and save at the same points; only rank 0
writes files. The shape follows torchtune's single-device recipe (pytorch/torchtune
``recipes/full_finetune_single_device.py``: ``setup`` once, then ``train`` over epochs and batches).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

from torch import nn

from asrprec import checkpoint as ckpt
from asrprec.devices import get_rank, get_world_size, is_main_process
from asrprec.experiment import Experiment, ExperimentError
from asrprec.models import unwrap_model
from asrprec.models.compile import compile_model
from asrprec.models.icefall import load_icefall_weights, parse_icefall_source, read_icefall_checkpoint
from asrprec.precision import PrecisionPolicy
from asrprec.rng import seed_everything, set_rng_state

from .config import TrainConfig
from .distributed import barrier, check_sharded, flags_by_rank, wrap_model
from .hooks import CompileReport, Hook
from .oom import sampler_max_duration, scan_on_every_rank, scan_wanted
from .optimizers import optimizer_from_config, scheduler_from_config
from .preemption import PreemptionWatch, preempted, preempted_event
from .reporting import SummaryWriterOrNull, log_run_start, write_precision
from .resume import EpochProgress, TrainState, batch_cut_ids, checkpoint_extra, epoch_iterator, restore
from .schedules import schedule_batches_per_step
from .skips import (UNLOADABLE, NoTrainingBatches, loader_broken, no_batch_reason, record_skip, report_dropped_cuts,
                    skip_budget_exceeded, stopped_event, too_many_skipped)

log = logging.getLogger(__name__)

__all__ = ["Run"]

#: the kinds of checkpoint :meth:`Run.save` writes
EPOCH, BATCH, BAD_MODEL = "epoch", "batch", "bad-model"


@dataclass
class Run:
    """One training run (module docstring). ``model`` is the model as trained (cast by the policy, compiled,
    DDP-wrapped); :attr:`bare` is the module itself. ``config``: what every checkpoint records as the run's
    configuration."""

    cfg: TrainConfig
    experiment: Experiment
    model: nn.Module
    policy: PrecisionPolicy
    tokenizer: Any
    optimizer: Any
    scheduler: Any
    scaler: Any
    averager: ckpt.RunningAverage | None
    state: TrainState
    train_dl: Any
    valid_dl: Any
    config: dict[str, Any]
    hooks: list[Hook] = field(default_factory=list)
    writer: SummaryWriterOrNull = field(default_factory=lambda: SummaryWriterOrNull("", enabled=False))
    preemption: PreemptionWatch | None = None
    # the frames trained since the last step log line, and its time (reporting.log_step)
    window: dict[str, float] = field(default_factory=lambda: {"frames": 0.0, "t": time.time()})
    precision: tuple[dict[str, Any], dict[str, Any]] = ({}, {})  # the policy's description, the parameter dtypes
    resumed: dict[str, Any] | None = None  # the resume's record for the history (None: a new run)
    rng: dict | None = None  # the resume checkpoint's generator states, set when the epoch's iterator is placed
    epoch_start: float = 0.0
    _batches: Iterator | None = None

    @classmethod
    def build(cls, *, model: nn.Module, policy: PrecisionPolicy, tokenizer, train_dl, valid_dl, cfg: TrainConfig,
              model_config: dict[str, Any] | None = None,
              config_for_checkpoint: dict[str, Any] | None = None) -> "Run":
        """Prepare the folder (:meth:`~asrprec.experiment.Experiment.prepare`: once per run, the folder's lock taken
        on rank 0), seed this rank, cast / compile / wrap the model, make the optimizer, schedule, scaler and
        average, resume if asked, and record the start. Arguments as :func:`asrprec.training.train`'s."""
        experiment = Experiment(cfg.exp_dir)
        resume_from = experiment.prepare(cfg, rank=get_rank(), model_config=model_config)
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
        hooks: list[Hook] = []
        if cfg.compile:  # in place, before DDP: DDP wraps the model that holds the compiled encoder
            compile_model(model, parts=("encoder", "joiner") if cfg.compile_joiner else ("encoder",),
                          dynamic=cfg.compile_dynamic, backend=cfg.compile_backend, mode=cfg.compile_mode,
                          recompile_limit=cfg.compile_recompile_limit, regions=cfg.compile_regions,
                          schedules=cfg.compile_schedules)
            hooks.append(CompileReport())
        # DDP after the cast (it broadcasts and hooks the parameters as they are) and before the optimizer (the
        # bf16 master weights copy rank 0's broadcast values)
        model = wrap_model(model, policy.device)
        precision = log_run_start(model, policy)
        optimizer = optimizer_from_config(model, cfg, policy)
        scheduler = scheduler_from_config(optimizer, cfg)
        scaler = policy.make_scaler()
        scaler.watch(unwrap_model(model))
        config = {"train": cfg.to_dict(), **(config_for_checkpoint or {})}
        if model_config is not None:
            config.setdefault("model", model_config)
        run = cls(cfg=cfg, experiment=experiment, model=model, policy=policy, tokenizer=tokenizer,
                  optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                  # rank 0 only: the replicas are identical, and only rank 0 saves
                  averager=ckpt.RunningAverage(unwrap_model(model), cfg.average_period)
                  if cfg.average_period and is_main_process() else None,
                  state=TrainState(epoch=cfg.start_epoch, per_step=per_step),
                  train_dl=train_dl, valid_dl=valid_dl, config=config, hooks=hooks, precision=precision)
        if resume_from is not None:
            run.rng, run.resumed = restore(resume_from, run.objects(), run.state, policy=policy, cfg=cfg)
            if run.state.epoch > cfg.num_epochs:
                raise ExperimentError(f"{resume_from} ends epoch {run.state.epoch - 1} and --num-epochs is "
                                      f"{cfg.num_epochs}: nothing to train. Fix: raise --num-epochs")
        experiment.record_start(config=config, model_config=model_config, precision=precision[0],
                                resume=run.resumed)
        return run

    @property
    def bare(self) -> nn.Module:
        return unwrap_model(self.model)

    @property
    def max_duration(self) -> float | None:
        """The training sampler's ``--max-duration`` (for out-of-memory advice)."""
        return sampler_max_duration(getattr(self.train_dl, "sampler", None))

    def objects(self) -> ckpt.TrainingObjects:
        """What a checkpoint of this run holds the state of."""
        return ckpt.TrainingObjects(model=self.bare, optimizer=self.optimizer, scheduler=self.scheduler,
                                    scaler=self.scaler, model_avg=self.averager)

    # -- the run's span: the preemption watch and the writer ------------------------------------------

    def __enter__(self) -> "Run":
        self.preemption = PreemptionWatch(self.cfg.preempt_signals).__enter__()
        self.writer = SummaryWriterOrNull(self.experiment.tensorboard_dir,
                                          enabled=self.cfg.tensorboard and is_main_process())
        write_precision(self.writer, *self.precision)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.writer.close()
        if self.preemption is not None:
            self.preemption.__exit__(*exc)

    # -- checkpoints and stops ------------------------------------------------------------------------

    def checkpoint_path(self, kind: str) -> Path:
        """Where :meth:`save` writes ``kind``: ``epoch`` (``epoch-N.pt``), ``batch`` (``checkpoint-B.pt``),
        ``bad-model`` (``bad-model.pt``)."""
        if kind == EPOCH:
            return self.experiment.epoch_checkpoint(self.state.epoch)
        if kind == BATCH:
            return self.experiment.batch_checkpoint(self.state.batch_idx_train)
        if kind == BAD_MODEL:
            return self.experiment.bad_model_path
        raise ValueError(f"no checkpoint kind {kind!r}; the kinds are {EPOCH}, {BATCH}, {BAD_MODEL}")

    def save(self, kind: str, *, collective: bool = True, rotate: bool = False) -> Path:
        """Write the checkpoint ``kind`` (:meth:`checkpoint_path`) on rank 0; return its path. ``collective``: every
        rank calls this at the same point (the saved totals and random states then cover every rank); a save only
        one rank may reach passes False. ``rotate``: then keep the newest ``cfg.keep_last_k`` batch checkpoints."""
        path = self.checkpoint_path(kind)
        # no sampler state: the position is extra["progress"] (a lhotse sampler's own state runs ahead of training
        # by the batches its DataLoader workers prefetched)
        extra = checkpoint_extra(self.state) if collective or get_world_size() == 1 else \
            {"epoch": self.state.epoch, "batch_idx_train": self.state.batch_idx_train}
        if is_main_process():
            ckpt.save_checkpoint(path, self.objects(), policy=self.policy, config=self.config, extra=extra)
            if rotate:
                self.experiment.keep_last(self.cfg.keep_last_k)
        return path

    def stop(self, error: Callable[[], BaseException], *, event: Callable[[], dict[str, Any]] | None = None,
             checkpoint: str | Path = BATCH, rotate: bool = False) -> NoReturn:
        """Stop the run: save ``checkpoint`` (a kind for :meth:`save`, or the path of a checkpoint written already),
        record ``event()`` in the history with the checkpoint's name and the save's seconds, wait for every rank (the
        checkpoint is on disk before any rank exits; torchrun then ends the others), raise ``error()``. Both are
        made after the save, so they tell what happened during it (a second signal, say). Collective: every rank
        calls this at the same point."""
        t0 = time.time()
        path = checkpoint if isinstance(checkpoint, Path) else self.save(checkpoint, rotate=rotate)
        if event is not None:
            self.experiment.record({**event(), "checkpoint": path.name, "save_seconds": round(time.time() - t0, 3)})
        barrier()
        raise error()

    # -- epochs and batches ---------------------------------------------------------------------------

    def epochs(self) -> Iterator[int]:
        """The epochs left to train, each with its progress, schedule, random state and loader placed (a resumed
        epoch continues where its checkpoint was written)."""
        state = self.state
        for epoch in range(state.epoch, self.cfg.num_epochs + 1):
            state.epoch = epoch
            resumed_mid_epoch = state.progress is not None and state.progress.epoch == epoch \
                and not state.progress.epoch_done
            if not resumed_mid_epoch:
                state.progress = EpochProgress(epoch)
            self.scheduler.step_epoch(epoch - 1)
            if self.rng is not None and not resumed_mid_epoch:
                set_rng_state(self.rng)  # the end-of-epoch checkpoint's generators precede this epoch's iterator
                self.rng = None
            duration_drops = getattr(self.train_dl, "duration_drops", None)
            if duration_drops is not None:
                duration_drops.start_pass()
            self._batches = epoch_iterator(self.train_dl, epoch, state.progress.batches_done,
                                           state.progress.last_cut_ids if is_main_process() else None)
            if self.rng is not None:
                set_rng_state(self.rng)  # a mid-epoch checkpoint's generators follow the positioned iterator
                self.rng = None
            for hook in self.hooks:
                hook.epoch_started(epoch)
            yield epoch

    def batches(self) -> Iterator[dict[str, Any]]:
        """The epoch's usable batches, from its position (``state.progress.batches_done``) to its end or
        ``cfg.max_batches_per_epoch``. A batch the loader failed on, or whose cuts all failed, is counted and named
        (:mod:`~asrprec.training.skips`), not yielded; the run stops when too many are skipped, when the loader
        keeps failing, or on a preemption signal (after the step of the batch in hand).

        Under DDP the ranks agree on each batch before its step: the epoch ends for all when a shard runs out, a
        batch one rank cannot use is skipped on all, and a signal stops all after the same step."""
        state, cfg, progress = self.state, self.cfg, self.state.progress
        self.epoch_start, self.window = time.time(), {"frames": 0.0, "t": time.time()}
        # a bar updated by hand: a tqdm-wrapped iterator would end the epoch at the first batch the loader fails on
        bar = None
        if cfg.progress_bar and is_main_process():
            from tqdm import tqdm

            bar = tqdm(desc=f"epoch {state.epoch}", mininterval=5.0, leave=False, initial=progress.batches_done)
        batches = iter(self._batches)
        failures_in_a_row = 0
        try:
            while not (cfg.max_batches_per_epoch and progress.batches_done >= cfg.max_batches_per_epoch):
                try:
                    batch, error = _next_batch(batches)
                    exhausted = False
                except StopIteration:
                    batch, error, exhausted = None, None, True
                ended, unusable_ranks, failed_ranks, preempted_on = flags_by_rank(
                    exhausted, not exhausted and (error is not None or batch["features"].shape[0] == 0),
                    error is not None, self.preemption is not None and self.preemption.requested)
                if ended:
                    if not exhausted:
                        log.warning("rank(s) %s ran out of batches first: epoch %d ends here on every rank", ended,
                                    state.epoch)
                    break
                progress.batches_done += 1
                progress.last_cut_ids = batch_cut_ids(batch) if batch is not None else []
                failures_in_a_row = failures_in_a_row + 1 if failed_ranks else 0
                if (broken := loader_broken(failures_in_a_row, error, self.checkpoint_path(BATCH))) is not None:
                    self.stop(lambda: broken)
                if self._usable(batch, error, [r for r in unusable_ranks if r != get_rank()]):
                    yield batch
                self._stop_if_too_many_skipped(end_of_epoch=False)
                if bar is not None:
                    bar.update(1)
                if preempted_on:
                    self.stop_for_preemption(preempted_on)
        finally:
            if bar is not None:
                bar.close()
        progress.seconds = time.time() - self.epoch_start
        self._stop_if_too_many_skipped(end_of_epoch=True)

    def _usable(self, batch: Any, error: BaseException | None, unusable_ranks: list[int]) -> bool:
        """Whether to train on a batch from the loader; if not, count and name why it is skipped.
        ``unusable_ranks``: the other ranks whose batch of this step could not be used (the step is then skipped on
        every rank, so that all ranks run the same collectives)."""
        progress, at = self.state.progress, self.state.batch_idx_train
        if error is not None:
            record_skip(progress, UNLOADABLE, [], f"the loader raised {type(error).__name__}: "
                        f"{(str(error).strip().splitlines() or [''])[-1][:300]}", at)
            return False
        report_dropped_cuts(batch, progress)
        if batch["features"].shape[0] == 0:
            ids = [d["cut_id"] for d in batch.get("dropped_cuts", [])]
            record_skip(progress, UNLOADABLE, ids, "no cut of the batch could be read", at)
            return False
        if unusable_ranks:
            record_skip(progress, UNLOADABLE, list(batch.get("cut_ids", [])),
                        f"the batch of rank(s) {unusable_ranks} could not be loaded (skipped on every rank)", at)
            return False
        return True

    def _stop_if_too_many_skipped(self, end_of_epoch: bool) -> None:
        """Stop with :class:`~asrprec.training.skips.TooManySkippedBatches` past the skip budget, or with
        :class:`~asrprec.training.skips.NoTrainingBatches` after an epoch with no batch (no checkpoint: nothing was
        trained in it). Collective."""
        progress = self.state.progress
        if end_of_epoch and progress.batches_done == 0:
            why = no_batch_reason(progress.epoch, getattr(self.train_dl, "duration_drops", None),
                                  getattr(self.train_dl, "batching", None))
            self.experiment.record(stopped_event(progress, why, self.state.batch_idx_train))
            barrier()
            raise NoTrainingBatches(why)
        why = skip_budget_exceeded(progress, self.cfg.max_skipped_fraction, end_of_epoch=end_of_epoch)
        if why is not None:
            self.stop(lambda: too_many_skipped(progress, why, self.checkpoint_path(BATCH)),
                      event=lambda: stopped_event(progress, why, self.state.batch_idx_train))

    def stop_for_preemption(self, ranks: list[int], written: Path | None = None) -> NoReturn:
        """Stop with :class:`~asrprec.training.preemption.TrainingPreempted` after ``ranks`` received a signal: save
        this batch's checkpoint (or name ``written``, e.g. the epoch's) and record a ``preempted`` event. Collective."""
        state = self.state
        where = (f"epoch {state.epoch}, {state.progress.batches_done} batches into it, training batch "
                 f"{state.batch_idx_train}")
        path = written or self.checkpoint_path(BATCH)
        if written is None:
            state.progress.seconds = time.time() - self.epoch_start
        self.stop(lambda: preempted(self.preemption, ranks, where, path),
                  event=lambda: preempted_event(self.preemption, ranks, state.epoch, state.batch_idx_train),
                  checkpoint=written or BATCH, rotate=True)


def _next_batch(batches: Iterator) -> tuple[Any, BaseException | None]:
    """The next batch, or ``(None, error)`` when the loader raised for this batch (StopIteration passes)."""
    try:
        return next(batches), None
    except StopIteration:
        raise
    except Exception as e:  # a dataset or worker error for one batch: the iterator stays usable
        return None, e


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
