"""Models: the transducer, its stateless decoder and joiner, its CTC head, the Conformer and Zipformer encoders."""

from .builders import (
    ENCODERS, build_encoder, build_transducer, configure_streaming, count_parameters, resolved_encoder_overrides,
)
from .ctc import CtcConfig
from .decoder import Decoder
from .icefall import IcefallImportError, from_icefall
from .joiner import Joiner
from .masks import make_pad_mask
from .options import ModelOptions, build_model
from .schedule import ScheduledFloat, set_batch_count, warmup_fraction
from .transducer import LossConfig, Transducer, pruned_loss_scales
from .unwrap import unwrap_model

__all__ = [
    "ENCODERS", "CtcConfig", "Decoder", "IcefallImportError", "Joiner", "LossConfig", "ModelOptions", "ScheduledFloat",
    "Transducer", "build_encoder", "build_model", "build_transducer", "configure_streaming", "count_parameters",
    "from_icefall", "make_pad_mask", "pruned_loss_scales", "resolved_encoder_overrides", "set_batch_count",
    "unwrap_model", "warmup_fraction",
]
