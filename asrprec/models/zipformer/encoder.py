"""Zipformer2 encoder: six stacks at 50/25/12.5/6.25/12.5/25 Hz, output assembly and 2x output downsampling.

Structure follows k2-fsa/icefall ``egs/librispeech/ASR/zipformer/zipformer.py`` (Zipformer2) and
``zipformer/model.py`` (forward_encoder); the code is ours.

Scheduled behaviour (layer skipping, feature masking rates, dropout, balancer probabilities) follows a batch
count that the training loop writes with :func:`asrprec.models.set_batch_count`. icefall feeds the *adjusted* count
``batch_idx * max_duration * world_size / 600`` (train.py ``get_adjusted_batch_count``) every 10 batches; until
it is set, all schedules return their defaults (layer skipping off).
"""

from __future__ import annotations

import random
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ..masks import make_pad_mask
from ..schedule import ScheduledFloat
from ..tracing import check_lengths_in_graph, is_exporting, is_tracing
from .frontend import ZipformerConv2dSubsampling
from .layers import DownsampledZipformer2Encoder, SimpleDownsample, Zipformer2Encoder, Zipformer2EncoderLayer


def convert_num_channels(x: Tensor, num_channels: int) -> Tensor:
    """Truncate or zero-pad the last dim of x to ``num_channels``."""
    c = x.shape[-1]
    if num_channels <= c:
        return x[..., :num_channels]
    pad = torch.zeros(*x.shape[:-1], num_channels - c, dtype=x.dtype, device=x.device)
    return torch.cat((x, pad), dim=-1)


def zipformer_dropout(rate: Optional[float] = None) -> Union[float, ScheduledFloat]:
    """A constant dropout ``rate``, or icefall's schedule 0.3 -> 0.1 over 20,000 batches when ``rate`` is None
    (k2-fsa/icefall egs/librispeech/ASR/zipformer/zipformer.py, Zipformer2 and Conv2dSubsampling defaults)."""
    if rate is None:
        return ScheduledFloat((0.0, 0.3), (20000.0, 0.1))
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {rate}")
    return float(rate)


