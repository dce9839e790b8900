"""Typed Zipformer configs, the named presets and the public builder.

small / medium / large are the icefall LibriSpeech configs (k2-fsa/icefall egs/librispeech/ASR/RESULTS.md,
PR #1058; medium = zipformer/train.py defaults). ``tiny`` is ours: three stacks (downsampling 2, 4, 2), 0.86 M
encoder parameters, no dropout; for the embedded recipe and CPU tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from asrprec.config import check_config_keys

from ..masks import check_feature_norm
from .encoder import Zipformer2, ZipformerEncoder, zipformer_dropout
from .frontend import ZipformerConv2dSubsampling

_PER_STACK = ("num_encoder_layers", "feedforward_dim", "encoder_dim", "encoder_unmasked_dim", "num_heads",
              "query_head_dim", "value_head_dim", "pos_head_dim", "cnn_module_kernel")


@dataclass(frozen=True)
class ZipformerConfig:
    """Every field of the encoder. Per-stack fields take one int (broadcast) or one value per stack."""

    num_features: int = 80
    downsampling_factor: Tuple[int, ...] = (1, 2, 4, 8, 4, 2)
    num_encoder_layers: Tuple[int, ...] = (2, 2, 3, 4, 3, 2)
    feedforward_dim: Tuple[int, ...] = (512, 768, 1024, 1536, 1024, 768)
    encoder_dim: Tuple[int, ...] = (192, 256, 384, 512, 384, 256)
    encoder_unmasked_dim: Tuple[int, ...] = (192, 192, 256, 256, 256, 192)
    num_heads: Tuple[int, ...] = (4, 4, 4, 8, 4, 4)
    query_head_dim: Tuple[int, ...] = (32,)
    value_head_dim: Tuple[int, ...] = (12,)
    pos_head_dim: Tuple[int, ...] = (4,)
    pos_dim: int = 48
    cnn_module_kernel: Tuple[int, ...] = (31, 31, 15, 15, 15, 31)
    output_downsampling_factor: int = 2
    # Conv2dSubsampling's three conv widths (the ConvNeXt runs at the last); icefall's are (8, 32, 128)
    frontend_channels: Tuple[int, ...] = (8, 32, 128)
    # the front-end ConvNeXt's hidden width / channels (icefall: 3); 0 builds the front-end without the ConvNeXt
    convnext_hidden_ratio: int = 3
    # dropout of the feed-forward modules and the front-end output: None = icefall's schedule 0.3 -> 0.1 over
    # 20,000 batches; a number = that constant rate
    dropout: Optional[float] = None
    warmup_batches: float = 4000.0
    causal: bool = False
    # chunked causal training (50 Hz frames); icefall train.py defaults
    chunk_size: Tuple[int, ...] = (16, 32, 64, -1)
    left_context_frames: Tuple[int, ...] = (64, 128, 256, -1)
    # True: each utterance of a padded batch gets exactly the outputs it gets alone (the front-end zeroes the
    # frames past its end before the ConvNeXt, the downsamplers repeat its last frame over the padding). False:
    # padded frames enter both, as in icefall's zipformer.py and subsampling.py, which an imported icefall model
    # needs to reproduce icefall's outputs for a padded batch. Streaming is padding-invariant either way.
    padding_invariant: bool = True
    # "utterance": each utterance's log-mel bins minus their mean over it, first thing in the front-end
    # (masks.utterance_mean_norm; not for causal models); "none": the features as given (icefall)
    feature_norm: str = "none"

    def __post_init__(self) -> None:
        check_feature_norm(self.feature_norm, causal=self.causal)
        n = len(self.downsampling_factor)
        if n == 0:
            raise ValueError("downsampling_factor must name at least one stack")
        for name in _PER_STACK:
            v = getattr(self, name)
            v = (int(v),) if isinstance(v, int) else tuple(int(a) for a in v)
            if len(v) == 1:
                v = v * n
            if len(v) != n:
                raise ValueError(f"{name} has {len(v)} entries but there are {n} stacks "
                                 f"(downsampling_factor={self.downsampling_factor})")
            object.__setattr__(self, name, v)
        object.__setattr__(self, "downsampling_factor", tuple(int(d) for d in self.downsampling_factor))
        if len(self.frontend_channels) != 3 or min(self.frontend_channels) < 1:
            raise ValueError(f"frontend_channels must be three positive widths, got {self.frontend_channels}")
        object.__setattr__(self, "frontend_channels", tuple(int(c) for c in self.frontend_channels))
        if int(self.convnext_hidden_ratio) < 0:
            raise ValueError(f"convnext_hidden_ratio must be >= 0 (0 = no ConvNeXt), got {self.convnext_hidden_ratio}")
        object.__setattr__(self, "convnext_hidden_ratio", int(self.convnext_hidden_ratio))
        if self.dropout is not None:  # zipformer_dropout checks the range
            object.__setattr__(self, "dropout", zipformer_dropout(float(self.dropout)))
        object.__setattr__(self, "chunk_size", tuple(int(c) for c in self.chunk_size))
        object.__setattr__(self, "left_context_frames", tuple(int(c) for c in self.left_context_frames))
        for u, d in zip(self.encoder_unmasked_dim, self.encoder_dim):
            if u > d:
                raise ValueError(f"encoder_unmasked_dim {u} exceeds encoder_dim {d}")
        for k in self.cnn_module_kernel:
            if k % 2 != 1:
                raise ValueError(f"cnn_module_kernel entries must be odd, got {k}")
        for q, p in zip(self.query_head_dim, self.pos_head_dim):
            if p > q:
                raise ValueError(f"pos_head_dim {p} exceeds query_head_dim {q}")
        for d, h in zip(self.encoder_dim, self.num_heads):
            if (3 * d // 4) % 1 != 0 or h < 1:
                raise ValueError(f"bad num_heads {h} for encoder_dim {d}")
        if self.pos_dim % 2:
            raise ValueError(f"pos_dim must be even, got {self.pos_dim}")

    @property
    def output_dim(self) -> int:
        return max(self.encoder_dim)


PRESETS: Dict[str, Dict[str, Any]] = {
    "tiny": dict(
        # three stacks at 25, 12.5 and 25 Hz (icefall's six-stack pattern 1,2,4,8,4,2 without the 50 Hz and 6.25 Hz
        # stacks): on 2 CPU cores a step is bound by the number of small ops, not by FLOPs, and the six-stack
        # tiny (1.70 M parameters) cost 1.38-1.50x a Conformer ``tiny`` step; this one costs 0.98-1.02x
        # (benchmarks/RESULTS.md, "Zipformer tiny: three stacks").
        downsampling_factor=(2, 4, 2),
        num_encoder_layers=1,
        feedforward_dim=256,
        encoder_dim=96,
        encoder_unmasked_dim=64,
        num_heads=4,
        query_head_dim=16, value_head_dim=8, pos_head_dim=4, pos_dim=32,
        cnn_module_kernel=(15, 7, 15),
        # quarter-width front-end: at (8, 32, 128) it was ~60 % of a tiny training step on CPU; (8, 16, 32) makes a
        # step 2.2x faster (1.06 -> 0.48 s, B=18 x 1.7 s, 1 thread; Conformer tiny 0.41 s)
        frontend_channels=(8, 16, 32),
        # no dropout, like the Conformer ``tiny``: in the embedded recipe (10 short epochs) the schedule's
        # 0.3 -> 0.1 cost about one epoch of progress (six-stack tiny: test WER 11.5 % vs 26.4 % at epoch 7,
        # 6.3 % vs 6.9 % at epoch 10; README "Measured"). Set ``dropout=None`` for icefall's schedule.
        dropout=0.0,
    ),
    "small": dict(
        num_encoder_layers=(2, 2, 2, 2, 2, 2),
        feedforward_dim=(512, 768, 768, 768, 768, 768),
        encoder_dim=(192, 256, 256, 256, 256, 256),
        encoder_unmasked_dim=(192, 192, 192, 192, 192, 192),
    ),
    "medium": dict(),  # the dataclass defaults
    "large": dict(
        num_encoder_layers=(2, 2, 4, 5, 4, 2),
        feedforward_dim=(512, 768, 1536, 2048, 1536, 768),
        encoder_dim=(192, 256, 512, 768, 512, 256),
        encoder_unmasked_dim=(192, 192, 256, 320, 256, 192),
    ),
}


def zipformer_config(size: str = "medium", **overrides: Any) -> ZipformerConfig:
    """The preset ``size`` with ``overrides`` applied; unknown keys raise ValueError."""
    if size not in PRESETS:
        raise ValueError(f"unknown Zipformer size {size!r}; choose one of {sorted(PRESETS)}")
    return ZipformerConfig(**{**PRESETS[size], **check_config_keys(ZipformerConfig, overrides)})


def build_zipformer_encoder(*, size: str = "medium", causal: bool = False, **overrides: Any) -> ZipformerEncoder:
    """Build front-end + Zipformer2. ``size`` in tiny/small/medium/large; ``overrides`` are ZipformerConfig
    fields. The result has ``output_dim``; its schedules follow :func:`asrprec.models.set_batch_count`."""
    cfg = zipformer_config(size, causal=causal, **overrides)
    return build_from_config(cfg)


def build_from_config(cfg: ZipformerConfig) -> ZipformerEncoder:
    c1, c2, c3 = cfg.frontend_channels
    embed = ZipformerConv2dSubsampling(cfg.num_features, cfg.encoder_dim[0], layer1_channels=c1,
                                       layer2_channels=c2, layer3_channels=c3, dropout=zipformer_dropout(cfg.dropout),
                                       convnext_hidden_ratio=cfg.convnext_hidden_ratio,
                                       zero_padding=cfg.padding_invariant, feature_norm=cfg.feature_norm)
    enc = Zipformer2(
        downsampling_factor=cfg.downsampling_factor, encoder_dim=cfg.encoder_dim,
        num_encoder_layers=cfg.num_encoder_layers, encoder_unmasked_dim=cfg.encoder_unmasked_dim,
        query_head_dim=cfg.query_head_dim, pos_head_dim=cfg.pos_head_dim, value_head_dim=cfg.value_head_dim,
        num_heads=cfg.num_heads, feedforward_dim=cfg.feedforward_dim, cnn_module_kernel=cfg.cnn_module_kernel,
        pos_dim=cfg.pos_dim, output_downsampling_factor=cfg.output_downsampling_factor,
        warmup_batches=cfg.warmup_batches, causal=cfg.causal,
        chunk_size=cfg.chunk_size if cfg.causal else (-1,),
        left_context_frames=cfg.left_context_frames if cfg.causal else (-1,), dropout=cfg.dropout,
        padding_invariant=cfg.padding_invariant)
    model = ZipformerEncoder(embed, enc, cfg.num_features)
    model.config = cfg
    return model

