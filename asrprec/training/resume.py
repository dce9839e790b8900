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
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator


class ResumeMismatchError(RuntimeError):
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
    tot_loss: float = 0.0
    tot_frames: float = 0.0
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
