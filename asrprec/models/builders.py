"""Builders with named presets: ``build_transducer(encoder="conformer"|"zipformer", size=..., vocab_size=...)``."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from torch import nn

from asrprec.config import strict_from_dict

from .decoder import Decoder
from .joiner import Joiner
from .schedule import set_batch_count  # noqa: F401  (the training loop imports it from here)
from .ctc import CtcConfig
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
    encoder: str = "zipformer",
    size: str = "tiny",
    vocab_size: int,
    blank_id: int = 0,
    context_size: int = 2,
    decoder_dim: int | None = None,
    joiner_dim: int | None = None,
    loss: LossConfig | dict | None = None,
    model_warmup_batches: int = 3000,
    encoder_overrides: dict | None = None,
    use_transducer: bool = True,
    ctc: CtcConfig | dict | None = None,
) -> Transducer:
    """A transducer with the named encoder preset and a stateless decoder + joiner, a CTC head, or both.

    The defaults are the recommended setup (icefall's current LibriSpeech recipe, and the embedded recipe's):
    a Zipformer trained with the pruned loss.

    Args:
        encoder: ``"zipformer"`` (default) or ``"conformer"``. size: the encoder preset (``"tiny"``, ...).
        vocab_size: V, blank included. blank_id: the blank id (0 by convention).
        decoder_dim / joiner_dim: default 256/256 for ``tiny``, else 512/512 (icefall's values).
        loss: a :class:`LossConfig` or a dict of its fields (``{"loss": "full"}``); default ``LossConfig()``
            (the pruned loss). ``loss="tdt"`` gives the joiner a duration head of ``len(tdt_durations)`` outputs.
        model_warmup_batches: the Conformer's model warm-up (other encoders ignore it).
        encoder_overrides: keyword overrides of the encoder preset's fields.
        use_transducer: build the decoder and joiner (icefall's ``--use-transducer``); False needs ``ctc``.
        ctc: a CTC head (:class:`CtcConfig` or a dict of its fields, ``{}`` for the defaults; icefall's
            ``--use-ctc``, ``--use-cr-ctc`` ...); None: none. ``model.json`` records both as these arguments.
    """
    if isinstance(ctc, dict):
        ctc = strict_from_dict(CtcConfig, ctc)
    if not use_transducer and ctc is None:
        raise ValueError("use_transducer=False leaves the model without a head: add a CTC head (ctc=CtcConfig(), "
                         "--use-ctc) or keep the transducer")
    enc = build_encoder(encoder, size, **(encoder_overrides or {}))
    d_dim, j_dim = _HEAD_DIMS.get(size, _DEFAULT_HEAD)
    if isinstance(loss, dict):
        loss = strict_from_dict(LossConfig, loss)
    decoder = joiner = None
    if use_transducer:
        decoder = Decoder(vocab_size, decoder_dim or d_dim, blank_id=blank_id, context_size=context_size)
        durations = loss.tdt_durations if loss is not None and loss.loss == "tdt" else ()
        joiner = Joiner(enc.output_dim, decoder.output_dim, joiner_dim or j_dim, vocab_size, durations=durations)
    return Transducer(enc, decoder, joiner, loss=loss, ctc=ctc, vocab_size=vocab_size, blank_id=blank_id,
                      model_warmup_batches=model_warmup_batches)


def resolved_encoder_overrides(model: nn.Module) -> dict[str, Any]:
    """Every field of the encoder's config (preset + overrides) as JSON values; ``num_features`` only where it is
    not 80 (so that the record of an 80-bin model reads as it always did).

    Pass it back as ``build_transducer(encoder_overrides=...)`` with the same encoder and size to rebuild exactly
    this architecture, even after the preset itself has changed (recipes store it in ``model.json``).
    """
    encoder = getattr(model, "encoder", model)
    config = getattr(encoder, "config", None)
    if config is None or not dataclasses.is_dataclass(config):
        raise TypeError(f"{type(encoder).__name__} has no dataclass .config to resolve")
    fields = dataclasses.asdict(config)
    if fields.get("num_features") == 80:
        fields.pop("num_features")
    return json.loads(json.dumps(fields))  # tuples -> lists, as they read back from model.json


def configure_streaming(model: nn.Module, chunk_size: int | None, left_context_frames: int | None,
                        streaming: bool = False) -> str:
    """Fix the chunk size and left context a causal Zipformer uses from now on (e.g. for decoding).

    A causal model draws both from its training lists on every call; decoding needs one value of each, as
    icefall's zipformer/decode.py (``--chunk-size 32 --left-context-frames 256`` simulates streaming;
    ``--chunk-size -1`` uses full context). ``streaming=True`` checks the values for real, chunk-by-chunk
    streaming (a positive chunk size and a finite left context). Returns a tag for result file names:
    ``"chunk-32-left-256"`` (``"streaming-chunk-32-left-256"``), ``"causal-full-context"``, or "" for a model
    that is not causal.

    Raises:
        ValueError: values given for a model that is not causal; a causal model without a chunk size; a chunk
            size that is not a multiple of every stack's downsampling factor, or a left context shorter than the
            convolutions' reach.
    """
    encoder = getattr(model, "encoder", model)
    if not getattr(getattr(encoder, "encoder", None), "causal", False):
        if streaming:
            raise ValueError("--streaming applies to causal Zipformer models only; this model is not causal "
                             "(train one with --encoder zipformer --causal)")
        if chunk_size not in (None, -1) or left_context_frames not in (None, -1):
            raise ValueError("--chunk-size/--left-context-frames apply to causal Zipformer models only; "
                             "this model is not causal (train one with --encoder zipformer --causal)")
        return ""
    return encoder.configure_streaming(chunk_size, left_context_frames, streaming=streaming)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
