"""Batched greedy search for transducers (frame-looping, several symbols per frame allowed).

Follows icefall's ``greedy_search_batch`` (k2-fsa/icefall egs/librispeech/ASR/pruned_transducer_stateless2/
beam_search.py): utterances are sorted by length so the ones still active at frame t form a prefix, the
encoder output is projected once, and the decoder is re-run only for rows that emitted a token. Unlike
icefall's batched version, which is limited to one symbol per frame (its per-utterance ``greedy_search`` handles
``max_sym_per_frame > 1``), this one handles any ``max_sym_per_frame`` in the batch: on each frame it loops
while some row keeps emitting, shrinking the set of rows to those that emitted.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import model_device, sort_and_project
from .fusion import BatchFusion, fused_greedy_tokens
from .hypothesis import DecodingResult, results_of


@torch.no_grad()
def greedy_search(model: nn.Module, encoder_out: torch.Tensor, encoder_out_lens: torch.Tensor,
                  max_sym_per_frame: int = 1, *, return_timestamps: bool = False,
                  fusion: BatchFusion | None = None, return_results: bool = False,
                  ) -> list[list[int]] | tuple[list[list[int]], list[list[int]]] | list[DecodingResult]:
    """Greedy transducer decoding of a batch.

    On each frame, take the argmax token; if it is not blank, emit it, update the decoder and try the
    same frame again, at most ``max_sym_per_frame`` times; a blank (or the cap) moves to the next frame.
    The argmax is taken on the raw logits (the same argmax as log-softmax's, without the fp32 cost).

    Legend: B utterances, T encoder frames, D_enc encoder width.

    Args:
        model: a transducer (:class:`~asrprec.decoding.SearchableTransducer`);
            any precision (fp32, a bf16-cast model, or called under autocast).
        encoder_out: (B, T, D_enc) from ``model.encode``, any float dtype.
        encoder_out_lens: (B,) integer valid frames per utterance; 0 is allowed (gives ``[]``).
        max_sym_per_frame: at most this many tokens per frame (>= 1).
        return_timestamps: also return, for each token, the encoder frame that emitted it.
        fusion: LM / LODR / phrase bonuses for non-blank tokens (:mod:`asrprec.decoding.fusion`): the blank decision
            stays the acoustic model's, the non-blank token is the best with the bonus.
        return_results: return B :class:`~asrprec.decoding.DecodingResult` (tokens and frames; no score).
    Returns:
        B lists of token ids, in the input order, without blanks and without the decoder's start context;
        with ``return_timestamps``, ``(tokens, timestamps)``: two such lists of lists, of equal lengths.
    """
    if not isinstance(max_sym_per_frame, int) or max_sym_per_frame < 1:
        raise ValueError(f"max_sym_per_frame must be an integer >= 1, got {max_sym_per_frame!r}")
    batch = sort_and_project(model, encoder_out, encoder_out_lens)
    B = encoder_out.size(0)
    if B == 0:
        return ([], []) if return_timestamps and not return_results else []
    blank = model.blank_id
    C = model.context_size
    device = model_device(model)
    enc = batch.encoder_proj  # (B, T, J), sorted by decreasing length

    hyps: list[list[int]] = [[] for _ in range(B)]
    stamps: list[list[int]] = [[] for _ in range(B)]
    contexts = torch.full((B, C), blank, dtype=torch.int64, device=device)
    dec = model.project_decoder(contexts)  # (B, J)
    fstate = fusion.start(torch.tensor(batch.order, device=device)) if fusion is not None else None  # (B, 4)
    for t, n in enumerate(batch.batch_sizes):
        rows = torch.arange(n, device=device)  # rows still emitting on this frame
        for _ in range(max_sym_per_frame):
            logits = model.join_projected(enc[rows, t], dec[rows])  # (len(rows), V)
            if fusion is None:
                tokens = logits.argmax(dim=-1)
            else:
                tokens = fused_greedy_tokens(logits, fusion, fstate[rows], blank)
            emitted = tokens != blank
            rows, tokens = rows[emitted], tokens[emitted]
            if rows.numel() == 0:
                break
            for r, k in zip(rows.tolist(), tokens.tolist()):
                hyps[r].append(k)
                stamps[r].append(t)
            contexts[rows] = torch.cat([contexts[rows, 1:], tokens[:, None]], dim=1)
            dec[rows] = model.project_decoder(contexts[rows])
            if fusion is not None:
                fstate[rows] = fusion.step(fstate[rows], tokens)[1]
    if return_results:
        return results_of(batch.unsort(hyps), batch.unsort(stamps))
    if return_timestamps:
        return batch.unsort(hyps), batch.unsort(stamps)
    return batch.unsort(hyps)
