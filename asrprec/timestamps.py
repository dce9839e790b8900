"""Word times from token times: token frames → word spans (seconds), CTC frame labels → token runs, words →
segments, CTM and segment files.

Time grid: features are computed every 10 ms (:mod:`asrprec.data.features`) and every encoder here subsamples them
4x, so one encoder frame is 40 ms (:data:`FRAME_SHIFT_S`): the Conformer's ``Conv2dSubsampling`` divides by 4
(:mod:`asrprec.models.subsampling`); the Zipformer's front-end divides by 2 (100 → 50 Hz,
:mod:`asrprec.models.zipformer.frontend`) and its output downsampling by 2 more (``output_downsampling_factor=2``).
Encoder frame ``t`` covers ``[t, t + 1) * 0.04`` s of the input (icefall's convention, ``frame_shift_ms *
subsampling_factor``; k2-fsa/icefall egs/librispeech/ASR/zipformer/decode.py ``--subsampling-factor``).

Rules (:func:`word_spans`), on sentencepiece pieces:

* a piece starting with ``▁`` starts a word; the first piece of a hypothesis starts one whatever it is;
* a word starts at the frame of its first *timed* piece: punctuation (``.``, ``,``, ``?`` …) and blank-like pieces
  (``<blk>``, ``<s>``, ``</s>``, ``<pad>``, a bare ``▁``) have zero duration and neither start nor extend a
  word's span; they still join its text;
* a word ends at the end of its last timed piece: that piece's frame + 1 (RNN-T, CTC spikes), or + its duration in
  frames (TDT's predicted duration, or a CTC run's length from :func:`ctc_token_runs`; at least 1);
* that end then moves on to the next word's start (or the utterance's end), by at most :data:`EXTEND_FRAMES`
  (400 ms, about one spoken word), since a transducer or CTC emits a word's token once, near its start: on the
  embedded recipe's Zipformer (greedy search) ends taken at the last token's frame + 1 fell 260 ms early on average,
  and 50 ms off with the extension; a TDT model's last token's frame + its duration fell 150 ms early, and 44 ms off
  with the extension (``benchmarks/timestamps.py``; TDT jumps over the word's later frames with blanks). The cap
  keeps a pause out;
* every end is capped at the next word's start and at the utterance's last frame. A word made only of
  zero-duration pieces lasts 0 s.

The first three rules time a word by its own pieces (:func:`token_words`); the last two look at the next word
(:func:`finish_words`), so words gathered from several decodes (long-form chunks) get them again once merged: spans
are then ordered by start and none ends after the next one starts, whatever the token frames.

Punctuation gets no duration because a TDT model emits it with a long duration (the frames it skips to the next
word): a port of NeMo's TDT timestamps saw word ends drift by up to 560 ms until it did so (NVIDIA/NeMo
``nemo/collections/asr/parts/utils/timestamp_utils.py`` refines TDT punctuation to zero duration the same way).
An empty hypothesis gives no words (NeMo #14427 failed there).

Segments (:func:`segment_spans`), as NeMo's segment timestamps: a segment is a run of words that ends after a word
ending in a sentence separator (:data:`SEGMENT_SEPARATORS`: ``.``, ``?``, ``!`` as NeMo's default
``segment_seperators``, and their ellipsis / full-width forms), or before a word that starts more than ``max_gap_s``
after the previous word ends. It spans from its first word's start to its last word's end; its text is its words
joined by spaces. NeMo splits at a gap only when ``segment_gap_threshold`` (frames) is set, and has none by default;
here the default is :data:`SEGMENT_GAP_S` (0.5 s, longer than the pauses between words of a fluent sentence), since
transcripts without punctuation (LibriSpeech's, the embedded corpus') would otherwise give one segment per
utterance. The gap is measured between word spans as written, ends already moved on by up to :data:`EXTEND_FRAMES`.

Files, beside the recogs of the same split and tag (utterances sorted by id, then by time; seconds, 2 decimals):

* ``ctm-<split>-<tag>.txt`` (:func:`write_ctm`): NIST CTM, one line per word:
  ``<utterance> <channel> <start> <duration> <word>``;
* ``segments-<split>-<tag>.txt`` (:func:`write_segments`): one line per segment: ``<utterance> <start> <end>
  <text>``, the text being the rest of the line (words separated by single spaces).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from asrprec.atomic import atomic_write_text

__all__ = ["EXTEND_FRAMES", "FEATURE_SHIFT_S", "FRAME_SHIFT_S", "SEGMENT_GAP_S", "SEGMENT_SEPARATORS",
           "SUBSAMPLING_FACTOR", "WORD_START", "CtmCollector", "SegmentSpan", "TokenWord", "WordSpan", "ctc_token_runs",
           "ctm_path", "finish_words", "format_ctm", "format_segments", "is_zero_duration", "segment_spans",
           "segments_path", "token_words", "word_spans", "words_from_ids", "words_from_token_times", "write_ctm",
           "write_segments"]

FEATURE_SHIFT_S = 0.01  # fbank frame shift
SUBSAMPLING_FACTOR = 4  # Conformer: Conv2dSubsampling 4x; Zipformer: front-end 2x, output downsampling 2x
FRAME_SHIFT_S = FEATURE_SHIFT_S * SUBSAMPLING_FACTOR  # one encoder frame: 40 ms
EXTEND_FRAMES = 10  # how far a word's end may move towards the next word's start (400 ms)
WORD_START = "\u2581"  # sentencepiece's "▁"
#: NeMo's default segment_seperators (NVIDIA/NeMo nemo/collections/asr/parts/submodules/rnnt_decoding.py,
#: ``RNNTDecodingConfig``; the same in ctc_decoding.py), with the ellipsis and full-width forms
SEGMENT_SEPARATORS = (".", "?", "!", "\u2026", "\u3002", "\uff1f", "\uff01")
SEGMENT_GAP_S = 0.5  # a pause longer than this between two words ends a segment (module docstring)

_SPECIALS = frozenset({"<blk>", "<s>", "</s>", "<pad>", "<sos/eos>", "<eps>", WORD_START})


@dataclass(frozen=True)
class WordSpan:
    """One word and its time in seconds: ``start`` <= ``end``."""

    word: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def centre(self) -> float:
        return 0.5 * (self.start + self.end)

    def shifted(self, seconds: float) -> "WordSpan":
        return WordSpan(self.word, self.start + seconds, self.end + seconds)


@dataclass(frozen=True)
class SegmentSpan:
    """A run of words (:func:`segment_spans`): their text joined by spaces, its first start and last end (s)."""

    text: str
    start: float
    end: float


def is_zero_duration(piece: str) -> bool:
    """Punctuation and blank-like pieces: no characters but punctuation (after ``▁``), or a special symbol."""
    if piece in _SPECIALS:
        return True
    body = piece.lstrip(WORD_START)
    return not any(c.isalnum() for c in body)


def _piece_text(piece: str) -> str:
    return "" if piece in _SPECIALS else piece.replace(WORD_START, "")


@dataclass(frozen=True)
class TokenWord:
    """One word as its own pieces time it (encoder frames), before the rules that look at its neighbours
    (:func:`finish_words`): ``first``: its first piece's frame; ``start``, ``end``: its first timed piece's frame
    and its last timed piece's end (both ``None``: only zero-duration pieces)."""

    text: str
    first: int
    start: int | None = None
    end: int | None = None

    @property
    def onset(self) -> int:
        """Where the word starts: its first timed piece, else its first piece."""
        return self.first if self.start is None else self.start

    def shifted(self, frames: int, *, limit: int | None = None) -> "TokenWord":
        """The word ``frames`` later, its end first cut at ``limit`` (the frames its tokens came from)."""
        end = self.end if self.end is None or limit is None else min(self.end, limit)
        return TokenWord(self.text, self.first + frames, None if self.start is None else self.start + frames,
                         None if end is None else end + frames)


