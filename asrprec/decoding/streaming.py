"""Streaming decoding: a causal Zipformer encodes chunk by chunk with its caches, and a chunk search (greedy or
modified beam search, TDT greedy, CTC; each beside its whole-utterance twin) carries its hypotheses from one chunk to
the next.

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

from .api import DecodingOptions
from .beam_search import StreamingModifiedBeamSearch
from .greedy import StreamingGreedySearch
from .hypothesis import DecodingResult
from .methods import select_search

__all__ = ["StreamingGreedySearch", "StreamingModifiedBeamSearch", "streaming_decode", "streaming_encode"]


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
    *,
    return_timestamps: bool = False,
) -> list[list[int]] | list[DecodingResult]:
    """Decode a batch as live streams: :func:`streaming_encode` (``whole_chunks_only`` as there), with the chunk search
    that the table of :mod:`asrprec.decoding.methods` gives for the method named in ``options`` (default greedy
    search) advancing after every chunk. Returns B token-id lists in the input order, or with ``return_timestamps``
    B :class:`~asrprec.decoding.DecodingResult` (frames counted from each stream's start). A method without a
    chunk-by-chunk form raises ValueError naming those the model has."""
    options = options or DecodingOptions()
    entry = select_search(model, options.method, streaming=True)
    search = entry.make(model, options.for_head(entry.head), features.shape[0], features.device)
    streaming_encode(model, features, feature_lens, chunk_size, left_context_frames, on_chunk=search.accept,
                     whole_chunks_only=whole_chunks_only)
    results = search.results()
    return results if return_timestamps else [list(r.tokens) for r in results]
