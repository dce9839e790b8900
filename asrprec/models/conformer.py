"""The reworked Conformer encoder (Dan Povey's, icefall pruned_transducer_stateless2), dtype-agnostic.

Structure and constants follow k2-fsa/icefall
``egs/librispeech/ASR/pruned_transducer_stateless2/conformer.py`` (our own code, batch-major):

    features (B, T, F) -> Conv2dSubsampling -> (B, T', D) -> N x ConformerLayer -> (B, T', D)

Each layer: x + FF_macaron(x); + RelPositionMultiheadAttention; + ConvolutionModule; + FF; then
ActivationBalancer and BasicNorm; finally the *model warm-up bypass* mixes the layer's output with its
input (see :class:`ConformerLayer`). No LayerNorm/BatchNorm anywhere; every linear/conv is a scaled layer.

Precision rules (asrprec): the relative positional encoding is computed in an fp32 island and cast to
the activations' dtype (no buffer that a whole-model cast could leave in fp32 and upcast activations
with); masks use ``torch.finfo(dtype).min`` instead of ``-inf`` so fully masked rows cannot turn into
NaN and fp16 cannot overflow; attention probabilities are computed in fp32 and cast back.

Deviations from icefall (for exact padding invariance): padded frames are zeroed before the front-end
and before each depthwise convolution, so an utterance's outputs do not depend on its batch mates.

Legend: B batch, T input frames, F feature dim, T' encoder frames = ((T-1)//2 - 1)//2, D model dim,
H heads, d_k = D/H.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from asrprec.config import check_config_keys
from asrprec.models.masks import check_feature_norm, make_pad_mask
from asrprec.models.scaling import ActivationBalancer, BasicNorm, DoubleSwish, ScaledConv1d, ScaledLinear
from asrprec.models.subsampling import MIN_INPUT_FRAMES, Conv2dSubsampling
from asrprec.models.tracing import check_lengths_in_graph, is_exporting, is_tracing
from asrprec.precision.islands import autocast_dtype, fp32_island

__all__ = [
    "ConformerConfig",
    "CONFORMER_PRESETS",
    "RENAMED_FIELDS",
    "build_conformer_encoder",
    "ConformerEncoder",
    "ConformerLayer",
    "RelPositionalEncoding",
    "RelPositionMultiheadAttention",
    "ConvolutionModule",
    "rel_positional_encoding",
]


# ---------------------------------------------------------------------------------------------------
# Relative positional encoding
# ---------------------------------------------------------------------------------------------------


@fp32_island
def rel_positional_encoding(length: int, d_model: int, device: torch.device | str | None = None) -> Tensor:
    """Sinusoidal encodings of relative positions length-1, ..., 0, ..., -(length-1), in float32.

    Returns (1, 2*length - 1, d_model); row n encodes relative position r = length-1-n (query index minus
    key index, Transformer-XL convention as in icefall's RelPositionalEncoding):
    column 2k = sin(r·w_k), column 2k+1 = cos(r·w_k), w_k = 10000^(-2k/d_model).
    """
    if d_model % 2 != 0:
        raise ValueError(f"d_model must be even for sinusoidal encodings, got {d_model}")
    r = torch.arange(length - 1, -length, -1, device=device, dtype=torch.float32)[:, None]  # (2L-1, 1)
    w = torch.exp(torch.arange(0, d_model, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    pe = torch.empty(2 * length - 1, d_model, device=device, dtype=torch.float32)
    pe[:, 0::2] = torch.sin(r * w)
    pe[:, 1::2] = torch.cos(r * w)
    return pe.unsqueeze(0)


class RelPositionalEncoding(nn.Module):
    """Dropout on x and the relative positional encoding for its length, in x's dtype.

    Computed per call in fp32 (cheap: (2T'-1)·D sines) instead of a cached buffer, so a whole-model cast
    cannot leave an fp32 buffer that silently upcasts activations.

    Shapes: x (B, T', D) -> (x (B, T', D), pos_emb (1, 2T'-1, D)), both in x's dtype.
    """

    def __init__(self, d_model: int, dropout: float) -> None:
        super().__init__()
        self.d_model = d_model
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        pos_emb = rel_positional_encoding(x.shape[1], self.d_model, x.device).to(x.dtype)
        return self.dropout(x), self.dropout(pos_emb)


# ---------------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------------


class RelPositionMultiheadAttention(nn.Module):
    """Multi-head self-attention with Transformer-XL relative positions (icefall's, batch-major).

    score(i, j) = (q_i/√d_k + u)·k_j + (q_i/√d_k + v)·P(i − j), u and v learned per head (each with a
    scalar log-scale), P a linear projection of the sinusoidal relative encoding. Padded keys get
    ``finfo(dtype).min``; probabilities are computed in fp32 and cast back.

    Args:
        d_model: D. num_heads: H (D % H == 0). dropout: on attention probabilities.
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % num_heads != 0:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.dropout = dropout
        self.in_proj = ScaledLinear(d_model, 3 * d_model)
        self.out_proj = ScaledLinear(d_model, d_model, initial_scale=0.25)
        self.linear_pos = ScaledLinear(d_model, d_model, bias=False)
        self.pos_bias_u = nn.Parameter(torch.randn(num_heads, self.head_dim) * 0.01)
        self.pos_bias_v = nn.Parameter(torch.randn(num_heads, self.head_dim) * 0.01)
        self.pos_bias_u_scale = nn.Parameter(torch.zeros(()))
        self.pos_bias_v_scale = nn.Parameter(torch.zeros(()))

    @staticmethod
    def rel_shift(bd: Tensor) -> Tensor:
        """(B, H, T, 2T-1) scores against relative positions -> (B, H, T, T) with out[i, j] = bd[i, T-1-i+j]."""
        B, H, T, n = bd.shape
        if n != 2 * T - 1:
            raise ValueError(f"rel_shift expects last dim 2T-1 = {2 * T - 1}, got {n}")
        i = torch.arange(T, device=bd.device)
        idx = (T - 1) - i[:, None] + i[None, :]  # (T, T)
        return bd.gather(-1, idx.expand(B, H, T, T))

    def forward(self, x: Tensor, pos_emb: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """Args:
            x: (B, T, D). pos_emb: (1, 2T-1, D). key_padding_mask: (B, T) bool, True at padding, or None.

        Returns: (B, T, D).
        """
        B, T, D = x.shape
        H, dk = self.num_heads, self.head_dim
        q, k, v = self.in_proj(x).chunk(3, dim=-1)
        q = q.reshape(B, T, H, dk) * (dk**-0.5)
        k = k.reshape(B, T, H, dk).permute(0, 2, 3, 1)  # (B, H, dk, T)
        v = v.reshape(B, T, H, dk).transpose(1, 2)  # (B, H, T, dk)
        p = self.linear_pos(pos_emb).reshape(1, 2 * T - 1, H, dk).permute(0, 2, 3, 1)  # (1, H, dk, 2T-1)
        bias_u = (self.pos_bias_u * self.pos_bias_u_scale.exp()).to(q.dtype)
        bias_v = (self.pos_bias_v * self.pos_bias_v_scale.exp()).to(q.dtype)
        ac = torch.matmul((q + bias_u).transpose(1, 2), k)  # (B, H, T, T)
        bd = self.rel_shift(torch.matmul((q + bias_v).transpose(1, 2), p))  # (B, H, T, T)
        scores = ac + bd
        if key_padding_mask is not None:
            scores = scores.masked_fill(key_padding_mask[:, None, None, :], torch.finfo(scores.dtype).min)
        attn = scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype)
        attn = F.dropout(attn, p=self.dropout, training=self.training)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(B, T, D)
        return self.out_proj(out)


# ---------------------------------------------------------------------------------------------------
# Convolution and feed-forward modules
# ---------------------------------------------------------------------------------------------------


class ConvolutionModule(nn.Module):
    """Conformer convolution module without BatchNorm (icefall pruned_transducer_stateless2).

    pointwise (D -> 2D) -> ActivationBalancer -> GLU -> zero padded frames -> depthwise (kernel K,
    'same' padding) -> ActivationBalancer -> DoubleSwish -> pointwise (D -> D, initial scale 0.25).

    Shapes: x (B, T, D), pad_mask (B, T) bool or None -> (B, T, D).
    """

    def __init__(self, d_model: int, kernel_size: int) -> None:
        super().__init__()
        if kernel_size % 2 != 1:
            raise ValueError(f"cnn kernel_size must be odd for 'same' padding, got {kernel_size}")
        self.pointwise_conv1 = ScaledConv1d(d_model, 2 * d_model, kernel_size=1)
        # icefall: the GLU input sometimes reached RMS 50-100 in layer 0; max_abs=10 keeps it in range.
        self.deriv_balancer1 = ActivationBalancer(channel_dim=1, min_positive=0.05, max_positive=1.0, max_abs=10.0)
        self.depthwise_conv = ScaledConv1d(d_model, d_model, kernel_size, padding=kernel_size // 2, groups=d_model)
        self.deriv_balancer2 = ActivationBalancer(channel_dim=1, min_positive=0.05, max_positive=1.0)
        self.activation = DoubleSwish()
        self.pointwise_conv2 = ScaledConv1d(d_model, d_model, kernel_size=1, initial_scale=0.25)

    def forward(self, x: Tensor, pad_mask: Tensor | None = None) -> Tensor:
        x = x.transpose(1, 2)  # (B, D, T)
        x = F.glu(self.deriv_balancer1(self.pointwise_conv1(x)), dim=1)
        if pad_mask is not None:
            x = x.masked_fill(pad_mask[:, None, :], 0.0)
        x = self.activation(self.deriv_balancer2(self.depthwise_conv(x)))
        return self.pointwise_conv2(x).transpose(1, 2)


def _feed_forward(d_model: int, ff_dim: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(
        ScaledLinear(d_model, ff_dim),
        ActivationBalancer(channel_dim=-1),
        DoubleSwish(),
        nn.Dropout(dropout),
        ScaledLinear(ff_dim, d_model, initial_scale=0.25),
    )


# ---------------------------------------------------------------------------------------------------
# Layer and encoder
# ---------------------------------------------------------------------------------------------------


class ConformerLayer(nn.Module):
    """One reworked Conformer layer with the model warm-up bypass.

    Warm-up (icefall pruned_transducer_stateless2 ``ConformerEncoderLayer.forward``): in training,
    with s = min(0.1 + warmup, 1), alpha = s with probability 1 − layer_dropout and 0.1 otherwise, and
    the layer returns alpha·layer(x) + (1 − alpha)·x. So at warmup = 0 every layer is 90 % bypassed and
    the network behaves like a shallow one; from warmup >= 0.9 layers are fully on except for the random
    layer-dropout draws. In eval mode alpha = 1 and ``warmup`` is ignored. The draw uses torch's CPU
    generator.

    Shapes: x (B, T, D), pos_emb (1, 2T-1, D), pad_mask (B, T) bool or None -> (B, T, D).
    """

    def __init__(self, d_model: int, num_heads: int, ff_dim: int, cnn_kernel: int, dropout: float = 0.1,
                 layer_dropout: float = 0.075) -> None:
        super().__init__()
        self.layer_dropout = layer_dropout
        self.feed_forward_macaron = _feed_forward(d_model, ff_dim, dropout)
        self.self_attn = RelPositionMultiheadAttention(d_model, num_heads, dropout=0.0)
        self.conv_module = ConvolutionModule(d_model, cnn_kernel)
        self.feed_forward = _feed_forward(d_model, ff_dim, dropout)
        # keep the output roughly zero-median and bounded (icefall: 0.45..0.55 positive, max_abs 6)
        self.balancer = ActivationBalancer(channel_dim=-1, min_positive=0.45, max_positive=0.55, max_abs=6.0)
        self.norm_final = BasicNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def bypass_alpha(self, warmup: float | Tensor) -> float | Tensor:
        """The weight of the layer's own output for this call (1.0 in eval mode); while tracing, a 0-dim tensor
        from the same draw (no ``.item()`` in the graph). ``warmup`` is a 0-dim tensor for a compiled encoder."""
        if not self.training:
            return 1.0
        warmup_scale = (0.1 + warmup).clamp(max=1.0) if isinstance(warmup, Tensor) else min(0.1 + warmup, 1.0)
        draw = torch.rand((), device="cpu")
        if is_tracing():
            keep = draw.to(torch.float64) <= 1.0 - self.layer_dropout
            return torch.where(keep, warmup_scale, 0.1).to(torch.float64)
        return warmup_scale if float(draw) <= 1.0 - self.layer_dropout else 0.1

    def forward(self, x: Tensor, pos_emb: Tensor, pad_mask: Tensor | None = None,
                warmup: float | Tensor = 1.0) -> Tensor:
        x_orig = x
        alpha = self.bypass_alpha(warmup)
        x = x + self.dropout(self.feed_forward_macaron(x))
        x = x + self.dropout(self.self_attn(x, pos_emb, pad_mask))
        x = x + self.dropout(self.conv_module(x, pad_mask))
        x = x + self.dropout(self.feed_forward(x))
        x = self.norm_final(self.balancer(x))
        if isinstance(alpha, Tensor):  # traced: always mix (alpha = 1 gives x exactly)
            x = alpha * x + (1.0 - alpha) * x_orig
        elif alpha != 1.0:
            x = alpha * x + (1.0 - alpha) * x_orig
        return x


@dataclass(frozen=True)
class ConformerConfig:
    """Hyper-parameters of :class:`ConformerEncoder` (one instance per preset), named as the Zipformer's and
    icefall's (``--encoder-dim``, ``--num-encoder-layers``, ``--feedforward-dim``, ``--cnn-module-kernel``).

    The earlier names (``d_model``, ``num_layers``, ``ff_dim``, ``cnn_kernel``) still load through
    :func:`build_conformer_encoder` (and so from a ``model.json``), with a DeprecationWarning.
    """

    num_features: int = 80
    encoder_dim: int = 144
    num_encoder_layers: int = 4
    num_heads: int = 4
    feedforward_dim: int = 576
    cnn_module_kernel: int = 15
    dropout: float = 0.1
    layer_dropout: float = 0.075
    #: Conv2dSubsampling channel widths (icefall: 8, 32, 128)
    frontend_channels: Tuple[int, int, int] = (8, 32, 128)
    #: "utterance": each utterance's log-mel bins minus their mean over it, before the front-end
    #: (:func:`asrprec.models.masks.utterance_mean_norm`); "none": the features as given
    feature_norm: str = "none"

    def __post_init__(self) -> None:
        check_feature_norm(self.feature_norm)
        if len(self.frontend_channels) != 3 or min(self.frontend_channels) < 1:
            raise ValueError(f"ConformerConfig.frontend_channels must be three positive widths, got "
                             f"{self.frontend_channels}")
        object.__setattr__(self, "frontend_channels", tuple(int(c) for c in self.frontend_channels))
        for name in ("num_features", "encoder_dim", "num_encoder_layers", "num_heads", "feedforward_dim",
                     "cnn_module_kernel"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ConformerConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.encoder_dim % self.num_heads != 0:
            raise ValueError(f"encoder_dim ({self.encoder_dim}) must be divisible by num_heads ({self.num_heads})")
        if self.encoder_dim % 2 != 0:
            raise ValueError(f"encoder_dim must be even, got {self.encoder_dim}")
        if self.cnn_module_kernel % 2 != 1:
            raise ValueError(f"cnn_module_kernel must be odd, got {self.cnn_module_kernel}")
        if not (0.0 <= self.dropout < 1.0 and 0.0 <= self.layer_dropout < 1.0):
            raise ValueError(f"dropout and layer_dropout must be in [0, 1), got {self.dropout}, {self.layer_dropout}")

    @property
    def output_dim(self) -> int:
        return self.encoder_dim


#: ConformerConfig fields renamed to icefall's names (old -> new); the old names load with a DeprecationWarning.
RENAMED_FIELDS = {"d_model": "encoder_dim", "num_layers": "num_encoder_layers", "ff_dim": "feedforward_dim",
                  "cnn_kernel": "cnn_module_kernel"}


#: Named presets. ``librispeech`` = icefall pruned_transducer_stateless2 train.py defaults
#: (dim 512, 12 layers, 8 heads, feed-forward 2048, conv kernel 31, dropout 0.1, layer_dropout 0.075).
CONFORMER_PRESETS: dict[str, ConformerConfig] = {
    # ~2.1 M parameters: trains on 2 CPU cores in minutes. No dropout: on the embedded recipe it changed neither
    # the valid loss nor the WER beyond noise, while CPU dropout (bernoulli_) costs about a fifth of a step.
    # Front-end 8/32/64 instead of 8/32/128 and feed-forward 432 (3x encoder_dim) instead of 576: a training step
    # about 20 % cheaper (benchmarks/train_step.py) at the same recipe WER.
    "tiny": ConformerConfig(encoder_dim=144, num_encoder_layers=4, num_heads=4, feedforward_dim=432,
                            cnn_module_kernel=15, dropout=0.0, layer_dropout=0.0, frontend_channels=(8, 32, 64)),
    # ~14 M parameters: a single-GPU model for 100 h scale data.
    "small": ConformerConfig(encoder_dim=256, num_encoder_layers=8, num_heads=4, feedforward_dim=1024,
                             cnn_module_kernel=31),
    "librispeech": ConformerConfig(encoder_dim=512, num_encoder_layers=12, num_heads=8, feedforward_dim=2048,
                                   cnn_module_kernel=31),
}


class ConformerEncoder(nn.Module):
    """Conv2d front-end + reworked Conformer layers.

    Attributes:
        output_dim: D, the last dim of ``encoder_out``.
        config: the :class:`ConformerConfig` it was built from.
        accepts_warmup: True; the transducer passes its model warm-up value to ``forward``.
        min_input_frames: the fewest feature frames an utterance may have (one output frame).
    """

    accepts_warmup = True
    min_input_frames = MIN_INPUT_FRAMES

    def __init__(self, config: ConformerConfig) -> None:
        super().__init__()
        self.config = config
        self.output_dim = config.encoder_dim
        self.encoder_embed = Conv2dSubsampling(config.num_features, config.encoder_dim, *config.frontend_channels,
                                               feature_norm=config.feature_norm)
        self.encoder_pos = RelPositionalEncoding(config.encoder_dim, config.dropout)
        self.layers = nn.ModuleList(
            ConformerLayer(config.encoder_dim, config.num_heads, config.feedforward_dim, config.cnn_module_kernel,
                           config.dropout, config.layer_dropout)
            for _ in range(config.num_encoder_layers)
        )

    def forward(self, features: Tensor, feature_lens: Tensor, warmup: float | Tensor = 1.0) -> tuple[Tensor, Tensor]:
        """Encode a padded batch.

        Args:
            features: (B, T, F) float. Outside autocast it is cast to the model's parameter dtype (so a
                whole-model bf16 model accepts fp32 features); under autocast it is left as is.
            feature_lens: (B,) int64 valid frames per utterance, 7 <= lens <= T.
            warmup: model warm-up in [0, 1] (training only; ignored in eval). The training loop passes
                ``min(1, batch_idx / warmup_batches)``.

        Returns:
            encoder_out: (B, T', D), T' = ((T-1)//2 - 1)//2; frames past encoder_out_lens are padding.
            encoder_out_lens: (B,) int64 = ((feature_lens-1)//2 - 1)//2.
        """
        if features.ndim != 3:
            raise ValueError(f"features must be (B, T, F), got shape {tuple(features.shape)}")
        if feature_lens.ndim != 1 or feature_lens.shape[0] != features.shape[0]:
            raise ValueError(
                f"feature_lens must be (B,) = ({features.shape[0]},), got shape {tuple(feature_lens.shape)}"
            )
        if feature_lens.is_floating_point():
            raise ValueError(f"feature_lens must be an integer tensor, got {feature_lens.dtype}")
        T = features.shape[1]
        # reading the lengths in Python would break a compiled graph: it asserts them in the graph instead
        if is_tracing() and not is_exporting():
            check_lengths_in_graph(feature_lens, MIN_INPUT_FRAMES, T)
            lo, hi = MIN_INPUT_FRAMES, T
        else:
            lo, hi = int(feature_lens.min()), int(feature_lens.max())
        if lo < MIN_INPUT_FRAMES or hi > T:
            raise ValueError(
                f"feature_lens must lie in [{MIN_INPUT_FRAMES}, T={T}] (the front-end needs >= {MIN_INPUT_FRAMES} "
                f"frames per utterance), got min {lo}, max {hi}; drop or pad too-short utterances"
            )
        if autocast_dtype(features) is None:
            param_dtype = self.encoder_embed.out.weight.dtype
            if features.dtype != param_dtype:
                features = features.to(param_dtype)

        x, lens = self.encoder_embed(features, feature_lens)
        x, pos_emb = self.encoder_pos(x)
        pad_mask = make_pad_mask(lens, x.shape[1])
        for layer in self.layers:
            x = layer(x, pos_emb, pad_mask, warmup=warmup)
        return x, lens

    def compile_regions(self) -> list[nn.Module]:
        """The submodules ``compile_model(regions="layers")`` compiles one by one: the front-end and every layer
        (all layers share one compiled code); the positional encoding between them runs eager."""
        return [self.encoder_embed, *self.layers]


def build_conformer_encoder(*, size: str = "tiny", num_features: int = 80, **overrides) -> ConformerEncoder:
    """Build a :class:`ConformerEncoder` from a named preset, with keyword overrides.

    Args:
        size: one of ``CONFORMER_PRESETS`` ("tiny", "small", "librispeech").
        num_features: input feature dim F.
        **overrides: any :class:`ConformerConfig` field (encoder_dim, num_encoder_layers, num_heads,
            feedforward_dim, cnn_module_kernel, dropout, layer_dropout, frontend_channels). The earlier names
            (:data:`RENAMED_FIELDS`) give a DeprecationWarning. Unknown keys raise ValueError.
    """
    if size not in CONFORMER_PRESETS:
        raise ValueError(f"unknown conformer size {size!r}; choose one of {sorted(CONFORMER_PRESETS)}")
    overrides = check_config_keys(ConformerConfig, overrides, renamed=RENAMED_FIELDS, exclude={"num_features"})
    config = dataclasses.replace(CONFORMER_PRESETS[size], num_features=num_features, **overrides)
    return ConformerEncoder(config)