def token_words(pieces: Sequence[str], frames: Sequence[int],
                durations: Sequence[int] | None = None) -> list[TokenWord]:
    """Pieces grouped into words, each timed by its own pieces (:func:`word_spans`' arguments and rules), in order;
    words of only blank-like pieces are left out. ValueError as :func:`word_spans`."""
    U = len(pieces)
    if len(frames) != U or (durations is not None and len(durations) != U):
        raise ValueError(f"pieces, frames and durations must have equal lengths, got {U}, {len(frames)}, "
                         f"{None if durations is None else len(durations)}")
    frames = [int(f) for f in frames]
    if any(f < 0 for f in frames) or any(b < a for a, b in zip(frames, frames[1:])):
        raise ValueError(f"frames must be non-decreasing and >= 0, got {frames}")
    if durations is not None and any(int(d) < 0 for d in durations):
        raise ValueError(f"durations must be >= 0, got {list(durations)}")
    words: list[list] = []  # [text, first frame, first timed frame or None, end of the last timed piece or None]
    for i, piece in enumerate(pieces):
        if not words or piece.startswith(WORD_START):
            words.append(["", frames[i], None, None])
        w = words[-1]
        w[0] += _piece_text(piece)
        if is_zero_duration(piece):
            continue
        if w[2] is None:
            w[2] = frames[i]
        w[3] = frames[i] + (1 if durations is None else max(1, int(durations[i])))
    return [TokenWord(*w) for w in words if w[0]]  # a word of only blank-like pieces: a bare "▁" at the very end


