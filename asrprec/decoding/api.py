"""How to decode (:class:`DecodingOptions`), the method's search chosen once (:class:`Searcher`, from the table of
:mod:`asrprec.decoding.methods`), and "encode, then decode with the named method" (:func:`decode`).

Legend: B utterances, T input frames, T' encoder frames, F feature bins, D_enc encoder width.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from asrprec.config import strict_from_dict

from .fusion import BatchFusion
from .hypothesis import DecodingResult
from .label_looping import GREEDY_METHODS
from .methods import CTC_METHODS, METHODS, TABLE, check_method, select_search
from .tdt import TDT_MAX_SYM_PER_FRAME

__all__ = ["CTC_METHODS", "METHODS", "TDT_MAX_SYM_PER_FRAME", "DecodingOptions", "Searcher", "check_method",
           "decode", "decode_encoder_out"]


@dataclass(frozen=True)
class DecodingOptions:
    """How to decode.

    method: ``"greedy_search"``, ``"modified_beam_search"`` or ``"malsd_batch"`` (transducer, RNN-T or TDT; the last
        is the batched ALSD beam search of :mod:`asrprec.decoding.batched_beam`), ``"ctc_greedy_search"`` or
        ``"ctc_prefix_beam_search"`` (CTC head); :mod:`asrprec.decoding.methods` maps each to its search.
    beam: hypotheses per utterance for the beam searches (icefall's ``--beam-size``, default 4).
    max_sym_per_frame: symbols per frame for ``greedy_search``, and for both searches of a TDT model (NeMo's
        ``max_symbols``; see :mod:`asrprec.decoding.tdt`); None: 1 for an RNN-T (icefall's default), 10 for TDT
        (:data:`TDT_MAX_SYM_PER_FRAME`), resolved by :meth:`for_head`.
    length_norm: final choice of ``modified_beam_search`` by length-normalised score (icefall) or raw score.
    greedy_method: ``greedy_search`` by frame looping (:func:`asrprec.decoding.greedy_search`) or by label looping
        (:class:`asrprec.decoding.LabelLoopingGreedy`, which a :class:`Searcher` keeps across batches); the same
        decisions.
    """

    method: str = "greedy_search"
    beam: int = 4
    max_sym_per_frame: int | None = None
    length_norm: bool = True
    greedy_method: str = "frame_looping"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown decoding method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.beam < 1:
            raise ValueError(f"beam must be >= 1, got {self.beam}")
        if self.max_sym_per_frame is not None and self.max_sym_per_frame < 1:
            raise ValueError(f"max_sym_per_frame must be >= 1 (or None: the head's default), got "
                             f"{self.max_sym_per_frame}")
        if self.greedy_method not in GREEDY_METHODS:
            raise ValueError(f"greedy_method must be one of {', '.join(GREEDY_METHODS)}, got {self.greedy_method!r}")

    def for_head(self, head: str) -> "DecodingOptions":
        """These options with ``max_sym_per_frame`` None replaced by ``head``'s default (a head of
        :data:`asrprec.decoding.methods.HEADS`): :data:`TDT_MAX_SYM_PER_FRAME` for ``"tdt"``, else 1."""
        if self.max_sym_per_frame is not None:
            return self
        return replace(self, max_sym_per_frame=TDT_MAX_SYM_PER_FRAME if head == "tdt" else 1)

    @classmethod
    def from_dict(cls, d: dict) -> "DecodingOptions":
        """Build from a config dict; unknown keys are an error (a typo must not be silently ignored)."""
        return strict_from_dict(cls, d)


class Searcher:
    """The search of ``options.method`` for ``model``, looked up once in the table of :mod:`asrprec.decoding.methods`
    and kept for many batches (label looping and ``malsd_batch`` keep their buffers and CUDA graphs).

    Call it as ``searcher(encoder_out (B, T', D_enc), encoder_out_lens (B,), fusion=None)``: B token-id lists in the
    input order, or with ``return_timestamps=True`` B :class:`~asrprec.decoding.DecodingResult` (tokens, the encoder
    frame of each, a TDT model's durations, a beam search's score). ``fusion``: LM / LODR / phrase bonuses
    (:mod:`asrprec.decoding.fusion`), taken by every method but ``ctc_greedy_search`` (a ValueError there).

    Raises ValueError for a method the model cannot run, naming those it can (:func:`check_method`).
    """

    def __init__(self, model: nn.Module, options: DecodingOptions | None = None):
        self.entry = select_search(model, (options or DecodingOptions()).method)
        self.options = (options or DecodingOptions()).for_head(self.entry.head)
        self._search = self.entry.make(model, self.options)

    @torch.no_grad()
    def __call__(self, encoder_out: torch.Tensor, encoder_out_lens: torch.Tensor, fusion: BatchFusion | None = None,
                 *, return_timestamps: bool = False) -> list[list[int]] | list[DecodingResult]:
        if fusion is not None and not self.entry.fusion:  # the methods of the same head that take it
            others = [m for m in METHODS if getattr(TABLE.get((m, self.entry.head, False)), "fusion", False)]
            raise ValueError(f"{self.entry.method} takes no language model or hot phrases; fix: decode with "
                             f"{' or '.join(others)}")
        results = self._search(encoder_out, encoder_out_lens, fusion)
        return results if return_timestamps else [list(r.tokens) for r in results]


def decode_encoder_out(
    model: nn.Module, encoder_out: torch.Tensor, encoder_out_lens: torch.Tensor, options: DecodingOptions,
    fusion: BatchFusion | None = None, *, return_timestamps: bool = False,
) -> list[list[int]] | list[DecodingResult]:
    """Run the decoding method named in ``options`` on (B, T', D_enc) ``encoder_out`` with (B,) ``encoder_out_lens``.

    Returns B token-id lists in the input order, or with ``return_timestamps`` B
    :class:`~asrprec.decoding.DecodingResult` (:class:`Searcher`). CTC methods read ``model.ctc_log_probs(encoder_out)``;
    a method the model has no head for raises ValueError (:func:`check_method`). ``fusion``: LM / LODR / phrase bonuses
    (:mod:`asrprec.decoding.fusion`), taken by every method but ``ctc_greedy_search`` (a ValueError there)."""
    return Searcher(model, options)(encoder_out, encoder_out_lens, fusion, return_timestamps=return_timestamps)


@torch.no_grad()
def decode(
    model: nn.Module, features: torch.Tensor, feature_lens: torch.Tensor, options: DecodingOptions | None = None,
    fusion: BatchFusion | None = None, *, return_timestamps: bool = False,
) -> list[list[int]] | list[DecodingResult]:
    """Encode features and decode them.

    Args:
        model: a transducer (``encode`` + the decoding interface of the method's head), in eval mode.
        features: (B, T, F) float features. feature_lens: (B,) integer valid frames.
        options: the method and its knobs (default: greedy search, one symbol per frame).
        fusion: LM / LODR / phrase bonuses for this batch (:meth:`asrprec.decoding.fusion.Fusion.for_batch`).
        return_timestamps: return :class:`~asrprec.decoding.DecodingResult` (tokens with encoder frames).
    Returns:
        B token-id lists in the input order, or B :class:`~asrprec.decoding.DecodingResult`.
    """
    options = options or DecodingOptions()
    encoder_out, encoder_out_lens = model.encode(features, feature_lens)
    return decode_encoder_out(model, encoder_out, encoder_out_lens, options, fusion,
                              return_timestamps=return_timestamps)
