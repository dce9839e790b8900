"""Zipformer attention: compact relative positional encoding, shared attention weights and their consumers.

Structure follows k2-fsa/icefall ``egs/librispeech/ASR/zipformer/zipformer.py`` (CompactRelPositionalEncoding,
RelPositionMultiheadAttentionWeights, SelfAttention, NonlinAttention); the code is ours.
Internal layout is time-major: (T, B, C). Legend: T frames, B batch, C/D channels, H heads.
"""

from __future__ import annotations

import copy
import math
import random
from typing import Optional

import torch
from torch import Tensor, nn

from .scaling import (
    Balancer,
    Dropout2,
    FloatLike,
    Linear,
    ScheduledFloat,
    Whiten,
    autocast_off,
    penalize_abs_values_gt,
    scaled_linear,
    softmax,
    whitening_schedule,
)

# Masked scores use -1000 (not -inf): representable in fp16, exp() is exactly 0, and an all-masked row stays finite.
_MASK_VALUE = -1000.0


class CompactRelPositionalEncoding(nn.Module):
    """Relative positional encoding compressed so large offsets differ little (log then atan), as Fourier
    features; the last dimension is constant 1 (a bias). Computed in fp32 (an fp32 island) and cached; the
    returned slice is cast to the activations' dtype.

    forward(x (T, B, C)) -> pos_emb (1, 2T-1, pos_dim); row j is relative offset j - (T-1).
    """

    def __init__(self, embed_dim: int, dropout_rate: FloatLike, length_factor: float = 1.0):
        super().__init__()
        if embed_dim % 2 != 0:
            raise ValueError(f"pos_dim must be even, got {embed_dim}")
        if length_factor < 1.0:
            raise ValueError(f"length_factor must be >= 1, got {length_factor}")
        self.embed_dim = embed_dim
        self.length_factor = length_factor
        self.dropout = Dropout2(dropout_rate)
        self._pe: Optional[Tensor] = None  # fp32, deliberately not a buffer: a model cast must not touch it

    def _table(self, t: int, device: torch.device) -> Tensor:
        pe = self._pe
        if pe is not None and pe.device == device and pe.shape[0] >= 2 * t - 1:
            return pe
        n = max(t, 1000 if pe is None else (pe.shape[0] + 1) // 2)
        with torch.no_grad(), autocast_off(torch.empty(0, device=device)):
            x = torch.arange(-(n - 1), n, device=device, dtype=torch.float32).unsqueeze(1)
            freqs = 1 + torch.arange(self.embed_dim // 2, device=device, dtype=torch.float32)
            c = self.embed_dim ** 0.5  # compression length
            x_comp = c * x.sign() * ((x.abs() + c).log() - math.log(c))
            length_scale = self.length_factor * self.embed_dim / (2.0 * math.pi)
            x_atan = (x_comp / length_scale).atan()
            pe = torch.zeros(x.shape[0], self.embed_dim, device=device, dtype=torch.float32)
            pe[:, 0::2] = (x_atan * freqs).cos()
            pe[:, 1::2] = (x_atan * freqs).sin()
            pe[:, -1] = 1.0
        self._pe = pe
        return pe

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[0]
        pe = self._table(t, x.device)
        center = pe.shape[0] // 2
        pos = pe[center - t + 1: center + t].unsqueeze(0).to(x.dtype)
        return self.dropout(pos)


class RelPositionMultiheadAttentionWeights(nn.Module):
    """Attention weights with relative-position scores, computed once per layer and shared by its consumers.

    forward(x (T,B,D), pos_emb (1,2T-1,P), key_padding_mask (B,T) bool True=pad, attn_mask (T,T) bool True=masked)
      -> weights (H, B, T, T) in the compute dtype, rows summing to 1.
    """

    def __init__(self, embed_dim: int, pos_dim: int, num_heads: int, query_head_dim: int, pos_head_dim: int,
                 pos_emb_skip_rate: Optional[FloatLike] = None):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.query_head_dim, self.pos_head_dim = query_head_dim, pos_head_dim
        if pos_emb_skip_rate is None:
            pos_emb_skip_rate = ScheduledFloat((0.0, 0.5), (4000.0, 0.0))
        self.pos_emb_skip_rate = copy.deepcopy(pos_emb_skip_rate)
        in_proj_dim = (2 * query_head_dim + pos_head_dim) * num_heads
        # initial scale query_head_dim**-0.25 on q and k replaces the usual 1/sqrt(d) (relies on ScaledAdam).
        self.in_proj = scaled_linear(embed_dim, in_proj_dim, bias=True, initial_scale=query_head_dim ** -0.25)
        self.whiten_keys = Whiten(num_groups=num_heads, whitening_limit=whitening_schedule(3.0),
                                  prob=(0.025, 0.25), grad_scale=0.025)
        self.balance_keys = Balancer(query_head_dim * num_heads, channel_dim=-1, min_positive=0.4,
                                     max_positive=0.6, min_abs=0.0, max_abs=100.0, prob=0.025)
        self.linear_pos = scaled_linear(pos_dim, num_heads * pos_head_dim, bias=False, initial_scale=0.05)

    def forward(self, x: Tensor, pos_emb: Tensor, key_padding_mask: Optional[Tensor] = None,
                attn_mask: Optional[Tensor] = None) -> Tensor:
        x = self.in_proj(x)
        t, b, _ = x.shape
        h, qd, pd = self.num_heads, self.query_head_dim, self.pos_head_dim
        q = x[..., : qd * h]
        k = self.whiten_keys(self.balance_keys(x[..., qd * h: 2 * qd * h]))
        p = x[..., 2 * qd * h:]

        q = q.reshape(t, b, h, qd).permute(2, 1, 0, 3)  # (H, B, T, qd)
        p = p.reshape(t, b, h, pd).permute(2, 1, 0, 3)  # (H, B, T, pd)
        k = k.reshape(t, b, h, qd).permute(2, 1, 3, 0)  # (H, B, qd, T)
        scores = torch.matmul(q, k)  # (H, B, Tq, Tk)

        if not self.training or random.random() >= float(self.pos_emb_skip_rate):
            pe = self.linear_pos(pos_emb)  # (1, 2T-1, H*pd)
            pe = pe.reshape(-1, 2 * t - 1, h, pd).permute(2, 0, 3, 1)  # (H, 1, pd, 2T-1)
            pos_scores = torch.matmul(p, pe).contiguous()  # (H, B, T, 2T-1), last axis = offset + (T-1)
            # relative -> absolute: entry (i, j) takes column (T-1) - i + j, i.e. offset j - i.
            s = pos_scores.stride()
            pos_scores = pos_scores.as_strided(
                (h, b, t, t), (s[0], s[1], s[2] - s[3], s[3]),
                storage_offset=pos_scores.storage_offset() + s[3] * (t - 1))
            scores = scores + pos_scores

        if self.training and random.random() < 0.1:
            scores = penalize_abs_values_gt(scores, limit=25.0, penalty=1.0e-4)
        if attn_mask is not None:
            scores = scores.masked_fill(attn_mask, _MASK_VALUE)
        if key_padding_mask is not None:
            scores = scores.masked_fill(key_padding_mask.unsqueeze(1), _MASK_VALUE)
        return softmax(scores, dim=-1)


class SelfAttention(nn.Module):
    """Applies precomputed attention weights to a value projection.

    forward(x (T,B,D), attn_weights (H,B,T,T)) -> (T,B,D)."""

    def __init__(self, embed_dim: int, num_heads: int, value_head_dim: int):
        super().__init__()
        self.in_proj = Linear(embed_dim, num_heads * value_head_dim, bias=True)
        self.out_proj = scaled_linear(num_heads * value_head_dim, embed_dim, bias=True, initial_scale=0.05)
        self.whiten = Whiten(num_groups=1, whitening_limit=whitening_schedule(7.5, ratio=3.0),
                             prob=(0.025, 0.25), grad_scale=0.01)

    def forward(self, x: Tensor, attn_weights: Tensor) -> Tensor:
        t, b, _ = x.shape
        h = attn_weights.shape[0]
        v = self.in_proj(x).reshape(t, b, h, -1).permute(2, 1, 0, 3)  # (H, B, T, vd)
        if attn_weights.dtype != v.dtype and not torch.is_autocast_enabled(v.device.type):
            attn_weights = attn_weights.to(v.dtype)
        v = torch.matmul(attn_weights, v)
        v = v.permute(2, 1, 0, 3).reshape(t, b, -1)
        return self.whiten(self.out_proj(v))


class NonlinAttention(nn.Module):
    """Gated "attention used as a convolution": tanh(s) gates x, which is mixed over time by one head of the
    attention weights, then multiplied by y.

    forward(x (T,B,D), attn_weights (1,B,T,T)) -> (T,B,D)."""

    def __init__(self, channels: int, hidden_channels: int):
        super().__init__()
        self.hidden_channels = hidden_channels
        self.in_proj = Linear(channels, 3 * hidden_channels, bias=True)
        self.balancer = Balancer(hidden_channels, channel_dim=-1,
                                 min_positive=ScheduledFloat((0.0, 0.25), (20000.0, 0.05)),
                                 max_positive=ScheduledFloat((0.0, 0.75), (20000.0, 0.95)),
                                 min_abs=0.5, max_abs=5.0)
        self.out_proj = scaled_linear(hidden_channels, channels, bias=True, initial_scale=0.05)
        self.whiten1 = Whiten(num_groups=1, whitening_limit=whitening_schedule(5.0), prob=(0.025, 0.25),
                              grad_scale=0.01)
        self.whiten2 = Whiten(num_groups=1, whitening_limit=whitening_schedule(5.0, ratio=3.0),
                              prob=(0.025, 0.25), grad_scale=0.01)

    def forward(self, x: Tensor, attn_weights: Tensor) -> Tensor:
        x = self.in_proj(x)
        t, b, _ = x.shape
        s, x, y = x.chunk(3, dim=-1)
        s = torch.tanh(self.balancer(s))
        x = self.whiten1(x) * s
        h = attn_weights.shape[0]
        x = x.reshape(t, b, h, -1).permute(2, 1, 0, 3)  # (h, B, T, hidden/h)
        if attn_weights.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
            attn_weights = attn_weights.to(x.dtype)
        x = torch.matmul(attn_weights, x)
        x = x.permute(2, 1, 0, 3).reshape(t, b, -1)
        x = x * y
        return self.whiten2(self.out_proj(x))