def finish_words(words: Iterable[TokenWord], *, num_frames: int | None = None, frame_shift: float = FRAME_SHIFT_S,
                 offset: float = 0.0, extend_frames: int = 0) -> list[WordSpan]:
    """Word spans of words timed by their own pieces, by the rules that look at the next word (module docstring):
    ends moved on by at most ``extend_frames``, then capped at the next word's start and at ``num_frames``; starts
    past ``num_frames`` put on it. Words are taken in order of their start (``onset``, ties kept in input order),
    whatever order they come in, so the spans returned are ordered by start and none ends after the next starts."""
    limit = math.inf if num_frames is None else int(num_frames)
    ordered = sorted(words, key=lambda w: w.onset)
    onsets = [min(w.onset, limit) for w in ordered] + [math.inf]
    out: list[WordSpan] = []
    for k, w in enumerate(ordered):
        start, nxt = onsets[k], onsets[k + 1]
        end = start  # only zero-duration pieces: an instant
        if w.start is not None:
            end = w.end
            if extend_frames:
                end = max(end, min(nxt, end + extend_frames, limit))
            end = max(start, min(end, nxt, limit))
        out.append(WordSpan(w.text, offset + start * frame_shift, offset + end * frame_shift))
    return out


def word_spans(pieces: Sequence[str], frames: Sequence[int], durations: Sequence[int] | None = None, *,
               num_frames: int | None = None, frame_shift: float = FRAME_SHIFT_S,
               offset: float = 0.0, extend_frames: int | None = None) -> list[WordSpan]:
    """Word spans of one hypothesis (rules in the module docstring): :func:`finish_words` of :func:`token_words`.

    Args:
        pieces: the hypothesis' sentencepiece pieces (U,), blank excluded.
        frames: (U,) encoder frame of each piece, non-decreasing, >= 0.
        durations: (U,) frames each piece lasts (TDT durations, CTC run lengths), or None: one frame each.
        num_frames: the utterance's encoder frames; spans end no later than ``num_frames * frame_shift``.
        frame_shift: seconds per encoder frame. offset: seconds added to every time (a chunk's start).
        extend_frames: at most how many frames a word's end moves towards the next word's start; None:
            :data:`EXTEND_FRAMES`.
    Returns:
        One :class:`WordSpan` per word, in order; ``[]`` for an empty hypothesis or one of only blank-like pieces.
    Raises:
        ValueError naming the argument for unequal lengths, negative or decreasing frames, negative durations.
    """
    if extend_frames is None:
        extend_frames = EXTEND_FRAMES
    return finish_words(token_words(pieces, frames, durations), num_frames=num_frames, frame_shift=frame_shift,
                        offset=offset, extend_frames=extend_frames)


def words_from_ids(id_to_piece: Callable[[int], str], tokens: Sequence[int], frames: Sequence[int],
                   durations: Sequence[int] | None = None, **kwargs) -> list[WordSpan]:
    """:func:`word_spans` of token ids, read through ``id_to_piece`` (e.g. ``Tokenizer.id_to_piece``)."""
    return word_spans([id_to_piece(int(t)) for t in tokens], frames, durations, **kwargs)


