"""Transducer decoding: ``greedy_search`` and ``modified_beam_search``, batched, plain PyTorch (no k2).

Both take ``(model, encoder_out (B, T, D_enc), encoder_out_lens (B,))`` and return B token-id lists
(no blank, no start context) in the input order. They run on models under any precision policy (a
bf16-cast model from ``policy.prepare_for_inference`` or an fp32 model under ``policy.autocast()``); beam
scores use an fp32 log-softmax.

:class:`DecodingOptions` and :func:`decode` bundle "encode, then decode with the named method";
:func:`streaming_decode` does it chunk by chunk for a causal Zipformer (real streaming, with caches).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from .beam_search import modified_beam_search
from .greedy import greedy_search
from .hypothesis import Hypothesis, HypothesisList
from .label_looping import LabelLoopingGreedy, label_looping_greedy_search

METHODS = ("greedy_search", "modified_beam_search")


@dataclass(frozen=True)
class DecodingOptions:
    """How to decode.

    method: ``"greedy_search"`` or ``"modified_beam_search"``.
    beam: hypotheses per utterance for ``modified_beam_search`` (icefall's ``--beam-size``, default 4).
    max_sym_per_frame: symbols per frame for ``greedy_search`` (icefall's default 1).
    length_norm: final choice of ``modified_beam_search`` by length-normalised score (icefall) or raw score.
    """

    method: str = "greedy_search"
    beam: int = 4
    max_sym_per_frame: int = 1
    length_norm: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown decoding method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.beam < 1:
            raise ValueError(f"beam must be >= 1, got {self.beam}")
        if self.max_sym_per_frame < 1:
            raise ValueError(f"max_sym_per_frame must be >= 1, got {self.max_sym_per_frame}")

    @classmethod
    def from_dict(cls, d: dict) -> "DecodingOptions":
        """Build from a config dict; unknown keys are an error (a typo must not be silently ignored)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown decoding option(s) {unknown}; known: {sorted(known)}")
        return cls(**d)


def decode_encoder_out(
    model: nn.Module, encoder_out: torch.Tensor, encoder_out_lens: torch.Tensor, options: DecodingOptions
) -> list[list[int]]:
    """Run the decoding method named in ``options`` on (B, T, D_enc) ``encoder_out``."""
    if options.method == "greedy_search":
        return greedy_search(model, encoder_out, encoder_out_lens, max_sym_per_frame=options.max_sym_per_frame)
    return modified_beam_search(
        model, encoder_out, encoder_out_lens, beam=options.beam, length_norm=options.length_norm
    )


@torch.no_grad()
def decode(
    model: nn.Module, features: torch.Tensor, feature_lens: torch.Tensor, options: DecodingOptions | None = None
) -> list[list[int]]:
    """Encode features and decode them.

    Legend: B utterances, T input frames, F feature bins.

    Args:
        model: a transducer (``encode`` + the decoding interface), in eval mode.
        features: (B, T, F) float features. feature_lens: (B,) integer valid frames.
        options: the method and its knobs (default: greedy search, one symbol per frame).
    Returns:
        B token-id lists in the input order.
    """
    options = options or DecodingOptions()
    encoder_out, encoder_out_lens = model.encode(features, feature_lens)
    return decode_encoder_out(model, encoder_out, encoder_out_lens, options)


from .dataset import decode_dataset  # noqa: E402  (uses decode above)
from .streaming import (  # noqa: E402
    StreamingGreedySearch, StreamingModifiedBeamSearch, streaming_decode, streaming_encode,
)

__all__ = [
    "METHODS", "DecodingOptions", "Hypothesis", "HypothesisList", "decode", "decode_dataset", "decode_encoder_out",
    "greedy_search", "modified_beam_search", "StreamingGreedySearch", "StreamingModifiedBeamSearch",
    "streaming_decode", "streaming_encode",
    "LabelLoopingGreedy", "label_looping_greedy_search",
]
