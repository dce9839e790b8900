"""Where training is within an epoch, and how a resumed run gets back there exactly.

A checkpoint stores :class:`EpochProgress`: the epoch, the number of batches *training consumed* in it (trained
or skipped), the optimizer steps, the running loss sums and the skip counts. It does not rely on the sampler's
own position: with DataLoader workers the sampler runs ahead of training by the prefetched batches, so its
``state_dict()`` at save time would skip batches that were never trained.

A resumed run re-creates the position deterministically (:func:`epoch_iterator`): it sets the epoch (the
shuffle is a function of seed and epoch), replays the sampler by the consumed number of batches, and hands it
to the DataLoader. For a lhotse sampler the replay reads only manifests (no features, no audio) and the
sampler is handed over with lhotse's own ``load_state_dict`` of the replayed state (which lhotse keeps for the
next ``iter()``); any other loader is iterated and its batches discarded. The replayed last batch is checked
against the cut ids the checkpoint recorded, so a changed corpus or batch size is an error, not a silent shift.

Random draws: the generators are restored *after* the positioned iterator exists (creating a DataLoader
iterator draws a seed from torch's generator, and a replay may draw more) when resuming mid-epoch, and before
the next epoch's iterator when resuming from an end-of-epoch checkpoint. The datamodule's augmentation is
seeded per batch (:class:`asrprec.data.datamodule.AsrDataset`), so it does not depend on which worker
prepares a batch; together, a resumed run sees the same batches and random numbers as an uninterrupted one.

The loop's counters live in :class:`TrainState`; :func:`checkpoint_extra` is what a checkpoint records of them
and :func:`restore` loads a checkpoint back into the training objects and the state. Which checkpoint a run
resumes from is a rule of the experiment folder (:func:`asrprec.experiment.resolve_resume`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from asrprec import checkpoint as ckpt
from asrprec.models import unwrap_model
from asrprec.devices import get_rank, get_world_size
from asrprec.errors import AsrprecError
from asrprec.rng import get_rng_state

from .config import TrainConfig
from .distributed import gather_objects, sum_over_ranks, summed_counts
from asrprec.experiment import Experiment

log = logging.getLogger(__name__)


class ResumeMismatchError(AsrprecError, RuntimeError):
    """The data a run resumes with do not reproduce the position its checkpoint recorded."""


@dataclass
class EpochProgress:
    """Training's position in one epoch (saved in every checkpoint as ``extra["progress"]``)."""

    epoch: int
    batches_done: int = 0  # loader batches consumed in this epoch: trained, or skipped
    steps: int = 0  # batches trained (a forward + backward ran)
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> skipped batches
    skipped_examples: list[str] = field(default_factory=list)  # a few "cut-id (reason)" of skipped batches
    dropped_cuts: int = 0  # unreadable cuts left out of batches that trained on their other cuts
    dropped_by_reason: dict[str, int] = field(default_factory=dict)  # the loader's reason -> cuts it left out
    tot_loss: float = 0.0
    tot_frames: float = 0.0
    tot_parts: dict[str, float] = field(default_factory=dict)  # loss component -> its sum (reporting.LOSS_COMPONENTS)
    padding: dict[str, float] = field(default_factory=dict)  # asrprec.data.buckets.PaddingTotals of trained batches
    seconds: float = 0.0
    last_cut_ids: list[str] = field(default_factory=list)  # sorted ids of the last consumed batch (check on resume)
    epoch_done: bool = False

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "EpochProgress":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in state.items() if k in known})


@dataclass
class TrainState:
    """The loop's counters; a checkpoint records them (:func:`checkpoint_extra`) and :func:`restore` reads them."""

    epoch: int = 1
    batch_idx_train: int = 0
    # the batch count the schedules see (asrprec.training.schedules.schedule_batches_per_step)
    adjusted_batch_count: float = 0.0
    best_valid_loss: float = math.inf
    best_valid_epoch: int = -1
    history: list[dict[str, Any]] = field(default_factory=list)
    progress: EpochProgress | None = None  # the position in the current epoch
    # schedule batches per optimizer step (schedule_batches_per_step): a setting of the run, not recorded
    per_step: float = 1.0


def set_epoch(loader: Any, epoch: int) -> None:
    """Tell the loader's sampler and dataset the epoch (the sampler's shuffle and the augmentation seeds)."""
    for obj in (getattr(loader, "sampler", None), getattr(loader, "dataset", None)):
        if hasattr(obj, "set_epoch"):
            obj.set_epoch(epoch)


def _is_lhotse_sampler(sampler: Any) -> bool:
    return all(hasattr(sampler, a) for a in ("allow_iter_to_reset_state", "state_dict", "load_state_dict",
                                              "__next__"))


def batch_cut_ids(batch: Any) -> list[str]:
    """The sorted cut ids of a batch dict (``cut_ids`` and the ``dropped_cuts`` the loader left out) or of a lhotse
    CutSet; [] when it names none."""
    if isinstance(batch, dict):
        ids = list(batch.get("cut_ids", []) or []) + [d["cut_id"] for d in batch.get("dropped_cuts", []) or []]
        return sorted(str(i) for i in ids)
    try:
        return sorted(str(c.id) for c in batch)
    except (TypeError, AttributeError):
        return []


