"""Batched ``modified_beam_search`` for transducers (one symbol per frame), without k2.

Follows icefall's ``modified_beam_search`` (k2-fsa/icefall egs/librispeech/ASR/pruned_transducer_stateless2/
beam_search.py): every hypothesis consumes exactly one frame per step, emitting either blank or one token;
the candidates of all hypotheses of one utterance compete for ``beam`` places; hypotheses with the same label
sequence merge by log-add. icefall does the per-utterance top-k over a k2 ragged tensor; here the (at most
``beam``) hypotheses of each utterance are scattered into a padded (B, beam, V) block filled with -inf, so a
single batched ``topk`` serves every utterance.

Final choice: like icefall (``get_most_probable(length_norm=True)``), the best hypothesis by
``log_prob / (context_size + len(tokens))`` — its ``ys`` counts the context prefix. Length normalisation
counters the per-token cost that makes raw scores prefer short outputs; ``length_norm=False`` picks by raw
``log_prob`` (the maximum-probability label sequence among the survivors).

Token times: candidates enter the next beam best first and a duplicate keeps the record already there, so a merged
hypothesis carries the frames of its most probable candidate on that step. :class:`StreamingModifiedBeamSearch` runs
the same step on encoder output that arrives a chunk at a time.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import check_inputs, log_softmax_fp32, sort_and_project
from .fusion import BatchFusion
from .hypothesis import DecodingResult, Hypothesis, HypothesisList


@torch.no_grad()
def modified_beam_search(model: nn.Module, encoder_out: torch.Tensor, encoder_out_lens: torch.Tensor, beam: int = 4, *,
                         length_norm: bool = True, return_hypotheses: bool = False,
                         fusion: BatchFusion | None = None, return_results: bool = False,
                         ) -> list[list[int]] | list[HypothesisList] | list[DecodingResult]:
    """Beam search over label sequences with one symbol per frame, batched across utterances.

    Scores are fp32 log-softmax values (computed in an fp32 island whatever the model's dtype) summed in
    float64.

    Legend: B utterances, T encoder frames, D_enc encoder width, V vocabulary (blank included).

    Args:
        model: a transducer (:class:`~asrprec.decoding.SearchableTransducer`);
            any precision (fp32, a bf16-cast model, or called under autocast).
        encoder_out: (B, T, D_enc) from ``model.encode``, any float dtype.
        encoder_out_lens: (B,) integer valid frames per utterance; 0 is allowed (gives ``[]``).
        beam: hypotheses kept per utterance (>= 1; ``beam=1`` is one-symbol-per-frame greedy search).
        length_norm: pick the final hypothesis by length-normalised score (icefall's choice) or raw score.
        return_hypotheses: return each utterance's final :class:`HypothesisList` instead of the best tokens.
        fusion: LM / LODR / phrase bonuses added to the non-blank candidates (:mod:`asrprec.decoding.fusion`; icefall's
            ``modified_beam_search_lm_shallow_fusion`` / ``_LODR``); scores then include them, and the final choice
            takes back the bonus of unfinished phrases.
        return_results: return the chosen hypotheses as B :class:`~asrprec.decoding.DecodingResult` (each token's
            frame: where the first alignment that reached the sequence emitted it; score: its ``log_prob``).
    Returns:
        B lists of token ids (input order, no blanks, no start context), or B ``HypothesisList``.
    """
    if not isinstance(beam, int) or beam < 1:
        raise ValueError(f"beam must be an integer >= 1, got {beam!r}")
    batch = sort_and_project(model, encoder_out, encoder_out_lens)
    B = encoder_out.size(0)
    if B == 0:
        return []
    C = model.context_size
    enc = batch.encoder_proj  # (B, T, J), sorted by decreasing length

    if fusion is None:
        beams = [HypothesisList([Hypothesis()]) for _ in range(B)]
    else:
        starts = fusion.start(torch.tensor(batch.order, device=enc.device)).tolist()
        beams = [HypothesisList([Hypothesis(fusion_state=tuple(s))]) for s in starts]
    for t, n in enumerate(batch.batch_sizes):
        beams[:n] = beam_search_step(model, enc[:n, t], beams[:n], [t] * n, beam, fusion=fusion)

    beams = batch.unsort(beams)
    if fusion is not None:  # an unfinished phrase gives its bonus back before the final choice
        flat = [h for b in beams for h in b]
        if flat:
            back = fusion.final(torch.tensor([h.fusion_state for h in flat], device=enc.device)).tolist()
            for h, v in zip(flat, back):
                h.log_prob += v
    if return_hypotheses:
        return beams
    best = [b.get_most_probable(length_norm=length_norm, context_size=C) for b in beams]
    return [h.result() for h in best] if return_results else [list(h.tokens) for h in best]


def beam_search_step(model: nn.Module, enc_t: torch.Tensor, beams: list[HypothesisList], frames: list[int],
                     beam: int, fusion: BatchFusion | None = None) -> list[HypothesisList]:
    """One frame of modified beam search for N utterances: each hypothesis emits blank or one token on its
    utterance's projected encoder frame ``enc_t`` (N, J); the best ``beam`` candidates per utterance survive,
    equal label sequences merged. ``frames`` (N) are the frame indices recorded as token timestamps. ``fusion``
    adds its bonus to the non-blank candidates and carries each hypothesis's fusion state."""
    n = len(beams)
    blank = model.blank_id
    C = model.context_size
    device = enc_t.device
    active = [list(b) for b in beams]
    counts = [len(a) for a in active]
    flat = [h for a in active for h in a]
    max_h = max(counts)
    row_ids = torch.repeat_interleave(torch.arange(n), torch.tensor(counts)).to(device)  # (H,)
    pos = torch.tensor([j for c in counts for j in range(c)], device=device)  # (H,) slot within its row

    contexts = torch.tensor([h.context(C, blank) for h in flat], dtype=torch.int64, device=device)
    dec = model.project_decoder(contexts)  # (H, J)
    logits = model.join_projected(enc_t.index_select(0, row_ids), dec)  # (H, V)
    V = logits.size(-1)
    scores = torch.tensor([h.log_prob for h in flat], dtype=torch.float64, device=device)
    cand = log_softmax_fp32(logits).double() + scores[:, None]  # (H, V)
    if fusion is not None:
        fstates = torch.tensor([h.fusion_state for h in flat], dtype=torch.int64, device=device)  # (H, 4)
        bonus, next_states = fusion.scores(fstates)  # (H, V), (H, V, 4)
        cand = cand + bonus.double()

    block = torch.full((n, max_h, V), float("-inf"), dtype=torch.float64, device=device)
    block[row_ids, pos] = cand
    k = min(beam, max_h * V)
    top_scores, top_idx = block.view(n, max_h * V).topk(k, dim=1)  # (n, k)

    chosen = None
    if fusion is not None:  # the fusion states of the chosen candidates: (n, k, 4)
        offsets = torch.tensor([0] + counts[:-1], device=device).cumsum(0)
        src_flat = (offsets[:, None] + top_idx // V).clamp(max=len(flat) - 1)
        chosen = next_states[src_flat, top_idx % V].tolist()
    top_scores, top_idx = top_scores.tolist(), top_idx.tolist()
    out = []
    for i in range(n):
        new = HypothesisList()
        for j, (score, idx) in enumerate(zip(top_scores[i], top_idx[i])):
            if score == float("-inf"):  # a padding slot (fewer than k real candidates)
                continue
            src, tok = active[i][idx // V], idx % V
            state = tuple(chosen[i][j]) if chosen is not None else src.fusion_state
            if tok == blank:
                new.add(Hypothesis(src.tokens, score, src.timestamps, state))
            else:
                new.add(Hypothesis(src.tokens + (tok,), score, src.timestamps + (frames[i],), state))
        out.append(new)
    return out


class StreamingModifiedBeamSearch:
    """Modified beam search fed encoder output a chunk at a time; :meth:`best` gives the partial (or, after the
    last chunk, final) result. Frame by frame it runs the same step as
    :func:`asrprec.decoding.modified_beam_search`, on the streams that have a frame left in the chunk; token
    timestamps count frames from the start of each stream."""

    def __init__(self, model: nn.Module, batch_size: int, beam: int = 4, length_norm: bool = True):
        if not isinstance(beam, int) or beam < 1:
            raise ValueError(f"beam must be an integer >= 1, got {beam!r}")
        self.model, self.beam, self.length_norm = model, beam, length_norm
        self.beams = [HypothesisList([Hypothesis()]) for _ in range(batch_size)]
        self.frames = [0] * batch_size  # frames consumed per stream

    @torch.no_grad()
    def accept(self, encoder_out: torch.Tensor, encoder_out_lens: torch.Tensor) -> None:
        """Consume the next chunk: encoder_out (B, T', D_enc), encoder_out_lens (B,) valid frames of it."""
        check_inputs(encoder_out, encoder_out_lens)
        if encoder_out.shape[0] != len(self.beams):
            raise ValueError(f"this search has {len(self.beams)} streams, got a chunk of {encoder_out.shape[0]}")
        enc = self.model.project_encoder(encoder_out)  # (B, T', J)
        lens = encoder_out_lens.tolist()
        for t in range(encoder_out.shape[1]):
            rows = [r for r, n in enumerate(lens) if n > t]
            if not rows:
                break
            new = beam_search_step(self.model, enc[rows, t], [self.beams[r] for r in rows],
                                   [self.frames[r] + t for r in rows], self.beam)
            for r, b in zip(rows, new):
                self.beams[r] = b
        self.frames = [f + n for f, n in zip(self.frames, lens)]

    def best(self) -> list[list[int]]:
        """The best token sequence of each stream so far (length-normalised score unless ``length_norm=False``)."""
        return [list(r.tokens) for r in self.results()]

    def results(self) -> list[DecodingResult]:
        """The best hypothesis of each stream so far with its frames and score."""
        c = self.model.context_size
        return [b.get_most_probable(length_norm=self.length_norm, context_size=c).result() for b in self.beams]