def words_from_token_times(pieces: Sequence[str], times: Sequence[float], duration: float | None = None, *,
                           frame_shift: float = FRAME_SHIFT_S, durations: Sequence[int] | None = None
                           ) -> list[WordSpan]:
    """:func:`word_spans` of tokens timed in seconds, as sherpa-onnx's ``OfflineRecognitionResult`` gives them
    (``tokens``: the pieces, ``timestamps``: each one's start): times go to the nearest frame; ``duration``: the
    audio's seconds, which the words stay within (a token timed later, as a streaming decode's tail padding can
    give, is put on the audio's last frame). ``durations``: TDT tokens' durations in frames."""
    frames = [max(0, int(round(t / frame_shift))) for t in times]
    num_frames = None if duration is None else max(1, math.ceil(duration / frame_shift - 1e-9))
    if num_frames is None:
        return word_spans(pieces, frames, durations, frame_shift=frame_shift)
    frames = [min(f, num_frames - 1) for f in frames]
    # the last frame may pass the audio's end (a part of a frame): ends are cut there
    return [WordSpan(w.word, w.start, min(w.end, duration))
            for w in word_spans(pieces, frames, durations, num_frames=num_frames, frame_shift=frame_shift)]


def segment_spans(words: Sequence[WordSpan], *, max_gap_s: float | None = SEGMENT_GAP_S,
                  separators: Sequence[str] = SEGMENT_SEPARATORS) -> list[SegmentSpan]:
    """Words (in time order) → segments (rules in the module docstring), as NeMo's ``get_segment_offsets`` forms them
    (NVIDIA/NeMo nemo/collections/asr/parts/utils/timestamp_utils.py; NeMo splits at a gap >= its threshold, here
    only at one longer than ``max_gap_s``).

    Args:
        words: one utterance's word spans.
        max_gap_s: a pause longer than this (next start - previous end, seconds) ends a segment; None: never.
        separators: a word ending in one of these (or made of one) ends a segment.
    Returns:
        One :class:`SegmentSpan` per segment, in order; ``[]`` without words.
    Raises:
        ValueError for a negative ``max_gap_s``.
    """
    if max_gap_s is not None and max_gap_s < 0:
        raise ValueError(f"max_gap_s must be >= 0 seconds or None (no gap splits), got {max_gap_s}")
    ends = tuple(separators)
    out: list[SegmentSpan] = []
    run: list[WordSpan] = []

    def close() -> None:
        if run:
            out.append(SegmentSpan(" ".join(w.word for w in run), run[0].start, run[-1].end))
            run.clear()

    for w in words:
        if run and max_gap_s is not None and w.start - run[-1].end > max_gap_s:
            close()
        run.append(w)
        if w.word.endswith(ends):
            close()
    close()
    return out


def ctc_token_runs(frame_labels: Sequence[int], blank_id: int = 0) -> tuple[list[int], list[int], list[int]]:
    """CTC's best path (T,) frame labels → ``(tokens, frames, durations)``: repeats collapsed, blanks dropped; each
    token's first frame and the length of its run of repeats (a spike is a run of 1)."""
    tokens: list[int] = []
    frames: list[int] = []
    durations: list[int] = []
    prev = blank_id
    for t, k in enumerate(int(x) for x in frame_labels):
        if k != blank_id and k == prev:
            durations[-1] += 1
        elif k != blank_id:
            tokens.append(k)
            frames.append(t)
            durations.append(1)
        prev = k
    return tokens, frames, durations


def ctm_path(exp_dir: str | Path, split: str, tag: str) -> Path:
    """``<exp_dir>/ctm-<split>-<tag>.txt``, beside the recogs file of the same split and tag."""
    return Path(exp_dir) / f"ctm-{split}-{tag}.txt"


