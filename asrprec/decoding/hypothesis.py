"""Decoding results (:class:`DecodingResult`) and the hypothesis records of transducer beam search.

A :class:`Hypothesis` is one partial label sequence with its score (log-probability summed over the
alignments that were merged into it). A :class:`HypothesisList` holds at most one hypothesis per
label sequence: adding a duplicate merges the two by log-add (the same label sequence reached by
different alignments), which is what makes ``modified_beam_search`` a search over label sequences
rather than over alignments (icefall, egs/librispeech/ASR/pruned_transducer_stateless2/beam_search.py,
``Hypothesis`` / ``HypothesisList``; there ``ys`` includes the decoder's context prefix and the score is
a tensor — here ``tokens`` excludes the prefix and the score is a Python float, so a hypothesis costs
no device memory and merging needs no device sync).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Sequence


def log_add(a: float, b: float) -> float:
    """log(exp(a) + exp(b)) without overflow; ``-inf`` is the identity."""
    if a == -math.inf:
        return b
    if b == -math.inf:
        return a
    hi, lo = (a, b) if a >= b else (b, a)
    return hi + math.log1p(math.exp(lo - hi))


@dataclass(frozen=True)
class DecodingResult:
    """One utterance's decoding: its tokens and where in the encoder output each was emitted.

    Every search gives it (``decode(..., return_timestamps=True)``; ``return_results=True`` of each search function).
    Times are in encoder frames counted from the utterance's first encoder frame (0-based). An encoder frame of the
    shipped encoders (Conformer, Zipformer) is 4 fbank frames of 10 ms: 40 ms; frame f starts at ``f · 0.04`` s.

    Attributes:
        tokens: token ids, without blank and the decoder's start context.
        frames: the encoder frame of each token: where a transducer search emitted it, or the first frame of the
            token's spike (its run of frames) for CTC. Non-decreasing.
        durations: TDT only: each token's predicted duration in encoder frames (the duration head's argmax, or the
            duration of the chosen (token, duration) pair in a beam search; 0 = another token may follow on the same
            frame); ``None`` for RNN-T and CTC.
        score: the log-probability score the search ranked the result by (beam searches: the hypothesis's float64
            sum, LM / phrase bonuses included, before length normalisation); ``None`` for greedy searches.
    """

    tokens: tuple[int, ...]
    frames: tuple[int, ...]
    durations: tuple[int, ...] | None = None
    score: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(k) for k in self.tokens))
        object.__setattr__(self, "frames", tuple(int(f) for f in self.frames))
        if self.durations is not None:
            object.__setattr__(self, "durations", tuple(int(d) for d in self.durations))
        if self.score is not None:
            object.__setattr__(self, "score", float(self.score))
        if len(self.frames) != len(self.tokens) or (self.durations is not None
                                                    and len(self.durations) != len(self.tokens)):
            raise ValueError(f"a DecodingResult needs one frame (and duration) per token: {len(self.tokens)} tokens, "
                             f"{len(self.frames)} frames, durations {self.durations}")


def results_of(tokens: Sequence[Sequence[int]], frames: Sequence[Sequence[int]],
               durations: Sequence[Sequence[int]] | None = None,
               scores: Sequence[float] | None = None) -> list[DecodingResult]:
    """B :class:`DecodingResult` from per-utterance lists (``durations`` / ``scores`` None: none)."""
    return [DecodingResult(tokens[b], frames[b], None if durations is None else durations[b],
                           None if scores is None else scores[b]) for b in range(len(tokens))]


@dataclass
class Hypothesis:
    """One partial label sequence.

    Attributes:
        tokens: emitted token ids, blank and the decoder's start context excluded.
        log_prob: log-probability of ``tokens`` over the frames consumed so far (fp32 log-softmax
            values accumulated in Python floats, i.e. float64).
        timestamps: for each token, the encoder frame that emitted it (from the first alignment that
            reached this sequence; merged duplicates keep the earlier record's timestamps).
        fusion_state: the LM / phrase states after ``tokens`` (:mod:`asrprec.decoding.fusion`; a function of the
            tokens, so merged duplicates share it), or ``()`` without fusion.
    """

    tokens: tuple[int, ...] = ()
    log_prob: float = 0.0
    timestamps: tuple[int, ...] = field(default=())
    fusion_state: tuple[int, ...] = field(default=())

    @property
    def key(self) -> tuple[int, ...]:
        return self.tokens

    def result(self) -> DecodingResult:
        """The :class:`DecodingResult` of this hypothesis (its tokens, their frames and ``log_prob``)."""
        return DecodingResult(self.tokens, self.timestamps, None, self.log_prob)

    def context(self, context_size: int, blank_id: int) -> list[int]:
        """The decoder input for this hypothesis: the last ``context_size`` tokens, left-padded with blank."""
        if len(self.tokens) >= context_size:
            return list(self.tokens[-context_size:])
        return [blank_id] * (context_size - len(self.tokens)) + list(self.tokens)

    def normalized_score(self, context_size: int) -> float:
        """``log_prob / (context_size + len(tokens))`` — icefall's length normalisation, whose ``ys``
        counts the context prefix (so an empty hypothesis divides by ``context_size``, never by 0)."""
        return self.log_prob / (context_size + len(self.tokens))


class HypothesisList:
    """At most one :class:`Hypothesis` per label sequence; duplicates merge by log-add."""

    def __init__(self, hyps: list[Hypothesis] | None = None):
        self._data: dict[tuple[int, ...], Hypothesis] = {}
        for h in hyps or ():
            self.add(h)

    def add(self, hyp: Hypothesis) -> None:
        old = self._data.get(hyp.key)
        if old is None:
            self._data[hyp.key] = hyp
        else:
            old.log_prob = log_add(old.log_prob, hyp.log_prob)

    def get_most_probable(self, length_norm: bool = False, context_size: int = 1) -> Hypothesis:
        """The best hypothesis by raw ``log_prob`` or, with ``length_norm``, by
        :meth:`Hypothesis.normalized_score` (ties: the one added first)."""
        if not self._data:
            raise ValueError("HypothesisList is empty: there is no most probable hypothesis")
        if length_norm:
            return max(self._data.values(), key=lambda h: h.normalized_score(context_size))
        return max(self._data.values(), key=lambda h: h.log_prob)

    def sorted(self) -> list[Hypothesis]:
        """Hypotheses by decreasing ``log_prob``."""
        return sorted(self._data.values(), key=lambda h: h.log_prob, reverse=True)

    def __contains__(self, tokens: tuple[int, ...]) -> bool:
        return tuple(tokens) in self._data

    def __getitem__(self, tokens: tuple[int, ...]) -> Hypothesis:
        return self._data[tuple(tokens)]

    def __iter__(self) -> Iterator[Hypothesis]:
        return iter(self._data.values())

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"HypothesisList({self.sorted()!r})"
