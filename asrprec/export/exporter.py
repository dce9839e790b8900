"""Export a transducer to the ONNX files sherpa-onnx loads: ``encoder.onnx``, ``decoder.onnx``, ``joiner.onnx`` and
``tokens.txt``, offline or streaming, with optional int8 and fp16 variants.

The contract (inputs and outputs matched by position, their dtypes, the metadata keys, the streaming state layout)
is sherpa-onnx's: k2-fsa/sherpa-onnx ``sherpa-onnx/csrc/offline-transducer-model.cc`` (offline graphs, decoder
``vocab_size`` / ``context_size``), ``online-zipformer2-transducer-model.cc`` (streaming metadata and states),
``offline-recognizer-impl.cc`` (encoder ``model_type``) and ``symbol-table.cc`` (tokens.txt). Names follow icefall's
exports (k2-fsa/icefall ``egs/librispeech/ASR/zipformer/export-onnx.py``, ``export-onnx-streaming.py``), which
also quantise to int8 with onnxruntime's dynamic quantisation.

Graphs are traced with ``torch.export`` (symbolic shapes: the batch and time axes stay dynamic without baking the
example's lengths into the arithmetic) and translated by ``torch.onnx.export(dynamo=True)``; weights are stored
inside each file.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import torch
from torch import nn

from asrprec._optional import require
from asrprec.atomic import atomic_write, atomic_write_text

from .wrappers import JoinerHead, OfflineEncoder, ProjectedDecoder, StreamingEncoder, StreamingLayout, encoder_family

log = logging.getLogger(__name__)

#: Why a TDT export cannot run in sherpa-onnx. sherpa-onnx decodes TDT only through its NeMo transducer path
#: (k2-fsa/sherpa-onnx ``sherpa-onnx/csrc/offline-recognizer-transducer-nemo-impl.h``,
#: ``offline-transducer-greedy-search-nemo-decoder.cc``, ``offline-transducer-nemo-model.cc``), whose contract differs
#: from asrprec's graphs in five places. Four could be bridged inside the exported graphs: the blank must be the last
#: token (asrprec's is 0: the token order would be permuted), the decoder is NeMo's recurrent one fed one token plus
#: two state tensors (the stateless decoder's last C - 1 tokens would travel in a state), the encoder takes and gives
#: (N, F, T) / (N, D, T) layouts, and the duration is read as the argmax index (durations must be 0, 1, ..., K - 1).
#: The fifth cannot: that path computes its own features, librosa-style mel filterbanks (``is_librosa``, low
#: frequency 0, no DC removal) with NeMo's per-feature normalisation, before any graph runs, while asrprec's models
#: are trained on Kaldi-compatible fbank (lhotse, kaldi-native-fbank in sherpa-onnx's icefall path). sherpa-onnx's
#: icefall transducer path, which computes those features, has no duration head: it would read the duration logits
#: as tokens and never skip a frame.
SHERPA_TDT_REASON = (
    "sherpa-onnx decodes TDT models only through its NeMo transducer path, which computes librosa-style, "
    "per-feature-normalised mel features instead of the Kaldi-compatible fbank asrprec's models are trained on, and "
    "its icefall transducer path has no duration head; decode a TDT export with asrprec.export.load_onnx_model "
    "(onnxruntime) instead, or train the transducer as an RNN-T (--loss pruned) for sherpa-onnx")

#: bumped when the exported graphs or metadata change meaning
EXPORT_VERSION = 1
MIN_TORCH = (2, 6)
# the example batch is 2 (torch.export treats sizes 0 and 1 as special, so 1 would pin the axis)
_EXAMPLE_BATCH = 2
_MAX_BATCH = 4096


@dataclasses.dataclass(frozen=True)
class ExportedModel:
    """The files of one export. ``streaming``: the encoder is a streaming step (sherpa-onnx ``OnlineRecognizer``)
    rather than a whole-utterance encoder (``OfflineRecognizer``)."""

    encoder: Path
    decoder: Path
    joiner: Path
    tokens: Path
    streaming: bool

    def variant(self, suffix: str) -> "ExportedModel":
        """The same export's ``encoder.<suffix>.onnx`` etc. (``"int8"``, ``"fp16"``); tokens.txt is shared."""
        def name(p: Path) -> Path:
            return p.with_name(f"{p.name.split('.')[0]}.{suffix}.onnx")

        return dataclasses.replace(self, encoder=name(self.encoder), decoder=name(self.decoder),
                                   joiner=name(self.joiner))


