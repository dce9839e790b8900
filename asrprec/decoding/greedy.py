"""Batched greedy search for transducers (frame-looping, several symbols per frame allowed).

Follows icefall's ``greedy_search_batch`` (k2-fsa/icefall egs/librispeech/ASR/pruned_transducer_stateless2/
beam_search.py): utterances are sorted by length so the ones still active at frame t form a prefix, the
encoder output is projected once, and the decoder is re-run only for rows that emitted a token. Unlike
icefall's batched version, which is limited to one symbol per frame (its per-utterance ``greedy_search`` handles
``max_sym_per_frame > 1``), this one handles any ``max_sym_per_frame`` in the batch: on each frame it loops
while some row keeps emitting, shrinking the set of rows to those that emitted.

:class:`StreamingGreedySearch` makes the same decisions on encoder output that arrives a chunk at a time.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import check_inputs, model_device, sort_and_project
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


class StreamingGreedySearch:
    """Greedy search fed encoder output a chunk at a time; :attr:`hyps` is the partial result after each chunk,
    :attr:`timestamps` the frame of each token counted from the start of its stream (:meth:`results`).

    Same decisions as :func:`asrprec.decoding.greedy_search` over the concatenated chunks (greedy search only
    looks at the current frame and the emitted tokens), written per frame without the length sort, so a test
    can check one against the other.
    """

    def __init__(self, model: nn.Module, batch_size: int, max_sym_per_frame: int = 1):
        if not isinstance(max_sym_per_frame, int) or max_sym_per_frame < 1:
            raise ValueError(f"max_sym_per_frame must be an integer >= 1, got {max_sym_per_frame!r}")
        self.model = model
        self.max_sym_per_frame = max_sym_per_frame
        self.blank = model.blank_id
        self.device = model_device(model)
        self.hyps: list[list[int]] = [[] for _ in range(batch_size)]
        self.timestamps: list[list[int]] = [[] for _ in range(batch_size)]
        self.frames = [0] * batch_size  # frames consumed per stream
        self.contexts = torch.full((batch_size, model.context_size), self.blank, dtype=torch.int64,
                                   device=self.device)
        self.dec = model.project_decoder(self.contexts) if batch_size else None  # (B, J)

    @torch.no_grad()
    def accept(self, encoder_out: torch.Tensor, encoder_out_lens: torch.Tensor) -> None:
        """Consume the next chunk: encoder_out (B, T', D_enc), encoder_out_lens (B,) valid frames of it
        (0 for a stream that has ended)."""
        check_inputs(encoder_out, encoder_out_lens)
        if encoder_out.shape[0] != len(self.hyps):
            raise ValueError(f"this search has {len(self.hyps)} streams, got a chunk of {encoder_out.shape[0]}")
        enc = self.model.project_encoder(encoder_out)  # (B, T', J)
        lens = encoder_out_lens.to(self.device)
        for t in range(encoder_out.shape[1]):
            rows = torch.nonzero(lens > t).squeeze(1)
            for _ in range(self.max_sym_per_frame):
                if rows.numel() == 0:
                    break
                tokens = self.model.join_projected(enc[rows, t], self.dec[rows]).argmax(dim=-1)
                emitted = tokens != self.blank
                rows, tokens = rows[emitted], tokens[emitted]
                if rows.numel() == 0:
                    break
                for r, k in zip(rows.tolist(), tokens.tolist()):
                    self.hyps[r].append(k)
                    self.timestamps[r].append(self.frames[r] + t)
                self.contexts[rows] = torch.cat([self.contexts[rows, 1:], tokens[:, None]], dim=1)
                self.dec[rows] = self.model.project_decoder(self.contexts[rows])
        self.frames = [f + n for f, n in zip(self.frames, lens.tolist())]

    def results(self) -> list[DecodingResult]:
        """Each stream's tokens so far with their frames."""
        return results_of(self.hyps, self.timestamps)
