"""Zipformer2 layer, stack, down/up-sampling and bypass.

Structure follows k2-fsa/icefall ``egs/librispeech/ASR/zipformer/zipformer.py`` (FeedforwardModule,
ConvolutionModule, BypassModule, Zipformer2EncoderLayer, Zipformer2Encoder, DownsampledZipformer2Encoder,
SimpleDownsample, SimpleUpsample) and ``zipformer/scaling.py`` (ChunkCausalDepthwiseConv1d, the bypass); the code
is ours. Layout (T, B, D): T frames, B batch, D channels.
Differences: SimpleDownsample, given the padding mask, fills each utterance's padded frames with its last valid
frame before grouping, so a padded batch gives exactly the outputs of each utterance alone (icefall mixes
padding into the last group, as ``DownsampledZipformer2Encoder(padding_invariant=False)`` does); the unused
per-layer ``bypass_scale`` parameter of icefall ("TODO remove") is left out (embed_dim fewer parameters per layer).
"""

from __future__ import annotations

import copy
import random
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from asrprec.precision.islands import compute_dtype, fp32_island, upcast

from ..schedule import FloatLike, ScheduledFloat, is_zero, schedule_value
from ..tracing import is_tracing, random_below
from .activations import ActivationDropoutAndLinear
from .conv import depthwise_conv2d
from .attention import CompactRelPositionalEncoding, NonlinAttention, RelPositionMultiheadAttentionWeights, \
    SelfAttention
from .grad_shaping import Balancer, Whiten, limit_param_value, whitening_schedule
from .linear import Linear
from .norm import BiasNorm


class FeedforwardModule(nn.Module):
    """Linear -> Balancer -> SwooshL -> dropout (shared over time) -> Linear -> Whiten. (T,B,D) -> (T,B,D)."""

    def __init__(self, embed_dim: int, feedforward_dim: int, dropout: FloatLike):
        super().__init__()
        self.in_proj = Linear(embed_dim, feedforward_dim)
        self.hidden_balancer = Balancer(feedforward_dim, channel_dim=-1, min_positive=0.3, max_positive=1.0,
                                        min_abs=0.75, max_abs=5.0)
        self.out_proj = ActivationDropoutAndLinear(feedforward_dim, embed_dim, activation="SwooshL",
                                                   dropout_p=dropout, dropout_shared_dim=0, bias=True,
                                                   initial_scale=0.1)
        self.out_whiten = Whiten(num_groups=1, whitening_limit=whitening_schedule(7.5), prob=(0.025, 0.25),
                                 grad_scale=0.01)

    def forward(self, x: Tensor) -> Tensor:
        return self.out_whiten(self.out_proj(self.hidden_balancer(self.in_proj(x))))