def _check_torch() -> None:
    version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    if version < MIN_TORCH:
        raise RuntimeError(f"ONNX export needs torch >= {'.'.join(map(str, MIN_TORCH))} (torch.export with dynamic "
                           f"shapes and torch.onnx.export(dynamo=True)); this is torch {torch.__version__}. Fix: "
                           "upgrade torch (export is tested with torch 2.14)")


def _require_export_packages() -> None:
    for name in ("onnx", "onnxscript"):
        require(name)


def _dim(name: str, **kw: int) -> Any:
    return torch.export.Dim(name, **kw)


def add_metadata(path: Path | str, metadata: Dict[str, str]) -> None:
    """Write ``metadata`` (string keys and values) into the ONNX file's ``metadata_props``, replacing equal keys."""
    onnx = require("onnx")
    model = onnx.load(str(path))
    _set_metadata(model, metadata)
    atomic_write(path, lambda f: onnx.save(model, f))


def _set_metadata(model: Any, metadata: Dict[str, str]) -> None:
    keep = [p for p in model.metadata_props if p.key not in metadata]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    for k, v in metadata.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = str(k), str(v)


def read_metadata(path: Path | str) -> Dict[str, str]:
    """The ``metadata_props`` of an ONNX file as a dict."""
    onnx = require("onnx")
    return {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}


def _rename_dims(model: Any, axis_names: Sequence[Dict[int, str]]) -> None:
    """Name the dynamic axes as icefall does (``N``, ``T``) instead of torch.export's symbols (``s27``), in the
    inputs and in every shape expression of the graph that mentions them."""
    rename: Dict[str, str] = {}
    for value, axes in zip(model.graph.input, axis_names):
        dims = value.type.tensor_type.shape.dim
        for axis, name in axes.items():
            if dims[axis].dim_param:
                rename[dims[axis].dim_param] = name
    if not rename:
        return
    pattern = re.compile(r"\b(" + "|".join(re.escape(k) for k in rename) + r")\b")
    for value in (*model.graph.input, *model.graph.output, *model.graph.value_info):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_param = pattern.sub(lambda m: rename[m.group(1)], dim.dim_param)


def _export_graph(module: nn.Module, args: tuple, path: Path, input_names: Sequence[str],
                  output_names: Sequence[str], dynamic_shapes: Any, axis_names: Sequence[Dict[int, str]],
                  metadata: Dict[str, str], opset: Optional[int]) -> Path:
    _require_export_packages()
    onnx = require("onnx")
    module.eval()
    with torch.no_grad():
        # guards torch.export cannot prove for every length (e.g. "this downsampled length is not 1") become
        # run-time assertions instead of errors; the parity tests check the graph at such lengths
        program = torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False,
                                      prefer_deferred_runtime_asserts_over_guards=True)
        onnx_program = torch.onnx.export(program, (), dynamo=True, external_data=False, opset_version=opset,
                                         input_names=list(input_names), output_names=list(output_names),
                                         verbose=False)
    model = onnx_program.model_proto
    _rename_dims(model, axis_names)
    _set_metadata(model, metadata)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: onnx.save(model, f))
    log.info("wrote %s", path)
    return path


def _common_metadata(model: nn.Module, kind: str) -> Dict[str, str]:
    return {"version": str(EXPORT_VERSION), "model_author": "asrprec",
            "comment": f"asrprec {encoder_family(model)} transducer, {kind}"}


