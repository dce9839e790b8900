"""The graphs a transducer is exported as: ``nn.Module`` wrappers with the inputs, outputs and layouts that
sherpa-onnx feeds and reads (k2-fsa/sherpa-onnx ``sherpa-onnx/csrc/offline-transducer-model.cc`` and
``online-zipformer2-transducer-model.cc``), built around a trained :class:`asrprec.models.Transducer` without
changing it. icefall exports the same three graphs (k2-fsa/icefall ``egs/librispeech/ASR/zipformer/export-onnx.py``
and ``export-onnx-streaming.py``); the wrappers here are ours.

Legend: N batch (utterances or streams), T feature frames (100 Hz), F feature bins (80), T' encoder frames
(25 Hz), C the decoder's context size, J the joiner width, V the vocabulary (blank = 0 included), L cached frames
of a stack, D a stack's width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: sherpa-onnx creates the streaming front-end cache as (N, 128, 3, ((80 - 1) // 2 - 1) // 2) whatever the model
#: (``GetEncoderInitStates`` in online-zipformer2-transducer-model.cc): icefall's Conv2dSubsampling width and ConvNeXt
#: left context; a narrower or ConvNeXt-free front-end uses a corner of it.
SHERPA_EMBED_CHANNELS = 128
SHERPA_EMBED_FRAMES = 3
SHERPA_FEATURE_DIM = 80


def encoder_family(model: nn.Module) -> str:
    """``"zipformer"`` or ``"conformer"`` for the transducer's encoder; TypeError for anything else."""
    from asrprec.models.conformer import ConformerEncoder
    from asrprec.models.zipformer import ZipformerEncoder

    if isinstance(model.encoder, ZipformerEncoder):
        return "zipformer"
    if isinstance(model.encoder, ConformerEncoder):
        return "conformer"
    raise TypeError(f"cannot export a {type(model.encoder).__name__} encoder; export supports the Zipformer and "
                    "Conformer transducers of asrprec.models.build_transducer")


class OfflineEncoder(nn.Module):
    """``(x (N, T, F) float32, x_lens (N,) int64) -> (encoder_out (N, T', J) float32, encoder_out_lens (N,) int64)``:
    the encoder followed by the joiner's encoder projection, as sherpa-onnx's offline transducer wants it (or by
    another ``head``: the CTC head's log-probabilities, (N, T', V), for sherpa-onnx's zipformer CTC model).

    Runs the encoder's parts directly, as icefall's ``OnnxEncoder`` does, so the graph holds no input checks that
    read data (an exported graph cannot); a causal Zipformer runs with the chunk size and left context given here
    (-1 = full context)."""

    def __init__(self, model: nn.Module, chunk_size: int = -1, left_context_frames: int = -1,
                 head: nn.Module | None = None):
        super().__init__()
        self.family = encoder_family(model)
        self.encoder = model.encoder
        self.head = head if head is not None else model.joiner.encoder_proj
        self.chunk_size = int(chunk_size)
        self.left_context_frames = int(left_context_frames)

    def forward(self, x: Tensor, x_lens: Tensor) -> Tuple[Tensor, Tensor]:
        from asrprec.models import make_pad_mask

        enc = self.encoder
        if self.family == "zipformer":
            h, h_lens = enc.encoder_embed(x, x_lens)
            h = h.permute(1, 0, 2)  # (T, N, D), the stacks' layout
            h, out_lens = enc.encoder(h, h_lens, make_pad_mask(h_lens, h.shape[0]), chunk_size=self.chunk_size,
                                      left_context_frames=self.left_context_frames)
            h = h.permute(1, 0, 2)
        else:
            h, out_lens = enc.encoder_embed(x, x_lens)
            h, pos_emb = enc.encoder_pos(h)
            mask = make_pad_mask(out_lens, h.shape[1])
            for layer in enc.layers:
                h = layer(h, pos_emb, mask)
        return self.head(h), out_lens


class ProjectedDecoder(nn.Module):
    """``y (N, C) int64 -> decoder_out (N, J) float32``: the stateless decoder on exactly C context tokens, then the
    joiner's decoder projection. Negative ids (sherpa-onnx starts every hypothesis with ``[-1] * (C - 1) + [0]``)
    are mapped to the blank inside the graph by :class:`asrprec.models.Decoder` itself, as asrprec's own search
    starts with ``[blank] * C``; a bare ONNX Gather would read row V - 1 for -1 instead."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.decoder = model.decoder
        self.decoder_proj = model.joiner.decoder_proj

    def forward(self, y: Tensor) -> Tensor:
        return self.decoder_proj(self.decoder(y, need_pad=False)).squeeze(1)


class JoinerHead(nn.Module):
    """``(encoder_out (N, J), decoder_out (N, J)) -> logit (N, V)``: ``output_linear(tanh(enc + dec))`` on inputs
    already projected by the encoder and decoder graphs; raw logits (sherpa-onnx takes the log-softmax itself). A TDT
    joiner gives (N, V + K): the token logits, then those of its K durations."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.joiner = model.joiner

    def forward(self, encoder_out: Tensor, decoder_out: Tensor) -> Tensor:
        return self.joiner(encoder_out, decoder_out, project_input=False)


