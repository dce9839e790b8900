"""Export a model's CTC head to the one ONNX file sherpa-onnx's zipformer CTC recognisers run, ``model.onnx``, with
``tokens.txt``: offline (``OfflineRecognizer.from_zipformer_ctc``) or streaming
(``OnlineRecognizer.from_zipformer2_ctc``).

The contract is sherpa-onnx's (k2-fsa/sherpa-onnx): offline, ``sherpa-onnx/csrc/offline-zipformer-ctc-model.cc`` feeds
``x`` (N, T, 80) and ``x_lens`` (N,) int64 by position and reads V from the static last axis of output 0; its decoder
(``offline-ctc-greedy-search-decoder.cc``) takes output 0 as (N, T', V) log-probabilities and output 1 as (N,) int64
lengths, and ``offline-recognizer-ctc-impl.h`` finds the blank as the token ``<blk>`` of tokens.txt. Streaming,
``online-zipformer2-ctc-model.cc`` reads the same encoder metadata and states as the streaming transducer
(:class:`asrprec.export.StreamingLayout`), and output 0 is (N, chunk/2, V) log-probabilities followed by the new
states. Names and metadata follow icefall's exports (k2-fsa/icefall
``egs/librispeech/ASR/zipformer/export-onnx-ctc.py``, ``export-onnx-streaming-ctc.py``: ``log_probs``,
``log_probs_len``, ``model_type`` ``zipformer2_ctc`` offline).

A hybrid (transducer + CTC) model writes ``model.onnx`` next to its transducer's ``encoder.onnx`` ... in the same
folder, sharing ``tokens.txt``.

Legend: N utterances (streams), T feature frames, T' encoder frames, D_enc encoder width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor, nn

from asrprec.atomic import atomic_write

from .exporter import (
    EXPORT_VERSION, _check_offline_chunking, _dim, _ensure_metadata, _EXAMPLE_BATCH, _export_graph, _MAX_BATCH,
    _num_features, _prepare, export_streaming_step, write_tokens,
)
from .wrappers import OfflineEncoder, StreamingEncoder, StreamingLayout, encoder_family

CTC_MODEL_NAME = "model.onnx"


@dataclasses.dataclass(frozen=True)
class ExportedCtcModel:
    """The files of one CTC export: ``model`` (``model.onnx``) and ``tokens``; ``streaming``: a streaming step for
    ``OnlineRecognizer.from_zipformer2_ctc`` rather than a whole-utterance model for ``from_zipformer_ctc``."""

    model: Path
    tokens: Path
    streaming: bool

    def variant(self, suffix: str) -> "ExportedCtcModel":
        """The same export's ``model.<suffix>.onnx`` (``"int8"``, ``"fp16"``); tokens.txt is shared."""
        return dataclasses.replace(self, model=self.model.with_name(f"{self.model.name.split('.')[0]}.{suffix}.onnx"))


class CtcLogProbs(nn.Module):
    """``encoder_out (N, T', D_enc) -> log_probs (N, T', V)``: the CTC head (eval mode: its dropout is the identity)
    and the log-softmax, as ``Transducer.ctc_log_probs`` computes them for an fp32 model."""

    def __init__(self, model: nn.Module):
        super().__init__()
        if not getattr(model, "use_ctc", False):
            raise ValueError("this model has no CTC head (it was trained without --use-ctc); export its transducer "
                             "(without --ctc)")
        self.ctc_output = model.ctc_output

    def forward(self, encoder_out: Tensor) -> Tensor:
        return self.ctc_output(encoder_out).float().log_softmax(dim=-1)


def _metadata(model: nn.Module, kind: str) -> dict[str, str]:
    return {"version": str(EXPORT_VERSION), "model_author": "asrprec",
            "comment": f"asrprec {encoder_family(model)} CTC head, {kind}", "vocab_size": str(model.vocab_size)}


def _check_ctc(model: nn.Module) -> None:
    CtcLogProbs(model)  # raises for a model without a CTC head
    if encoder_family(model) != "zipformer":
        raise ValueError("sherpa-onnx runs CTC models of a Zipformer (its zipformer CTC recognisers); this model's "
                         "encoder is a Conformer: decode its CTC head with asrprec instead")
    if model.blank_id != 0:
        raise ValueError(f"the blank is token {model.blank_id}; tokens.txt names id 0 <blk> (the tokenizer's "
                         "layout), so export a model trained with blank_id=0")


