"""Word error rate (via kaldialign), recognition / error-report files, and RTFx.

``results`` everywhere is a sequence of ``(cut_id, ref, hyp)`` where ``ref`` and ``hyp`` are either strings
(split on whitespace) or lists of words — the triple icefall's decode scripts collect. The file formats
follow icefall's ``store_transcripts`` / ``write_error_stats`` (k2-fsa/icefall icefall/utils.py) in spirit:
a recogs file with ``ref=[...]`` / ``hyp=[...]`` lines, and an errs file with the WER summary, per-utterance
alignments, the most common substitutions / deletions / insertions and per-word statistics.

All counts come from one kaldialign alignment per utterance (unit costs), so the summary line and the
per-utterance report always agree. When several minimal alignments exist, how the errors split into
ins/del/sub is kaldialign's choice; their total is the Levenshtein distance.
"""

from __future__ import annotations

import ast
import contextlib
import math
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence, Union

import kaldialign

from asrprec.atomic import atomic_path

Words = Union[str, Sequence[str]]
Result = tuple[str, Words, Words]


def _words(x: Words) -> list[str]:
    if isinstance(x, str):
        return x.split()
    words = list(x)
    for w in words:
        if not isinstance(w, str):
            raise ValueError(
                f"expected a string or a list of word strings, got an element {w!r} of type {type(w).__name__}"
            )
    return words


@dataclass
class ErrorCounts:
    """Edit-operation counts over one or more utterances."""

    ins: int = 0
    dels: int = 0
    subs: int = 0
    ref_words: int = 0
    utts: int = 0

    @property
    def errors(self) -> int:
        return self.ins + self.dels + self.subs

    @property
    def correct(self) -> int:
        return self.ref_words - self.dels - self.subs

    @property
    def wer(self) -> float:
        """errors / reference words (a fraction; 0 errors over 0 words is 0, any error over 0 words is inf)."""
        if self.ref_words == 0:
            return 0.0 if self.errors == 0 else math.inf
        return self.errors / self.ref_words

    @property
    def wer_percent(self) -> float:
        return 100.0 * self.wer

    def __add__(self, other: "ErrorCounts") -> "ErrorCounts":
        return ErrorCounts(
            self.ins + other.ins, self.dels + other.dels, self.subs + other.subs,
            self.ref_words + other.ref_words, self.utts + other.utts,
        )

    def summary(self) -> str:
        """Kaldi-style one-liner: ``%WER 12.50 [ 5 / 40, 1 ins, 2 del, 2 sub ]``."""
        return (
            f"%WER {self.wer_percent:.2f} [ {self.errors} / {self.ref_words}, "
            f"{self.ins} ins, {self.dels} del, {self.subs} sub ]"
        )


def _eps_for(ref: list[str], hyp: list[str]) -> str:
    eps = "*"
    while eps in ref or eps in hyp:  # a word that *is* the filler would make the alignment ambiguous
        eps = f"<{eps}>"
    return eps


def align_words(ref: Words, hyp: Words) -> tuple[list[tuple[str | None, str | None]], ErrorCounts]:
    """Minimum-edit alignment of two word sequences.

    Returns ``(pairs, counts)``: ``pairs`` is a list of ``(ref_word, hyp_word)`` where ``None`` on the ref side
    is an insertion and on the hyp side a deletion; ``counts`` is the one-utterance :class:`ErrorCounts`.
    """
    r, h = _words(ref), _words(hyp)
    eps = _eps_for(r, h)
    pairs = [(None if a == eps else a, None if b == eps else b) for a, b in kaldialign.align(r, h, eps)]
    counts = ErrorCounts(ref_words=len(r), utts=1)
    for a, b in pairs:
        if a is None:
            counts.ins += 1
        elif b is None:
            counts.dels += 1
        elif a != b:
            counts.subs += 1
    return pairs, counts


def word_errors(ref: Words, hyp: Words) -> ErrorCounts:
    """Error counts of one utterance (strings are split on whitespace)."""
    return align_words(ref, hyp)[1]


def compute_wer(refs: Sequence[Words], hyps: Sequence[Words]) -> ErrorCounts:
    """Corpus error counts: sums of per-utterance counts (WER = total errors / total reference words)."""
    if isinstance(refs, str) or isinstance(hyps, str):
        raise ValueError(
            "compute_wer takes a list of references and a list of hypotheses; for one pair use word_errors"
        )
    if len(refs) != len(hyps):
        raise ValueError(f"got {len(refs)} references but {len(hyps)} hypotheses")
    total = ErrorCounts()
    for r, h in zip(refs, hyps):
        total = total + word_errors(r, h)
    return total


def _check_results(results: Sequence[Result]) -> list[tuple[str, list[str], list[str]]]:
    out = []
    for i, item in enumerate(results):
        if not (isinstance(item, (tuple, list)) and len(item) == 3):
            raise ValueError(f"results[{i}] must be a (cut_id, ref, hyp) triple, got {item!r}")
        cut_id, ref, hyp = item
        out.append((str(cut_id), _words(ref), _words(hyp)))
    return out


def write_recogs(path: str | os.PathLike, results: Sequence[Result]) -> Path:
    """Write ``cut_id:\\tref=[...]`` and ``cut_id:\\thyp=[...]`` lines, sorted by cut id."""
    rows = sorted(_check_results(results), key=lambda r: r[0])
    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for cut_id, ref, hyp in rows:
            print(f"{cut_id}:\tref={ref}", file=f)
            print(f"{cut_id}:\thyp={hyp}", file=f)
    return path


