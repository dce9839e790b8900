"""Zipformer2 encoder (k2-free, pure PyTorch), trainable under fp32 / amp-fp16 / amp-bf16 / bf16.

Public names: :func:`build_zipformer_encoder`, :class:`ZipformerConfig`, :data:`PRESETS`,
:class:`ZipformerEncoder` (``output_dim``, ``set_batch_count(n)``), :func:`set_batch_count`.
"""

from .encoder import Zipformer2, ZipformerEncoder, make_pad_mask
from .presets import PRESETS, ZipformerConfig, build_from_config, build_zipformer_encoder, zipformer_config
from .scaling import ScheduledFloat, set_batch_count, swoosh_l, swoosh_r

__all__ = [
    "PRESETS", "ScheduledFloat", "Zipformer2", "ZipformerConfig", "ZipformerEncoder", "build_from_config",
    "build_zipformer_encoder", "make_pad_mask", "set_batch_count", "swoosh_l", "swoosh_r", "zipformer_config",
]