def export_ctc_offline(model: nn.Module, tokenizer: Any, out_dir: Path | str, *, chunk_size: int = -1,
                       left_context_frames: int = -1, opset: Optional[int] = None) -> ExportedCtcModel:
    """Export a Zipformer's CTC head for sherpa-onnx's ``OfflineRecognizer.from_zipformer_ctc``.

    ``model.onnx``: ``x`` (N, T, 80) float32, ``x_lens`` (N,) int64 -> ``log_probs`` (N, T', V) float32 (V static),
    ``log_probs_len`` (N,) int64; N and T dynamic; metadata ``model_type`` = ``zipformer2_ctc``. A causal Zipformer
    runs at ``chunk_size`` / ``left_context_frames`` (simulated streaming; -1 = full context). Writes tokens.txt.

    Raises ValueError for a model without a CTC head, a Conformer, or chunking the model was not trained with.
    """
    model = _prepare(model)
    _check_ctc(model)
    _check_offline_chunking(model, chunk_size, left_context_frames)
    out_dir = Path(out_dir)
    n = _dim("N", min=1, max=_MAX_BATCH)
    # the shortest input torch.export traces as a general length (see export_offline)
    t = _dim("T", min=2 * max(max(model.encoder.encoder.downsampling_factor) + 1, 3) + 7)
    frames = 203
    x = torch.randn(_EXAMPLE_BATCH, frames, _num_features(model))
    x_lens = torch.tensor([frames, frames - 40], dtype=torch.int64)
    meta = {**_metadata(model, "offline"), "model_type": "zipformer2_ctc"}
    if model.encoder.encoder.causal:
        meta.update(chunk_size=str(chunk_size), left_context_frames=str(left_context_frames))
    path = _export_graph(
        OfflineEncoder(model, chunk_size, left_context_frames, head=CtcLogProbs(model)), (x, x_lens),
        out_dir / CTC_MODEL_NAME, ["x", "x_lens"], ["log_probs", "log_probs_len"], ({0: n, 1: t}, {0: n}),
        [{0: "N", 1: "T"}, {0: "N"}], meta, opset)
    tokens = write_tokens(tokenizer, out_dir / "tokens.txt", model.vocab_size)
    return ExportedCtcModel(path, tokens, streaming=False)


def export_ctc_streaming(model: nn.Module, tokenizer: Any, out_dir: Path | str, *, chunk_size: int,
                         left_context_frames: int, opset: Optional[int] = None) -> ExportedCtcModel:
    """Export a causal Zipformer's CTC head for sherpa-onnx's ``OnlineRecognizer.from_zipformer2_ctc``.

    ``model.onnx`` is one streaming step: ``x`` (N, T, 80) with T = 2 x ``chunk_size`` + the front-end's lookahead,
    then the states of :meth:`StreamingLayout.init_states` -> ``log_probs`` (N, ``chunk_size``/2, V), then the new
    states; the encoder metadata of :meth:`StreamingLayout.metadata` (``model_type`` = ``zipformer2``, as icefall's
    streaming CTC export). Writes tokens.txt.

    Raises ValueError for a model without a CTC head, one that is not a causal Zipformer, or a chunk size / left
    context it was not trained with.
    """
    model = _prepare(model)
    _check_ctc(model)
    out_dir = Path(out_dir)
    layout = StreamingLayout.of(model, chunk_size, left_context_frames)
    path = export_streaming_step(model, layout, StreamingEncoder(model, layout, head=CtcLogProbs(model)),
                                 out_dir / CTC_MODEL_NAME, "log_probs", _metadata(model, "streaming"), opset)
    tokens = write_tokens(tokenizer, out_dir / "tokens.txt", model.vocab_size)
    return ExportedCtcModel(path, tokens, streaming=True)


def quantize_ctc_int8(exported: ExportedCtcModel) -> ExportedCtcModel:
    """int8 variant ``model.int8.onnx``: the weight matrices quantised as :func:`asrprec.export.quantize_int8` does
    for a transducer's encoder (icefall quantises its CTC model's MatMuls the same way); the metadata is kept."""
    from .exporter import _quantize_file_int8

    out = exported.variant("int8")
    _quantize_file_int8(exported.model, out.model, ["MatMul"])
    _ensure_metadata(exported.model, out.model)
    return out


def convert_ctc_fp16(exported: ExportedCtcModel) -> ExportedCtcModel:
    """fp16 variant ``model.fp16.onnx`` (float32 inputs and outputs), as :func:`asrprec.export.convert_fp16`."""
    from asrprec._optional import require

    onnx = require("onnx")
    require("onnxruntime")
    from onnxruntime.transformers.float16 import convert_float_to_float16

    out = exported.variant("fp16")
    model = convert_float_to_float16(onnx.load(str(exported.model)), keep_io_types=True)
    atomic_write(out.model, lambda f: onnx.save(model, f))
    _ensure_metadata(exported.model, out.model)
    return out
