"""The decoding methods in one table: (method, head, streaming) → the search that runs it.

A model's heads are ``rnnt`` or ``tdt`` (its transducer: a joiner without or with a duration head) and ``ctc`` (its CTC
head). A method reads one head: the CTC methods the ``ctc`` head, the others the transducer. :func:`select_search`
looks the triple up once; a triple missing from the table (no such head, or no chunk-by-chunk form) is refused with one
error naming what the model can do.

Every entry gives :class:`~asrprec.decoding.DecodingResult` (tokens, encoder frames, TDT durations, score):

* whole utterances: ``make(model, options)`` → a batch search called as ``search(encoder_out (B, T, D_enc),
  encoder_out_lens (B,), fusion)``; it may keep state across batches (label looping's and ``malsd_batch``'s
  buffers and CUDA graphs);
* chunk by chunk (``streaming``): ``make(model, options, batch_size, device)`` → a chunk search with
  ``accept(encoder_out (B, T', D_enc), encoder_out_lens (B,))`` per chunk and ``results()``.

``options`` is a :class:`~asrprec.decoding.DecodingOptions` (read: ``method``, ``beam``, ``max_sym_per_frame``,
``length_norm``, ``greedy_method``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .batched_beam import MalsdBeamSearch
from .beam_search import StreamingModifiedBeamSearch, modified_beam_search
from .ctc import StreamingCtcGreedySearch, StreamingCtcPrefixBeamSearch, ctc_greedy_search, ctc_prefix_beam_search
from .fusion import BatchFusion
from .greedy import StreamingGreedySearch, greedy_search
from .hypothesis import DecodingResult
from .label_looping import LabelLoopingGreedy
from .tdt import StreamingTdtGreedySearch, tdt_greedy_search, tdt_modified_beam_search
from .tdt_label_looping import TdtLabelLoopingGreedy

__all__ = ["CTC_METHODS", "HEADS", "METHODS", "SearchEntry", "check_method", "method_head", "model_heads",
           "select_search", "supported_methods"]

#: methods that read the CTC head (``model.ctc_log_probs``); every other method reads the transducer
CTC_METHODS = ("ctc_greedy_search", "ctc_prefix_beam_search")
METHODS = ("greedy_search", "modified_beam_search", "malsd_batch") + CTC_METHODS
HEADS = ("rnnt", "tdt", "ctc")

BatchSearch = Callable[[torch.Tensor, torch.Tensor, "BatchFusion | None"], "list[DecodingResult]"]


@dataclass(frozen=True)
class SearchEntry:
    """One row of the table: ``make`` builds the search (module docstring); ``fusion``: whether it takes LM / LODR /
    phrase bonuses."""

    method: str
    head: str
    streaming: bool
    make: Callable[..., Any]
    fusion: bool = True


# -- whole utterances ---------------------------------------------------------------------------------------------
def _rnnt_greedy(model: nn.Module, o: Any) -> BatchSearch:
    if getattr(o, "greedy_method", "frame_looping") == "label_looping":
        looping = LabelLoopingGreedy(model, o.max_sym_per_frame)
        return lambda enc, lens, fusion: looping(enc, lens, fusion=fusion, return_results=True)
    return lambda enc, lens, fusion: greedy_search(model, enc, lens, max_sym_per_frame=o.max_sym_per_frame,
                                                   fusion=fusion, return_results=True)


def _tdt_greedy(model: nn.Module, o: Any) -> BatchSearch:
    looping = None
    if getattr(o, "greedy_method", "frame_looping") == "label_looping":
        looping = TdtLabelLoopingGreedy(model, o.max_sym_per_frame)

    def search(enc: torch.Tensor, lens: torch.Tensor, fusion: BatchFusion | None) -> list[DecodingResult]:
        if looping is not None and fusion is None:  # TDT label looping takes no fusion: frame looping does
            return looping(enc, lens, return_results=True)
        return tdt_greedy_search(model, enc, lens, o.max_sym_per_frame, fusion=fusion, return_results=True)

    return search


def _rnnt_beam(model: nn.Module, o: Any) -> BatchSearch:
    return lambda enc, lens, fusion: modified_beam_search(model, enc, lens, beam=o.beam, length_norm=o.length_norm,
                                                          fusion=fusion, return_results=True)


def _tdt_beam(model: nn.Module, o: Any) -> BatchSearch:
    return lambda enc, lens, fusion: tdt_modified_beam_search(model, enc, lens, o.beam, o.max_sym_per_frame,
                                                              length_norm=o.length_norm, fusion=fusion,
                                                              return_results=True)


def _malsd(model: nn.Module, o: Any) -> BatchSearch:  # RNN-T and TDT alike
    # one search for every batch: it keeps its state, its decoder outputs by context and (on CUDA) its graph
    search = MalsdBeamSearch(model, o.beam, o.max_sym_per_frame, length_norm=o.length_norm)
    return lambda enc, lens, fusion: search(enc, lens, fusion=fusion, return_results=True)


def _ctc_greedy(model: nn.Module, o: Any) -> BatchSearch:
    return lambda enc, lens, fusion: ctc_greedy_search(model.ctc_log_probs(enc), lens, blank_id=model.blank_id,
                                                       return_results=True)


def _ctc_beam(model: nn.Module, o: Any) -> BatchSearch:
    return lambda enc, lens, fusion: ctc_prefix_beam_search(model.ctc_log_probs(enc), lens, o.beam,
                                                            blank_id=model.blank_id, fusion=fusion,
                                                            return_results=True)


# -- chunk by chunk -----------------------------------------------------------------------------------------------
class _CtcChunks:
    """A CTC chunk search fed encoder output: each chunk goes through ``model.ctc_log_probs`` first."""

    def __init__(self, model: nn.Module, search: Any):
        self.model, self.search = model, search

    def accept(self, encoder_out: torch.Tensor, encoder_out_lens: torch.Tensor) -> None:
        self.search.accept(self.model.ctc_log_probs(encoder_out), encoder_out_lens)

    def results(self) -> list[DecodingResult]:
        return self.search.results()


def _stream_ctc_greedy(model: nn.Module, o: Any, batch_size: int, device: torch.device) -> _CtcChunks:
    return _CtcChunks(model, StreamingCtcGreedySearch(batch_size, model.blank_id))


def _stream_ctc_beam(model: nn.Module, o: Any, batch_size: int, device: torch.device) -> _CtcChunks:
    return _CtcChunks(model, StreamingCtcPrefixBeamSearch(batch_size, o.beam, model.blank_id, device=device))


_ENTRIES = (
    SearchEntry("greedy_search", "rnnt", False, _rnnt_greedy),
    SearchEntry("greedy_search", "tdt", False, _tdt_greedy),
    SearchEntry("modified_beam_search", "rnnt", False, _rnnt_beam),
    SearchEntry("modified_beam_search", "tdt", False, _tdt_beam),
    SearchEntry("malsd_batch", "rnnt", False, _malsd),
    SearchEntry("malsd_batch", "tdt", False, _malsd),
    SearchEntry("ctc_greedy_search", "ctc", False, _ctc_greedy, fusion=False),
    SearchEntry("ctc_prefix_beam_search", "ctc", False, _ctc_beam),
    SearchEntry("greedy_search", "rnnt", True,
                lambda model, o, b, device: StreamingGreedySearch(model, b, o.max_sym_per_frame), fusion=False),
    SearchEntry("greedy_search", "tdt", True,
                lambda model, o, b, device: StreamingTdtGreedySearch(model, b, o.max_sym_per_frame), fusion=False),
    SearchEntry("modified_beam_search", "rnnt", True,
                lambda model, o, b, device: StreamingModifiedBeamSearch(model, b, o.beam, o.length_norm),
                fusion=False),
    SearchEntry("ctc_greedy_search", "ctc", True, _stream_ctc_greedy, fusion=False),
    SearchEntry("ctc_prefix_beam_search", "ctc", True, _stream_ctc_beam, fusion=False),
)
TABLE: dict[tuple[str, str, bool], SearchEntry] = {(e.method, e.head, e.streaming): e for e in _ENTRIES}

#: why a triple is missing, where there is more to say than "not in the table"
_WHY_NOT = {
    ("malsd_batch", "rnnt", True): "malsd_batch decodes whole utterances",
    ("malsd_batch", "tdt", True): "malsd_batch decodes whole utterances",
    ("modified_beam_search", "tdt", True): "chunk-by-chunk modified_beam_search is not implemented for TDT models "
                                           "(without --streaming it decodes a causal model by simulated streaming)",
}


def model_heads(model: nn.Module) -> tuple[str, ...]:
    """The heads ``model`` has: ``rnnt`` or ``tdt`` (a transducer; ``tdt`` when its joiner has durations) and
    ``ctc``."""
    heads = []
    if getattr(model, "use_transducer", True):
        heads.append("tdt" if tuple(getattr(model, "durations", ())) else "rnnt")
    if getattr(model, "use_ctc", False):
        heads.append("ctc")
    return tuple(heads)


def method_head(model: nn.Module, method: str) -> str:
    """The head ``method`` reads on ``model`` (``ctc``, or the model's transducer kind)."""
    if method in CTC_METHODS:
        return "ctc"
    return "tdt" if tuple(getattr(model, "durations", ())) else "rnnt"


def supported_methods(model: nn.Module, streaming: bool = False) -> list[str]:
    """The methods ``model`` can be decoded with (chunk by chunk with ``streaming``), in :data:`METHODS` order."""
    heads = model_heads(model)
    return [m for m in METHODS if any((m, h, streaming) in TABLE for h in heads)]


def _refusal(model: nn.Module, method: str, streaming: bool) -> str:
    how = " chunk by chunk (--streaming)" if streaming else ""
    supported = supported_methods(model, streaming)
    offer = f"decode it{how} with {' or '.join(supported)}" if supported else f"it has no method that decodes{how}"
    head = method_head(model, method)
    if head not in model_heads(model):
        if head == "ctc":
            return f"{method} decodes a CTC head and this model has none (it was trained without --use-ctc); {offer}"
        return f"{method} decodes a transducer and this model is CTC-only (trained with --use-transducer false); {offer}"
    why = _WHY_NOT.get((method, head, streaming), f"{method} does not decode a {head} model{how}")
    return f"{why}; {offer}"


def select_search(model: nn.Module, method: str, streaming: bool = False) -> SearchEntry:
    """The table's entry for ``method`` on ``model`` (whole utterances, or chunk by chunk with ``streaming``).

    Raises:
        ValueError: an unknown method, or one the model cannot run (no such head, or no chunk-by-chunk form),
            naming the methods the model has.
    """
    if method not in METHODS:
        raise ValueError(f"unknown decoding method {method!r}; choose one of {', '.join(METHODS)}")
    entry = TABLE.get((method, method_head(model, method), bool(streaming)))
    if entry is None or method_head(model, method) not in model_heads(model):
        raise ValueError(_refusal(model, method, bool(streaming)))
    return entry


def check_method(model: nn.Module, method: str, streaming: bool = False) -> None:
    """Refuse a method the model cannot run (:func:`select_search`'s ValueError)."""
    select_search(model, method, streaming)
