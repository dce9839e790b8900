"""Transducer decoding: ``greedy_search`` and ``modified_beam_search``, batched, plain PyTorch (no k2).

Both take ``(model, encoder_out (B, T, D_enc), encoder_out_lens (B,))`` and return B token-id lists
(no blank, no start context) in the input order; with ``return_results=True`` (every search) B
:class:`DecodingResult`: the tokens with the encoder frame of each, a TDT model's durations and a beam search's score.
They read the model through :class:`SearchableTransducer` and run under any precision policy (a bf16-cast model from ``policy.prepare_for_inference`` or an fp32 model under ``policy.autocast()``); beam
scores use an fp32 log-softmax.

:class:`DecodingOptions` and :func:`decode` bundle "encode, then decode with the named method" (:mod:`.api`), the
method found in one table of (method, head, streaming) → search (:mod:`.methods`);
:func:`decode_dataset` decodes a dataloader (:mod:`.dataset`); :func:`streaming_decode` does it chunk by chunk
for a causal Zipformer (real streaming, with caches; :mod:`.streaming`).

A TDT model (a joiner with a duration head) is decoded by the same names through the searches of :mod:`.tdt` and
:mod:`.tdt_label_looping`, which jump over frames by the predicted durations.

``malsd_beam_search`` (method ``malsd_batch``) is a beam search with every hypothesis of the batch in tensors, for
RNN-T and TDT (:mod:`.batched_beam`). Every search takes a ``fusion`` (:mod:`.fusion`): an n-gram LM, LODR and hot
phrases as a bonus on non-blank tokens.

CTC heads: ``ctc_greedy_search`` and ``ctc_prefix_beam_search`` take ``(log_probs (B, T, V), log_probs_lens (B,))``
from ``model.ctc_log_probs`` (:mod:`.ctc`); :func:`decode` runs them by name too.
"""

from ._common import SearchableTransducer
from .api import CTC_METHODS, METHODS, DecodingOptions, Searcher, check_method, decode, decode_encoder_out
from .batched_beam import malsd_beam_search
from .beam_search import StreamingModifiedBeamSearch, modified_beam_search
from .ctc import (
    StreamingCtcGreedySearch, StreamingCtcPrefixBeamSearch, ctc_greedy_search, ctc_prefix_beam_search,
)
from .dataset import decode_dataset
from .greedy import StreamingGreedySearch, greedy_search
from .hypothesis import DecodingResult, Hypothesis, HypothesisList
from .label_looping import LabelLoopingGreedy, label_looping_greedy_search
from .methods import HEADS, model_heads, select_search, supported_methods
from .streaming import streaming_decode, streaming_encode
from .tdt import (TDT_MAX_SYM_PER_FRAME, StreamingTdtGreedySearch, TdtHypothesis, is_tdt, tdt_greedy_search,
                  tdt_modified_beam_search)
from .tdt_label_looping import TdtLabelLoopingGreedy, tdt_label_looping_greedy_search

__all__ = [
    "DecodingResult", "HEADS", "Searcher", "SearchableTransducer", "model_heads", "select_search", "supported_methods",
    "METHODS", "DecodingOptions", "Hypothesis", "HypothesisList", "decode", "decode_dataset", "decode_encoder_out",
    "greedy_search", "modified_beam_search", "malsd_beam_search", "StreamingGreedySearch", "StreamingModifiedBeamSearch",
    "streaming_decode", "streaming_encode",
    "LabelLoopingGreedy", "label_looping_greedy_search",
    "CTC_METHODS", "check_method", "ctc_greedy_search", "ctc_prefix_beam_search", "StreamingCtcGreedySearch",
    "StreamingCtcPrefixBeamSearch",
    "StreamingTdtGreedySearch", "TDT_MAX_SYM_PER_FRAME", "TdtHypothesis", "TdtLabelLoopingGreedy", "is_tdt",
    "tdt_greedy_search",
    "tdt_label_looping_greedy_search", "tdt_modified_beam_search",
]
