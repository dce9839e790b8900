"""Decode a whole dataloader: token ids → words, references, and the real-time factor."""

from __future__ import annotations

import logging
from typing import Callable, Iterable

import torch
from torch import nn

from asrprec.data.frames import FRAME_SHIFT_S
from asrprec.metrics import RtfxMeter

from .api import DecodingOptions, Searcher
from .fusion import Fusion
from .hypothesis import DecodingResult
from .streaming import streaming_decode

log = logging.getLogger(__name__)


@torch.inference_mode()
def decode_dataset(
    model: nn.Module, loader: Iterable[dict], tokenizer, options: DecodingOptions | None,
    device: torch.device | str = "cpu",
    streaming: tuple[int, int] | None = None,
    search: Callable[[torch.Tensor, torch.Tensor], list[list[int]]] | None = None,
    whole_chunks_only: bool = False,
    fusion: Fusion | None = None,
    on_results: Callable[[list[str], list[DecodingResult]], None] | None = None,
) -> tuple[list[tuple[str, list[str], list[str]]], dict[str, float]]:
    """Decode every batch of ``loader`` (dicts with ``features``, ``feature_lens``, ``texts``, ``cut_ids``).

    ``streaming=(chunk_size, left_context_frames)`` decodes a causal Zipformer chunk by chunk with its caches
    (:func:`asrprec.decoding.streaming_decode`) instead of encoding whole utterances; ``whole_chunks_only`` ends
    each stream at its last whole chunk, as sherpa-onnx does (see :func:`asrprec.decoding.streaming_encode`).
    Whole utterances go through one :class:`asrprec.decoding.Searcher` of ``options`` for the whole loader (label
    looping keeps its state across batches); ``search``, called as ``search(encoder_out (B, T, D_enc),
    encoder_out_lens (B,))`` after ``model.encode``, replaces it. ``fusion`` adds LM / LODR / phrase bonuses
    (:mod:`asrprec.decoding.fusion`), each batch's utterances with their own phrases (by cut id); not with
    ``streaming``. ``on_results(cut_ids, results)`` receives each batch's :class:`~asrprec.decoding.DecodingResult`
    (token frames; ``search`` must then be a :class:`~asrprec.decoding.Searcher`).

    Cuts the loader could not read (named in a batch's ``dropped_cuts``) are left out of the results, logged, and
    counted in ``stats["unreadable_cuts"]``.

    Returns:
        results: ``(cut_id, ref_words, hyp_words)`` per utterance, ready for :mod:`asrprec.metrics`.
        stats: ``audio_seconds``, ``wall_seconds`` and ``rtfx`` (audio seconds per wall second, including
        the encoder and the search, excluding data loading), ``unreadable_cuts``.
    """
    if fusion is not None and streaming is not None:
        raise ValueError("language models and hot phrases are not supported in streaming decoding; fix: decode "
                         "without --streaming (a causal model decodes whole utterances with --chunk-size)")
    if streaming is None and search is None:
        search = Searcher(model, options)
    timed = {"return_timestamps": True} if on_results is not None else {}
    meter = RtfxMeter()
    results = []
    unreadable = 0
    for batch in loader:
        for d in batch.get("dropped_cuts", []):
            unreadable += 1
            log.warning("cut %s not decoded: %s", d["cut_id"], d["reason"])
        if batch["features"].shape[0] == 0:
            continue
        features = batch["features"].to(device)
        feature_lens = batch["feature_lens"].to(device)
        with meter.measure(audio_seconds=float(batch["feature_lens"].sum()) * FRAME_SHIFT_S):
            batch_fusion = fusion.for_batch(batch["cut_ids"]) if fusion is not None else None
            if streaming is None:
                extra = {"fusion": batch_fusion} if batch_fusion is not None else {}
                hyps = search(*model.encode(features, feature_lens), **extra, **timed)
            else:
                hyps = streaming_decode(model, features, feature_lens, options, *streaming,
                                        whole_chunks_only=whole_chunks_only, **timed)
        if on_results is not None:
            on_results(list(batch["cut_ids"]), hyps)
            hyps = [list(r.tokens) for r in hyps]
        for cut_id, ref, hyp in zip(batch["cut_ids"], batch["texts"], hyps):
            results.append((cut_id, ref.split(), tokenizer.decode(hyp).split()))
    return results, {"audio_seconds": meter.audio_seconds, "wall_seconds": meter.wall_seconds, "rtfx": meter.rtfx,
                     "unreadable_cuts": unreadable}
