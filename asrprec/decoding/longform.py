"""Decode a recording of any length in overlapping chunks, with bounded memory, into words timed in the recording.

The encoder sees one chunk (``chunk_seconds``) at a time, so its memory (attention is quadratic in length) does not
grow with the recording; from a lhotse cut or recording, audio is also read and turned into fbank one chunk at a
time. Neighbouring chunks share ``overlap_seconds``; the boundary between them is the middle of the shared part, and
each chunk keeps the words whose centre lies on its side (its *owned* region). A word near a seam is therefore whole
in at least the chunk that owns it (words shorter than ``overlap_seconds / 2``) and kept once; a word cut by a chunk's
edge has its centre beyond the boundary and is dropped from that chunk. Chunk starts are whole encoder frames (4 fbank
frames), so every chunk's frames lie on the recording's 40 ms grid (:mod:`asrprec.timestamps`).

A chunk's spans only decide which words it keeps: no span inside one chunk sees the words kept from the next, so a
word kept from one chunk may end after a word kept from the next starts, or even start after it (a long word of the
next chunk can start before the boundary and still be centred beyond it). The kept words' own token times (ends cut
at their chunk's last frame) therefore get the rules that look at the next word once more, over the whole recording
(:func:`~asrprec.timestamps.finish_words`): the words come out ordered by start, none ending after the next
starts, all inside the recording, whatever tokens and frames a model emits.

With ``pause_seconds`` > 0 the recording is first cut at its pauses (:func:`plan_segments`): frames whose mel energy
lies ``pause_db`` below the recording's speech level (the 95th percentile of its frames' energies), in runs of at
least ``pause_seconds``, separate segments, each decoded alone (from its first loud frame, moved on to the encoder
grid, to its last) and owning the words up to the middle of its pauses; a segment longer than ``chunk_seconds`` is
chunked as above. A model trained on single utterances then sees single utterances (sherpa-onnx pairs its offline
recognisers with a voice-activity detector for long files the same way, k2-fsa/sherpa-onnx
``python-api-examples/vad-with-non-streaming-asr.py``); without it, such a model fails on a chunk that holds several
(``benchmarks/RESULTS.md``, "Word times and long recordings"). The energy is read in a first pass over the
recording, one chunk at a time.

Defaults suit the offline Zipformer, whose attention spans the whole chunk: 20 s chunks, the longest cut icefall's
LibriSpeech recipes train it on (k2-fsa/icefall egs/librispeech/ASR/zipformer/train.py, ``remove_short_and_long_utt``:
1-20 s), so a chunk is never longer than what the model has seen, with 4 s of overlap, so each kept word has at least
2 s of context on both sides. A model trained on shorter audio wants chunks no longer than its training cuts.

Legend: T feature frames (10 ms), F feature bins, T' encoder frames (40 ms), B chunks in one batch.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from asrprec.config import option

from ._common import model_device
from .api import DecodingOptions, Searcher
from asrprec.timestamps import (
    EXTEND_FRAMES, FEATURE_SHIFT_S, SUBSAMPLING_FACTOR, TokenWord, WordSpan, finish_words, token_words,
)

__all__ = ["Chunk", "LongFormOptions", "decode_long", "decode_long_cuts", "frame_energy", "plan_chunks",
           "plan_segments"]

SAMPLE_RATE = 16000


@dataclass
class LongFormOptions:
    """How a long recording is cut into chunks (module docstring)."""

    chunk_seconds: float = option(20.0, metavar="SECONDS", help="long-form decoding: seconds of audio the encoder sees "
                                                                "at once (memory does not grow with the recording)")
    overlap_seconds: float = option(4.0, metavar="SECONDS", help="long-form decoding: seconds two neighbouring chunks "
                                                                 "share; each keeps the words centred on its side")
    chunks_per_batch: int = option(4, help="long-form decoding: chunks encoded together in one batch")
    pause_seconds: float = option(0.0, metavar="SECONDS", help="long-form decoding: cut the recording at pauses at "
                                  "least this long and decode each piece alone (0: fixed chunks only)")
    pause_db: float = option(30.0, help="long-form decoding: a frame is a pause when its energy lies this many dB "
                             "below the recording's speech level (95th percentile of the frames)")

    def __post_init__(self) -> None:
        if not self.chunk_seconds > 0:
            raise ValueError(f"chunk_seconds must be > 0, got {self.chunk_seconds}")
        if not 0 <= self.overlap_seconds < self.chunk_seconds:
            raise ValueError(f"overlap_seconds must lie in [0, chunk_seconds={self.chunk_seconds}), "
                             f"got {self.overlap_seconds}")
        if self.chunks_per_batch < 1:
            raise ValueError(f"chunks_per_batch must be >= 1, got {self.chunks_per_batch}")
        if self.pause_seconds < 0 or self.pause_db <= 0:
            raise ValueError(f"pause_seconds must be >= 0 and pause_db > 0, got {self.pause_seconds} and "
                             f"{self.pause_db}")


@dataclass(frozen=True)
class Chunk:
    """Feature frames ``[start, end)`` of the recording and the region ``[own_start, own_end)`` (seconds) whose
    words this chunk keeps."""

    start: int
    end: int
    own_start: float
    own_end: float


def plan_chunks(num_frames: int, options: LongFormOptions) -> list[Chunk]:
    """The chunks covering ``num_frames`` 10 ms frames: starts every ``chunk - overlap`` (whole encoder frames), the
    last one ending at ``num_frames``; owned regions meet at the middle of each overlap and tile the line."""
    chunk = max(SUBSAMPLING_FACTOR, int(round(options.chunk_seconds / FEATURE_SHIFT_S)))
    step = (chunk - int(round(options.overlap_seconds / FEATURE_SHIFT_S))) // SUBSAMPLING_FACTOR * SUBSAMPLING_FACTOR
    step = max(step, SUBSAMPLING_FACTOR)
    spans = []
    start = 0
    while start + chunk < num_frames:
        spans.append([start, start + chunk])
        start += step
    last = max(0, num_frames - chunk) // SUBSAMPLING_FACTOR * SUBSAMPLING_FACTOR
    if spans and last <= spans[-1][0]:
        spans[-1][1] = num_frames  # the rest is shorter than one encoder frame: the previous chunk takes it
    else:
        spans.append([last, num_frames])
    bounds = [(a_end + b_start) / 2 * FEATURE_SHIFT_S for (_, a_end), (b_start, _) in zip(spans, spans[1:])]
    owns = zip([-float("inf")] + bounds, bounds + [float("inf")])
    return [Chunk(s, e, lo, hi) for (s, e), (lo, hi) in zip(spans, owns)]


def frame_energy(features: torch.Tensor) -> torch.Tensor:
    """(T, F) log-mel frames -> (T,) each frame's mel energy, natural log (the log of the bins' summed power)."""
    return torch.logsumexp(features.float(), dim=-1)


def plan_segments(energy: torch.Tensor, options: LongFormOptions) -> list[Chunk]:
    """The chunks of a recording cut at its pauses (module docstring), from (T,) :func:`frame_energy`: one per
    segment of speech, a segment longer than ``chunk_seconds`` in overlapping chunks (:func:`plan_chunks`). Chunk
    starts are whole encoder frames; owned regions tile the line. Without pauses: :func:`plan_chunks`."""
    T = int(energy.numel())
    if T == 0 or options.pause_seconds <= 0:
        return plan_chunks(T, options)
    level = torch.quantile(energy.float(), 0.95)
    quiet = (energy < level - options.pause_db / 10.0 * math.log(10.0)).tolist()
    shortest = max(1, int(round(options.pause_seconds / FEATURE_SHIFT_S)))
    pauses, t = [], 0  # [start, end) runs of quiet frames at least `shortest` long
    while t < T:
        if quiet[t]:
            end = t
            while end < T and quiet[end]:
                end += 1
            if end - t >= shortest:
                pauses.append((t, end))
            t = end
        else:
            t += 1
    # a segment starts at its first loud frame moved on (not back) to the encoder grid, so it holds no pause: a model
    # trained on utterances cut tight (the embedded corpus') decoded 5 minutes of them at 8.49 % WER so, 9.10 % with
    # the start moved back (up to 3 frames of pause), and 1 minute at 11.8 % with 0.1 s of pause each side, against
    # 8.12 and 2.96 % for the utterances alone
    middles = [-math.inf] + [(a + b) / 2 * FEATURE_SHIFT_S for a, b in pauses] + [math.inf]
    ends = [0] + [b for _, b in pauses]  # speech runs from the end of one pause to the start of the next
    starts = [a for a, _ in pauses] + [T]
    chunks = []
    for k, (a, b) in enumerate(zip(ends, starts)):
        if b <= a:  # a pause at the very start or end
            continue
        start = -(-a // SUBSAMPLING_FACTOR) * SUBSAMPLING_FACTOR
        if start >= b:  # a burst shorter than the grid
            continue
        offset = start * FEATURE_SHIFT_S
        for c in plan_chunks(b - start, options):
            chunks.append(Chunk(start + c.start, start + c.end, max(middles[k], c.own_start + offset),
                                min(middles[k + 1], c.own_end + offset)))
    if not chunks:  # nothing but pause
        return plan_chunks(T, options)
    # the first and last segments own the pauses before and after them (as plan_chunks' first and last chunks)
    chunks[0] = dataclasses.replace(chunks[0], own_start=-math.inf)
    chunks[-1] = dataclasses.replace(chunks[-1], own_end=math.inf)
    return chunks


class _Features:
    """Feature frames of a (T, F) tensor or, read chunk by chunk from its audio, of a lhotse cut or recording."""

    def __init__(self, source: Any):
        self.tensor = source if isinstance(source, torch.Tensor) else None
        if self.tensor is None and not getattr(source, "has_recording", True) and getattr(source, "has_features", False):
            self.tensor = torch.from_numpy(source.load_features())  # a cut with features and no audio
        if self.tensor is not None:
            if self.tensor.dim() != 2:
                raise ValueError(f"features must be (T, F), got shape {tuple(self.tensor.shape)}")
            self.num_frames = self.tensor.size(0)
            return
        if not hasattr(source, "load_audio") or not hasattr(source, "duration"):
            raise TypeError(f"decode_long takes (T, F) features or a lhotse Cut / Recording, got {type(source)}")
        from lhotse.utils import compute_num_frames

        from asrprec.data.features import fbank_extractor

        self.source = source if source.sampling_rate == SAMPLE_RATE else source.resample(SAMPLE_RATE)
        self.num_frames = compute_num_frames(source.duration, FEATURE_SHIFT_S, SAMPLE_RATE)
        self.extractor = fbank_extractor()

    def __call__(self, start: int, end: int) -> torch.Tensor:
        """(end - start, F) float32 frames."""
        if self.tensor is not None:
            return self.tensor[start:end].float()
        from asrprec.precision import fp32_island

        offset, duration = start * FEATURE_SHIFT_S, (end - start) * FEATURE_SHIFT_S
        src = self.source
        if hasattr(src, "truncate"):  # a cut
            audio = src.truncate(offset=offset, duration=min(duration, src.duration - offset)).load_audio()
        else:
            audio = src.load_audio(offset=offset, duration=min(duration, src.duration - offset))
        with fp32_island():
            feats = torch.as_tensor(self.extractor.extract(audio, SAMPLE_RATE)).float()
        if feats.size(0) < end - start:  # the audio ends inside the last frame
            feats = torch.cat([feats, feats[-1:].expand(end - start - feats.size(0), -1)])
        return feats[: end - start]


@torch.no_grad()
def decode_long(model: nn.Module, source: Any, tokenizer: Any, options: LongFormOptions | None = None,
                search: DecodingOptions | None = None) -> list[WordSpan]:
    """Decode one recording of any length into its words, timed in the recording.

    Args:
        model: a transducer and / or CTC model in eval mode (``encode``, the search's head).
        source: (T, F) float features at 10 ms, or a lhotse ``Cut`` / ``Recording`` (16 kHz, or resampled to it;
            its audio is read and turned into fbank one chunk at a time).
        tokenizer: anything with ``id_to_piece(int) -> str`` (:class:`asrprec.tokenizer.Tokenizer`).
        options: the chunking. search: the decoding method (default greedy search), any method the model has a
            head for (:class:`~asrprec.decoding.api.Searcher`).
    Returns:
        The recording's :class:`~asrprec.timestamps.WordSpan` (seconds from its start) ordered by start,
        none ending after the next starts, all inside the recording (module docstring).
    """
    options = options or LongFormOptions()
    search = search or DecodingOptions()
    feats = _Features(source)
    if options.pause_seconds > 0:  # a first pass for the frames' energy, a chunk at a time
        step = max(SUBSAMPLING_FACTOR, int(round(options.chunk_seconds / FEATURE_SHIFT_S)))
        energy = torch.cat([frame_energy(feats(a, min(feats.num_frames, a + step)))
                            for a in range(0, feats.num_frames, step)] or [torch.zeros(0)])
        chunks = plan_segments(energy, options)
    else:
        chunks = plan_chunks(feats.num_frames, options)
    device = model_device(model)
    searcher = Searcher(model, search)  # refuses a method the model has no head for, before any audio is read
    min_frames = int(getattr(model, "min_input_frames", 1))
    kept: list[TokenWord] = []  # in recording frames
    num_out = 0
    for i in range(0, len(chunks), options.chunks_per_batch):
        batch = [c for c in chunks[i: i + options.chunks_per_batch] if c.end - c.start >= min_frames]
        if not batch:
            continue
        x = torch.nn.utils.rnn.pad_sequence([feats(c.start, c.end) for c in batch], batch_first=True).to(device)
        x_lens = torch.tensor([c.end - c.start for c in batch], dtype=torch.int64, device=device)
        encoder_out, encoder_out_lens = model.encode(x, x_lens)
        found = searcher(encoder_out, encoder_out_lens, return_timestamps=True)
        for c, r, n in zip(batch, found, encoder_out_lens.tolist()):
            shift = c.start // SUBSAMPLING_FACTOR
            num_out = max(num_out, shift + n)
            own = token_words([tokenizer.id_to_piece(int(t)) for t in r.tokens], r.frames, r.durations)
            # token_words gives words in order of start, so finish_words keeps them aligned with their spans
            spans = finish_words(own, num_frames=n, offset=c.start * FEATURE_SHIFT_S, extend_frames=EXTEND_FRAMES)
            kept += [w.shifted(shift, limit=n) for w, s in zip(own, spans) if c.own_start <= s.centre < c.own_end]
    end_s = feats.num_frames * FEATURE_SHIFT_S
    return [WordSpan(w.word, min(w.start, end_s), min(w.end, end_s))
            for w in finish_words(kept, num_frames=num_out, extend_frames=EXTEND_FRAMES)]


def decode_long_cuts(model: nn.Module, cuts: Iterable[Any], tokenizer: Any, options: LongFormOptions | None = None,
                     search: DecodingOptions | None = None) -> tuple[list[tuple[str, list[str], list[str]]],
                                                                     list[tuple[str, list[WordSpan]]], dict]:
    """Decode each cut (any length) from its audio by :func:`decode_long`.

    Returns ``(results, words, stats)``: ``(cut_id, ref_words, hyp_words)`` per cut for :mod:`asrprec.metrics`
    (the reference: its supervisions' texts in order), ``(cut_id, WordSpans)`` per cut for
    :func:`~asrprec.timestamps.write_ctm` (times from the cut's start), and ``{"audio_seconds",
    "wall_seconds", "rtfx"}``.
    """
    results, words, audio_s = [], [], 0.0
    start = time.perf_counter()
    for cut in cuts:
        spans = decode_long(model, cut, tokenizer, options, search)
        ref = " ".join(s.text or "" for s in sorted(cut.supervisions, key=lambda s: s.start)).split()
        results.append((cut.id, ref, [w.word for w in spans]))
        words.append((cut.id, spans))
        audio_s += cut.duration
    wall = time.perf_counter() - start
    return results, words, {"audio_seconds": audio_s, "wall_seconds": wall, "rtfx": audio_s / wall if wall else 0.0}
