"""Decoding for token-and-duration transducers (TDT; Xu et al., "Efficient Sequence Transduction by Jointly
Predicting Tokens and Durations", ICML 2023, arXiv 2304.06795): greedy search that jumps over frames by the
predicted duration, the same fed chunk by chunk (streaming), and a modified beam search adapted to durations.

A TDT joiner outputs V token logits (blank included) and then one logit per duration
(``model.durations``, e.g. (0, 1, 2, 3, 4)); token and duration distributions are normalised separately. Rules
shared by every search here, so that they agree with each other:

* From frame t with decoder output g, the joiner gives the best token k and the best duration d.
* A token is emitted with timestamp t, the decoder advances, and the search moves to frame t + d (d = 0 stays on
  t). At most ``max_sym_per_frame`` tokens are emitted on one frame: a token with d = 0 that reaches the cap moves
  on one frame (NeMo's ``max_symbols``; NVIDIA/NeMo
  ``nemo/collections/asr/parts/submodules/tdt_loop_labels_computer.py``, "force blank").
* A blank moves to t + d; a blank whose duration is 0 moves one frame, as NeMo's TDT greedy searches do ("for blank
  labels force duration >= 1", same file; its TDT beam search forces the smallest non-zero duration,
  ``tdt_beam_decoding.py``). The loss gives blank with d = 0 no path, so a trained model rarely predicts it.
* A token whose jump lands at or past the last frame is kept and ends the search, as NeMo's per-utterance
  ``GreedyTDTInfer`` does (its label-looping computer drops such a token instead).

Legend: B utterances, T encoder frames, D_enc encoder width, J joiner width, C the decoder's context size,
V vocabulary (blank included), K number of durations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ._common import check_inputs, log_softmax_fp32, model_device, sort_and_project
from .fusion import BatchFusion, fused_greedy_tokens
from .hypothesis import DecodingResult, log_add, results_of

#: a TDT model's default ``max_sym_per_frame``: NeMo's ``max_symbols_per_step`` default (NVIDIA/NeMo
#: ``nemo/collections/asr/parts/submodules/rnnt_greedy_decoding.py``, ``GreedyBatchedRNNTInferConfig``). A TDT model
#: emits several labels on one frame by predicting duration 0; a cap of 1 would override every such prediction.
TDT_MAX_SYM_PER_FRAME = 10

__all__ = [
    "TDT_MAX_SYM_PER_FRAME", "StreamingTdtGreedySearch", "TdtHypothesis", "is_tdt", "tdt_durations",
    "tdt_greedy_search", "tdt_modified_beam_search",
]


def is_tdt(model: nn.Module) -> bool:
    """Whether ``model``'s joiner has a TDT duration head."""
    return bool(tdt_durations(model, required=False))


def tdt_durations(model: nn.Module, required: bool = True) -> tuple[int, ...]:
    """The durations of ``model``'s joiner (``()`` for an RNN-T joiner unless ``required``, which raises)."""
    durations = tuple(getattr(model, "durations", ()))
    if required and not durations:
        raise ValueError("this model's joiner has no duration head (an RNN-T model): decode it with greedy_search / "
                         "modified_beam_search, or train a TDT model with --loss tdt")
    return durations


def _check_max_sym(max_sym_per_frame: int) -> None:
    if not isinstance(max_sym_per_frame, int) or max_sym_per_frame < 1:
        raise ValueError(f"max_sym_per_frame must be an integer >= 1, got {max_sym_per_frame!r}")


