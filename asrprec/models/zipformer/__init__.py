"""Zipformer2 encoder (k2-free, pure PyTorch), trainable under fp32 / amp-fp16 / amp-bf16 / bf16.

Public names: :func:`build_zipformer_encoder`, :class:`ZipformerConfig`, :data:`PRESETS`,
:class:`ZipformerEncoder` (``output_dim``), :func:`swoosh_l`, :func:`swoosh_r`. Its schedules follow
:func:`asrprec.models.set_batch_count`.

Modules: ``encoder`` (the stacks and the batch-major encoder), ``layers`` (layer, stack, down/up-sampling,
bypass), ``attention``, ``frontend`` (Conv2d subsampling + ConvNeXt), ``presets`` (configs and the builder), and
the building blocks ``activations`` (softmax, Swoosh), ``linear``, ``norm`` (BiasNorm), ``grad_shaping``
(Balancer, Whiten, ...) and ``dropout``.
"""

from .activations import swoosh_l, swoosh_r
from .encoder import Zipformer2, ZipformerEncoder
from .presets import PRESETS, ZipformerConfig, build_from_config, build_zipformer_encoder, zipformer_config

__all__ = [
    "PRESETS", "Zipformer2", "ZipformerConfig", "ZipformerEncoder", "build_from_config", "build_zipformer_encoder",
    "swoosh_l", "swoosh_r", "zipformer_config",
]
