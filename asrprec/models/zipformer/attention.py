"""Zipformer attention: compact relative positional encoding, shared attention weights and their consumers.

Structure follows k2-fsa/icefall ``egs/librispeech/ASR/zipformer/zipformer.py`` (CompactRelPositionalEncoding,
RelPositionMultiheadAttentionWeights, SelfAttention, NonlinAttention); the code is ours.
Internal layout is time-major: (T, B, C). Legend: T frames, B batch, C/D channels, H heads.
"""

from __future__ import annotations

import copy
import math
import random
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from asrprec.precision.islands import autocast_dtype, fp32_island

from ..schedule import FloatLike, ScheduledFloat
from ..tracing import is_tracing, random_below
from .activations import softmax
from .dropout import Dropout2
from .grad_shaping import Balancer, Whiten, penalize_abs_values_gt, whitening_schedule
from .linear import Linear, scaled_linear

# Masked scores use -1000 (not -inf): representable in fp16, exp() is exactly 0, and an all-masked row stays finite.
_MASK_VALUE = -1000.0


class CompactRelPositionalEncoding(nn.Module):
    """Relative positional encoding compressed so large offsets differ little (log then atan), as Fourier
    features; the last dimension is constant 1 (a bias). Computed in fp32 (an fp32 island) and cached; the
    returned slice is cast to the activations' dtype.

    forward(x (T, B, C)) -> pos_emb (1, 2T-1, pos_dim); row j is relative offset j - (T-1). With
    ``left_context_len`` L (streaming): (1, L+2T-1, pos_dim), row j is offset j - (L+T-1).
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

    @fp32_island
    def _encode(self, offsets: Tensor) -> Tensor:
        """(N,) float32 relative offsets -> (N, pos_dim) float32 encodings."""
        x = offsets.unsqueeze(1)
        freqs = 1 + torch.arange(self.embed_dim // 2, device=x.device, dtype=torch.float32)
        c = self.embed_dim ** 0.5  # compression length
        x_comp = c * x.sign() * ((x.abs() + c).log() - math.log(c))
        length_scale = self.length_factor * self.embed_dim / (2.0 * math.pi)
        x_atan = (x_comp / length_scale).atan()
        # interleaved cos/sin columns, the last one overwritten by the constant 1
        pe = torch.stack(((x_atan * freqs).cos(), (x_atan * freqs).sin()), dim=-1).reshape(x.shape[0], -1)
        return torch.cat((pe[:, :-1], torch.ones_like(pe[:, -1:])), dim=1)

    def _table(self, t: int, device: torch.device) -> Tensor:
        pe = self._pe
        if pe is not None and pe.device == device and pe.shape[0] >= 2 * t - 1:
            return pe
        n = max(t, 1000 if pe is None else (pe.shape[0] + 1) // 2)
        with torch.no_grad():
            pe = self._encode(torch.arange(-(n - 1), n, device=device, dtype=torch.float32))
        self._pe = pe
        return pe

    def forward(self, x: Tensor, left_context_len: int = 0) -> Tensor:
        """x (T, B, C) -> (1, left_context_len + 2T - 1, pos_dim): offsets -(left_context_len + T - 1) .. T - 1,
        for T queries attending to ``left_context_len`` cached keys and the T current ones (streaming)."""
        t = x.shape[0]
        n = t + left_context_len
        if is_tracing():
            # an exported graph computes the rows for its own length (no cached table, no bound on T)
            pos = self._encode(torch.arange(-(n - 1), t, device=x.device, dtype=torch.float32))
            return self.dropout(pos.unsqueeze(0).to(x.dtype))
        pe = self._table(n, x.device)
        center = pe.shape[0] // 2
        pos = pe[center - n + 1: center + t].unsqueeze(0).to(x.dtype)
        return self.dropout(pos)


@torch.compiler.disable
def _draw_below(rate: FloatLike) -> bool:
    """``random.random() < rate`` outside any compiled graph (see the position-score skip below); reading a
    schedule here keeps the graph from specialising on the batch count."""
    return random.random() < float(rate)


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

    def _project(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """(T,B,D) -> query (T,B,H*qd), key (T,B,H*qd), positional query (T,B,H*pd)."""
        x = self.in_proj(x)
        h, qd = self.num_heads, self.query_head_dim
        k = self.whiten_keys(self.balance_keys(x[..., qd * h: 2 * qd * h]))
        return x[..., : qd * h], k, x[..., 2 * qd * h:]

    def _weights(self, q: Tensor, k: Tensor, p: Tensor, pos_emb: Tensor, key_padding_mask: Optional[Tensor],
                 attn_mask: Optional[Tensor]) -> Tensor:
        """Queries (Tq,B,H*qd) and p (Tq,B,H*pd) against keys (Tk,B,H*qd), Tk >= Tq, the queries being the last
        Tq key positions; pos_emb (1, Tq+Tk-1, P). Returns (H, B, Tq, Tk)."""
        tq, b, _ = q.shape
        tk = k.shape[0]
        h, qd, pd = self.num_heads, self.query_head_dim, self.pos_head_dim
        q = q.reshape(tq, b, h, qd).permute(2, 1, 0, 3)  # (H, B, Tq, qd)
        p = p.reshape(tq, b, h, pd).permute(2, 1, 0, 3)  # (H, B, Tq, pd)
        k = k.reshape(tk, b, h, qd).permute(2, 1, 3, 0)  # (H, B, qd, Tk)
        scores = torch.matmul(q, k)  # (H, B, Tq, Tk)

        traced = is_tracing()
        keep = True
        if self.training:
            # A skipped call leaves linear_pos without a gradient (None), which an optimizer treats differently
            # from a zero one, so no mask can stand in for the skip: while the rate is above 0 (the first 4000
            # batches by default) the draw stays eager, a documented graph break (docs/compile.md).
            rate = self.pos_emb_skip_rate
            settled = rate.settled if isinstance(rate, ScheduledFloat) else float(rate)
            if not traced:
                keep = random.random() >= float(rate)
            elif settled is None or settled != 0.0:
                keep = not _draw_below(rate)
            else:
                random.random()  # the draw eager mode makes (and always passes), keeping the random sequence
        if keep:
            pe = self.linear_pos(pos_emb)  # (1, Tq+Tk-1, H*pd)
            pe = pe.reshape(-1, tq + tk - 1, h, pd).permute(2, 0, 3, 1)  # (H, 1, pd, Tq+Tk-1)
            pos_scores = torch.matmul(p, pe).contiguous()  # (H, B, Tq, Tq+Tk-1), last axis = offset + (Tk-1)
            # relative -> absolute: query i sits at key position (Tk-Tq) + i, so entry (i, j) has offset
            # j - (Tk-Tq) - i, i.e. column (Tq-1) - i + j.
            s = pos_scores.stride()
            # (a fresh contiguous tensor starts at offset 0; a traced graph cannot ask for the offset)
            offset = 0 if traced else pos_scores.storage_offset()
            pos_scores = pos_scores.as_strided(
                (h, b, tq, tk), (s[0], s[1], s[2] - s[3], s[3]), storage_offset=offset + s[3] * (tq - 1))
            scores = scores + pos_scores

        if self.training:
            if traced:
                scores = penalize_abs_values_gt(scores, limit=25.0, penalty=1.0e-4, apply=random_below(0.1))
            elif random.random() < 0.1:
                scores = penalize_abs_values_gt(scores, limit=25.0, penalty=1.0e-4)
        if attn_mask is not None:
            scores = scores.masked_fill(attn_mask, _MASK_VALUE)
        if key_padding_mask is not None:
            scores = scores.masked_fill(key_padding_mask.unsqueeze(1), _MASK_VALUE)
        return softmax(scores, dim=-1)

    def forward(self, x: Tensor, pos_emb: Tensor, key_padding_mask: Optional[Tensor] = None,
                attn_mask: Optional[Tensor] = None) -> Tensor:
        q, k, p = self._project(x)
        return self._weights(q, k, p, pos_emb, key_padding_mask, attn_mask)

    def streaming_forward(self, x: Tensor, pos_emb: Tensor, cached_key: Tensor,
                          key_padding_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """One chunk: x (T,B,D) attends to L cached keys and its own T keys.

        cached_key (L,B,H*qd); pos_emb (1, L+2T-1, P) from ``CompactRelPositionalEncoding(x, L)``;
        key_padding_mask (B, L+T), True at cache slots not yet filled and at padded frames.
        Returns weights (H, B, T, L+T) and the new cache (L,B,H*qd): the last L keys."""
        q, k, p = self._project(x)
        left = cached_key.shape[0]
        k = torch.cat((cached_key.to(k.dtype), k), dim=0)
        return self._weights(q, k, p, pos_emb, key_padding_mask, None), k[k.shape[0] - left:]


class SelfAttention(nn.Module):
    """Applies precomputed attention weights to a value projection.

    forward(x (T,B,D), attn_weights (H,B,T,T)) -> (T,B,D)."""

    def __init__(self, embed_dim: int, num_heads: int, value_head_dim: int):
        super().__init__()
        self.in_proj = Linear(embed_dim, num_heads * value_head_dim, bias=True)
        self.out_proj = scaled_linear(num_heads * value_head_dim, embed_dim, bias=True, initial_scale=0.05)
        self.whiten = Whiten(num_groups=1, whitening_limit=whitening_schedule(7.5, ratio=3.0),
                             prob=(0.025, 0.25), grad_scale=0.01)

    def _attend(self, v: Tensor, attn_weights: Tensor) -> Tensor:
        """values (Tk,B,H*vd), weights (H,B,Tq,Tk) -> (Tq,B,D)."""
        tk, b, _ = v.shape
        h, tq = attn_weights.shape[0], attn_weights.shape[2]
        v = v.reshape(tk, b, h, -1).permute(2, 1, 0, 3)  # (H, B, Tk, vd)
        v = torch.matmul(_weights_like(attn_weights, v), v)
        v = v.permute(2, 1, 0, 3).reshape(tq, b, -1)
        return self.whiten(self.out_proj(v))

    def forward(self, x: Tensor, attn_weights: Tensor) -> Tensor:
        return self._attend(self.in_proj(x), attn_weights)

    def streaming_forward(self, x: Tensor, attn_weights: Tensor, cached_val: Tensor) -> Tuple[Tensor, Tensor]:
        """x (T,B,D), weights (H,B,T,L+T), cached_val (L,B,H*vd) -> ((T,B,D), new cache: the last L values)."""
        v = self.in_proj(x)
        left = cached_val.shape[0]
        v = torch.cat((cached_val.to(v.dtype), v), dim=0)
        return self._attend(v, attn_weights), v[v.shape[0] - left:]


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

    def _gate(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """(T,B,D) -> gated values (T,B,hidden) to be mixed over time, and the output gate y (T,B,hidden)."""
        s, x, y = self.in_proj(x).chunk(3, dim=-1)
        s = torch.tanh(self.balancer(s))
        return self.whiten1(x) * s, y

    def _mix(self, x: Tensor, y: Tensor, attn_weights: Tensor) -> Tensor:
        """values (Tk,B,hidden), gate (Tq,B,hidden), weights (h,B,Tq,Tk) -> (Tq,B,D)."""
        tk, b, _ = x.shape
        h, tq = attn_weights.shape[0], attn_weights.shape[2]
        x = x.reshape(tk, b, h, -1).permute(2, 1, 0, 3)  # (h, B, Tk, hidden/h)
        x = torch.matmul(_weights_like(attn_weights, x), x)
        x = x.permute(2, 1, 0, 3).reshape(tq, b, -1)
        return self.whiten2(self.out_proj(x * y))

    def forward(self, x: Tensor, attn_weights: Tensor) -> Tensor:
        x, y = self._gate(x)
        return self._mix(x, y, attn_weights)

    def streaming_forward(self, x: Tensor, attn_weights: Tensor, cached_x: Tensor) -> Tuple[Tensor, Tensor]:
        """x (T,B,D), weights (1,B,T,L+T), cached_x (L,B,hidden) -> ((T,B,D), new cache: the last L values)."""
        x, y = self._gate(x)
        left = cached_x.shape[0]
        x = torch.cat((cached_x.to(x.dtype), x), dim=0)
        return self._mix(x, y, attn_weights), x[x.shape[0] - left:]


def _weights_like(attn_weights: Tensor, x: Tensor) -> Tensor:
    """The attention weights in the values' dtype, unless autocast chooses the matmul's dtype itself."""
    if attn_weights.dtype != x.dtype and autocast_dtype(x) is None:
        return attn_weights.to(x.dtype)
    return attn_weights
