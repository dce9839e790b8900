"""Duration buckets of a corpus, batches of a fixed size per bucket, and the padding a batch carries.

:func:`corpus_buckets` places lhotse's bucket boundaries (``estimate_duration_buckets``: equal total audio per
bucket, as ``DynamicBucketingSampler`` places them) and counts each bucket's cuts, audio and longest transcript.
:func:`planned_sampler` is lhotse's ``DynamicBucketingSampler`` with ``FixedBucketBatchSizeConstraint``: a batch
size per bucket instead of one ``max_duration`` (NeMo sizes its buckets the same way: NVIDIA/NeMo
``nemo/collections/common/data/lhotse/dataloader.py``, ``bucket_batch_size``). :func:`tempo_bucketing_sampler`
buckets by each utterance's duration after its tempo change. :func:`batch_padding` counts what a batch pads.
:class:`Batching` says how the training sampler makes batches, and why it made none of a small corpus.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

__all__ = ["Batching", "BucketStats", "PaddingTotals", "batch_padding", "corpus_buckets", "planned_sampler",
           "tempo_bucketing_sampler"]


@dataclass(frozen=True)
class BucketStats:
    """Cuts with ``min_duration < duration <= max_duration``: their count, total seconds and most tokens."""

    max_duration: float
    min_duration: float
    cuts: int
    seconds: float
    max_tokens: int


def corpus_buckets(cuts: Any, num_buckets: int, *, count_tokens: Optional[Callable[[str], int]] = None,
                   tokens_per_second: float = 0.0, look: int = 100_000) -> list[BucketStats]:
    """The duration buckets of ``cuts`` (the first ``look`` of a lazy set): lhotse's boundaries, each bucket's
    upper edge its longest cut. Tokens: ``count_tokens(text)`` of each cut's transcript, else ``tokens_per_second``
    × duration (an assumption)."""
    from lhotse.dataset.sampling.dynamic_bucketing import estimate_duration_buckets

    rows = []
    for cut in itertools.islice(iter(cuts), look):
        text = " ".join((s.text or "") for s in cut.supervisions).strip()
        n = count_tokens(text) if count_tokens is not None else int(round(tokens_per_second * cut.duration))
        rows.append((float(cut.duration), max(1, n)))
    if not rows:
        raise ValueError("no cuts to place duration buckets on")
    rows.sort()
    k = max(1, min(num_buckets, len(rows) // 2))

    class _D:  # estimate_duration_buckets measures .duration
        def __init__(self, d):
            self.duration = d

    bins = estimate_duration_buckets([_D(d) for d, _ in rows], num_buckets=k) if k > 1 else []
    edges = sorted(set(bins))
    out, start = [], 0
    lower = 0.0
    for edge in [*edges, float("inf")]:
        # lhotse's bucket i holds bins[i-1] <= d < bins[i]: a cut equal to an edge opens the next bucket
        end = next((j for j in range(start, len(rows)) if rows[j][0] >= edge), len(rows))
        part = rows[start:end]
        if part:
            out.append(BucketStats(max_duration=part[-1][0], min_duration=lower, cuts=len(part),
                                   seconds=sum(d for d, _ in part), max_tokens=max(n for _, n in part)))
            lower = part[-1][0]
        start = end
    return out


def planned_sampler(cuts: Any, max_durations: Sequence[float], batch_sizes: Sequence[int], *,
                    mean_batch_seconds: Optional[float] = None, **kwargs: Any) -> Any:
    """lhotse's ``DynamicBucketingSampler`` with ``batch_sizes[k]`` cuts per batch of bucket k, bucket k holding
    ``max_durations[k-1] < duration <= max_durations[k]``; cuts longer than the last edge are an error of the caller
    (filter them first). ``mean_batch_seconds``: the plan's seconds of audio per batch, offered as the constraint's
    ``max_duration`` to what counts schedules in audio (:func:`asrprec.training.oom.sampler_max_duration`).
    ``kwargs``: the sampler's (shuffle, drop_last, seed, rank, world_size, buffer sizes)."""
    from lhotse.dataset.sampling.dynamic_bucketing import FixedBucketBatchSizeConstraint

    edges = [float(e) for e in max_durations]
    constraint = FixedBucketBatchSizeConstraint(max_seq_len_buckets=edges, batch_sizes=[int(b) for b in batch_sizes])
    if mean_batch_seconds is not None:  # an attribute, not a field: lhotse's state_dict of the constraint is unchanged
        constraint.max_duration = float(mean_batch_seconds)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*eagerly read CutSet.*")
        # lhotse opens one more bucket past the last edge; the caller's duration filter leaves it empty
        return _custom_constraint_sampler()(cuts, constraint=constraint, duration_bins=edges, **kwargs)