def _num_features(model: nn.Module) -> int:
    enc = model.encoder
    return int(enc.num_features if encoder_family(model) == "zipformer" else enc.config.num_features)


def _check_offline_chunking(model: nn.Module, chunk_size: int, left_context_frames: int) -> None:
    """A causal Zipformer exported offline runs at one trained chunk size and left context (or -1, full context);
    other encoders take no chunking."""
    stacks = getattr(model.encoder, "encoder", None)
    if encoder_family(model) != "zipformer" or not stacks.causal:
        if (chunk_size, left_context_frames) != (-1, -1):
            raise ValueError("--chunk-size/--left-context-frames apply to causal Zipformer models only; this model is "
                             "not causal")
        return
    if chunk_size == -1:
        return
    if chunk_size not in stacks.chunk_size or left_context_frames not in stacks.left_context_frames:
        raise ValueError(f"chunk size {chunk_size} / left context {left_context_frames} were not trained: this model "
                         f"was trained with chunk sizes {list(stacks.chunk_size)} and left contexts "
                         f"{list(stacks.left_context_frames)} (50 Hz frames)")
    cs, lcc = stacks.get_chunk_info(chunk_size, left_context_frames)
    stacks._get_attn_mask(2 * cs, cs, lcc, torch.device("cpu"))  # validates, raises with the reason