@dataclass(frozen=True)
class StreamingLayout:
    """How a causal Zipformer streams at one chunk size and left context, in sherpa-onnx's terms: the per-stack
    lists of the encoder's metadata, the frames per call and the state tensors' names and shapes.

    Lists have one entry per stack. ``left_context_len[i]`` = cached frames of stack i = ``left // ds[i]``, with
    ``left`` the whole-chunk left context at 50 Hz that asrprec streams with
    (:meth:`asrprec.models.zipformer.ZipformerEncoder.streaming_left_context`). ``T`` feature frames enter each
    call, which then advances ``decode_chunk_len`` = 2 x chunk frames.
    """

    chunk_size: int
    left_context_frames: int
    encoder_dims: Tuple[int, ...]
    num_encoder_layers: Tuple[int, ...]
    query_head_dims: Tuple[int, ...]
    value_head_dims: Tuple[int, ...]
    num_heads: Tuple[int, ...]
    cnn_module_kernels: Tuple[int, ...]
    left_context_len: Tuple[int, ...]
    T: int
    decode_chunk_len: int
    embed_channels: int  # the front-end cache's real channels and frames (a corner of sherpa's (128, 3))
    embed_frames: int
    embed_width: int

    @classmethod
    def of(cls, model: nn.Module, chunk_size: int, left_context_frames: int) -> "StreamingLayout":
        """The layout of ``model`` (a causal Zipformer transducer) streaming at ``chunk_size`` /
        ``left_context_frames``; raises ValueError for values it cannot stream with (see
        :func:`check_streaming_values`)."""
        check_streaming_values(model, chunk_size, left_context_frames)
        enc = model.encoder
        stacks = enc.encoder
        left = enc.streaming_left_context(chunk_size, left_context_frames)
        layers, query, value, heads = [], [], [], []
        for module in stacks.encoders:
            stack = getattr(module, "encoder", module)  # DownsampledZipformer2Encoder wraps a Zipformer2Encoder
            attn = stack.layers[0].self_attn_weights
            layers.append(stack.num_layers)
            query.append(attn.query_head_dim)
            heads.append(attn.num_heads)
            value.append(stack.layers[0].self_attn1.in_proj.out_features // attn.num_heads)
        cache = enc.encoder_embed.init_cache(1)
        return cls(
            chunk_size=int(chunk_size), left_context_frames=int(left_context_frames),
            encoder_dims=tuple(stacks.encoder_dim), num_encoder_layers=tuple(layers), query_head_dims=tuple(query),
            value_head_dims=tuple(value), num_heads=tuple(heads), cnn_module_kernels=tuple(stacks.cnn_module_kernel),
            left_context_len=tuple(left // d for d in stacks.downsampling_factor),
            T=2 * int(chunk_size) + enc.streaming_lookahead, decode_chunk_len=2 * int(chunk_size),
            embed_channels=cache.shape[1], embed_frames=cache.shape[2], embed_width=cache.shape[3])

    @property
    def num_layers(self) -> int:
        return sum(self.num_encoder_layers)

    def metadata(self) -> Dict[str, str]:
        """The encoder metadata sherpa-onnx reads (``OnlineZipformer2TransducerModel::InitEncoder``)."""
        def join(v):
            return ",".join(str(int(a)) for a in v)

        return {
            "model_type": "zipformer2", "encoder_dims": join(self.encoder_dims),
            "num_encoder_layers": join(self.num_encoder_layers), "query_head_dims": join(self.query_head_dims),
            "value_head_dims": join(self.value_head_dims), "num_heads": join(self.num_heads),
            "cnn_module_kernels": join(self.cnn_module_kernels), "left_context_len": join(self.left_context_len),
            "T": str(self.T), "decode_chunk_len": str(self.decode_chunk_len),
            "chunk_size": str(self.chunk_size), "left_context_frames": str(self.left_context_frames),
        }

    def state_names(self) -> List[str]:
        """Input state names in order (icefall's; outputs are the same with a ``new_`` prefix)."""
        names = []
        for i in range(self.num_layers):
            names += [f"cached_key_{i}", f"cached_nonlin_attn_{i}", f"cached_val1_{i}", f"cached_val2_{i}",
                      f"cached_conv1_{i}", f"cached_conv2_{i}"]
        return names + ["embed_states", "processed_lens"]

    def state_batch_dims(self) -> List[int]:
        return [1, 1, 1, 1, 0, 0] * self.num_layers + [0, 0]

    def init_states(self, batch_size: int) -> List[Tensor]:
        """Zero states of ``batch_size`` streams in sherpa-onnx's shapes (what it creates from the metadata)."""
        states: List[Tensor] = []
        for stack, n_layers in enumerate(self.num_encoder_layers):
            L, D = self.left_context_len[stack], self.encoder_dims[stack]
            key = self.query_head_dims[stack] * self.num_heads[stack]
            val = self.value_head_dims[stack] * self.num_heads[stack]
            conv = (batch_size, D, self.cnn_module_kernels[stack] // 2)
            for _ in range(n_layers):
                states += [torch.zeros(L, batch_size, key), torch.zeros(1, batch_size, L, 3 * D // 4),
                           torch.zeros(L, batch_size, val), torch.zeros(L, batch_size, val),
                           torch.zeros(conv), torch.zeros(conv)]
        states.append(torch.zeros(batch_size, SHERPA_EMBED_CHANNELS, SHERPA_EMBED_FRAMES, self.embed_width))
        states.append(torch.zeros(batch_size, dtype=torch.int64))
        return states


def check_streaming_values(model: nn.Module, chunk_size: int, left_context_frames: int) -> None:
    """Refuse a streaming export the model cannot serve: an encoder that is not a causal Zipformer, a chunk size or
    left context it was not trained with, a front-end sherpa-onnx's fixed cache cannot hold."""
    if encoder_family(model) != "zipformer" or not model.encoder.encoder.causal:
        raise ValueError("streaming export needs a causal Zipformer (trained with --encoder zipformer --causal); "
                         "this model is not causal: export it offline (without --streaming)")
    stacks = model.encoder.encoder
    chunks = sorted(c for c in stacks.chunk_size if c > 0)
    lefts = sorted(c for c in stacks.left_context_frames if c > 0)
    if chunk_size not in chunks:
        raise ValueError(f"--chunk-size {chunk_size} was not trained: this model was trained with chunk sizes "
                         f"{chunks} (50 Hz frames); export with one of them")
    if left_context_frames not in lefts:
        raise ValueError(f"--left-context-frames {left_context_frames} was not trained: this model was trained with "
                         f"left contexts {lefts} (50 Hz frames); export with one of them")
    model.encoder.streaming_left_context(chunk_size, left_context_frames)  # raises with the reason
    embed = model.encoder.encoder_embed
    cache = embed.init_cache(1)
    if embed.in_channels != SHERPA_FEATURE_DIM:
        raise ValueError(f"sherpa-onnx feeds {SHERPA_FEATURE_DIM} fbank bins; this model takes {embed.in_channels}")
    if cache.shape[1] > SHERPA_EMBED_CHANNELS or cache.shape[2] > SHERPA_EMBED_FRAMES:
        raise ValueError(f"the front-end cache {tuple(cache.shape[1:])} does not fit sherpa-onnx's fixed "
                         f"({SHERPA_EMBED_CHANNELS}, {SHERPA_EMBED_FRAMES}, ...) front-end state")


class StreamingEncoder(nn.Module):
    """One streaming step in sherpa-onnx's layout, around ``ZipformerEncoder.streaming_forward``.

    ``forward(x (N, T, 80), *states) -> (encoder_out (N, chunk/2, J), *new_states)``, the states in the order and
    shapes of :meth:`StreamingLayout.init_states`. asrprec's own cache layouts differ in two places, bridged here:
    the NonlinAttention cache is (L, N, 3D/4) in asrprec and (1, N, L, 3D/4) in sherpa-onnx, and the front-end cache
    is (N, C, t, 19) with C front-end channels and t = 3 (0 without the ConvNeXt), which sherpa-onnx keeps in the
    corner of an (N, 128, 3, 19) tensor. Every frame of ``x`` is valid (sherpa-onnx passes no lengths); each call
    adds chunk frames to ``processed_lens``, which masks the cache slots not yet filled.
    """

    def __init__(self, model: nn.Module, layout: StreamingLayout, head: nn.Module | None = None):
        super().__init__()
        self.encoder = model.encoder
        self.head = head if head is not None else model.joiner.encoder_proj  # or the CTC head's log-probs
        self.layout = layout

    def forward(self, x: Tensor, *states: Tensor) -> Tuple[Tensor, ...]:
        lay = self.layout
        n = lay.num_layers
        ours: List[Tensor] = []
        for i in range(n):
            key, nonlin, val1, val2, conv1, conv2 = states[6 * i: 6 * i + 6]
            ours += [key, nonlin[0].transpose(0, 1), val1, val2, conv1, conv2]
        ours.append(states[6 * n][:, : lay.embed_channels, : lay.embed_frames])
        processed = states[6 * n + 1]
        ours.append(processed)
        x_lens = torch.zeros_like(processed) + x.shape[1]
        out, _, new = self.encoder.streaming_forward(x, x_lens, ours)
        result: List[Tensor] = [self.head(out)]
        for i in range(n):
            key, nonlin, val1, val2, conv1, conv2 = new[6 * i: 6 * i + 6]
            result += [key, nonlin.transpose(0, 1).unsqueeze(0), val1, val2, conv1, conv2]
        embed = new[6 * n]
        result.append(F.pad(embed, (0, 0, 0, SHERPA_EMBED_FRAMES - lay.embed_frames,
                                    0, SHERPA_EMBED_CHANNELS - lay.embed_channels)))
        result.append(new[6 * n + 1])
        return tuple(result)
