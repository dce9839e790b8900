"""Skipped batches: each one named in the log and counted in the epoch's
:class:`~asrprec.training.resume.EpochProgress`, and a budget that stops the run with a checkpoint.

A batch is skipped when its loader raised, when no cut of it could be read, or when its loss is not finite
(under DDP such a step is skipped on every rank). More than ``max_skipped_fraction`` of an epoch's batches, an
epoch without a single trained batch, or a loader that keeps failing stops the run with
:class:`TooManySkippedBatches` after a checkpoint (:meth:`asrprec.training.run.Run.stop`). An epoch whose loader
served no batch at all stops it with :class:`NoTrainingBatches`, saying which it was: every cut dropped, or a
sampler that made no batch of the cuts kept (:func:`no_batch_reason`); there is nothing to save.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from asrprec.errors import AsrprecError

from .distributed import gather_objects, summed_counts
from .resume import EpochProgress

log = logging.getLogger(__name__)

# batch skip reasons (EpochProgress.skipped keys)
UNLOADABLE = "unloadable"
NONFINITE = "non-finite loss"
# how many skipped batches an epoch must have before the share of skipped batches is checked mid-epoch (at the
# end of an epoch it is always checked)
_MIN_SKIPS_FOR_SHARE = 3
# a loader that raised this many times in a row is broken, not serving a few bad batches
MAX_LOADER_FAILURES_IN_A_ROW = 10


class TooManySkippedBatches(AsrprecError, RuntimeError):
    """Too many batches of an epoch were skipped (bad data or a diverged model); a checkpoint was saved."""


class NoTrainingBatches(AsrprecError, RuntimeError):
    """An epoch's loader served no batch at all; the message says why (:func:`no_batch_reason`) and the fix."""


def record_skip(progress: EpochProgress, reason: str, ids: list[str], detail: str, batch_idx_train: int) -> None:
    """Count a skipped batch and name it in the log."""
    progress.skipped[reason] = progress.skipped.get(reason, 0) + 1
    shown = ", ".join(ids[:8]) + (f", ... ({len(ids)} cuts)" if len(ids) > 8 else "") if ids else "cut ids unknown"
    if len(progress.skipped_examples) < 10:
        progress.skipped_examples.append(f"{ids[0] if ids else '?'} ({reason})")
    log.warning("epoch %d, batch %d of the epoch (after training batch %d): skipped, %s: %s; cuts: %s",
                progress.epoch, progress.batches_done, batch_idx_train, reason, detail, shown)


def report_dropped_cuts(batch: dict[str, Any], progress: EpochProgress) -> None:
    """Count (per reason) and name the cuts the loader left out of a batch that still trains on its other cuts."""
    for d in batch.get("dropped_cuts", []):
        progress.dropped_cuts += 1
        reason = str(d["reason"]).split(" (")[0]  # "unreadable audio (OSError: ...)" counts as "unreadable audio"
        progress.dropped_by_reason[reason] = progress.dropped_by_reason.get(reason, 0) + 1
        log.warning("epoch %d, batch %d of the epoch: cut %s left out of its batch: %s", progress.epoch,
                    progress.batches_done, d["cut_id"], d["reason"])


def dropped_cut_totals(progress: EpochProgress, duration_drops: Any | None) -> dict[str, int]:
    """The epoch's cuts left out, per reason, over all ranks: those the loader left out of batches, and those the
    training set's duration filter dropped (``duration_drops``: the loader's counter,
    :class:`asrprec.data.AsrDataModule`; every rank's sampler filters the whole set, so rank 0's count is the
    total). Logged in one line. Collective: every rank calls this at the same point."""
    totals = summed_counts(progress.dropped_by_reason)
    if duration_drops is not None:
        totals = {**gather_objects(duration_drops.dropped_in_pass())[0], **totals}
    if totals:
        log.info("epoch %d: cuts left out of training: %s", progress.epoch,
                 ", ".join(f"{reason}: {n}" for reason, n in sorted(totals.items(), key=lambda kv: -kv[1])))
    return totals


