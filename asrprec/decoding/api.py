"""How to decode (:class:`DecodingOptions`) and "encode, then decode with the named method" (:func:`decode`).

Legend: B utterances, T input frames, T' encoder frames, F feature bins, D_enc encoder width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from asrprec.config import strict_from_dict

from .batched_beam import malsd_beam_search
from .beam_search import modified_beam_search
from .ctc import ctc_greedy_search, ctc_prefix_beam_search
from .fusion import BatchFusion
from .greedy import greedy_search
from .tdt import is_tdt, tdt_greedy_search, tdt_modified_beam_search

__all__ = ["CTC_METHODS", "METHODS", "DecodingOptions", "check_method", "decode", "decode_encoder_out"]

#: methods that read the CTC head (``model.ctc_log_probs``); every other method reads the transducer
CTC_METHODS = ("ctc_greedy_search", "ctc_prefix_beam_search")
METHODS = ("greedy_search", "modified_beam_search", "malsd_batch") + CTC_METHODS


@dataclass(frozen=True)
class DecodingOptions:
    """How to decode.

    method: ``"greedy_search"``, ``"modified_beam_search"`` or ``"malsd_batch"`` (transducer, RNN-T or TDT; the last
        is the batched ALSD beam search of :mod:`asrprec.decoding.batched_beam`), ``"ctc_greedy_search"`` or
        ``"ctc_prefix_beam_search"`` (CTC head).
    beam: hypotheses per utterance for the beam searches (icefall's ``--beam-size``, default 4).
    max_sym_per_frame: symbols per frame for ``greedy_search`` (icefall's default 1), and for both searches of a
        TDT model (NeMo's ``max_symbols``; see :mod:`asrprec.decoding.tdt`).
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
        return strict_from_dict(cls, d)


def check_method(model: nn.Module, method: str) -> None:
    """Refuse a method the model has no head for: a transducer method on a CTC-only model, a CTC method on a model
    without a CTC head (ValueError naming the methods it has)."""
    if method in CTC_METHODS and not getattr(model, "use_ctc", False):
        raise ValueError(f"{method} decodes a CTC head and this model has none (it was trained without --use-ctc); "
                         "decode it with greedy_search or modified_beam_search")
    if method not in CTC_METHODS and not getattr(model, "use_transducer", True):
        raise ValueError(f"{method} decodes a transducer and this model is CTC-only (trained with --use-transducer "
                         f"false); decode it with {' or '.join(CTC_METHODS)}")


def decode_encoder_out(
    model: nn.Module, encoder_out: torch.Tensor, encoder_out_lens: torch.Tensor, options: DecodingOptions,
    fusion: BatchFusion | None = None,
) -> list[list[int]]:
    """Run the decoding method named in ``options`` on (B, T', D_enc) ``encoder_out`` with (B,) ``encoder_out_lens``;
    B token-id lists in the input order. CTC methods read ``model.ctc_log_probs(encoder_out)``; a method the model
    has no head for raises ValueError (:func:`check_method`). ``fusion``: LM / LODR / phrase bonuses
    (:mod:`asrprec.decoding.fusion`), taken by every method but ``ctc_greedy_search`` (a ValueError there)."""
    check_method(model, options.method)
    if options.method in CTC_METHODS:
        log_probs = model.ctc_log_probs(encoder_out)
        if options.method == "ctc_greedy_search":
            if fusion is not None:
                raise ValueError("ctc_greedy_search takes no language model or hot phrases; fix: decode with "
                                 "ctc_prefix_beam_search")
            return ctc_greedy_search(log_probs, encoder_out_lens, blank_id=model.blank_id)
        return ctc_prefix_beam_search(log_probs, encoder_out_lens, options.beam, blank_id=model.blank_id,
                                      fusion=fusion)
    if options.method == "malsd_batch":  # RNN-T and TDT alike
        return malsd_beam_search(model, encoder_out, encoder_out_lens, options.beam, options.max_sym_per_frame,
                                 length_norm=options.length_norm, fusion=fusion)
    if is_tdt(model):  # a joiner with a duration head: the searches that jump by the predicted durations
        if options.method == "greedy_search":
            return tdt_greedy_search(model, encoder_out, encoder_out_lens, options.max_sym_per_frame, fusion=fusion)
        return tdt_modified_beam_search(model, encoder_out, encoder_out_lens, options.beam, options.max_sym_per_frame,
                                        length_norm=options.length_norm, fusion=fusion)
    if options.method == "greedy_search":
        return greedy_search(model, encoder_out, encoder_out_lens, max_sym_per_frame=options.max_sym_per_frame,
                             fusion=fusion)
    return modified_beam_search(
        model, encoder_out, encoder_out_lens, beam=options.beam, length_norm=options.length_norm, fusion=fusion
    )


@torch.no_grad()
def decode(
    model: nn.Module, features: torch.Tensor, feature_lens: torch.Tensor, options: DecodingOptions | None = None,
    fusion: BatchFusion | None = None,
) -> list[list[int]]:
    """Encode features and decode them.

    Args:
        model: a transducer (``encode`` + the decoding interface of the method's head), in eval mode.
        features: (B, T, F) float features. feature_lens: (B,) integer valid frames.
        options: the method and its knobs (default: greedy search, one symbol per frame).
        fusion: LM / LODR / phrase bonuses for this batch (:meth:`asrprec.decoding.fusion.Fusion.for_batch`).
    Returns:
        B token-id lists in the input order.
    """
    options = options or DecodingOptions()
    encoder_out, encoder_out_lens = model.encode(features, feature_lens)
    return decode_encoder_out(model, encoder_out, encoder_out_lens, options, fusion)