def write_tokens(tokenizer: Any, path: Path | str, vocab_size: Optional[int] = None) -> Path:
    """Write sherpa-onnx's tokens.txt: one ``piece id`` line for every id 0 .. V-1 (k2-fsa/sherpa-onnx
    ``sherpa-onnx/csrc/symbol-table.cc``); id 0 must be the blank. ``tokenizer``: an
    :class:`asrprec.tokenizer.Tokenizer` (or anything with ``vocab_size`` and ``id_to_piece``)."""
    n = tokenizer.vocab_size
    if vocab_size is not None and vocab_size != n:
        raise ValueError(f"the tokenizer has {n} tokens but the model's joiner emits {vocab_size}: export with the "
                         "tokenizer the model was trained with (the recipe's --data-dir)")
    lines = []
    for i in range(n):
        piece = tokenizer.id_to_piece(i)
        if not piece or any(c.isspace() for c in piece):
            raise ValueError(f"token {i} ({piece!r}) is empty or holds whitespace; tokens.txt cannot represent it")
        lines.append(f"{piece} {i}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


def _prepare(model: nn.Module) -> nn.Module:
    _check_torch()
    encoder_family(model)  # raises for other encoders
    param = next(model.parameters())
    if param.dtype != torch.float32:
        raise ValueError(f"export from fp32 weights (the model's parameters are {param.dtype}); load the checkpoint "
                         "into an fp32 model: a reduced-precision variant is made from the fp32 export (--fp16)")
    return model.eval()


def _export_decoder_joiner(model: nn.Module, out_dir: Path, opset: Optional[int]) -> tuple[Path, Path]:
    dec, joiner = model.decoder, model.joiner
    n = _dim("N", min=1, max=_MAX_BATCH)
    y = torch.full((_EXAMPLE_BATCH, dec.context_size), dec.blank_id, dtype=torch.int64)
    y[0, 0] = -1  # the example holds sherpa-onnx's start context
    decoder_path = _export_graph(
        ProjectedDecoder(model), (y,), out_dir / "decoder.onnx", ["y"], ["decoder_out"], ({0: n},), [{0: "N"}],
        {**_common_metadata(model, "decoder"), "vocab_size": str(dec.vocab_size),
         "context_size": str(dec.context_size)}, opset)
    j = joiner.joiner_dim
    enc = torch.randn(_EXAMPLE_BATCH, j)
    dout = torch.randn(_EXAMPLE_BATCH, j)
    joiner_meta = {**_common_metadata(model, "joiner"), "joiner_dim": str(j)}
    durations = tuple(getattr(joiner, "durations", ()))
    if durations:  # a TDT joiner: its last len(durations) outputs are duration logits
        joiner_meta["tdt_durations"] = ",".join(str(d) for d in durations)
    joiner_path = _export_graph(
        JoinerHead(model), (enc, dout), out_dir / "joiner.onnx", ["encoder_out", "decoder_out"], ["logit"],
        ({0: n}, {0: n}), [{0: "N"}, {0: "N"}], joiner_meta, opset)
    return decoder_path, joiner_path


def export_offline(model: nn.Module, tokenizer: Any, out_dir: Path | str, *, chunk_size: int = -1,
                   left_context_frames: int = -1, opset: Optional[int] = None) -> ExportedModel:
    """Export a Zipformer or Conformer transducer for sherpa-onnx's ``OfflineRecognizer.from_transducer``.

    Graphs (inputs and outputs in this order; N and T dynamic):

    * ``encoder.onnx``: ``x`` (N, T, 80) float32, ``x_lens`` (N,) int64 -> ``encoder_out`` (N, T', J) float32
      (already through the joiner's encoder projection), ``encoder_out_lens`` (N,) int64; metadata ``model_type``
      (``zipformer2`` or ``conformer``).
    * ``decoder.onnx``: ``y`` (N, C) int64 (negative ids are blanks) -> ``decoder_out`` (N, J); metadata
      ``vocab_size``, ``context_size``.
    * ``joiner.onnx``: ``encoder_out`` (N, J), ``decoder_out`` (N, J) -> ``logit`` (N, V); a TDT model's joiner
      gives (N, V + K), token logits then the logits of its K durations, listed in the metadata ``tdt_durations``
      (e.g. ``0,1,2,3,4``). asrprec's onnxruntime search (:mod:`asrprec.export.runtime`) decodes it with the TDT
      greedy search; sherpa-onnx cannot (see :data:`SHERPA_TDT_REASON`).

    A causal Zipformer is exported with ``chunk_size`` / ``left_context_frames`` (50 Hz frames; -1 = full
    context) as a whole-utterance encoder (simulated streaming).
    """
    model = _prepare(model)
    out_dir = Path(out_dir)
    family = encoder_family(model)
    _check_offline_chunking(model, chunk_size, left_context_frames)
    n = _dim("N", min=1, max=_MAX_BATCH)
    # torch.export traces lengths of 2 and more as general lengths: the shortest input whose every intermediate
    # length is >= 2 is 2 * (ds_max + 1) + 7 frames for a Zipformer (its slowest stack, downsampling ds_max, gets 2
    # frames) and 11 for a Conformer. The graph also runs on the shorter inputs the encoders accept (9 and 7
    # frames), which the parity tests check.
    t = _dim("T", min=2 * max(max(model.encoder.encoder.downsampling_factor) + 1, 3) + 7 if family == "zipformer" else 11)
    frames = 203  # odd, so no stack's length is a multiple of its downsampling
    x = torch.randn(_EXAMPLE_BATCH, frames, _num_features(model))
    x_lens = torch.tensor([frames, frames - 40], dtype=torch.int64)
    meta = {**_common_metadata(model, "offline encoder"),
            "model_type": "zipformer2" if family == "zipformer" else "conformer"}
    if family == "zipformer" and model.encoder.encoder.causal:
        meta.update(chunk_size=str(chunk_size), left_context_frames=str(left_context_frames))
    encoder_path = _export_graph(
        OfflineEncoder(model, chunk_size, left_context_frames), (x, x_lens), out_dir / "encoder.onnx",
        ["x", "x_lens"], ["encoder_out", "encoder_out_lens"], ({0: n, 1: t}, {0: n}), [{0: "N", 1: "T"}, {0: "N"}],
        meta, opset)
    decoder_path, joiner_path = _export_decoder_joiner(model, out_dir, opset)
    tokens = write_tokens(tokenizer, out_dir / "tokens.txt", model.decoder.vocab_size)
    return ExportedModel(encoder_path, decoder_path, joiner_path, tokens, streaming=False)


def _refuse_tdt_streaming(model: nn.Module) -> None:
    if tuple(getattr(getattr(model, "joiner", None), "durations", ())):
        raise ValueError("streaming export of a TDT model is not supported: sherpa-onnx cannot decode TDT ("
                         f"{SHERPA_TDT_REASON}), and asrprec's onnxruntime streaming search decodes RNN-T joiners "
                         "only; export the model offline (without --streaming)")


def export_streaming(model: nn.Module, tokenizer: Any, out_dir: Path | str, *, chunk_size: int,
                     left_context_frames: int, opset: Optional[int] = None) -> ExportedModel:
    """Export a causal Zipformer transducer for sherpa-onnx's ``OnlineRecognizer.from_transducer``.

    ``encoder.onnx`` is one streaming step: ``x`` (N, T, 80) float32 with T = 2 x ``chunk_size`` + 13 (7 without
    the front-end ConvNeXt), then the states -> ``encoder_out`` (N, ``chunk_size``/2, J), then the new states; per
    layer ``cached_key`` (L, N, key_dim), ``cached_nonlin_attn`` (1, N, L, 3D/4), ``cached_val1`` /
    ``cached_val2`` (L, N, value_dim), ``cached_conv1`` / ``cached_conv2`` (N, D, kernel/2), then ``embed_states``
    (N, 128, 3, 19) and ``processed_lens`` (N,) int64; N dynamic. The metadata (:meth:`StreamingLayout.metadata`)
    lists every per-stack value. ``decoder.onnx`` and ``joiner.onnx`` are the offline ones.

    Raises ValueError for a model that is not a causal Zipformer, or a chunk size / left context it was not trained
    with, and for a TDT model.
    """
    _refuse_tdt_streaming(model)
    model = _prepare(model)
    out_dir = Path(out_dir)
    layout = StreamingLayout.of(model, chunk_size, left_context_frames)
    encoder_path = export_streaming_step(model, layout, StreamingEncoder(model, layout), out_dir / "encoder.onnx",
                                         "encoder_out", _common_metadata(model, "streaming encoder"), opset)
    decoder_path, joiner_path = _export_decoder_joiner(model, out_dir, opset)
    tokens = write_tokens(tokenizer, out_dir / "tokens.txt", model.decoder.vocab_size)
    return ExportedModel(encoder_path, decoder_path, joiner_path, tokens, streaming=True)


def export_streaming_step(model: nn.Module, layout: StreamingLayout, step: nn.Module, path: Path, output: str,
                          metadata: dict, opset: Optional[int]) -> Path:
    """Export one streaming step ``step(x, *states) -> (output, *new states)`` of a causal Zipformer to ``path``:
    ``x`` (N, ``layout.T``, 80) and the states of ``layout`` with N dynamic, ``metadata`` plus the layout's."""
    n = _dim("N", min=1, max=_MAX_BATCH)
    states = layout.init_states(_EXAMPLE_BATCH)
    names = layout.state_names()
    x = torch.randn(_EXAMPLE_BATCH, layout.T, _num_features(model))
    dynamic = ({0: n}, tuple({d: n} for d in layout.state_batch_dims()))  # forward(x, *states)
    return _export_graph(step, (x, *states), path, ["x", *names], [output, *[f"new_{s}" for s in names]], dynamic,
                         [{0: "N"}] + [{d: "N"} for d in layout.state_batch_dims()],
                         {**metadata, **layout.metadata()}, opset)


def quantize_int8(exported: ExportedModel) -> ExportedModel:
    """int8 variant (``encoder.int8.onnx`` ...) by onnxruntime's dynamic quantisation of the weight matrices
    (MatMul with a constant weight; the decoder's embedding Gather too), as icefall's export-onnx.py; the metadata
    is kept.

    Three choices differ from icefall's, for closer agreement with the float model: activation-by-activation
    products (attention) stay float (``MatMulConstBOnly``), weights get one scale per output channel rather than one
    per matrix, and they use 7 bits (``reduce_range``, so that CPUs without VNNI do not saturate). Activations are quantised at run time with one scale per tensor, so a batch shares it: results can
    depend slightly on which utterances are decoded together."""
    out = exported.variant("int8")
    for src, dst, ops in ((exported.encoder, out.encoder, ["MatMul"]), (exported.decoder, out.decoder,
                          ["MatMul", "Gather"]), (exported.joiner, out.joiner, ["MatMul"])):
        _quantize_file_int8(src, dst, ops)
    for src, dst in ((exported.encoder, out.encoder), (exported.decoder, out.decoder), (exported.joiner, out.joiner)):
        _ensure_metadata(src, dst)
    return out


def _quantize_file_int8(src: Path, dst: Path, ops: list[str]) -> None:
    """Dynamic int8 quantisation of ``src``'s ``ops`` into ``dst``: per-channel int8 weights, activations quantised at
    run time, activation-by-activation products left float.

    Weights use 7 of the 8 bits (onnxruntime's ``reduce_range``). On an x86 CPU without VNNI (AVX2 only), onnxruntime
    multiplies uint8 activations by int8 weights with ``vpmaddubsw``, which adds pairs of products into int16 and
    saturates: with full-range weights (255 * 127 * 2 > 32767) the sums clip, and a quantised Zipformer decoded
    repeated tokens on such a CPU. With 7-bit weights no pair can overflow; onnxruntime's quantisation docs
    recommend it for non-VNNI machines."""
    require("onnxruntime")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # the quantiser logs every tensor it skips through the root logger
    try:
        quantize_dynamic(src, dst, op_types_to_quantize=ops, weight_type=QuantType.QInt8, per_channel=True,
                         reduce_range=True, nodes_to_exclude=_constant_products(src),
                         extra_options={"MatMulConstBOnly": True})
    finally:
        logging.disable(previous)


def _constant_products(path: Path) -> list[str]:
    """MatMul nodes whose constant operand is not a (in, out) weight matrix: in a streaming encoder the relative
    positional projection, a constant of the fixed chunk, folds into a (H, 1, d, L) operand; it is not a weight,
    and onnxruntime's per-channel integer kernels reject its shape."""
    onnx = require("onnx")
    model = onnx.load(str(path))
    ranks = {t.name: len(t.dims) for t in model.graph.initializer}
    return [n.name for n in model.graph.node
            if n.op_type == "MatMul" and n.input[1] in ranks and ranks[n.input[1]] != 2]


def convert_fp16(exported: ExportedModel) -> ExportedModel:
    """fp16 variant (``encoder.fp16.onnx`` ...): weights and arithmetic in float16, inputs and outputs float32 (what
    sherpa-onnx feeds), by onnxruntime's converter, which keeps the graph's explicit casts consistent (icefall's
    onnxmltools route breaks on them, k2-fsa/icefall issue #2011); the metadata is kept."""
    onnx = require("onnx")
    require("onnxruntime")
    from onnxruntime.transformers.float16 import convert_float_to_float16

    out = exported.variant("fp16")
    for src, dst in ((exported.encoder, out.encoder), (exported.decoder, out.decoder),
                     (exported.joiner, out.joiner)):
        model = convert_float_to_float16(onnx.load(str(src)), keep_io_types=True)
        atomic_write(dst, lambda f, model=model: onnx.save(model, f))
        _ensure_metadata(src, dst)
    return out


def _ensure_metadata(src: Path, dst: Path) -> None:
    want = read_metadata(src)
    if read_metadata(dst) != want:
        add_metadata(dst, want)
