"""The training set's duration filter: cuts outside [``min_cut_s``, ``max_cut_s``] dropped, counted and named (an
eager CutSet at once, a lazily read one as each pass meets them), and the per-epoch counts the training loop reports."""

from __future__ import annotations

import logging
from typing import Any

from asrprec.data.validate import filter_by_duration

log = logging.getLogger(__name__)

__all__ = ["filter_durations"]

def _is_lazy(cuts: Any) -> bool:
    return bool(getattr(cuts, "is_lazy", False))


class _DurationFilter:
    """Keep cuts with ``min_s <= duration <= max_s``, logging what it drops (named for the first few, then
    counted). For lazily read CutSets, which cannot be counted up front without reading them whole; a lazy set
    is filtered again on every pass over it, so each cut is reported once."""

    def __init__(self, min_s: float, max_s: float, named: int = 10) -> None:
        if min_s > max_s:
            raise ValueError(f"min duration {min_s} s is above max duration {max_s} s")
        self.min_s, self.max_s, self.named = min_s, max_s, named
        self.dropped: set[str] = set()
        self.in_pass = 0  # drops since start_pass(): one epoch's total
        self.kept, self.kept_seconds = 0, 0.0  # the cuts (and seconds) kept since start_pass()

    @property
    def reason(self) -> str:
        return f"outside {self.min_s:.2f}-{self.max_s:.2f} s"

    def start_pass(self) -> None:
        self.in_pass, self.kept, self.kept_seconds = 0, 0, 0.0

    def dropped_in_pass(self) -> dict[str, int]:
        return {self.reason: self.in_pass} if self.in_pass else {}

    def kept_in_pass(self) -> tuple[int, float]:
        """The cuts kept since :meth:`start_pass`, and their seconds: the sampler's input."""
        return self.kept, self.kept_seconds

    def __call__(self, cut: Any) -> bool:
        if self.min_s <= cut.duration <= self.max_s:
            self.kept += 1
            self.kept_seconds += cut.duration
            return True
        self.in_pass += 1
        if cut.id not in self.dropped:
            self.dropped.add(cut.id)
            n = len(self.dropped)
            if n <= self.named:
                more = " (further drops are counted every 1000)" if n == self.named else ""
                log.warning("dropped cut %s from training: %.3f s is outside %.2f-%.2f s%s", cut.id, cut.duration,
                            self.min_s, self.max_s, more)
            elif n % 1000 == 0:
                log.warning("dropped %d cuts outside %.2f-%.2f s so far", n, self.min_s, self.max_s)
        return False


class _FilteredOnce:
    """The duration drops of an eager CutSet, filtered once: the same every epoch (so are the cuts kept)."""

    def __init__(self, reason: str, count: int, kept: int, kept_seconds: float) -> None:
        self.reason, self.count, self.kept, self.kept_seconds = reason, count, kept, kept_seconds

    def start_pass(self) -> None:
        pass

    def dropped_in_pass(self) -> dict[str, int]:
        return {self.reason: self.count} if self.count else {}

    def kept_in_pass(self) -> tuple[int, float]:
        return self.kept, self.kept_seconds


def filter_durations(cuts: Any, min_s: float, max_s: float) -> Any:
    """Training cuts within [``min_s``, ``max_s``] seconds: an eager CutSet is filtered at once (with a count,
    :func:`asrprec.data.validate.filter_by_duration`), a lazy one lazily (drops logged as they are met)."""
    return _filter_durations(cuts, min_s, max_s)[0]


def _filter_durations(cuts: Any, min_s: float, max_s: float) -> tuple[Any, Any]:
    """:func:`filter_durations` and what counts its drops and the cuts it kept per epoch (``start_pass`` /
    ``dropped_in_pass`` / ``kept_in_pass``)."""
    if _is_lazy(cuts):
        f = _DurationFilter(min_s, max_s)
        return cuts.filter(f), f
    kept = filter_by_duration(cuts, min_s, max_s)
    return kept, _FilteredOnce(_DurationFilter(min_s, max_s).reason, len(cuts) - len(kept), len(kept),
                               sum(c.duration for c in kept))