def no_batch_reason(epoch: int, duration_drops: Any | None, batching: Any | None) -> str:
    """Why epoch ``epoch``'s loader served no batch at all, with the fix: the duration filter dropped every cut, or
    the sampler made no batch of the cuts kept (``batching``: :class:`asrprec.data.buckets.Batching`), told apart by
    the filter's counts of the pass (``duration_drops``: the loader's counter, :class:`asrprec.data.AsrDataModule`;
    every rank filters the whole set). A loader without these counts gets the possible causes."""
    head = f"epoch {epoch} had no batch at all"
    if duration_drops is None or not hasattr(duration_drops, "kept_in_pass"):
        return (f"{head}: the training loader served nothing (an empty training set, or a sampler that makes no "
                "batch of it). Fix: check the training cuts, --max-duration and --num-buckets")
    kept, seconds = duration_drops.kept_in_pass()
    dropped = duration_drops.dropped_in_pass()
    n_dropped = sum(dropped.values())
    if kept == 0 and n_dropped:
        reasons = ", ".join(f"{reason}: {n}" for reason, n in dropped.items())
        return (f"{head}: the duration filter dropped all {n_dropped} training cuts ({reasons}). Fix: widen "
                "--data.min_cut_s / --data.max_cut_s to the cuts' durations")
    if kept == 0:
        return f"{head}: the training set holds no cut. Fix: check the training manifest"
    also = f"; {n_dropped} dropped by the duration filter" if n_dropped else ""
    cuts = f"{kept} training cuts kept ({seconds:.1f} s of audio{also})"
    if batching is None:
        return f"{head}: the sampler made no batch of the {cuts}. Fix: check its settings"
    return f"{head}: the sampler made no batch of the {cuts}: {batching.why_no_batch(kept, seconds)}"


def skip_budget_exceeded(progress: EpochProgress, max_skipped_fraction: float, *, end_of_epoch: bool) -> str | None:
    """Why the run must stop because of skipped batches, or None (an epoch with no batch at all:
    :func:`no_batch_reason`)."""
    n, done = progress.num_skipped, progress.batches_done
    counts = ", ".join(f"{reason} {k}" for reason, k in sorted(progress.skipped.items()))
    if end_of_epoch and done > 0 and progress.steps == 0:
        return f"no batch of epoch {progress.epoch} could be trained: all {done} were skipped ({counts})"
    if n > max_skipped_fraction * done and (end_of_epoch or n >= _MIN_SKIPS_FOR_SHARE) and n > 0:
        return (f"{n} of the {done} batches of epoch {progress.epoch}{'' if end_of_epoch else ' so far'} were "
                f"skipped ({counts}), more than --max-skipped-fraction {max_skipped_fraction:g}")
    return None


def too_many_skipped(progress: EpochProgress, why: str, path: Path) -> TooManySkippedBatches:
    """The error that stops the run when :func:`skip_budget_exceeded` gave ``why``; ``path``: the checkpoint saved."""
    return TooManySkippedBatches(
        f"{why}. Skipped batches, e.g.: {', '.join(progress.skipped_examples[:5])} (the log names every cut). "
        f"Saved {path}. Fix: for unreadable data, check the files (--validate-data full finds "
        "them) and fix or leave them out; for non-finite losses, check those cuts (empty or very long "
        "transcripts, corrupt features) or lower --base-lr; then continue with --resume latest (raise "
        "--max-skipped-fraction to accept more skipped batches)")


def stopped_event(progress: EpochProgress, why: str, batch_idx_train: int) -> dict[str, Any]:
    """The ``stopped`` record of ``history.json`` for :func:`too_many_skipped`."""
    return {"event": "stopped", "epoch": progress.epoch, "batch_idx_train": batch_idx_train, "reason": why,
            "skipped_examples": progress.skipped_examples}


def loader_broken(failures_in_a_row: int, error: BaseException | None, path: Path) -> TooManySkippedBatches | None:
    """The error that stops the run once the loader failed :data:`MAX_LOADER_FAILURES_IN_A_ROW` times in a row
    (None before); ``path``: the checkpoint saved."""
    if failures_in_a_row < MAX_LOADER_FAILURES_IN_A_ROW:
        return None
    last = f"{type(error).__name__}: {str(error)[:300]}" if error is not None else "on another rank, see its log"
    stop = TooManySkippedBatches(
        f"the training data loader failed {failures_in_a_row} times in a row (last: {last}); it is broken rather "
        f"than serving a few bad batches. Saved {path}. Fix the loader or the data, then continue with --resume "
        "latest")
    stop.__cause__ = error
    return stop
