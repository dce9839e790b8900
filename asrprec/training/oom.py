"""Out-of-memory guards: try the riskiest batches before training, and explain an OOM when one happens.

Before the first epoch, :func:`scan_pessimistic_batches` runs forward + backward on the batches most likely
to exhaust memory (lhotse's ``find_pessimistic_batches``: the longest cut, the longest supervision, the
largest total duration, the most cuts ...), so a ``--max-duration`` that does not fit fails in the first
minute with a message naming the batch and the fix, not hours into an epoch. icefall does the same in
every recipe (k2-fsa/icefall ``egs/librispeech/ASR/zipformer/train.py``, ``scan_pessimistic_batches_for_oom``).
The scan leaves no trace: parameters, buffers, gradients, batch counts and random-number generators are as
before. It runs with every schedule at its final value (no layer skipping: the most memory).

An OOM during training is turned into :class:`BatchOutOfMemory`, which names the batch, saves it for
reproduction and says what to change (:func:`out_of_memory_error`).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from asrprec.atomic import atomic_write
from asrprec.errors import AsrprecError
from asrprec.models import set_batch_count, unwrap_model
from asrprec.precision import PrecisionPolicy
from asrprec.rng import get_rng_state, set_rng_state

from .distributed import raise_if_any_failed
from .forward import compute_loss

log = logging.getLogger(__name__)

# "out of memory": CUDA (torch.OutOfMemoryError), MPS, HIP; "can't allocate memory": the CPU allocator
_OOM_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory")
# the batch count the scan runs at: every ScheduledFloat at its final value (no layer skipping, full model)
SCAN_BATCH_COUNT = 10**9


class BatchOutOfMemory(AsrprecError, RuntimeError):
    """A batch did not fit in memory; the message names the batch, the precision and what to change."""


def is_out_of_memory(exc: BaseException) -> bool:
    """True for an allocator failure on any device (``torch.OutOfMemoryError``, a CPU allocation error,
    Python's ``MemoryError``)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(t in str(exc).lower() for t in _OOM_TEXT)


def sampler_max_duration(sampler: Any) -> float | None:
    """The sampler's ``max_duration`` in seconds, for lhotse's samplers (None when it has none)."""
    for holder in (sampler, getattr(sampler, "constraint", None), getattr(sampler, "time_constraint", None)):
        value = getattr(holder, "max_duration", None) if holder is not None else None
        if isinstance(value, (int, float)):
            return float(value)
    return None


def describe_batch(batch: dict[str, Any]) -> str:
    """'B utterances padded to F frames, S s of features' for a training batch dict."""
    feats = batch["features"]
    lens = batch.get("feature_lens")
    seconds = float(lens.sum()) / 100.0 if lens is not None else float("nan")  # 10 ms frames
    n = feats.shape[0]
    return f"{n} utterance{'s' if n != 1 else ''} padded to {feats.shape[1]} frames, {seconds:.1f} s of features"


def out_of_memory_error(what: str, policy: PrecisionPolicy, exc: BaseException,
                        max_duration: float | None = None) -> BatchOutOfMemory:
    """The error to raise (``from exc``) when ``what`` (a batch description) ran out of memory."""
    fixes = [f"decrease --max-duration (now {max_duration:g} s)" if max_duration else "use smaller batches"]
    if policy.name == "fp32":  # the amp policies already keep activations in 2 bytes: bf16 saves little more
        fixes.append("or train with --precision amp-bf16 or bf16 (about half the activation memory; on a device "
                     "that supports bf16)")
    where = policy.device.type
    used = ""
    if where == "cuda" and torch.cuda.is_available():
        used = (f" Peak allocated on {policy.device}: {torch.cuda.max_memory_allocated(policy.device) / 2**20:.0f} "
                f"MB of {torch.cuda.get_device_properties(policy.device).total_memory / 2**20:.0f} MB.")
    return BatchOutOfMemory(f"out of memory on {where} under precision {policy.name} with {what}.{used} "
                            f"To fix: {' '.join(fixes)}. ({type(exc).__name__}: {str(exc)[:300]})")


def save_batch(batch: dict[str, Any], path: str | Path) -> Path:
    """Save a batch (features, lengths, texts, cut ids) so the failure can be reproduced."""
    path = Path(path)
    keep = {k: v for k, v in batch.items() if k in ("features", "feature_lens", "texts", "cut_ids")}
    atomic_write(path, lambda f: torch.save(keep, f))
    return path


def scan_pessimistic_batches(
    model: nn.Module,
    train_dl: Any,
    tokenizer,
    policy: PrecisionPolicy,
    *,
    encoder_schedule_scale: float = 1.0,
) -> dict[str, float]:
    """Forward + backward on the riskiest batches of ``train_dl`` (a DataLoader over a lhotse sampler whose
    dataset maps a CutSet to a batch dict); returns {criterion: peak MB} (NaN off CUDA).

    Raises :class:`BatchOutOfMemory` naming the criterion, its value and the fix when one does not fit;
    other errors propagate unchanged. The model, its gradients and the random-number generators are left as
    they were (the sampler is iterated once; ``set_epoch`` at the start of each epoch resets it).
    """
    from lhotse.dataset.sampling.utils import find_pessimistic_batches

    sampler, dataset = getattr(train_dl, "sampler", None), getattr(train_dl, "dataset", None)
    if sampler is None or dataset is None:
        raise ValueError("scan_pessimistic_batches needs a DataLoader with a lhotse sampler and a dataset that "
                         "maps a CutSet to a batch; pass scan_oom='off' for other loaders")
    batches, scores = find_pessimistic_batches(sampler)
    max_duration = sampler_max_duration(sampler)
    bare = unwrap_model(model)
    rng = get_rng_state()
    buffers = {name: b.detach().clone() for name, b in bare.named_buffers()}
    counts = [(m, m.batch_count) for m in bare.modules() if hasattr(m, "batch_count")]
    was_training = model.training
    model.train()
    set_batch_count(bare, SCAN_BATCH_COUNT)
    if hasattr(bare, "encoder"):
        set_batch_count(bare.encoder, SCAN_BATCH_COUNT * encoder_schedule_scale)
    cuda = policy.device.type == "cuda"
    peaks: dict[str, float] = {}
    try:
        tried: dict[frozenset, str] = {}
        for criterion, cuts in batches.items():
            ids = frozenset(c.id for c in cuts)
            if ids in tried:  # e.g. the longest cut's batch is also the longest supervision's
                log.info("OOM scan: %s = %.1f is the batch of %s, already tried", criterion, scores[criterion],
                         tried[ids])
                peaks[criterion] = peaks[tried[ids]]
                continue
            tried[ids] = criterion
            batch = dataset[cuts]
            if cuda:
                torch.cuda.synchronize(policy.device)
                torch.cuda.reset_peak_memory_stats(policy.device)
            try:
                loss, _ = compute_loss(model, batch, tokenizer, policy)
                loss.backward()
            except Exception as e:
                if is_out_of_memory(e):
                    raise out_of_memory_error(
                        f"the pessimistic batch for {criterion} (= {scores[criterion]:.1f}): {describe_batch(batch)}",
                        policy, e, max_duration) from e
                raise
            finally:
                model.zero_grad(set_to_none=True)
            peaks[criterion] = torch.cuda.max_memory_allocated(policy.device) / 2**20 if cuda else math.nan
            log.info("OOM scan: %s = %.1f (%s) fits%s", criterion, scores[criterion], describe_batch(batch),
                     f", peak {peaks[criterion]:.0f} MB" if cuda else "")
    finally:
        with torch.no_grad():
            for name, b in bare.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
        for m, count in counts:
            m.batch_count = count
        set_rng_state(rng)
        model.train(was_training)
    return peaks


def scan_wanted(mode: str, policy: PrecisionPolicy, train_dl: Any) -> bool:
    """``scan_oom``: "on" always (a loader without a lhotse sampler is then an error), "off" never, "auto" on
    CUDA with a lhotse loader (a CPU run rarely hits its memory limit, and the scan costs a few steps' time)."""
    if mode == "on":
        return True
    if mode == "off" or policy.device.type != "cuda":
        return False
    return hasattr(getattr(train_dl, "sampler", None), "state_dict") and hasattr(train_dl, "dataset")


def scan_on_every_rank(model: nn.Module, train_dl, tokenizer, policy: PrecisionPolicy, *,
                       encoder_schedule_scale: float = 1.0) -> None:
    """:func:`scan_pessimistic_batches` of each rank's riskiest batches, on the model before DDP wraps it (no
    gradient all-reduce: ranks may try different numbers of batches; the memory of DDP's gradient buckets, one
    more copy of the gradients, is not included); a rank whose batch does not fit stops every rank with its
    message."""
    error = None
    try:
        scan_pessimistic_batches(model, train_dl, tokenizer, policy, encoder_schedule_scale=encoder_schedule_scale)
    except Exception as e:  # noqa: BLE001 - re-raised by raise_if_any_failed
        error = e
    raise_if_any_failed(error, "the out-of-memory scan of the riskiest batches")