class ChunkCausalDepthwiseConv1d(nn.Module):
    """Depthwise Conv1d usable in chunked streaming: a causal conv over the left half of the kernel plus a
    full-kernel conv applied within each chunk (so nothing right of the chunk is seen), scaled by learned
    per-position corrections near chunk edges. (icefall scaling.py ``ChunkCausalDepthwiseConv1d``.)

    Input/output (B, C, T)."""

    def __init__(self, channels: int, kernel_size: int, initial_scale: float = 1.0, bias: bool = True):
        super().__init__()
        if kernel_size % 2 != 1:
            raise ValueError(f"kernel_size must be odd, got {kernel_size}")
        half = (kernel_size + 1) // 2
        self.causal_conv = nn.Conv1d(channels, channels, groups=channels, kernel_size=half, bias=True)
        self.chunkwise_conv = nn.Conv1d(channels, channels, groups=channels, kernel_size=kernel_size,
                                        padding=kernel_size // 2, bias=bias)
        # row 0: corrections near the chunk's left edge; row 1: near its right edge (added to a scale of 1).
        self.chunkwise_conv_scale = nn.Parameter(torch.zeros(2, channels, kernel_size))
        self.kernel_size = kernel_size
        with torch.no_grad():
            self.causal_conv.weight.mul_(initial_scale)
            self.chunkwise_conv.weight.mul_(initial_scale)
            nn.init.uniform_(self.causal_conv.bias, -0.1 * initial_scale, 0.1 * initial_scale)

    def _chunk_scale(self, chunk_size: int, dtype: torch.dtype) -> Tensor:
        left, right = self.chunkwise_conv_scale[0], self.chunkwise_conv_scale[1]
        k = self.kernel_size
        if chunk_size < k:
            left, right = left[:, :chunk_size], right[:, -chunk_size:]
        else:
            pad = torch.zeros(left.shape[0], chunk_size - k, device=left.device, dtype=left.dtype)
            left, right = torch.cat((left, pad), dim=-1), torch.cat((pad, right), dim=-1)
        return (1.0 + left + right).to(dtype)

    def forward(self, x: Tensor, chunk_size: int = -1) -> Tensor:
        b, c, t = x.shape
        left_pad = self.kernel_size // 2
        if chunk_size < 0 or chunk_size > t:
            chunk_size = t
        right_pad = -t % chunk_size
        x = F.pad(x, (left_pad, right_pad))
        x_causal = self.causal_conv(x[..., : left_pad + t])
        xc = x[..., left_pad:]
        n = xc.shape[2] // chunk_size
        xc = xc.reshape(b, c, n, chunk_size).permute(0, 2, 1, 3).reshape(b * n, c, chunk_size)
        xc = self.chunkwise_conv(xc)
        xc = xc * self._chunk_scale(chunk_size, xc.dtype)
        xc = xc.reshape(b, n, c, chunk_size).permute(0, 2, 1, 3).reshape(b, c, n * chunk_size)[..., :t]
        return xc + x_causal

    def streaming_forward(self, x: Tensor, cache: Tensor) -> Tuple[Tensor, Tensor]:
        """One whole chunk x (B, C, T) after ``cache`` (B, C, kernel_size // 2), the frames just before it.

        Returns the same (B, C, T) as :meth:`forward` gives for this chunk inside a longer input, and the new
        cache: the last kernel_size // 2 frames of cache + x."""
        left_pad = self.kernel_size // 2
        x_full = torch.cat((cache.to(x.dtype), x), dim=2)
        x_causal = self.causal_conv(x_full)
        xc = self.chunkwise_conv(x) * self._chunk_scale(x.shape[2], x.dtype)
        return xc + x_causal, x_full[..., x_full.shape[2] - left_pad:]


class ConvolutionModule(nn.Module):
    """Linear(D,2D) -> GLU-like sigmoid gate -> zero padded frames -> depthwise conv -> SwooshR -> Linear.

    forward(x (T,B,D), key_padding_mask (B,T) or None, chunk_size) -> (T,B,D)."""

    def __init__(self, channels: int, kernel_size: int, causal: bool):
        super().__init__()
        if kernel_size % 2 != 1:
            raise ValueError(f"cnn_module_kernel must be odd, got {kernel_size}")
        self.causal = causal
        self.in_proj = Linear(channels, 2 * channels)
        self.balancer1 = Balancer(channels, channel_dim=-1,
                                  min_positive=ScheduledFloat((0.0, 0.05), (8000.0, 0.025)), max_positive=1.0,
                                  min_abs=1.5, max_abs=ScheduledFloat((0.0, 5.0), (8000.0, 10.0), default=1.0))
        if causal:
            self.depthwise_conv = ChunkCausalDepthwiseConv1d(channels, kernel_size)
        else:
            self.depthwise_conv = nn.Conv1d(channels, channels, groups=channels, kernel_size=kernel_size,
                                            padding=kernel_size // 2)
        self.balancer2 = Balancer(channels, channel_dim=1,
                                  min_positive=ScheduledFloat((0.0, 0.1), (8000.0, 0.05)), max_positive=1.0,
                                  min_abs=ScheduledFloat((0.0, 0.2), (20000.0, 0.5)), max_abs=10.0)
        self.whiten = Whiten(num_groups=1, whitening_limit=whitening_schedule(7.5), prob=(0.025, 0.25),
                             grad_scale=0.01)
        self.out_proj = ActivationDropoutAndLinear(channels, channels, activation="SwooshR", dropout_p=0.0,
                                                   initial_scale=0.05)

    def forward(self, x: Tensor, key_padding_mask: Optional[Tensor] = None, chunk_size: int = -1) -> Tensor:
        x = self.in_proj(x)
        x, s = x.chunk(2, dim=-1)
        x = x * torch.sigmoid(self.balancer1(s))
        if self.causal:
            x = x.permute(1, 2, 0)  # (B, D, T)
            if key_padding_mask is not None:
                x = x.masked_fill(key_padding_mask.unsqueeze(1), 0.0)
            x = self.depthwise_conv(x, chunk_size=chunk_size)
        else:
            x = x.transpose(0, 1).contiguous()  # (B, T, D)
            if key_padding_mask is not None:
                x = x.masked_fill(key_padding_mask.unsqueeze(-1), 0.0)
            # The depthwise conv as a 2-D conv over (B, D, 1, T) in channels-last memory, i.e. on the (B, T, D)
            # tensor without a transpose: oneDNN's depthwise kernels are 1.1-1.65x faster this way on CPU
            # (forward plus backward, tiny shapes, benchmarks/RESULTS.md) than nn.Conv1d on (B, D, T).
            # Same weights and math.
            # (asrprec.models.zipformer.conv keeps that layout under torch.compile too)
            w = self.depthwise_conv.weight
            x = depthwise_conv2d(x.permute(0, 2, 1).unsqueeze(2), w.unsqueeze(2), self.depthwise_conv.bias,
                                 (0, w.shape[-1] // 2)).squeeze(2)  # (B, D, T)
        x = self.balancer2(x).permute(2, 0, 1)  # (T, B, D)
        return self.out_proj(self.whiten(x))

    def streaming_forward(self, x: Tensor, cache: Tensor,
                          key_padding_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """One chunk of a causal module: x (T,B,D), cache (B,D,kernel//2), key_padding_mask (B,T) of this chunk.
        Returns ((T,B,D), new cache)."""
        if not self.causal:
            raise RuntimeError("streaming needs a causal convolution module (build the encoder with causal=True)")
        x = self.in_proj(x)
        x, s = x.chunk(2, dim=-1)
        x = (x * torch.sigmoid(self.balancer1(s))).permute(1, 2, 0)  # (B, D, T)
        if key_padding_mask is not None:
            x = x.masked_fill(key_padding_mask.unsqueeze(1), 0.0)
        x, cache = self.depthwise_conv.streaming_forward(x, cache)
        x = self.balancer2(x).permute(2, 0, 1)  # (T, B, D)
        return self.out_proj(self.whiten(x)), cache


class _BypassFunction(torch.autograd.Function):
    """out = src_orig + (src - src_orig) * scale, saving the difference in the compute dtype (not fp32 under
    autocast) and the scale; used by BypassModule (icefall computes it with plain ops, which keep an fp32 copy)."""

    @staticmethod
    def forward(ctx, src_orig: Tensor, src: Tensor, scale: Tensor) -> Tensor:
        diff = src - src_orig
        out = src_orig + diff * scale
        ctx.save_for_backward(diff.to(compute_dtype(src)), scale)
        ctx.dtypes = (src_orig.dtype, src.dtype)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        diff, scale = ctx.saved_tensors
        g_orig = g_src = g_scale = None
        with fp32_island():
            gs = g * scale.to(g.dtype)
            if ctx.needs_input_grad[1]:
                g_src = gs.to(ctx.dtypes[1])
            if ctx.needs_input_grad[0]:
                g_orig = (g - gs).to(ctx.dtypes[0])
            if ctx.needs_input_grad[2]:
                prod = upcast(g) * upcast(diff).to(upcast(g).dtype)
                dims = tuple(range(prod.ndim - scale.ndim))
                if scale.ndim == 2:  # (B, C) against (T, B, C)
                    dims = (0,)
                g_scale = prod.sum(dim=dims).to(scale.dtype)
        return g_orig, g_src, g_scale


def bypass(src_orig: Tensor, src: Tensor, scale: Tensor) -> Tensor:
    if not torch.is_grad_enabled():
        return src_orig + (src - src_orig) * scale
    return _BypassFunction.apply(src_orig, src, scale)


class BypassModule(nn.Module):
    """out = src_orig + c * (src - src_orig) with learned per-channel c (init 0.5); in training c is kept in
    [scale_min, scale_max] and set to 0 for a random ``skip_rate`` of sequences (layer skipping)."""

    def __init__(self, embed_dim: int, skip_rate: FloatLike = 0.0, straight_through_rate: FloatLike = 0.0,
                 scale_min: Optional[FloatLike] = None, scale_max: FloatLike = 1.0):
        super().__init__()
        if scale_min is None:
            scale_min = ScheduledFloat((0.0, 0.9), (20000.0, 0.2), default=0.0)
        self.bypass_scale = nn.Parameter(torch.full((embed_dim,), 0.5))
        self.skip_rate = copy.deepcopy(skip_rate)
        self.straight_through_rate = copy.deepcopy(straight_through_rate)
        self.scale_min = copy.deepcopy(scale_min)
        self.scale_max = copy.deepcopy(scale_max)

    def _scale(self, batch_size: int) -> Tensor:
        if not self.training:
            return self.bypass_scale
        ans = limit_param_value(self.bypass_scale, schedule_value(self.scale_min), schedule_value(self.scale_max))
        skip = schedule_value(self.skip_rate)
        if not is_zero(skip):
            ans = ans * (torch.rand((batch_size, 1), device=ans.device) > skip).to(ans.dtype)
        st = schedule_value(self.straight_through_rate)
        if not is_zero(st):
            ans = torch.maximum(ans, (torch.rand((batch_size, 1), device=ans.device) < st).to(ans.dtype))
        return ans

    def forward(self, src_orig: Tensor, src: Tensor) -> Tensor:
        return bypass(src_orig, src, self._scale(src.shape[1]))


def _sequence_mask(x: Tensor, rate: Union[float, Tensor], training: bool) -> Optional[Tensor]:
    if not training or is_zero(rate):
        return None
    return (torch.rand(x.shape[1], 1, device=x.device) > rate).to(x.dtype)


def _apply_mask(x: Tensor, mask: Optional[Tensor]) -> Tensor:
    return x if mask is None else x * mask


class Zipformer2EncoderLayer(nn.Module):
    """One Zipformer2 layer: attention weights once; FF1, NonlinAttention, SelfAttention1, Conv1, FF2, mid bypass,
    SelfAttention2 (same weights), Conv2, FF3, Balancer, BiasNorm, bypass, Balancer, Whiten.

    forward(src (T,B,D), pos_emb (1,2T-1,P), chunk_size, attn_mask (T,T), key_padding_mask (B,T)) -> (T,B,D)."""

    def __init__(self, embed_dim: int, pos_dim: int, num_heads: int, query_head_dim: int, pos_head_dim: int,
                 value_head_dim: int, feedforward_dim: int, dropout: FloatLike = 0.1, cnn_module_kernel: int = 31,
                 causal: bool = False):
        super().__init__()
        self.embed_dim = embed_dim
        self.bypass = BypassModule(embed_dim, skip_rate=ScheduledFloat((0.0, 0.5), (4000.0, 0.02), default=0.0))
        self.bypass_mid = BypassModule(embed_dim)
        self.attention_skip_rate = ScheduledFloat((0.0, 0.2), (4000.0, 0.05), (16000.0, 0.0), default=0.0)
        self.conv_skip_rate = ScheduledFloat((0.0, 0.2), (4000.0, 0.05), (16000.0, 0.0), default=0.0)
        self.ff2_skip_rate = ScheduledFloat((0.0, 0.1), (4000.0, 0.01), (50000.0, 0.0))
        self.ff3_skip_rate = ScheduledFloat((0.0, 0.1), (4000.0, 0.01), (50000.0, 0.0))
        self.const_attention_rate = ScheduledFloat((0.0, 0.25), (4000.0, 0.025), default=0.0)

        self.self_attn_weights = RelPositionMultiheadAttentionWeights(
            embed_dim, pos_dim=pos_dim, num_heads=num_heads, query_head_dim=query_head_dim,
            pos_head_dim=pos_head_dim)
        self.self_attn1 = SelfAttention(embed_dim, num_heads, value_head_dim)
        self.self_attn2 = SelfAttention(embed_dim, num_heads, value_head_dim)
        self.feed_forward1 = FeedforwardModule(embed_dim, (feedforward_dim * 3) // 4, dropout)
        self.feed_forward2 = FeedforwardModule(embed_dim, feedforward_dim, dropout)
        self.feed_forward3 = FeedforwardModule(embed_dim, (feedforward_dim * 5) // 4, dropout)
        self.nonlin_attention = NonlinAttention(embed_dim, hidden_channels=3 * embed_dim // 4)
        self.conv_module1 = ConvolutionModule(embed_dim, cnn_module_kernel, causal=causal)
        self.conv_module2 = ConvolutionModule(embed_dim, cnn_module_kernel, causal=causal)
        self.norm = BiasNorm(embed_dim)

        self.balancer1 = Balancer(embed_dim, channel_dim=-1, min_positive=0.45, max_positive=0.55, min_abs=0.2,
                                  max_abs=4.0)
        self.balancer_na = Balancer(embed_dim, channel_dim=-1, min_positive=0.3, max_positive=0.7,
                                    min_abs=ScheduledFloat((0.0, 0.004), (4000.0, 0.02)), prob=0.05)
        self.balancer_ff2 = Balancer(embed_dim, channel_dim=-1, min_positive=0.3, max_positive=0.7,
                                     min_abs=ScheduledFloat((0.0, 0.0), (4000.0, 0.1), default=0.0), max_abs=2.0,
                                     prob=0.05)
        self.balancer_ff3 = Balancer(embed_dim, channel_dim=-1, min_positive=0.3, max_positive=0.7,
                                     min_abs=ScheduledFloat((0.0, 0.0), (4000.0, 0.2), default=0.0), max_abs=4.0,
                                     prob=0.05)
        self.whiten = Whiten(num_groups=1, whitening_limit=whitening_schedule(4.0, ratio=3.0),
                             prob=(0.025, 0.25), grad_scale=0.01)
        self.balancer2 = Balancer(embed_dim, channel_dim=-1, min_positive=0.45, max_positive=0.55, min_abs=0.1,
                                  max_abs=4.0)

    def forward(self, src: Tensor, pos_emb: Tensor, chunk_size: int = -1, attn_mask: Optional[Tensor] = None,
                key_padding_mask: Optional[Tensor] = None) -> Tensor:
        src_orig = src
        tr = self.training
        attn_mask_seq = _sequence_mask(src, schedule_value(self.attention_skip_rate) if tr else 0.0, tr)
        attn_weights = self.self_attn_weights(src, pos_emb=pos_emb, attn_mask=attn_mask,
                                              key_padding_mask=key_padding_mask)
        src = src + self.feed_forward1(src)

        selected = attn_weights[0:1]
        if tr and is_tracing():
            # the same draw; the graph selects between both weightings instead of branching
            uniform = (selected > 0.0).to(selected.dtype)
            uniform = uniform * (1.0 / uniform.sum(dim=-1, keepdim=True))
            selected = torch.where(random_below(schedule_value(self.const_attention_rate)), uniform, selected)
        elif tr and random.random() < float(self.const_attention_rate):
            # replace by uniform averaging over the unmasked keys (pushes NonlinAttention towards averaging)
            selected = (selected > 0.0).to(selected.dtype)
            selected = selected * (1.0 / selected.sum(dim=-1, keepdim=True))
        na = self.balancer_na(self.nonlin_attention(src, selected))
        src = src + _apply_mask(na, attn_mask_seq)
        src = src + _apply_mask(self.self_attn1(src, attn_weights), attn_mask_seq)

        conv_rate = schedule_value(self.conv_skip_rate) if tr else 0.0
        src = src + _apply_mask(self.conv_module1(src, key_padding_mask, chunk_size),
                                _sequence_mask(src, conv_rate, tr))
        ff2_rate = schedule_value(self.ff2_skip_rate) if tr else 0.0
        src = src + _apply_mask(self.balancer_ff2(self.feed_forward2(src)), _sequence_mask(src, ff2_rate, tr))

        src = self.bypass_mid(src_orig, src)

        src = src + _apply_mask(self.self_attn2(src, attn_weights), attn_mask_seq)
        src = src + _apply_mask(self.conv_module2(src, key_padding_mask, chunk_size),
                                _sequence_mask(src, conv_rate, tr))
        ff3_rate = schedule_value(self.ff3_skip_rate) if tr else 0.0
        src = src + _apply_mask(self.balancer_ff3(self.feed_forward3(src)), _sequence_mask(src, ff3_rate, tr))

        src = self.norm(self.balancer1(src))
        src = self.bypass(src_orig, src)
        return self.whiten(self.balancer2(src))

    def streaming_forward(self, src: Tensor, pos_emb: Tensor, caches: Sequence[Tensor],
                          key_padding_mask: Optional[Tensor] = None) -> Tuple[Tensor, List[Tensor]]:
        """One chunk in eval mode (no skipping or masking): src (T,B,D), pos_emb (1,L+2T-1,P),
        key_padding_mask (B,L+T), caches as in :meth:`init_caches`. Returns ((T,B,D), new caches)."""
        cached_key, cached_nonlin, cached_val1, cached_val2, cached_conv1, cached_conv2 = caches
        left = cached_key.shape[0]
        chunk_mask = None if key_padding_mask is None else key_padding_mask[:, left:]
        src_orig = src
        attn_weights, cached_key = self.self_attn_weights.streaming_forward(src, pos_emb, cached_key,
                                                                            key_padding_mask)
        src = src + self.feed_forward1(src)
        na, cached_nonlin = self.nonlin_attention.streaming_forward(src, attn_weights[0:1], cached_nonlin)
        src = src + self.balancer_na(na)
        sa, cached_val1 = self.self_attn1.streaming_forward(src, attn_weights, cached_val1)
        src = src + sa
        conv, cached_conv1 = self.conv_module1.streaming_forward(src, cached_conv1, chunk_mask)
        src = src + conv
        src = src + self.balancer_ff2(self.feed_forward2(src))

        src = self.bypass_mid(src_orig, src)

        sa, cached_val2 = self.self_attn2.streaming_forward(src, attn_weights, cached_val2)
        src = src + sa
        conv, cached_conv2 = self.conv_module2.streaming_forward(src, cached_conv2, chunk_mask)
        src = src + conv
        src = src + self.balancer_ff3(self.feed_forward3(src))

        src = self.norm(self.balancer1(src))
        src = self.bypass(src_orig, src)
        return self.whiten(self.balancer2(src)), [cached_key, cached_nonlin, cached_val1, cached_val2,
                                                  cached_conv1, cached_conv2]

    def init_caches(self, batch_size: int, left_context_len: int, device: Optional[torch.device] = None,
                    dtype: Optional[torch.dtype] = None) -> List[Tensor]:
        """Zero caches for streaming: keys (L,B,H*qd), NonlinAttention values (L,B,hidden), values of the two
        self-attentions (L,B,H*vd) each, and the two convolutions' left context (B,D,kernel//2) each."""
        w = self.self_attn_weights
        conv = self.conv_module1.depthwise_conv
        if not isinstance(conv, ChunkCausalDepthwiseConv1d):
            raise RuntimeError("streaming needs a causal encoder (build it with causal=True)")
        kw = dict(device=device, dtype=dtype)
        b, L = batch_size, left_context_len
        return [
            torch.zeros(L, b, w.num_heads * w.query_head_dim, **kw),
            torch.zeros(L, b, self.nonlin_attention.hidden_channels, **kw),
            torch.zeros(L, b, self.self_attn1.in_proj.out_features, **kw),
            torch.zeros(L, b, self.self_attn2.in_proj.out_features, **kw),
            torch.zeros(b, self.embed_dim, conv.kernel_size // 2, **kw),
            torch.zeros(b, self.embed_dim, conv.kernel_size // 2, **kw),
        ]


class Zipformer2Encoder(nn.Module):
    """A stack of ``num_layers`` copies of a layer sharing one positional encoding; layer i's bypass skip rate
    warms up from ``initial_layerdrop_rate`` to ``final_layerdrop_rate`` in its slice of
    [warmup_begin, warmup_end] batches.

    forward(src (T,B,D), chunk_size, feature_mask (1,B,D) or 1.0, attn_mask (T,T), key_padding_mask (B,T))."""

    def __init__(self, encoder_layer: Zipformer2EncoderLayer, num_layers: int, pos_dim: int, warmup_begin: float,
                 warmup_end: float, initial_layerdrop_rate: float = 0.5, final_layerdrop_rate: float = 0.05):
        super().__init__()
        if not 0 <= warmup_begin <= warmup_end:
            raise ValueError(f"need 0 <= warmup_begin <= warmup_end, got {warmup_begin}, {warmup_end}")
        self.encoder_pos = CompactRelPositionalEncoding(pos_dim, dropout_rate=0.15, length_factor=1.0)
        self.layers = nn.ModuleList([copy.deepcopy(encoder_layer) for _ in range(num_layers)])
        self.num_layers = num_layers
        delta = (warmup_end - warmup_begin) / num_layers
        begin = warmup_begin
        for layer in self.layers:
            layer.bypass.skip_rate = ScheduledFloat((begin, initial_layerdrop_rate),
                                                    (begin + delta, final_layerdrop_rate), default=0.0)
            begin += delta

    def forward(self, src: Tensor, chunk_size: int = -1, feature_mask: Union[Tensor, float] = 1.0,
                attn_mask: Optional[Tensor] = None, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        pos_emb = self.encoder_pos(src)
        out = src * feature_mask
        for layer in self.layers:
            out = layer(out, pos_emb, chunk_size=chunk_size, attn_mask=attn_mask,
                        key_padding_mask=key_padding_mask)
            out = out * feature_mask
        return out

    def streaming_forward(self, src: Tensor, caches: Sequence[Tensor], left_context_len: int,
                          key_padding_mask: Optional[Tensor] = None) -> Tuple[Tensor, List[Tensor]]:
        """One chunk: src (T,B,D), six caches per layer, key_padding_mask (B, left_context_len+T)."""
        pos_emb = self.encoder_pos(src, left_context_len)
        new_caches: List[Tensor] = []
        for i, layer in enumerate(self.layers):
            src, c = layer.streaming_forward(src, pos_emb, caches[6 * i: 6 * i + 6], key_padding_mask)
            new_caches.extend(c)
        return src, new_caches

    def init_caches(self, batch_size: int, left_context_len: int, device: Optional[torch.device] = None,
                    dtype: Optional[torch.dtype] = None) -> List[Tensor]:
        return [c for layer in self.layers for c in layer.init_caches(batch_size, left_context_len, device, dtype)]


def _ds_mask(mask: Optional[Tensor], ds: int) -> Optional[Tensor]:
    # contiguous: a strided view's row stride is T while its length is ceil(T / ds), so where the mask crosses a
    # graph break (the position-score skip) dynamo guards on whether ds divides T and compiles a graph per case
    return None if mask is None else mask[:, ::ds].contiguous()


class _SimpleDownsampleFunction(torch.autograd.Function):
    """out[i] = sum_k softmax(bias)[k] * src[i*ds + k], the last frame repeated to fill the last group.

    Saves only the unpadded input (a plain ``(src * w).sum()`` saves a padded copy); it is needed only for the
    gradient of the ``ds`` weights. Legend: T frames, B batch, C channels.
    """

    @staticmethod
    def forward(ctx, src: Tensor, bias: Tensor, ds: int) -> Tensor:
        t, b, c = src.shape
        d_t = (t + ds - 1) // ds
        pad = d_t * ds - t
        with fp32_island():
            w = upcast(bias).softmax(dim=0)
            if is_tracing():
                # the same frames by indexing (last index repeated): a graph for every T, with no branch on T
                src_p = src.index_select(0, torch.arange(d_t * ds, device=src.device).clamp(max=t - 1))
            else:
                src_p = torch.cat((src, src[t - 1:].expand(pad, b, c)), dim=0) if pad else src
            out = (src_p.reshape(d_t, ds, b, c) * w.to(src.dtype).reshape(1, ds, 1, 1)).sum(dim=1)
        # in its own dtype: the weights' gradient cancels strongly (adjacent frames are alike), so a bf16 copy
        # would make it mostly noise
        ctx.save_for_backward(src, w)
        ctx.ds, ctx.src_dtype, ctx.bias_dtype = ds, src.dtype, bias.dtype
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        src, w = ctx.saved_tensors
        ds = ctx.ds
        t, b, c = src.shape
        d_t = g.shape[0]
        pad = d_t * ds - t
        g_src = g_bias = None
        with fp32_island():
            if ctx.needs_input_grad[0]:
                gp = (g.unsqueeze(1) * w.to(g.dtype).reshape(1, ds, 1, 1)).reshape(d_t * ds, b, c)
                if is_tracing():
                    # no branch on T, and no tensor sized by the padding (a size that can be 1 makes AOTAutograd
                    # guard the graph on T mod ds): the padded rows, all in the last group, selected from it by
                    # position and summed into the last frame's row
                    last = gp[(d_t - 1) * ds:]  # (ds, B, C)
                    padded = torch.arange(ds, device=gp.device) + (d_t - 1) * ds >= t
                    extra = torch.where(padded.reshape(ds, 1, 1), last, 0).sum(dim=0, keepdim=True)
                    g_src = torch.cat((gp[:t - 1], gp[t - 1:t] + extra), dim=0)
                else:
                    g_src = gp[:t]
                    if pad:
                        g_src = g_src.clone()
                        g_src[t - 1] += gp[t:].sum(dim=0)
                g_src = g_src.to(ctx.src_dtype)
            if ctx.needs_input_grad[1]:
                if is_tracing():  # as in forward: the padded frames by indexing, no branch on T
                    src_p = src.index_select(0, torch.arange(d_t * ds, device=src.device).clamp(max=t - 1))
                else:
                    src_p = torch.cat((src, src[t - 1:].expand(pad, b, c)), dim=0) if pad else src
                # d loss / d w_k = sum_{i,b,c} g[i] * src[i*ds + k], accumulated in fp32
                acc = torch.promote_types(w.dtype, torch.float32)  # fp32 (fp64 for an fp64 model)
                gw = torch.einsum("ikn,in->k", src_p.reshape(d_t, ds, b * c).to(acc), g.reshape(d_t, b * c).to(acc))
                g_bias = (w * (gw - (gw * w).sum())).to(ctx.bias_dtype)  # softmax backward
        return g_src, g_bias, None


class SimpleDownsample(nn.Module):
    """Softmax-weighted sum of each group of ``downsample`` frames (``downsample`` learned weights).

    forward(src (T,B,D), key_padding_mask (B,T) or None) -> (ceil(T/ds), B, D)."""

    def __init__(self, downsample: int):
        super().__init__()
        self.downsample = downsample
        self.bias = nn.Parameter(torch.zeros(downsample))

    def forward(self, src: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        t, b, c = src.shape
        # (the .any() test saves a copy when nothing is padded; an exported graph cannot branch on data)
        if key_padding_mask is not None and (is_tracing() or bool(key_padding_mask.any())):
            # repeat each utterance's last valid frame over its padding, as if it were alone in the batch.
            lens = (~key_padding_mask).sum(dim=1).clamp(min=1)
            idx = torch.minimum(torch.arange(t, device=src.device).unsqueeze(1), (lens - 1).unsqueeze(0))
            src = src.gather(0, idx.unsqueeze(-1).expand(t, b, c))
        return _SimpleDownsampleFunction.apply(src, self.bias, self.downsample)


class SimpleUpsample(nn.Module):
    """Repeat each frame ``upsample`` times: (T,B,D) -> (T*upsample,B,D)."""

    def __init__(self, upsample: int):
        super().__init__()
        self.upsample = upsample

    def forward(self, src: Tensor) -> Tensor:
        t, b, c = src.shape
        return src.unsqueeze(1).expand(t, self.upsample, b, c).reshape(t * self.upsample, b, c)


class DownsampledZipformer2Encoder(nn.Module):
    """Downsample by ``downsample``, run the stack, upsample, crop, and combine with the input by a bypass.

    forward(src (T,B,D), chunk_size, feature_mask, attn_mask (T,T), key_padding_mask (B,T) at the input rate).
    ``padding_invariant=False`` downsamples a padded utterance's last group with the padding's frames, as icefall's
    DownsampledZipformer2Encoder.forward does (zipformer.py); streaming is padding-invariant either way."""

    def __init__(self, encoder: Zipformer2Encoder, dim: int, downsample: int, padding_invariant: bool = True):
        super().__init__()
        self.padding_invariant = padding_invariant
        self.downsample_factor = downsample
        self.downsample = SimpleDownsample(downsample)
        self.encoder = encoder
        self.num_layers = encoder.num_layers
        self.upsample = SimpleUpsample(downsample)
        self.out_combiner = BypassModule(dim, straight_through_rate=0)

    def forward(self, src: Tensor, chunk_size: int = -1, feature_mask: Union[Tensor, float] = 1.0,
                attn_mask: Optional[Tensor] = None, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        src_orig = src
        ds = self.downsample_factor
        src = self.downsample(src, key_padding_mask if self.padding_invariant else None)
        src = self.encoder(src, chunk_size=chunk_size // ds if chunk_size > 0 else chunk_size,
                           feature_mask=feature_mask,
                           attn_mask=None if attn_mask is None else attn_mask[::ds, ::ds].contiguous(),
                           key_padding_mask=_ds_mask(key_padding_mask, ds))
        src = self.upsample(src)[: src_orig.shape[0]]
        return self.out_combiner(src_orig, src)

    def streaming_forward(self, src: Tensor, caches: Sequence[Tensor], left_context_len: int,
                          key_padding_mask: Optional[Tensor] = None) -> Tuple[Tensor, List[Tensor]]:
        """One chunk at the input rate: src (T,B,D) with T and ``left_context_len`` multiples of the factor,
        key_padding_mask (B, left_context_len+T)."""
        src_orig = src
        ds = self.downsample_factor
        chunk_mask = None if key_padding_mask is None else key_padding_mask[:, left_context_len:]
        src = self.downsample(src, chunk_mask)
        src, caches = self.encoder.streaming_forward(src, caches, left_context_len // ds,
                                                     _ds_mask(key_padding_mask, ds))
        src = self.upsample(src)[: src_orig.shape[0]]
        return self.out_combiner(src_orig, src), caches

    def init_caches(self, batch_size: int, left_context_len: int, device: Optional[torch.device] = None,
                    dtype: Optional[torch.dtype] = None) -> List[Tensor]:
        return self.encoder.init_caches(batch_size, left_context_len // self.downsample_factor, device, dtype)
