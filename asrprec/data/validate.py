"""Checks on lhotse CutSets before training and decoding.

* :func:`check_cuts` (the training recipes' ``--validate-data``): finds every cut that cannot be trained on or
  decoded, drops it, and returns a :class:`DataReport` with a count per reason and example cut ids. Reasons:
  no or an empty transcript, words outside the tokenizer's vocabulary (they would become ``<unk>``) above a
  share, a duration the encoder cannot take (fewer feature frames than it needs for one output frame), a
  non-positive or too long duration (training only), a missing or empty feature/audio file and, in ``full``
  mode, a file that cannot be read or holds non-finite values.
* :func:`validate_cuts`: the same checks, raising a ValueError naming the first bad cut and the fix.
* :func:`filter_by_duration`: keep cuts within a duration range, with a log line.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from asrprec.config import ConfigError, option
from asrprec.errors import AsrprecError

from .frames import cut_num_frames

log = logging.getLogger(__name__)

#: the checks of :func:`check_cuts`: "fast" reads manifests and file sizes; "full" also decodes every file
CHECK_MODES = ("off", "fast", "full")

EMPTY_TRANSCRIPT = "empty transcript"
OOV = "words outside the tokenizer"
TOO_SHORT = "too short for the encoder"
TOO_LONG = "longer than the maximum duration"
BAD_DURATION = "non-positive duration"
MISSING_FILE = "missing or empty feature/audio file"
UNREADABLE = "unreadable or non-finite features/audio"
#: what each reason means and how to fix it (for the report)
FIXES = {
    EMPTY_TRANSCRIPT: "the transcript is empty; fix the corpus' text or leave these cuts out",
    OOV: "the tokenizer cannot spell these words (they would train as <unk>); retrain the tokenizer on these texts "
         "or normalise the text (raise --max-oov-fraction to keep such cuts)",
    TOO_SHORT: "the encoder's front-end needs more feature frames to give one output frame",
    TOO_LONG: "longer than the training duration limit",
    BAD_DURATION: "the manifest's duration is zero or negative; re-run data preparation",
    MISSING_FILE: "the file the manifest points to is missing or empty; re-run feature extraction / data preparation",
    UNREADABLE: "the file cannot be decoded or holds NaN/inf; re-run feature extraction / data preparation",
}


class DataCheckError(AsrprecError, ValueError):
    """No cut of a split passed the data checks."""


@dataclass
class DataReport:
    """What :func:`check_cuts` found in one split: ``problems[reason]`` lists the dropped cut ids."""

    split: str
    total: int = 0
    problems: dict[str, list[str]] = field(default_factory=dict)
    oov_words: dict[str, int] = field(default_factory=dict)  # word -> occurrences in the checked cuts

    @property
    def dropped(self) -> int:
        return sum(len(v) for v in self.problems.values())

    @property
    def kept(self) -> int:
        return self.total - self.dropped

    def add(self, reason: str, cut_id: str) -> None:
        self.problems.setdefault(reason, []).append(cut_id)

    def summary(self, examples: int = 3) -> str:
        """One line per reason: count, example ids and the fix."""
        if not self.problems:
            line = f"{self.split}: all {self.total} cuts passed the data checks"
            if self.oov_words:
                line += f" ({sum(self.oov_words.values())} word(s) outside the tokenizer, within the allowed share)"
            return line
        lines = [f"{self.split}: dropped {self.dropped} of {self.total} cuts:"]
        for reason, ids in sorted(self.problems.items(), key=lambda kv: -len(kv[1])):
            more = ", ..." if len(ids) > examples else ""
            lines.append(f"  {reason}: {len(ids)} (e.g. {', '.join(ids[:examples])}{more}) - {FIXES.get(reason, '')}")
        if self.oov_words:
            top = sorted(self.oov_words.items(), key=lambda kv: -kv[1])[:5]
            lines.append(f"  words outside the tokenizer: {', '.join(f'{w!r} x{n}' for w, n in top)}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"split": self.split, "total": self.total, "kept": self.kept,
                "dropped": {k: len(v) for k, v in self.problems.items()},
                "examples": {k: v[:10] for k, v in self.problems.items()}}


def _files(cut: Any) -> list[str]:
    out = []
    if cut.has_features and cut.features.storage_type not in ("memory_lilcom", "memory_writer", "memory_raw",
                                                              "memory_npy"):
        path = cut.features.storage_path
        key = cut.features.storage_key
        # a chunked archive (lilcom_chunky, lilcom_hdf5, ...) is one file; a files storage has one file per key
        out.append(os.path.join(path, key) if os.path.isdir(path) else path)
    elif cut.has_recording:
        out += [str(s.source) for s in cut.recording.sources if s.type == "file"]
    # remote storage (s3://, http://) and in-memory arrays are checked by loading only
    return [f for f in out if f and "://" not in f]


def _words(cuts: Iterable[Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for cut in cuts:
        for s in cut.supervisions:
            for w in (s.text or "").split():
                counts[w] = counts.get(w, 0) + 1
    return counts


def check_cuts(
    cuts: Any,
    *,
    split: str,
    tokenizer: Any = None,
    max_oov_fraction: float = 0.0,
    min_frames: int = 1,
    max_duration: float | None = None,
    require_transcript: bool = True,
    mode: str = "fast",
    allow_empty: bool = False,
) -> tuple[Any, DataReport]:
    """Drop the cuts of ``cuts`` that cannot be used, and report them. Returns ``(kept CutSet, report)``.

    Args:
        split: the name used in the report ("train", "dev", ...).
        tokenizer: an :class:`asrprec.tokenizer.Tokenizer` (or anything with ``unknown_words``); None skips the
            vocabulary check.
        max_oov_fraction: a cut is dropped when more than this share of its words lie outside the tokenizer.
        min_frames: the fewest feature frames the encoder accepts (``Transducer.min_input_frames``).
        max_duration: drop longer cuts (seconds; None keeps them, as for dev and test).
        require_transcript: drop cuts without a non-empty transcript (training and validation; a test reference
            may be empty).
        mode: "fast" (manifests, file existence and size) or "full" (also decode every feature matrix / audio
            file and check it is finite); "off" returns ``cuts`` unchecked.
        allow_empty: return an empty CutSet when no cut passes, instead of raising :class:`DataCheckError`.
    """
    if mode not in CHECK_MODES:
        raise ValueError(f"mode must be one of {CHECK_MODES}, got {mode!r}")
    if not 0.0 <= max_oov_fraction <= 1.0:
        raise ValueError(f"max_oov_fraction must be in [0, 1], got {max_oov_fraction}")
    # a lazy manifest (a large corpus) stays lazy: it is read in streaming passes and only the ids of bad cuts are kept
    lazy = bool(getattr(cuts, "is_lazy", False))
    if not lazy:
        cuts = cuts.to_eager()
    if mode == "off":
        return cuts, DataReport(split=split, total=0 if lazy else len(cuts))
    report = DataReport(split=split, total=0)
    unknown: set[str] = set()
    if tokenizer is not None:
        words = _words(cuts)
        unknown = set(tokenizer.unknown_words(list(words)))
        report.oov_words = {w: words[w] for w in unknown}
    file_ok: dict[str, bool] = {}
    bad: set[str] = set()
    for cut in cuts:
        report.total += 1
        reason = _problem(cut, unknown, max_oov_fraction, min_frames, max_duration, require_transcript, file_ok,
                          mode)
        if reason is not None:
            report.add(reason, cut.id)
            bad.add(cut.id)
    if bad:
        kept = cuts.filter(_IdNotIn(bad))
        kept = kept if lazy else kept.to_eager()
    else:
        kept = cuts
    (log.warning if report.problems else log.info)("data check (%s): %s", mode, report.summary())
    if report.kept == 0 and not allow_empty:
        raise DataCheckError(f"no cut of {split} passed the data checks. {report.summary()}")
    return kept, report


class _IdNotIn:
    """A picklable filter (a lazy CutSet may travel to DataLoader workers; a lambda cannot)."""

    def __init__(self, ids: set[str]) -> None:
        self.ids = ids

    def __call__(self, cut: Any) -> bool:
        return cut.id not in self.ids


def _problem(cut, unknown, max_oov_fraction, min_frames, max_duration, require_transcript, file_ok, mode):
    if not cut.duration or cut.duration <= 0 or not math.isfinite(cut.duration):
        return BAD_DURATION
    texts = [s.text for s in cut.supervisions]
    words = [w for t in texts for w in (t or "").split()]
    if require_transcript and not words:
        return EMPTY_TRANSCRIPT
    if unknown and words and sum(w in unknown for w in words) > max_oov_fraction * len(words):
        return OOV
    if cut_num_frames(cut) < min_frames:
        return TOO_SHORT
    if max_duration is not None and cut.duration > max_duration:
        return TOO_LONG
    for f in _files(cut):
        if f not in file_ok:
            try:
                file_ok[f] = os.path.getsize(f) > 0
            except OSError:
                file_ok[f] = False
        if not file_ok[f]:
            return MISSING_FILE
    if mode == "full":
        try:
            data = cut.load_features() if cut.has_features else cut.load_audio()
        except Exception:  # lhotse / lilcom / soundfile raise many types for unreadable files
            return UNREADABLE
        if data.size == 0 or not np.isfinite(data).all():
            return UNREADABLE
    return None


@dataclass
class CheckOptions:
    """How a training run checks its splits (:func:`check_splits`); the recipes' ``--validate-data`` and
    ``--max-oov-fraction``."""

    validate_data: str = option("fast", choices=CHECK_MODES,
                                help="drop and report unusable cuts before training; full also reads every file")
    max_oov_fraction: float = option(0.0, help="drop a cut when more than this share of its words is out of "
                                               "vocabulary")


def check_splits(cuts: dict[str, Any], options: CheckOptions, tokenizer: Any, min_frames: int, *,
                 max_duration: float | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each split's cuts without those that cannot be used (:func:`check_cuts` per split; dropped cuts are counted
    and named in the log), and each split's report as a dict (for the checkpoint's record)."""
    kept, checks = {}, {}
    for split, split_cuts in cuts.items():
        kwargs = {} if max_duration is None else {"max_duration": max_duration}
        kept[split], report = check_cuts(split_cuts, split=split, tokenizer=tokenizer, mode=options.validate_data,
                                         max_oov_fraction=options.max_oov_fraction, min_frames=min_frames, **kwargs)
        checks[split] = report.to_dict()
    return kept, checks