def epoch_iterator(loader: Iterable, epoch: int, batches_done: int = 0,
                   expect_last_cut_ids: list[str] | None = None) -> Iterator:
    """An iterator over ``loader`` for ``epoch`` that continues after its first ``batches_done`` batches.

    ``expect_last_cut_ids``: the sorted cut ids of batch ``batches_done`` as the checkpoint recorded them; when
    the replay reaches another batch, :class:`ResumeMismatchError` says what probably changed.
    """
    set_epoch(loader, epoch)
    sampler = getattr(loader, "sampler", None)
    lhotse = _is_lhotse_sampler(sampler)
    if lhotse:
        sampler.allow_iter_to_reset_state()  # this loop owns the position: drop any state loaded before
    if batches_done <= 0:
        return iter(loader)
    last: Any = None
    if lhotse:
        iter(sampler)
        for i in range(batches_done):
            try:
                last = next(sampler)  # a CutSet: manifests only, nothing is loaded
            except StopIteration:
                _too_short(epoch, i, batches_done)
        sampler.load_state_dict(sampler.state_dict())  # lhotse keeps this position for the DataLoader's iter()
        it = iter(loader)
    else:
        it = iter(loader)
        for i in range(batches_done):
            try:
                last = next(it)
            except StopIteration:
                _too_short(epoch, i, batches_done)
    got = batch_cut_ids(last)
    if expect_last_cut_ids and got and got != list(expect_last_cut_ids):
        raise ResumeMismatchError(
            f"resuming epoch {epoch} after batch {batches_done}: that batch now holds cuts {got[:3]}..., but the "
            f"checkpoint trained {list(expect_last_cut_ids)[:3]}... last. The training data, --max-duration, "
            "bucketing or --seed differ from the run's. Fix: resume with the run's data settings (its config.json), "
            "or restart the epoch from the previous epoch's checkpoint (--start-epoch)")
    return it


def _too_short(epoch: int, have: int, want: int) -> None:
    raise ResumeMismatchError(
        f"resuming epoch {epoch} after batch {want}, but the training data now give only {have} batches in that "
        "epoch. The training data, --max-duration or bucketing differ from the run's. Fix: resume with the run's data "
        "settings (its config.json), or restart the epoch from the previous epoch's checkpoint (--start-epoch)")


# -- the train state in a checkpoint ---------------------------------------------------------------


def checkpoint_extra(state: TrainState) -> dict[str, Any]:
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
            progress["dropped_by_reason"] = summed_counts(progress["dropped_by_reason"])
            names = sorted(progress["tot_parts"])
            progress["tot_parts"] = dict(zip(names, sum_over_ranks(*(progress["tot_parts"][k] for k in names))))
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


def restore(path: Path, objects: ckpt.TrainingObjects, state: TrainState, *, policy,
            cfg: TrainConfig) -> tuple[dict | None, dict[str, Any]]:
    """Load ``path`` into the training ``objects`` (``model_avg``: the run's running average, if it keeps one) and
    ``state``; return (its random-generator states, a record of the resume for the history). The generators are not
    restored here: the loop sets them when its iterator is positioned (module docstring). A checkpoint that records
    no adjusted batch count gets ``state.per_step`` per batch.

    Raises:
        CheckpointReadError / CheckpointMismatchError: an unreadable checkpoint, one of another model or
            optimizer, or a mid-epoch one that records no position within its epoch.
    """
    saved = ckpt.read_checkpoint(path, allow_nonfinite=cfg.allow_nonfinite)
    averager = objects.model_avg
    loaded = ckpt.TrainingObjects(model=unwrap_model(objects.model), optimizer=objects.optimizer,
                                  scheduler=objects.scheduler, scaler=objects.scaler)
    info = ckpt.load_checkpoint(path, loaded, policy=policy, options=ckpt.LoadOptions(restore_rng=False),
                                checkpoint=saved)
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
    state.adjusted_batch_count = float(extra.get("adjusted_batch_count", state.batch_idx_train * state.per_step))
    state.best_valid_loss = float(extra.get("best_valid_loss", math.inf))
    state.best_valid_epoch = int(extra.get("best_valid_epoch", -1))
    state.history = _resumed_history(list(extra.get("history") or []), Experiment(cfg.exp_dir))
    epoch = int(extra.get("epoch", max(cfg.start_epoch - 1, 1)))
    progress = extra.get("progress")
    if progress is None:  # no recorded position: only an end-of-epoch checkpoint can be resumed exactly
        if path.name.startswith("checkpoint-"):
            raise ckpt.CheckpointMismatchError(
                f"{path} records no position within epoch {epoch}, so a mid-epoch resume from it cannot be exact. "
                f"Fix: resume from the end of the previous epoch (--start-epoch {epoch})")
        progress = {"epoch": epoch, "epoch_done": True}
    state.progress = EpochProgress.from_state_dict(progress)
    if get_rank() > 0:  # the saved totals are those of all ranks together (checkpoint_extra): rank 0 carries them
        state.progress.tot_loss = state.progress.tot_frames = 0.0
        state.progress.tot_parts = {k: 0.0 for k in state.progress.tot_parts}
        state.progress.dropped_cuts = 0
        state.progress.dropped_by_reason = {}
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


def _resumed_history(history: list[dict[str, Any]], experiment: Experiment) -> list[dict[str, Any]]:
    """The checkpoint's epoch records, with validation losses the folder recorded after the checkpoint was
    written (an epoch's checkpoint precedes its validation)."""
    try:
        recorded = {e.get("epoch"): e for e in experiment.history() if e.get("event") == "epoch"}
    except (OSError, ValueError):
        recorded = {}
    out = []
    for h in history:
        r = recorded.get(h.get("epoch"), {})
        out.append({**h, **{k: r[k] for k in ("valid_loss",) if k in r and "valid_loss" not in h}})
    return out