def best_token_and_jump(logits: torch.Tensor, vocab_size: int, durations: torch.Tensor,
                        blank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, V + K) joiner logits → the argmax token (N,) and its jump in frames (N,): the argmax duration, at least 1
    for a blank. The argmax is taken on raw logits (that of the separately normalised log-softmaxes)."""
    tokens = logits[:, :vocab_size].argmax(dim=-1)
    jumps = durations[logits[:, vocab_size:].argmax(dim=-1)]
    return tokens, torch.where(tokens == blank, jumps.clamp(min=1), jumps)


class StreamingTdtGreedySearch:
    """TDT greedy search over encoder output that arrives a chunk at a time (or all at once).

    Each utterance keeps its own frame pointer; one step evaluates the joiner once for every utterance whose pointer
    lies inside the frames received so far, emits or skips, and jumps. A jump past the frames received waits for the
    next chunk, so the result equals that of decoding the concatenated chunks at once. :attr:`hyps`,
    :attr:`timestamps` and :attr:`token_durations` (each token's predicted duration) hold the partial results
    (:meth:`results`); :attr:`joiner_steps` counts each utterance's joiner evaluations.

    Args:
        model: a TDT transducer (``model.durations`` non-empty), any precision.
        batch_size: B streams. max_sym_per_frame: at most this many tokens on one frame (>= 1).
        fusion: LM / phrase bonuses for the non-blank choice (stream b is the batch's utterance b;
            :mod:`asrprec.decoding.fusion`); the duration is the duration head's argmax either way.
    """

    def __init__(self, model: nn.Module, batch_size: int, max_sym_per_frame: int = TDT_MAX_SYM_PER_FRAME,
                 fusion: BatchFusion | None = None):
        _check_max_sym(max_sym_per_frame)
        self.model = model
        self.max_sym = max_sym_per_frame
        self.blank = model.blank_id
        self.vocab = model.vocab_size
        self.device = model_device(model)
        self.durations = torch.tensor(tdt_durations(model), dtype=torch.int64, device=self.device)
        self.hyps: list[list[int]] = [[] for _ in range(batch_size)]
        self.timestamps: list[list[int]] = [[] for _ in range(batch_size)]
        self.token_durations: list[list[int]] = [[] for _ in range(batch_size)]
        self.t = torch.zeros(batch_size, dtype=torch.int64, device=self.device)  # absolute frame per stream
        self.sym = torch.zeros_like(self.t)  # tokens emitted on the current frame
        self.joiner_steps = torch.zeros_like(self.t)
        self.received = torch.zeros_like(self.t)
        self.contexts = torch.full((batch_size, model.context_size), self.blank, dtype=torch.int64,
                                   device=self.device)
        self.dec = model.project_decoder(self.contexts) if batch_size else None  # (B, J)
        self._enc: torch.Tensor | None = None  # (B, W, J) projected frames [self._offset, self._offset + W)
        self._offset = 0
        self.fusion = fusion
        if fusion is not None:
            self.fstate = fusion.to(self.device).start(torch.arange(batch_size, device=self.device))  # (B, 4)

    @torch.no_grad()
    def accept(self, encoder_out: torch.Tensor, encoder_out_lens: torch.Tensor) -> None:
        """Consume the next chunk: encoder_out (B, T', D_enc), encoder_out_lens (B,) valid frames of it (0 for a
        stream that has ended). Every stream's chunk starts right after its previous chunk's valid frames."""
        check_inputs(encoder_out, encoder_out_lens)
        B = len(self.hyps)
        if encoder_out.shape[0] != B:
            raise ValueError(f"this search has {B} streams, got a chunk of {encoder_out.shape[0]}")
        if B == 0:
            return
        # contiguous, as the other searches project it (sort_and_project copies): a half-precision matmul on a strided
        # view may round differently
        enc = self.model.project_encoder(encoder_out.contiguous())  # (B, T', J)
        lens = encoder_out_lens.to(self.device, torch.int64)
        self._append(enc, lens)
        self.received += lens
        self._run()

    def _append(self, enc: torch.Tensor, lens: torch.Tensor) -> None:
        """Place each stream's new frames at their absolute positions in the buffer, dropping the frames before
        every stream's pointer (never read again)."""
        B = enc.shape[0]
        start = int(self.t.min())
        end = max(int((self.received + lens).max()), start)
        width = max(end - start, 1)
        buf = enc.new_zeros(B, width, enc.shape[-1])
        if self._enc is not None:
            keep = self._offset + self._enc.shape[1] - start
            if keep > 0:
                buf[:, :keep] = self._enc[:, start - self._offset:]
        pos = self.received[:, None] + torch.arange(enc.shape[1], device=self.device) - start  # (B, T')
        valid = (torch.arange(enc.shape[1], device=self.device)[None, :] < lens[:, None]) & (pos >= 0)
        rows = torch.arange(B, device=self.device)[:, None].expand_as(pos)
        buf[rows[valid], pos[valid]] = enc[valid]
        self._enc, self._offset = buf, start

    def results(self) -> list[DecodingResult]:
        """Each stream's tokens so far with their frames and predicted durations."""
        return results_of(self.hyps, self.timestamps, self.token_durations)

    def _run(self) -> None:
        model, blank = self.model, self.blank
        while True:
            rows = torch.nonzero(self.t < self.received).squeeze(1)
            if rows.numel() == 0:
                return
            t = self.t[rows]
            logits = model.join_projected(self._enc[rows, t - self._offset], self.dec[rows])
            if self.fusion is not None:
                tokens = fused_greedy_tokens(logits[:, : self.vocab], self.fusion, self.fstate[rows], blank)
                jumps = self.durations[logits[:, self.vocab :].argmax(dim=-1)]
                jumps = torch.where(tokens == blank, jumps.clamp(min=1), jumps)
            else:
                tokens, jumps = best_token_and_jump(logits, self.vocab, self.durations, blank)
            self.joiner_steps[rows] += 1
            emit = tokens != blank
            predicted = jumps  # a token's duration (only a blank's is clamped)
            stay = emit & (jumps == 0)
            sym = torch.where(stay, self.sym[rows] + 1, 0)
            capped = sym >= self.max_sym
            jumps = torch.where(capped, 1, jumps)
            self.sym[rows] = torch.where(capped, 0, sym)
            self.t[rows] = t + jumps
            erows, etoks = rows[emit], tokens[emit]
            if erows.numel():
                for r, k, f, d in zip(erows.tolist(), etoks.tolist(), t[emit].tolist(), predicted[emit].tolist()):
                    self.hyps[r].append(k)
                    self.timestamps[r].append(f)
                    self.token_durations[r].append(d)
                self.contexts[erows] = torch.cat([self.contexts[erows, 1:], etoks[:, None]], dim=1)
                self.dec[erows] = model.project_decoder(self.contexts[erows])
                if self.fusion is not None:
                    self.fstate[erows] = self.fusion.step(self.fstate[erows], etoks)[1]


@torch.no_grad()
def tdt_greedy_search(model: nn.Module, encoder_out: torch.Tensor, encoder_out_lens: torch.Tensor,
                      max_sym_per_frame: int = TDT_MAX_SYM_PER_FRAME, *, return_timestamps: bool = False,
                      fusion: BatchFusion | None = None, return_results: bool = False,
                      ) -> list[list[int]] | tuple[list[list[int]], list[list[int]]] | list[DecodingResult]:
    """Batched TDT greedy search: each utterance advances by its predicted durations (the rules in the module
    docstring); one joiner call per step for every utterance with frames left, the decoder only for those that
    emitted.

    Args:
        model: a TDT transducer (``model.durations`` non-empty), any precision.
        encoder_out: (B, T, D_enc) from ``model.encode``, any float dtype.
        encoder_out_lens: (B,) integer valid frames; 0 is allowed (gives ``[]``).
        max_sym_per_frame: at most this many tokens on one frame (>= 1).
        return_timestamps: also return, for each token, the encoder frame that emitted it.
        fusion: LM / phrase bonuses (:class:`StreamingTdtGreedySearch`).
        return_results: return B :class:`~asrprec.decoding.DecodingResult` (tokens, frames, predicted durations).
    Returns:
        B token-id lists in the input order (no blanks, no start context); with ``return_timestamps``,
        ``(tokens, timestamps)``.
    """
    _check_max_sym(max_sym_per_frame)
    check_inputs(encoder_out, encoder_out_lens)
    search = StreamingTdtGreedySearch(model, encoder_out.shape[0], max_sym_per_frame, fusion=fusion)
    search.accept(encoder_out, encoder_out_lens)
    if return_results:
        return search.results()
    return (search.hyps, search.timestamps) if return_timestamps else search.hyps


@dataclass
class TdtHypothesis:
    """One partial label sequence of :func:`tdt_modified_beam_search`, waiting at ``frame``.

    Merged duplicates keep the frames and durations of the more probable one.

    Attributes:
        tokens: emitted token ids (no blank, no start context).
        log_prob: log-probability over the alignments merged into it (fp32 log-softmax values summed in float64).
        timestamps: the frame of each token.
        frame: the frame it is to be expanded at.
        sym: tokens it emitted on ``frame`` so far.
        durations: each token's duration, that of its chosen token-and-duration pair.
    """

    tokens: tuple[int, ...] = ()
    log_prob: float = 0.0
    timestamps: tuple[int, ...] = field(default=())
    frame: int = 0
    sym: int = 0
    fusion_state: tuple[int, ...] = field(default=())
    durations: tuple[int, ...] = field(default=())

    def result(self) -> DecodingResult:
        """The :class:`DecodingResult` of this hypothesis (tokens, frames, durations and ``log_prob``)."""
        return DecodingResult(self.tokens, self.timestamps, self.durations, self.log_prob)

    def normalized_score(self, context_size: int) -> float:
        """``log_prob / (context_size + len(tokens))``, the length normalisation of
        :meth:`asrprec.decoding.Hypothesis.normalized_score` (icefall's)."""
        return self.log_prob / (context_size + len(self.tokens))


def _merge(pool: dict[tuple[int, ...], TdtHypothesis], hyp: TdtHypothesis) -> None:
    """Add ``hyp`` to the hypotheses waiting on one frame: the same label sequence merges by log-add, with the token
    frames and durations of the more probable of the two (they may come from different frames)."""
    old = pool.get(hyp.tokens)
    if old is None:
        pool[hyp.tokens] = hyp
    else:
        if hyp.log_prob > old.log_prob:
            old.timestamps, old.durations = hyp.timestamps, hyp.durations
        old.log_prob = log_add(old.log_prob, hyp.log_prob)


@torch.no_grad()
def tdt_modified_beam_search(model: nn.Module, encoder_out: torch.Tensor, encoder_out_lens: torch.Tensor, beam: int = 4,
                             max_sym_per_frame: int = TDT_MAX_SYM_PER_FRAME, *, length_norm: bool = True,
                             return_hypotheses: bool = False,
                             fusion: BatchFusion | None = None, return_results: bool = False,
                             ) -> list[list[int]] | list[list[TdtHypothesis]] | list[DecodingResult]:
    """Modified beam search adapted to durations, batched across utterances.

    icefall's ``modified_beam_search`` moves every hypothesis one frame per step; here each hypothesis waits at its
    own frame, as in NeMo's TDT beam searches (``last_frame`` in NVIDIA/NeMo
    ``nemo/collections/asr/parts/submodules/tdt_beam_decoding.py``). The search walks the frames in order; at frame
    t the hypotheses waiting there (all of which have consumed exactly t frames, so their scores compare) keep the
    best ``beam``, and each expands into (token, duration) pairs scored log p(token) + log p(duration): blank goes
    to t + max(d, 1), a token to t + d (d = 0: another round on frame t, at most ``max_sym_per_frame`` tokens per
    frame, as in greedy search). As in icefall, the candidates of one utterance's hypotheses on a frame compete for
    ``beam`` places, and hypotheses waiting on one frame with the same label sequence merge by log-add. Frames no
    hypothesis waits at are never evaluated. Hypotheses that jump to or past the last frame are finished; the result
    is the best finished one (length-normalised score like icefall's, or raw score). With ``beam=1`` the search
    makes greedy search's decisions (:func:`tdt_greedy_search`).

    Args:
        model: a TDT transducer, any precision. encoder_out: (B, T, D_enc). encoder_out_lens: (B,) integer (0 allowed).
        beam: hypotheses kept per utterance and frame (>= 1). max_sym_per_frame: tokens per frame (>= 1).
        length_norm: pick the final hypothesis by length-normalised score (icefall's choice) or raw score.
        return_hypotheses: return each utterance's finished hypotheses (best first by the chosen score).
        fusion: LM / LODR / phrase bonuses added to the non-blank tokens' scores (:mod:`asrprec.decoding.fusion`);
            finished hypotheses give back the bonus of an unfinished phrase.
        return_results: return the chosen hypotheses as B :class:`~asrprec.decoding.DecodingResult` (frames,
            durations and score).
    Returns:
        B token-id lists in the input order, or B lists of :class:`TdtHypothesis`.
    """
    if not isinstance(beam, int) or beam < 1:
        raise ValueError(f"beam must be an integer >= 1, got {beam!r}")
    _check_max_sym(max_sym_per_frame)
    durations = tdt_durations(model)
    batch = sort_and_project(model, encoder_out, encoder_out_lens)
    B = encoder_out.size(0)
    if B == 0:
        return []
    blank, C, V = model.blank_id, model.context_size, model.vocab_size
    K = len(durations)
    device = batch.encoder_proj.device
    lens = [sum(1 for n in batch.batch_sizes if n > i) for i in range(B)]  # sorted utterance i's frames
    # waiting[i][t]: hypotheses of sorted utterance i waiting at frame t, by label sequence
    starts = ([tuple(r) for r in fusion.to(device).start(torch.tensor(batch.order, device=device)).tolist()]
              if fusion is not None else [()] * B)
    waiting: list[dict[int, dict[tuple[int, ...], TdtHypothesis]]] = [
        {0: {(): TdtHypothesis(fusion_state=starts[i])}} if n else {} for i, n in enumerate(lens)]
    finished: list[dict[tuple[int, ...], TdtHypothesis]] = [
        {} if n else {(): TdtHypothesis(fusion_state=starts[i])} for i, n in enumerate(lens)]
    # blank with duration 0 jumps one frame; every other pair jumps its duration
    jump = [max(d, 1) if v == blank else d for v in range(V) for d in durations]  # by (token, duration) pair

    for t, n in enumerate(batch.batch_sizes):
        while True:  # rounds on frame t (tokens of duration 0 come back to it)
            utts, hyps = [], []
            for i in range(n):
                pool = waiting[i].pop(t, None)
                if pool:
                    best = sorted(pool.values(), key=lambda h: h.log_prob, reverse=True)[:beam]
                    utts += [i] * len(best)
                    hyps += best
            if not hyps:
                break
            contexts = torch.tensor([([blank] * C + list(h.tokens))[-C:] for h in hyps], dtype=torch.int64,
                                    device=device)
            rows = torch.tensor(utts, device=device)
            logits = model.join_projected(batch.encoder_proj[rows, t], model.project_decoder(contexts))  # (H, V + K)
            lp = log_softmax_fp32(logits[:, :V]).double()
            lp_dur = log_softmax_fp32(logits[:, V:]).double()
            if fusion is not None:
                bonus, next_states = fusion.scores(torch.tensor([h.fusion_state for h in hyps], device=device))
                lp = lp + bonus.double()
            scores = torch.tensor([h.log_prob for h in hyps], dtype=torch.float64, device=device)
            cand = (scores[:, None, None] + lp[:, :, None] + lp_dur[:, None, :]).view(len(hyps), V * K)
            # the candidates of one utterance compete for `beam` places: pad into (utterances, hyps, V·K)
            order = sorted(set(utts))
            slot_of = {u: j for j, u in enumerate(order)}
            counts = [utts.count(u) for u in order]
            block = torch.full((len(order), max(counts), V * K), -math.inf, dtype=torch.float64, device=device)
            pos, seen = [], {}
            for u in utts:
                pos.append(seen.get(u, 0))
                seen[u] = pos[-1] + 1
            block[torch.tensor([slot_of[u] for u in utts], device=device), torch.tensor(pos, device=device)] = cand
            k = min(beam, block.shape[1] * V * K)
            top_scores, top_idx = block.view(len(order), -1).topk(k, dim=1)
            first = {u: utts.index(u) for u in order}
            for j, u in enumerate(order):
                for score, idx in zip(top_scores[j].tolist(), top_idx[j].tolist()):
                    if score == -math.inf:
                        continue
                    h = first[u] + idx // (V * K)
                    src = hyps[h]
                    pair = idx % (V * K)
                    tok = pair // K
                    step = jump[pair]
                    if tok == blank:
                        new = TdtHypothesis(src.tokens, score, src.timestamps, t + step, 0, src.fusion_state,
                                            src.durations)
                    else:
                        sym = src.sym + 1 if step == 0 else 0
                        if sym >= max_sym_per_frame:
                            step, sym = 1, 0
                        state = tuple(next_states[h, tok].tolist()) if fusion is not None else ()
                        new = TdtHypothesis(src.tokens + (tok,), score, src.timestamps + (t,), t + step, sym, state,
                                            src.durations + (durations[pair % K],))
                    if new.frame >= lens[u]:
                        _merge(finished[u], new)
                    else:
                        _merge(waiting[u].setdefault(new.frame, {}), new)

    if fusion is not None:  # an unfinished phrase gives its bonus back before the final choice
        done = [h for f in finished for h in f.values()]
        back = fusion.final(torch.tensor([h.fusion_state for h in done], device=device)).tolist() if done else []
        for h, v in zip(done, back):
            h.log_prob += v

    def rank(h: TdtHypothesis) -> float:
        return h.normalized_score(C) if length_norm else h.log_prob

    results = batch.unsort([sorted(f.values(), key=rank, reverse=True) for f in finished])
    if return_hypotheses:
        return results
    return [r[0].result() for r in results] if return_results else [list(r[0].tokens) for r in results]