def check_feature_bins(cuts: dict[str, Any], num_mel_bins: int, *, on_the_fly_feats: bool = False) -> None:
    """Raise a ConfigError (a ValueError) when a split's stored features are not ``num_mel_bins`` wide (the model
    is built for ``num_mel_bins``); its first cut stands for the split. Nothing to check when fbank is computed on
    the fly."""
    if on_the_fly_feats:
        return
    for split, split_cuts in cuts.items():
        first = next(iter(split_cuts), None)
        if first is None or not first.has_features or first.num_features == num_mel_bins:
            continue
        raise ConfigError(f"the {split} split's features have {first.num_features} bins (cut {first.id!r}) but "
                          f"--data.num_mel_bins is {num_mel_bins}; fix: --data.num_mel_bins {first.num_features}, "
                          f"or extract {num_mel_bins}-bin features (or --data.on_the_fly_feats true)")


def validate_cuts(cuts: Any, *, check_audio: bool = True, check_features: bool = False) -> int:
    """The strict form of :func:`check_cuts` for data preparation: return how many cuts were checked, or raise a
    ValueError naming the first bad cut, its problem and the fix.

    Checks durations, transcripts and files; with ``check_audio`` or ``check_features`` also decodes every file
    (``check_cuts``'s "full" mode: a cut's features where it has them, else its audio).
    """
    mode = "full" if check_audio or check_features else "fast"
    _, report = check_cuts(cuts, split="data", mode=mode, allow_empty=True)
    if report.problems:
        reason, ids = next(iter(report.problems.items()))
        more = f" ({report.dropped - 1} more bad cut(s) follow)" if report.dropped > 1 else ""
        raise ValueError(f"cut {ids[0]!r}: {reason}{more}; fix: {FIXES.get(reason, 're-run data preparation')}")
    return report.total


def filter_by_duration(cuts: Any, min_s: float = 0.5, max_s: float = 20.0) -> Any:
    """Keep cuts with ``min_s <= duration <= max_s`` (an eager CutSet) and log how many were dropped."""
    if min_s > max_s:
        raise ValueError(f"min duration {min_s} s is above max duration {max_s} s")
    cuts = cuts.to_eager()
    kept = cuts.filter(lambda c: min_s <= c.duration <= max_s).to_eager()
    dropped = len(cuts) - len(kept)
    if dropped:
        out = [f"{c.id} ({c.duration:.2f} s)" for c in cuts if not min_s <= c.duration <= max_s][:3]
        log.warning("dropped %d of %d cuts outside %.2f-%.2f s (e.g. %s)", dropped, len(cuts), min_s, max_s,
                    ", ".join(out))
    else:
        log.info("all %d cuts are within %.2f-%.2f s", len(cuts), min_s, max_s)
    return kept