def read_recogs(path: str | os.PathLike) -> dict[str, tuple[list[str], list[str]]]:
    """The inverse of :func:`write_recogs`: ``{cut_id: (ref_words, hyp_words)}``."""
    out: dict[str, list] = {}
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        cut_id, sep, rest = line.partition(":\t")
        kind, _, words = rest.partition("=")
        if not sep or kind not in ("ref", "hyp"):
            raise ValueError(f"{path}:{n} is not a recogs line (cut_id:\\tref=[...] or hyp=[...]): {line!r}")
        out.setdefault(cut_id, [None, None])[kind == "hyp"] = list(ast.literal_eval(words))
    return {k: (v[0], v[1]) for k, v in out.items()}


def write_error_stats(path: str | os.PathLike, results: Sequence[Result], *, title: str = "") -> ErrorCounts:
    """Write an icefall-style error report and return the corpus counts.

    Sections: the WER summary, ``PER-UTT DETAILS`` (correct words plain, errors as ``(ref->hyp)`` with ``*``
    for nothing), ``SUBSTITUTIONS``, ``DELETIONS``, ``INSERTIONS`` (most common first) and
    ``PER-WORD STATS`` (``word corr tot_errs count_in_ref count_in_hyp``).
    """
    rows = sorted(_check_results(results), key=lambda r: r[0])
    total = ErrorCounts()
    subs: Counter = Counter()
    dels: Counter = Counter()
    ins: Counter = Counter()
    words: dict[str, list[int]] = {}  # word -> [corr, ref_errs, hyp_errs, in_ref, in_hyp]
    details = []

    def stat(w: str) -> list[int]:
        return words.setdefault(w, [0, 0, 0, 0, 0])

    for cut_id, ref, hyp in rows:
        pairs, counts = align_words(ref, hyp)
        total = total + counts
        shown = []
        for a, b in pairs:
            if a is not None:
                stat(a)[3] += 1
            if b is not None:
                stat(b)[4] += 1
            if a == b:
                stat(a)[0] += 1
                shown.append(a)
                continue
            if a is None:
                ins[b] += 1
                stat(b)[2] += 1
            elif b is None:
                dels[a] += 1
                stat(a)[1] += 1
            else:
                subs[(a, b)] += 1
                stat(a)[1] += 1
                stat(b)[2] += 1
            shown.append(f"({a if a is not None else '*'}->{b if b is not None else '*'})")
        details.append(f"{cut_id}:\t{' '.join(shown)}")

    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        if title:
            print(title, file=f)
        print(f"%WER = {total.wer_percent:.2f}", file=f)
        print(
            f"Errors: {total.ins} insertions, {total.dels} deletions, {total.subs} substitutions, over "
            f"{total.ref_words} reference words ({total.correct} correct) in {total.utts} utterances",
            file=f,
        )
        print("Search below for sections starting with PER-UTT DETAILS:, SUBSTITUTIONS:, DELETIONS:, INSERTIONS:, "
              "PER-WORD STATS:", file=f)
        print("", file=f)
        print("PER-UTT DETAILS: corr or (ref->hyp)", file=f)
        for line in details:
            print(line, file=f)
        print("", file=f)
        print("SUBSTITUTIONS: count ref -> hyp", file=f)
        for (a, b), n in sorted(subs.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"{n}   {a} -> {b}", file=f)
        print("", file=f)
        print("DELETIONS: count ref", file=f)
        for w, n in sorted(dels.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"{n}   {w}", file=f)
        print("", file=f)
        print("INSERTIONS: count hyp", file=f)
        for w, n in sorted(ins.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"{n}   {w}", file=f)
        print("", file=f)
        print("PER-WORD STATS: word  corr tot_errs count_in_ref count_in_hyp", file=f)
        for w, (corr, ref_err, hyp_err, in_ref, in_hyp) in sorted(
            words.items(), key=lambda kv: (-(kv[1][1] + kv[1][2]), kv[0])
        ):
            print(f"{w}   {corr} {ref_err + hyp_err} {in_ref} {in_hyp}", file=f)
    return total


# -- speed -----------------------------------------------------------------------------------------


def rtfx(audio_seconds: float, wall_seconds: float) -> float:
    """Inverse real-time factor: seconds of audio processed per second of wall time (higher is faster)."""
    if wall_seconds <= 0:
        raise ValueError(f"wall_seconds must be > 0, got {wall_seconds}")
    if audio_seconds < 0:
        raise ValueError(f"audio_seconds must be >= 0, got {audio_seconds}")
    return audio_seconds / wall_seconds


class RtfxMeter:
    """Accumulates audio seconds and wall time over many batches.

    Usage::

        meter = RtfxMeter()
        for batch in loader:
            with meter.measure(audio_seconds=batch_duration):
                hyps = decode(...)
        print(meter.rtfx)

    ``measure`` synchronises CUDA before and after (when CUDA is initialised), so queued kernels are counted.
    """

    def __init__(self) -> None:
        self.audio_seconds = 0.0
        self.wall_seconds = 0.0

    def add(self, audio_seconds: float, wall_seconds: float) -> None:
        self.audio_seconds += audio_seconds
        self.wall_seconds += wall_seconds

    @contextlib.contextmanager
    def measure(self, audio_seconds: float) -> Iterator[None]:
        _sync()
        start = time.perf_counter()
        yield
        _sync()
        self.add(audio_seconds, time.perf_counter() - start)

    @property
    def rtfx(self) -> float:
        return rtfx(self.audio_seconds, self.wall_seconds)


def _sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