class Zipformer2(nn.Module):
    """The stacks, without the front-end. forward(x (T,B,D0), x_lens (B,), key_padding_mask (B,T)) ->
    ((ceil(T/2), B, max(encoder_dim)), (x_lens+1)//2). Time-major internally, as in icefall."""

    def __init__(self, *, downsampling_factor: Sequence[int], encoder_dim: Sequence[int],
                 num_encoder_layers: Sequence[int], encoder_unmasked_dim: Sequence[int],
                 query_head_dim: Sequence[int], pos_head_dim: Sequence[int], value_head_dim: Sequence[int],
                 num_heads: Sequence[int], feedforward_dim: Sequence[int], cnn_module_kernel: Sequence[int],
                 pos_dim: int, output_downsampling_factor: int = 2, warmup_batches: float = 4000.0,
                 causal: bool = False, chunk_size: Sequence[int] = (-1,),
                 left_context_frames: Sequence[int] = (-1,), dropout: Optional[float] = None,
                 padding_invariant: bool = True):
        super().__init__()
        if output_downsampling_factor != 2:
            raise ValueError("output_downsampling_factor must be 2 (lengths are (L+1)//2)")
        self.downsampling_factor = tuple(downsampling_factor)
        self.encoder_dim = tuple(encoder_dim)
        self.encoder_unmasked_dim = tuple(encoder_unmasked_dim)
        self.cnn_module_kernel = tuple(cnn_module_kernel)
        self.causal = causal
        self.chunk_size = tuple(chunk_size)
        self.left_context_frames = tuple(left_context_frames)
        # the downsamplers fill a padded utterance's last group with its own last frame (False: with the batch's
        # padded frames, as icefall's SimpleDownsample does; see SimpleDownsample)
        self.padding_invariant = padding_invariant
        # feed-forward dropout: icefall's schedule (0.3 -> 0.1 over 20k batches) unless a constant rate is given
        dropout = zipformer_dropout(dropout)
        n = len(downsampling_factor)
        encoders: List[nn.Module] = []
        for i in range(n):
            layer = Zipformer2EncoderLayer(
                embed_dim=encoder_dim[i], pos_dim=pos_dim, num_heads=num_heads[i],
                query_head_dim=query_head_dim[i], pos_head_dim=pos_head_dim[i], value_head_dim=value_head_dim[i],
                feedforward_dim=feedforward_dim[i], dropout=dropout, cnn_module_kernel=cnn_module_kernel[i],
                causal=causal)
            enc: nn.Module = Zipformer2Encoder(
                layer, num_encoder_layers[i], pos_dim=pos_dim,
                warmup_begin=warmup_batches * (i + 1) / (n + 1), warmup_end=warmup_batches * (i + 2) / (n + 1),
                final_layerdrop_rate=0.035 * (downsampling_factor[i] ** 0.5))
            if downsampling_factor[i] != 1:
                enc = DownsampledZipformer2Encoder(enc, dim=encoder_dim[i], downsample=downsampling_factor[i],
                                                   padding_invariant=padding_invariant)
            encoders.append(enc)
        self.encoders = nn.ModuleList(encoders)
        self.downsample_output = SimpleDownsample(output_downsampling_factor)

    def get_feature_masks(self, x: Tensor) -> List[Union[float, Tensor]]:
        """Training only: per sequence, with p=0.125 (and a nested second draw) zero the channels above
        ``encoder_unmasked_dim`` (in two halves) of every stack. Returns one (1,B,D_i) mask per stack."""
        n = len(self.encoder_dim)
        if not self.training:
            return [1.0] * n
        b = x.shape[1]
        p = 0.125
        mask1 = (torch.rand(1, b, 1, device=x.device) > p).to(x.dtype)
        mask2 = mask1 * (torch.rand(1, b, 1, device=x.device) > p).to(x.dtype)
        masks: List[Union[float, Tensor]] = []
        for d, u1 in zip(self.encoder_dim, self.encoder_unmasked_dim):
            m = torch.ones(1, b, d, dtype=x.dtype, device=x.device)
            u2 = u1 + (d - u1) // 2
            m[:, :, u1:u2] *= mask1
            m[:, :, u2:] *= mask2
            masks.append(m)
        return masks

    def get_chunk_info(self, chunk_size: Optional[int] = None,
                       left_context_frames: Optional[int] = None) -> Tuple[int, int]:
        """(chunk_size, left_context_chunks) at 50 Hz; random choices from the configured lists unless given."""
        if not self.causal:
            if chunk_size not in (None, -1):
                raise ValueError("chunk_size needs an encoder built with causal=True")
            return -1, -1
        cs = random.choice(self.chunk_size) if chunk_size is None else int(chunk_size)
        if cs == -1:
            return -1, -1
        if cs <= 0:
            raise ValueError(f"chunk_size must be positive or -1, got {cs}")
        lc = random.choice(self.left_context_frames) if left_context_frames is None else int(left_context_frames)
        lcc = lc // cs if lc >= 0 else -1
        if lc >= 0 and lcc == 0:
            lcc = 1
        return cs, lcc

    def check_chunking(self, chunk_size: int, left_context_chunks: int) -> None:
        """Raise ValueError unless chunked attention can run with ``chunk_size`` (50 Hz frames; <= 0: none) and
        ``left_context_chunks`` (-1: unlimited): a multiple of every downsampling factor, and a left context that
        covers each convolution's left reach."""
        if chunk_size <= 0:
            return
        if any(chunk_size % d != 0 for d in self.downsampling_factor):
            raise ValueError(f"chunk_size {chunk_size} must be a multiple of every downsampling factor "
                             f"{self.downsampling_factor}")
        if left_context_chunks >= 0:
            for k, d in zip(self.cnn_module_kernel, self.downsampling_factor):
                if chunk_size * left_context_chunks < (k // 2) * d:
                    raise ValueError(f"left context {chunk_size * left_context_chunks} frames is shorter than the "
                                     f"convolution's left reach {(k // 2) * d}; raise left_context_frames")

    def _get_attn_mask(self, t: int, chunk_size: int, left_context_chunks: int,
                       device: torch.device) -> Optional[Tensor]:
        if chunk_size <= 0:
            return None
        self.check_chunking(chunk_size, left_context_chunks)
        if left_context_chunks < 0:
            left_context_chunks = 1_000_000
        c = torch.arange(t, device=device) // chunk_size
        return torch.logical_or(c.unsqueeze(0) > c.unsqueeze(1), c.unsqueeze(0) < c.unsqueeze(1) - left_context_chunks)

    def _get_full_dim_output(self, outputs: List[Tensor]) -> Tensor:
        pieces = [outputs[-1]]
        cur = self.encoder_dim[-1]
        for i in range(len(outputs) - 2, -1, -1):
            d = self.encoder_dim[i]
            if d > cur:
                pieces.append(outputs[i][..., cur:d])
                cur = d
        return torch.cat(pieces, dim=-1) if len(pieces) > 1 else pieces[0]

    def forward(self, x: Tensor, x_lens: Tensor, key_padding_mask: Optional[Tensor] = None,
                chunk_size: Optional[int] = None, left_context_frames: Optional[int] = None) -> Tuple[Tensor, Tensor]:
        feature_masks = self.get_feature_masks(x)
        cs, lcc = self.get_chunk_info(chunk_size, left_context_frames)
        attn_mask = self._get_attn_mask(x.shape[0], cs, lcc, x.device)
        outputs = []
        for i, module in enumerate(self.encoders):
            x = convert_num_channels(x, self.encoder_dim[i])
            x = module(x, chunk_size=cs, feature_mask=feature_masks[i], attn_mask=attn_mask,
                       key_padding_mask=key_padding_mask)
            outputs.append(x)
        x = self._get_full_dim_output(outputs)
        x = self.downsample_output(x, key_padding_mask if self.padding_invariant else None)
        return x, torch.div(x_lens + 1, 2, rounding_mode="floor")

    def streaming_forward(self, x: Tensor, x_lens: Tensor, caches: Sequence[Tensor], left_context_len: int,
                          key_padding_mask: Tensor) -> Tuple[Tensor, Tensor, List[Tensor]]:
        """One chunk, eval mode: x (T,B,D0) at 50 Hz, x_lens (B,) its valid frames, the stacks' caches,
        ``left_context_len`` cached frames at 50 Hz, key_padding_mask (B, left_context_len + T).
        Returns ((T/2, B, D), (x_lens+1)//2, new caches)."""
        outputs = []
        new_caches: List[Tensor] = []
        pos = 0
        for i, module in enumerate(self.encoders):
            n = 6 * module.num_layers
            x = convert_num_channels(x, self.encoder_dim[i])
            x, c = module.streaming_forward(x, caches[pos: pos + n], left_context_len, key_padding_mask)
            new_caches.extend(c)
            pos += n
            outputs.append(x)
        x = self._get_full_dim_output(outputs)
        x = self.downsample_output(x, key_padding_mask[:, left_context_len:])
        return x, torch.div(x_lens + 1, 2, rounding_mode="floor"), new_caches


class ZipformerEncoder(nn.Module):
    """Front-end + Zipformer2 with the batch-major interface used by the Transducer.

    Legend: B batch, T input frames (100 Hz), F feature bins, T' = ((T-7)//2 + 1)//2 output frames (25 Hz),
    D = ``output_dim`` = max(encoder_dim).

    forward(features (B,T,F) float, feature_lens (B,) int64, chunk_size=None, left_context_frames=None, **ignored)
      -> (encoder_out (B,T',D) in the activations' dtype, encoder_out_lens (B,) int64).
    ``chunk_size``/``left_context_frames`` (50 Hz frames) fix the chunked causal mode (causal encoders only);
    by default training draws them from the configured lists. Extra keyword arguments (e.g. ``warmup``) are
    ignored. The training loop drives the schedules with :func:`asrprec.models.set_batch_count`.
    """

    #: the fewest feature frames an utterance may have: (9-7)//2 = 1 frame after the front-end
    min_input_frames = 9

    def __init__(self, encoder_embed: ZipformerConv2dSubsampling, encoder: Zipformer2, num_features: int):
        super().__init__()
        self.encoder_embed = encoder_embed
        self.encoder = encoder
        self.num_features = num_features
        self.output_dim = max(encoder.encoder_dim)

    def forward(self, features: Tensor, feature_lens: Tensor, chunk_size: Optional[int] = None,
                left_context_frames: Optional[int] = None, **ignored) -> Tuple[Tensor, Tensor]:
        if features.ndim != 3 or features.shape[-1] != self.num_features:
            raise ValueError(f"features must be (B, T, {self.num_features}), got {tuple(features.shape)}")
        if feature_lens.ndim != 1 or feature_lens.shape[0] != features.shape[0]:
            raise ValueError(f"feature_lens must be (B,) with B={features.shape[0]}, got {tuple(feature_lens.shape)}")
        # reading the lengths in Python would break a compiled graph: it asserts them in the graph instead
        traced = is_tracing() and not is_exporting()
        if traced:
            check_lengths_in_graph(feature_lens, self.min_input_frames, features.shape[1])
        if features.shape[1] < self.min_input_frames or (
                not traced and int(feature_lens.min()) < self.min_input_frames):
            raise ValueError(f"every utterance needs at least {self.min_input_frames} feature frames (front-end gives "
                             "(T-7)//2 frames)")
        if not traced and int(feature_lens.max()) > features.shape[1]:
            raise ValueError(f"feature_lens max {int(feature_lens.max())} exceeds T={features.shape[1]}")
        x, x_lens = self.encoder_embed(features, feature_lens)
        mask = make_pad_mask(x_lens, x.shape[1])
        x = x.permute(1, 0, 2)  # (T, B, D)
        x, out_lens = self.encoder(x, x_lens, mask, chunk_size=chunk_size, left_context_frames=left_context_frames)
        return x.permute(1, 0, 2), out_lens

    def compile_regions(self) -> List[nn.Module]:
        """The submodules ``compile_model(regions="layers")`` compiles one by one: the front-end and every encoder
        layer. Layers of the same shape (same stack width, heads and kernel) share their compiled code, so a model
        compiles once per distinct layer instead of once as a whole; the code between them (downsampling, the
        stacks' bypasses, the output assembly) runs eager."""
        return [self.encoder_embed] + [m for m in self.encoder.modules() if isinstance(m, Zipformer2EncoderLayer)]

    # -- streaming: chunk by chunk, with caches (k2-fsa/icefall egs/librispeech/ASR/zipformer/zipformer.py
    # streaming_forward and streaming_decode.py give the layout of the work; the state layout here is ours) --

    def streaming_left_context(self, chunk_size: int, left_context_frames: int) -> int:
        """The cached frames (50 Hz) a stream keeps for ``chunk_size`` / ``left_context_frames``: whole chunks, as
        the chunk mask of simulated streaming allows (``left_context_frames // chunk_size`` chunks, at least
        one). Raises ValueError for a model that is not causal or values streaming cannot run with."""
        stacks = self.encoder
        if not stacks.causal:
            raise ValueError("streaming needs a causal Zipformer (train it with --encoder zipformer --causal)")
        if chunk_size <= 0 or chunk_size % 2:
            raise ValueError(f"streaming needs an even chunk size > 0 (50 Hz frames), got {chunk_size}")
        if left_context_frames <= 0:
            raise ValueError(f"streaming needs a finite left context > 0 (50 Hz frames), got {left_context_frames}; "
                             "-1 (unlimited) is for simulated streaming only")
        cs, lcc = stacks.get_chunk_info(chunk_size, left_context_frames)
        stacks.check_chunking(cs, lcc)
        return cs * lcc

    def configure_streaming(self, chunk_size: Optional[int], left_context_frames: Optional[int],
                            streaming: bool = False) -> str:
        """Fix the chunk size and left context (50 Hz frames) this causal encoder uses from now on; see
        :func:`asrprec.models.configure_streaming`, which also accepts models that are not causal."""
        stacks = self.encoder
        if not stacks.causal:
            raise ValueError("chunked decoding needs a causal Zipformer (train it with --encoder zipformer --causal)")
        if chunk_size is None:
            raise ValueError(f"this causal model was trained with chunk sizes {list(stacks.chunk_size)} and left "
                             f"contexts {list(stacks.left_context_frames)}; decoding needs one of each: pass e.g. "
                             "--chunk-size 32 --left-context-frames 256, or --chunk-size -1 for full context")
        if chunk_size != -1 and left_context_frames is None:
            raise ValueError("a chunk size needs a left context: pass --left-context-frames (e.g. 256, or -1 for all)")
        chunk = int(chunk_size)
        left = -1 if left_context_frames is None else int(left_context_frames)
        stacks.check_chunking(*stacks.get_chunk_info(chunk, left))
        if streaming:
            self.streaming_left_context(chunk, left)  # raises with the reason
        stacks.chunk_size = (chunk,)
        stacks.left_context_frames = (left,)
        tag = "causal-full-context" if chunk == -1 else f"chunk-{chunk}-left-{left}"
        return f"streaming-{tag}" if streaming else tag

    def get_init_states(self, batch_size: int, chunk_size: int, left_context_frames: int,
                        device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> List[Tensor]:
        """Initial streaming state for B streams: six caches per layer (stack by stack, layer by layer; see
        ``Zipformer2EncoderLayer.init_caches``), the front-end's ConvNeXt cache, and the (B,) int64 count of
        50 Hz frames processed. ``dtype`` defaults to the parameters' (a bf16-cast model keeps bf16 caches)."""
        left = self.streaming_left_context(chunk_size, left_context_frames)
        param = next(self.parameters())
        device = param.device if device is None else device
        dtype = param.dtype if dtype is None else dtype
        states: List[Tensor] = []
        for module in self.encoder.encoders:
            states.extend(module.init_caches(batch_size, left, device, dtype))
        states.append(self.encoder_embed.init_cache(batch_size, device, dtype))
        states.append(torch.zeros(batch_size, dtype=torch.int64, device=device))
        return states

    def _state_batch_dims(self) -> List[int]:
        """The batch dim of each state tensor: 1 for the time-major caches (keys, NonlinAttention and attention
        values), 0 for the convolution caches, the front-end cache and the frame counter."""
        n_layers = sum(m.num_layers for m in self.encoder.encoders)
        return [1, 1, 1, 1, 0, 0] * n_layers + [0, 0]

    def stack_states(self, states_list: Sequence[Sequence[Tensor]]) -> List[Tensor]:
        """Batch the states of separate streams (each from :meth:`get_init_states` with B=1 or more, same chunk
        size and left context), e.g. to add a new stream to a running pool."""
        if not states_list:
            raise ValueError("stack_states needs at least one state")
        dims = self._state_batch_dims()
        if any(len(st) != len(dims) for st in states_list):
            raise ValueError(f"every state must hold {len(dims)} tensors (from get_init_states of this encoder)")
        return [torch.cat([st[i] for st in states_list], dim=d) for i, d in enumerate(dims)]

    def unstack_states(self, states: Sequence[Tensor]) -> List[List[Tensor]]:
        """The inverse of :meth:`stack_states`: one B=1 state per stream (e.g. to drop finished streams)."""
        dims = self._state_batch_dims()
        if len(states) != len(dims):
            raise ValueError(f"a state must hold {len(dims)} tensors (from get_init_states of this encoder)")
        per_tensor = [t.split(1, dim=d) for t, d in zip(states, dims)]
        return [list(parts) for parts in zip(*per_tensor)]

    def export_streaming(self, chunk_size: int, left_context_frames: int, example_batch_size: int = 2,
                         dynamic_batch: bool = True) -> "torch.export.ExportedProgram":
        """``torch.export`` one streaming step for a fixed chunk size and left context: a graph with no Python,
        inputs ``(features (B, 2C + streaming_lookahead, F), feature_lens (B,), states)`` and the outputs of
        :meth:`streaming_forward`; B is dynamic unless ``dynamic_batch=False``. Save it with
        ``torch.export.save(program, "encoder.pt2")``, run ``torch.export.load(path).module()(...)`` with states
        from :meth:`get_init_states`; it is also what AOTInductor, ExecuTorch or ``torch.onnx.export`` take."""
        if self.training:
            raise RuntimeError("export_streaming is for inference: call model.eval() first")
        states = self.get_init_states(example_batch_size, chunk_size, left_context_frames)
        param = next(self.parameters())
        frames = 2 * chunk_size + self.streaming_lookahead
        features = torch.zeros(example_batch_size, frames, self.num_features, device=param.device, dtype=param.dtype)
        feature_lens = torch.full((example_batch_size,), frames, dtype=torch.int64, device=param.device)
        with torch.no_grad():
            self.streaming_forward(features, feature_lens, states)  # checks the inputs, fills cached tables
        dynamic_shapes = None
        if dynamic_batch:
            batch = torch.export.Dim("batch", min=1, max=4096)
            dynamic_shapes = ({0: batch}, {0: batch}, [{d: batch} for d in self._state_batch_dims()])
        return torch.export.export(_StreamingStep(self), (features, feature_lens, states),
                                   dynamic_shapes=dynamic_shapes, strict=False)

    @property
    def streaming_lookahead(self) -> int:
        """Feature frames (100 Hz) each streaming step needs after its chunk (13 with the ConvNeXt)."""
        return self.encoder_embed.streaming_lookahead

    def streaming_forward(self, features: Tensor, feature_lens: Tensor,
                          states: Sequence[Tensor]) -> Tuple[Tensor, Tensor, List[Tensor]]:
        """Encode the next chunk of B streams, in eval mode.

        Legend: B streams, C chunk size (50 Hz frames, from ``get_init_states``), F feature bins, D output dim.

        Args:
            features: (B, 2C + ``streaming_lookahead``, F): the chunk's 2C feature frames followed by the
                look-ahead frames; the next call starts 2C frames later. Pad past the end with anything.
            feature_lens: (B,) int64 valid frames in ``features`` (counted from its first frame; below the
                full length at the end of an utterance, <= 0 after it).
            states: from :meth:`get_init_states` or the previous call.
        Returns:
            (B, C/2, D) output frames (25 Hz), (B,) how many are valid, and the new states. Concatenated over
            chunks, the valid frames equal ``forward(..., chunk_size=C, left_context_frames=L)`` of the whole
            utterances (simulated streaming), up to rounding.
        """
        if self.training:
            raise RuntimeError("streaming_forward is for inference: call model.eval() first")
        stacks = self.encoder
        if features.ndim != 3 or features.shape[-1] != self.num_features:
            raise ValueError(f"features must be (B, T, {self.num_features}), got {tuple(features.shape)}")
        n_states = len(self._state_batch_dims())
        if len(states) != n_states or states[-1].shape != (features.shape[0],):
            raise ValueError(f"states must be the {n_states} tensors of get_init_states for these B="
                             f"{features.shape[0]} streams (or the previous call's), got {len(states)} tensors for "
                             f"B={states[-1].shape[0] if len(states) and states[-1].ndim else '?'}")
        left = states[0].shape[0] * stacks.downsampling_factor[0]
        chunk2 = features.shape[1] - self.streaming_lookahead
        if chunk2 <= 0 or chunk2 % 4:
            raise ValueError(f"features must hold 2 x chunk_size + {self.streaming_lookahead} frames (an even chunk "
                             f"size), got {features.shape[1]}")
        x, x_lens, embed_cache = self.encoder_embed.streaming_forward(features, feature_lens, states[-2])
        processed = states[-1]
        # cache slot j of `left` holds the frame `left - j` frames before this chunk: masked until processed
        slots = torch.arange(left, 0, -1, device=x.device)
        cache_mask = slots.unsqueeze(0) > processed.unsqueeze(1)
        mask = torch.cat((cache_mask, make_pad_mask(x_lens, x.shape[1])), dim=1)
        x, out_lens, caches = stacks.streaming_forward(x.permute(1, 0, 2), x_lens, states[:-2], left, mask)
        return x.permute(1, 0, 2), out_lens, caches + [embed_cache, processed + x_lens]


class _StreamingStep(nn.Module):
    """``encoder.streaming_forward`` as a module's forward, for ``torch.export``."""

    def __init__(self, encoder: ZipformerEncoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, features: Tensor, feature_lens: Tensor,
                states: List[Tensor]) -> Tuple[Tensor, Tensor, List[Tensor]]:
        return self.encoder.streaming_forward(features, feature_lens, states)
