"""Builders with named presets: ``build_transducer(encoder="conformer"|"zipformer", size=..., vocab_size=...)``."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from torch import nn

from .decoder import Decoder
from .joiner import Joiner
from .transducer import LossConfig, Transducer

ENCODERS = ("conformer", "zipformer")

# decoder_dim, joiner_dim per size; icefall uses 512/512 for every LibriSpeech model.
_HEAD_DIMS = {"tiny": (256, 256)}
_DEFAULT_HEAD = (512, 512)


def build_encoder(encoder: str, size: str, **overrides: Any) -> nn.Module:
    """Build an encoder by family and preset name (imported lazily: each family is its own module)."""
    if encoder == "conformer":
        from .conformer import build_conformer_encoder

        return build_conformer_encoder(size=size, **overrides)
    if encoder == "zipformer":
        from .zipformer import build_zipformer_encoder

        return build_zipformer_encoder(size=size, **overrides)
    raise ValueError(f"unknown encoder {encoder!r}; choose one of {', '.join(ENCODERS)}")


def build_transducer(
    *,
    encoder: str = "conformer",
    size: str = "tiny",
    vocab_size: int,
    blank_id: int = 0,
    context_size: int = 2,
    decoder_dim: int | None = None,
    joiner_dim: int | None = None,
    loss: LossConfig | dict | None = None,
    model_warmup_batches: int = 3000,
    encoder_overrides: dict | None = None,
) -> Transducer:
    """A transducer with the named encoder preset and a stateless decoder + joiner.

    Args:
        encoder: ``"conformer"`` or ``"zipformer"``. size: the encoder preset (``"tiny"``, ...).
        vocab_size: V, blank included. blank_id: the blank id (0 by convention).
        decoder_dim / joiner_dim: default 256/256 for ``tiny``, else 512/512 (icefall's values).
        loss: a :class:`LossConfig` or a dict of its fields (``{"loss": "pruned"}``).
        encoder_overrides: keyword overrides of the encoder preset's fields.
    """
    enc = build_encoder(encoder, size, **(encoder_overrides or {}))
    d_dim, j_dim = _HEAD_DIMS.get(size, _DEFAULT_HEAD)
    decoder = Decoder(vocab_size, decoder_dim or d_dim, blank_id=blank_id, context_size=context_size)
    joiner = Joiner(enc.output_dim, decoder.output_dim, joiner_dim or j_dim, vocab_size)
    if isinstance(loss, dict):
        loss = LossConfig(**loss)
    return Transducer(enc, decoder, joiner, loss=loss, model_warmup_batches=model_warmup_batches)


def set_batch_count(model: nn.Module, batch_count: float) -> None:
    """Tell every module that schedules on training progress (``batch_count`` attribute) where we are."""
    for m in model.modules():
        if hasattr(m, "batch_count"):
            m.batch_count = batch_count


def resolved_encoder_overrides(model: nn.Module) -> dict[str, Any]:
    """Every field of the encoder's config (preset + overrides, without ``num_features``) as JSON values.

    Pass it back as ``build_transducer(encoder_overrides=...)`` with the same encoder and size to rebuild exactly
    this architecture, even after the preset itself has changed (recipes store it in ``model.json``).
    """
    encoder = getattr(model, "encoder", model)
    config = getattr(encoder, "config", None)
    if config is None or not dataclasses.is_dataclass(config):
        raise TypeError(f"{type(encoder).__name__} has no dataclass .config to resolve")
    fields = dataclasses.asdict(config)
    fields.pop("num_features", None)
    return json.loads(json.dumps(fields))  # tuples -> lists, as they read back from model.json


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