def format_ctm(utterances: Iterable[tuple[str, Sequence[WordSpan]]], channel: str = "1") -> str:
    """NIST CTM text: one line per word, ``<utterance> <channel> <start> <duration> <word>`` (seconds, 2 decimals),
    utterances sorted by id and words by start (sclite's order). ValueError for an id or word holding whitespace."""
    lines = []
    for utt, words in sorted(utterances, key=lambda x: x[0]):
        if not utt or any(c.isspace() for c in utt):
            raise ValueError(f"CTM utterance ids must be non-empty without whitespace, got {utt!r}")
        for w in sorted(words, key=lambda w: (w.start, w.end)):
            if not w.word or any(c.isspace() for c in w.word):
                raise ValueError(f"CTM words must be non-empty without whitespace, got {w.word!r} in {utt}")
            lines.append(f"{utt} {channel} {w.start:.2f} {w.duration:.2f} {w.word}\n")
    return "".join(lines)


def write_ctm(path: str | Path, utterances: Iterable[tuple[str, Sequence[WordSpan]]], channel: str = "1") -> Path:
    """Write :func:`format_ctm` to ``path`` atomically (:mod:`asrprec.atomic`)."""
    return atomic_write_text(path, format_ctm(utterances, channel))


def segments_path(exp_dir: str | Path, split: str, tag: str) -> Path:
    """``<exp_dir>/segments-<split>-<tag>.txt``, beside the CTM file of the same split and tag."""
    return Path(exp_dir) / f"segments-{split}-{tag}.txt"


def format_segments(utterances: Iterable[tuple[str, Sequence[WordSpan]]], **kwargs) -> str:
    """The segments file (module docstring) of each utterance's words: ``<utterance> <start> <end> <text>`` per
    :func:`segment_spans` (``kwargs``: its ``max_gap_s``, ``separators``), utterances sorted by id. ValueError for an
    id holding whitespace."""
    lines = []
    for utt, words in sorted(utterances, key=lambda x: x[0]):
        if not utt or any(c.isspace() for c in utt):
            raise ValueError(f"segment file utterance ids must be non-empty without whitespace, got {utt!r}")
        ordered = sorted(words, key=lambda w: (w.start, w.end))
        for seg in segment_spans(ordered, **kwargs):
            lines.append(f"{utt} {seg.start:.2f} {seg.end:.2f} {seg.text}\n")
    return "".join(lines)


def write_segments(path: str | Path, utterances: Iterable[tuple[str, Sequence[WordSpan]]], **kwargs) -> Path:
    """Write :func:`format_segments` to ``path`` atomically (:mod:`asrprec.atomic`)."""
    return atomic_write_text(path, format_segments(utterances, **kwargs))


class CtmCollector:
    """Collects word times while a split is decoded and writes them as one CTM file.

    Pass it as ``decode_dataset(..., on_results=collector)``: it is called with each batch's cut ids and
    :class:`~asrprec.decoding.DecodingResult` (anything with ``tokens``, ``frames``, ``durations``).
    ``durations``: ``{cut_id: seconds}``; a cut's words then end within its audio (a spike's end moves at most
    :data:`EXTEND_FRAMES` otherwise, and may pass the end of the audio by that much).
    """

    def __init__(self, id_to_piece: Callable[[int], str], durations: Mapping[str, float] | None = None):
        self.id_to_piece = id_to_piece
        self.durations = durations or {}
        self.utterances: list[tuple[str, list[WordSpan]]] = []

    def __call__(self, cut_ids: Sequence[str], results: Sequence) -> None:
        for cut_id, r in zip(cut_ids, results):
            seconds = self.durations.get(cut_id)
            num_frames = None if seconds is None else max(1, math.ceil(seconds / FRAME_SHIFT_S - 1e-9))
            self.utterances.append((cut_id, words_from_ids(self.id_to_piece, r.tokens, r.frames, r.durations,
                                                           num_frames=num_frames)))

    def write(self, path: str | Path, channel: str = "1") -> Path:
        """:func:`write_ctm` of everything collected."""
        return write_ctm(path, self.utterances, channel)

    def write_segments(self, path: str | Path, **kwargs) -> Path:
        """:func:`write_segments` of everything collected (``kwargs``: :func:`segment_spans`' options)."""
        return write_segments(path, self.utterances, **kwargs)