def tempo_bucketing_sampler(cuts: Any, *, max_duration: float, num_buckets: int, tempo_of: Callable[[Any, int], float],
                            look: int = 5000, **kwargs: Any) -> Any:
    """lhotse's ``DynamicBucketingSampler`` for a training set whose utterances are sped up by a factor each,
    drawn anew every epoch: ``tempo_of(cut, epoch)`` gives it before batching (the dataset applies the same one),
    and the sampler buckets and fills batches by the duration after the change. Bucketed by the duration before
    it, a batch of similar originals holds rows up to ``max / min`` factor apart in length, all padded to the
    longest (a quarter of the frames with factors 0.9-1.8).

    A cut counts ``duration * m / factor`` against ``max_duration``, ``m`` the harmonic mean of the factors of the
    first ``look`` cuts, so that an epoch makes as many batches as without the tempo and ``max_duration`` keeps
    meaning seconds of audio before it. ``kwargs``: the sampler's (shuffle, drop_last, seed, rank, world_size,
    buffer sizes)."""
    from lhotse.dataset.sampling.base import TimeConstraint

    class TempoTimeConstraint(TimeConstraint):
        """lhotse's ``TimeConstraint`` (padding-aware: rows x longest) over the durations after the tempo."""

        def __init__(self, max_duration: float, scale: float) -> None:
            super().__init__(max_duration=max_duration)
            self.scale = scale
            self.epoch = 0
            self.cache: dict[tuple[int, str], float] = {}  # shared by the copies lhotse makes of a constraint

        def measure_length(self, cut: Any) -> float:
            key = (self.epoch, cut.id)
            if key not in self.cache:
                if len(self.cache) >= 1 << 17:
                    self.cache.clear()
                self.cache[key] = cut.duration * self.scale / tempo_of(cut, self.epoch)
            return self.cache[key]

        def add(self, example: Any) -> None:
            length = self.measure_length(example)
            self.current += length
            self.longest_seen = max(self.longest_seen, length)
            self.num_cuts += 1

    sample = list(itertools.islice(iter(cuts), look))
    inverse = [1.0 / tempo_of(c, 0) for c in sample]
    scale = len(inverse) / sum(inverse) if inverse else 1.0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*eagerly read CutSet.*")
        return _custom_constraint_sampler()(cuts, constraint=TempoTimeConstraint(max_duration, scale),
                                            num_buckets=num_buckets, **kwargs)


def _custom_constraint_sampler() -> type:
    """``DynamicBucketingSampler`` with a constraint of ours: it keeps ``state_dict`` (lhotse refuses it for a
    custom constraint; ours is rebuilt from the configuration, so the position is all there is to save) and hands
    the epoch to a constraint that has one."""
    from lhotse.dataset import DynamicBucketingSampler

    class CustomConstraintSampler(DynamicBucketingSampler):
        def set_epoch(self, epoch: int) -> None:
            super().set_epoch(epoch)
            if hasattr(getattr(self, "constraint", None), "epoch"):
                self.constraint.epoch = int(epoch)

        def state_dict(self) -> dict[str, Any]:
            constraint, self.constraint = self.constraint, None
            try:
                return super().state_dict()
            finally:
                self.constraint = constraint

    return CustomConstraintSampler


@dataclass(frozen=True)
class Batching:
    """How the training sampler makes batches: ``max_duration`` seconds of audio per batch (None: a batch plan's
    sizes per bucket), over ``num_buckets`` duration buckets (1: none), keeping a last, short batch of each bucket
    or not (``drop_last``), for ``world_size`` ranks."""

    max_duration: float | None
    num_buckets: int
    drop_last: bool
    world_size: int = 1

    def why_no_batch(self, kept: int, seconds: float) -> str:
        """Why the sampler made no batch of ``kept`` cuts (``seconds`` of audio), with the fix."""
        if self.drop_last and self.max_duration is None:
            return ("with drop_last, a batch is made only of a bucket holding its planned batch size, and none "
                    "does. Fix: set --data.drop_last false, or train without --max-memory")
        if self.drop_last:
            per_bucket = seconds / self.num_buckets
            fixes = []
            fill = int(seconds // self.max_duration)  # buckets that would each hold a full batch
            if 1 <= fill < self.num_buckets:
                fixes.append(f"lower --num-buckets to {fill}")
            fixes.append(f"lower --max-duration to {max(per_bucket, 0.01):.2f} s or less")
            fixes.append("set --data.drop_last false")
            return (f"with drop_last, a batch is made only of a duration bucket holding --max-duration "
                    f"{self.max_duration:g} s of audio, and {self.num_buckets} bucket(s) of about {per_bucket:.1f} s "
                    f"each fill none. Fix: {', or '.join(fixes)}")
        ranks = f" for {self.world_size} ranks" if self.world_size > 1 else ""
        size = "its batch plan" if self.max_duration is None else f"--max-duration {self.max_duration:g} s"
        return (f"lhotse's sampler over {self.num_buckets} bucket(s) with {size} made none{ranks}. Fix: lower "
                "--num-buckets (e.g. 1) or --max-duration")


@dataclass
class PaddingTotals:
    """Sums over batches: frames (all, padded) and joint cells (all, padded). A joint cell is one (frame, token
    row) of the transducer lattice, (T, U + 1) per utterance, computed once per padded cell."""

    frames: float = 0.0
    padded_frames: float = 0.0
    joint: float = 0.0
    padded_joint: float = 0.0

    def add(self, other: "PaddingTotals") -> None:
        self.frames += other.frames
        self.padded_frames += other.padded_frames
        self.joint += other.joint
        self.padded_joint += other.padded_joint

    @property
    def frame_fraction(self) -> float:
        return self.padded_frames / self.frames if self.frames else 0.0

    @property
    def joint_fraction(self) -> float:
        return self.padded_joint / self.joint if self.joint else 0.0


def batch_padding(frame_lens: torch.Tensor | Sequence[int], token_lens: torch.Tensor | Sequence[int]) -> PaddingTotals:
    """What a batch pads. Legend: B utterances; ``frame_lens`` (B,) valid frames, ``token_lens`` (B,) tokens.

    The batch is (B, max T) frames and (B, max T, max U + 1) joint cells; the padded ones are those beyond each
    utterance's own T and (T, U + 1)."""
    t = torch.as_tensor(frame_lens, dtype=torch.float64).reshape(-1)
    u = torch.as_tensor(token_lens, dtype=torch.float64).reshape(-1)
    if t.numel() == 0:
        return PaddingTotals()
    frames = float(t.numel() * t.max())
    joint = float(t.numel() * t.max() * (u.max() + 1))
    return PaddingTotals(frames=frames, padded_frames=frames - float(t.sum()), joint=joint,
                         padded_joint=joint - float((t * (u + 1)).sum()))
