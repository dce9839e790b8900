"""Streaming decoding: a causal Zipformer encodes chunk by chunk with its caches, and greedy search or modified
beam search carries its hypotheses from one chunk to the next.

icefall decodes streaming models with ``egs/librispeech/ASR/zipformer/streaming_decode.py`` (a pool of streams,
each with its own encoder and decoder state); this module does the same work for a batch of utterances that
start together, which gives each utterance the same result as decoding it alone.

Legend: B streams (utterances), C chunk size (50 Hz frames), T' encoder frames (25 Hz), D_enc encoder width,
J joiner width, F feature bins.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ._common import check_inputs, model_device
from .api import CTC_METHODS, DecodingOptions, check_method
from .beam_search import beam_search_step
from .ctc import StreamingCtcGreedySearch, StreamingCtcPrefixBeamSearch
from .hypothesis import DecodingResult, Hypothesis, HypothesisList, results_of


class StreamingGreedySearch:
    """Greedy search fed encoder output a chunk at a time; :attr:`hyps` is the partial result after each chunk,
    :attr:`timestamps` the frame of each token counted from the start of its stream (:meth:`results`).

    Same decisions as :func:`asrprec.decoding.greedy_search` over the concatenated chunks (greedy search only
    looks at the current frame and the emitted tokens), written per frame without the length sort, so a test
    can check one against the other.
    """

    def __init__(self, model: nn.Module, batch_size: int, max_sym_per_frame: int = 1):
        if not isinstance(max_sym_per_frame, int) or max_sym_per_frame < 1:
            raise ValueError(f"max_sym_per_frame must be an integer >= 1, got {max_sym_per_frame!r}")
        self.model = model
        self.max_sym_per_frame = max_sym_per_frame
        self.blank = model.blank_id
        self.device = model_device(model)
        self.hyps: list[list[int]] = [[] for _ in range(batch_size)]
        self.timestamps: list[list[int]] = [[] for _ in range(batch_size)]
        self.frames = [0] * batch_size  # frames consumed per stream
        self.contexts = torch.full((batch_size, model.context_size), self.blank, dtype=torch.int64,
                                   device=self.device)
        self.dec = model.project_decoder(self.contexts) if batch_size else None  # (B, J)

    @torch.no_grad()
    def accept(self, encoder_out: torch.Tensor, encoder_out_lens: torch.Tensor) -> None:
        """Consume the next chunk: encoder_out (B, T', D_enc), encoder_out_lens (B,) valid frames of it
        (0 for a stream that has ended)."""
        check_inputs(encoder_out, encoder_out_lens)
        if encoder_out.shape[0] != len(self.hyps):
            raise ValueError(f"this search has {len(self.hyps)} streams, got a chunk of {encoder_out.shape[0]}")
        enc = self.model.project_encoder(encoder_out)  # (B, T', J)
        lens = encoder_out_lens.to(self.device)
        for t in range(encoder_out.shape[1]):
            rows = torch.nonzero(lens > t).squeeze(1)
            for _ in range(self.max_sym_per_frame):
                if rows.numel() == 0:
                    break
                tokens = self.model.join_projected(enc[rows, t], self.dec[rows]).argmax(dim=-1)
                emitted = tokens != self.blank
                rows, tokens = rows[emitted], tokens[emitted]
                if rows.numel() == 0:
                    break
                for r, k in zip(rows.tolist(), tokens.tolist()):
                    self.hyps[r].append(k)
                    self.timestamps[r].append(self.frames[r] + t)
                self.contexts[rows] = torch.cat([self.contexts[rows, 1:], tokens[:, None]], dim=1)
                self.dec[rows] = self.model.project_decoder(self.contexts[rows])
        self.frames = [f + n for f, n in zip(self.frames, lens.tolist())]

    def results(self) -> list[DecodingResult]:
        """Each stream's tokens so far with their frames."""
        return results_of(self.hyps, self.timestamps)


class StreamingModifiedBeamSearch:
    """Modified beam search fed encoder output a chunk at a time; :meth:`best` gives the partial (or, after the
    last chunk, final) result. Frame by frame it runs the same step as
    :func:`asrprec.decoding.modified_beam_search`, on the streams that have a frame left in the chunk; token
    timestamps count frames from the start of each stream."""

    def __init__(self, model: nn.Module, batch_size: int, beam: int = 4, length_norm: bool = True):
        if not isinstance(beam, int) or beam < 1:
            raise ValueError(f"beam must be an integer >= 1, got {beam!r}")
        self.model, self.beam, self.length_norm = model, beam, length_norm
        self.beams = [HypothesisList([Hypothesis()]) for _ in range(batch_size)]
        self.frames = [0] * batch_size  # frames consumed per stream

    @torch.no_grad()
    def accept(self, encoder_out: torch.Tensor, encoder_out_lens: torch.Tensor) -> None:
        """Consume the next chunk: encoder_out (B, T', D_enc), encoder_out_lens (B,) valid frames of it."""
        check_inputs(encoder_out, encoder_out_lens)
        if encoder_out.shape[0] != len(self.beams):
            raise ValueError(f"this search has {len(self.beams)} streams, got a chunk of {encoder_out.shape[0]}")
        enc = self.model.project_encoder(encoder_out)  # (B, T', J)
        lens = encoder_out_lens.tolist()
        for t in range(encoder_out.shape[1]):
            rows = [r for r, n in enumerate(lens) if n > t]
            if not rows:
                break
            new = beam_search_step(self.model, enc[rows, t], [self.beams[r] for r in rows],
                                   [self.frames[r] + t for r in rows], self.beam)
            for r, b in zip(rows, new):
                self.beams[r] = b
        self.frames = [f + n for f, n in zip(self.frames, lens)]

    def best(self) -> list[list[int]]:
        """The best token sequence of each stream so far (length-normalised score unless ``length_norm=False``)."""
        return [list(r.tokens) for r in self.results()]

    def results(self) -> list[DecodingResult]:
        """The best hypothesis of each stream so far with its frames and score."""
        c = self.model.context_size
        return [b.get_most_probable(length_norm=self.length_norm, context_size=c).result() for b in self.beams]


@torch.no_grad()
def streaming_encode(
    model: nn.Module,
    features: torch.Tensor,
    feature_lens: torch.Tensor,
    chunk_size: int,
    left_context_frames: int,
    on_chunk: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None,
    whole_chunks_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a causal Zipformer transducer's encoder chunk by chunk, as a live stream would.

    By default each utterance ends where its features end: the last chunk runs with the frames past the end
    masked. ``whole_chunks_only`` ends it as sherpa-onnx does instead: a chunk runs only while more than
    ``2C + lookahead`` frames are left past the processed ones, and the rest is never decoded
    (k2-fsa/sherpa-onnx ``sherpa-onnx/csrc/online-recognizer-transducer-impl.h``); its clients therefore append
    silence to the audio (0.66 s in ``python-api-examples/online-decode-files.py``), which the features given here
    must then hold too.

    Args:
        model: a transducer whose ``encoder`` has ``streaming_forward`` (``build_transducer(encoder="zipformer",
            encoder_overrides={"causal": True})``), in eval mode, any precision.
        features: (B, T, F) features; feature_lens: (B,) valid frames.
        chunk_size: C, 50 Hz frames per chunk (even; a multiple of every stack's downsampling factor).
        left_context_frames: cached 50 Hz frames (rounded down to whole chunks, as in simulated streaming).
        on_chunk: called with each chunk's (B, C/2, D_enc) output and its (B,) valid frames, as they come.
    Returns:
        encoder_out (B, T', D_enc) and encoder_out_lens (B,): equal to ``model.encode`` of the model configured
        for the same chunk size and left context (simulated streaming), up to rounding.
    """
    encoder = model.encoder
    if not hasattr(encoder, "streaming_forward"):
        raise ValueError(f"{type(encoder).__name__} cannot stream; streaming needs a causal Zipformer encoder")
    if features.dim() != 3 or feature_lens.shape != (features.shape[0],):
        raise ValueError(f"features must be (B, T, F) and feature_lens (B,), got {tuple(features.shape)} and "
                         f"{tuple(feature_lens.shape)}")
    b, t, _ = features.shape
    states = encoder.get_init_states(b, chunk_size, left_context_frames)
    dtype = states[0].dtype
    step, lookahead = 2 * chunk_size, encoder.streaming_lookahead
    padded = F.pad(features.to(dtype), (0, 0, 0, step + lookahead))
    feature_lens = feature_lens.to(features.device)
    outs, out_lens = [], torch.zeros(b, dtype=torch.int64, device=features.device)
    # a chunk is run while some utterance still has output frames in it: (L - 7) // 2 frames at 50 Hz
    n_out = torch.div(feature_lens - 7, 2, rounding_mode="floor")
    for start in range(0, max(int(n_out.max()), 0) * 2 if b else 0, step):
        valid = feature_lens - start
        if whole_chunks_only:
            # a stream without more than a whole chunk of frames left has ended
            valid = torch.where(valid > step + lookahead, torch.full_like(valid, step + lookahead),
                                torch.zeros_like(valid))
            if not bool((valid > 0).any()):
                break
        out, lens, states = encoder.streaming_forward(padded[:, start: start + step + lookahead], valid, states)
        lens = lens.clamp(min=0)
        if on_chunk is not None:
            on_chunk(out, lens)
        outs.append(out)
        out_lens += lens
    if not outs:
        raise ValueError("every utterance is shorter than 9 feature frames; nothing to encode")
    return torch.cat(outs, dim=1), out_lens


@torch.no_grad()
def streaming_decode(
    model: nn.Module,
    features: torch.Tensor,
    feature_lens: torch.Tensor,
    options: DecodingOptions | None,
    chunk_size: int,
    left_context_frames: int,
    whole_chunks_only: bool = False,
) -> list[list[int]]:
    """Decode a batch as live streams: :func:`streaming_encode` (``whole_chunks_only`` as there), with the search
    named in ``options`` (:class:`StreamingGreedySearch` or :class:`StreamingModifiedBeamSearch`; default greedy
    search; for the CTC methods :class:`asrprec.decoding.StreamingCtcGreedySearch` or
    :class:`asrprec.decoding.StreamingCtcPrefixBeamSearch` on each chunk's ``model.ctc_log_probs``) advancing after
    every chunk. Returns B token-id lists in the input order."""
    options = options or DecodingOptions()
    b = features.shape[0]
    check_method(model, options.method)
    if options.method == "malsd_batch":
        raise ValueError("malsd_batch decodes whole utterances; fix: stream with modified_beam_search, or decode "
                         "without --streaming")
    if options.method in CTC_METHODS:
        if options.method == "ctc_greedy_search":
            ctc = StreamingCtcGreedySearch(b, model.blank_id)
        else:
            ctc = StreamingCtcPrefixBeamSearch(b, options.beam, model.blank_id, device=features.device)
        streaming_encode(model, features, feature_lens, chunk_size, left_context_frames,
                         on_chunk=lambda out, lens: ctc.accept(model.ctc_log_probs(out), lens),
                         whole_chunks_only=whole_chunks_only)
        return ctc.hyps if options.method == "ctc_greedy_search" else ctc.best()
    if options.method == "greedy_search":
        from .tdt import StreamingTdtGreedySearch, is_tdt

        greedy = StreamingTdtGreedySearch if is_tdt(model) else StreamingGreedySearch
        search = greedy(model, b, options.max_sym_per_frame)
        streaming_encode(model, features, feature_lens, chunk_size, left_context_frames, on_chunk=search.accept,
                         whole_chunks_only=whole_chunks_only)
        return search.hyps
    if getattr(getattr(model, "joiner", None), "durations", ()):
        raise ValueError("chunk-by-chunk modified_beam_search is not implemented for TDT models; decode a TDT model "
                         "with --streaming using greedy_search, or use modified_beam_search without --streaming "
                         "(simulated streaming)")
    beam = StreamingModifiedBeamSearch(model, b, options.beam, options.length_norm)
    streaming_encode(model, features, feature_lens, chunk_size, left_context_frames, on_chunk=beam.accept,
                     whole_chunks_only=whole_chunks_only)
    return beam.best()
