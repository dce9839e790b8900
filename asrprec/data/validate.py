"""Checks on lhotse CutSets before training: every problem is a ValueError naming the cut and the fix."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:300] if lines else ""


def validate_cuts(cuts: Any, *, check_audio: bool = True, check_features: bool = False) -> int:
    """Check every cut of ``cuts`` and return how many were checked.

    Each cut must have a positive duration and at least one supervision, all with non-empty text;
    with ``check_audio`` its audio must decode to finite samples; with ``check_features`` its
    precomputed features must load with the manifest's shape. Raises ValueError on the first bad cut.
    """
    n = 0
    for cut in cuts:
        n += 1
        if not cut.duration or cut.duration <= 0:
            raise ValueError(f"cut {cut.id!r} has duration {cut.duration}; fix: drop it or re-run data preparation")
        texts = [s.text for s in cut.supervisions]
        if not texts or any(t is None or not t.strip() for t in texts):
            raise ValueError(
                f"cut {cut.id!r} has an empty transcript; fix: drop such cuts with "
                f"cuts.filter(lambda c: c.supervisions and all(s.text and s.text.strip() for s in c.supervisions)) "
                f"or re-run data preparation"
            )
        if check_audio and cut.has_recording:
            sources = [s.source for s in cut.recording.sources]
            try:
                audio = cut.load_audio()
            except Exception as e:  # lhotse / soundfile raise many types for unreadable files
                raise ValueError(
                    f"cut {cut.id!r}: its audio {sources} cannot be read ({type(e).__name__}: {_first_line(e)}); "
                    f"fix: regenerate it (re-run data preparation with force=True) or drop the cut"
                ) from e
            if audio.size == 0 or not np.isfinite(audio).all():
                raise ValueError(f"cut {cut.id!r}: its audio {sources} is empty or not finite; fix: regenerate it or drop the cut")
        if check_features and cut.has_features:
            try:
                feats = cut.load_features()
            except Exception as e:
                raise ValueError(
                    f"cut {cut.id!r}: its features in {cut.features.storage_path} cannot be read "
                    f"({type(e).__name__}: {_first_line(e)}); "
                    f"fix: delete the feature manifest and recompute features"
                ) from e
            if feats.shape != (cut.num_frames, cut.num_features) or not np.isfinite(feats).all():
                raise ValueError(
                    f"cut {cut.id!r}: features have shape {feats.shape} (manifest says {(cut.num_frames, cut.num_features)}) "
                    f"or are not finite; fix: delete the feature manifest and recompute features"
                )
    return n


def filter_by_duration(cuts: Any, min_s: float = 0.5, max_s: float = 20.0) -> Any:
    """Keep cuts with ``min_s <= duration <= max_s`` (an eager CutSet) and log how many were dropped."""
    if min_s > max_s:
        raise ValueError(f"min duration {min_s} s is above max duration {max_s} s")
    cuts = cuts.to_eager()
    kept = cuts.filter(lambda c: min_s <= c.duration <= max_s).to_eager()
    dropped = len(cuts) - len(kept)
    if dropped:
        log.warning("dropped %d of %d cuts outside %.2f-%.2f s", dropped, len(cuts), min_s, max_s)
    else:
        log.info("all %d cuts are within %.2f-%.2f s", len(cuts), min_s, max_s)
    return kept
