"""CTC decoding: ``ctc_greedy_search`` and ``ctc_prefix_beam_search`` over a CTC head's log-probabilities, batched,
plain PyTorch, whole utterances or chunk by chunk.

Both follow icefall's (k2-fsa/icefall ``icefall/decode.py``, ``ctc_greedy_search`` / ``ctc_prefix_beam_search``, used
by ``egs/librispeech/ASR/zipformer/ctc_decode.py``): greedy search takes the argmax of every frame, collapses
repeats and drops blanks; prefix beam search (Graves 2006, section 3.2, with the per-frame token pruning of
Hannun et al. 2014) keeps ``beam`` label sequences, each with the log-probability of the alignments that collapse to
it and end in blank (``pb``) or in its last token (``pnb``), and considers on each frame only the ``beam`` most
probable tokens of that frame. icefall runs one Python hypothesis list per utterance in a process pool; here the
(B, beam) hypotheses of a batch advance together as tensors, equal label sequences found by comparing the token
buffers.

Legend: B utterances (streams), T frames, V vocabulary (blank included), K beam, L the longest hypothesis so far.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fusion import BatchFusion
from .hypothesis import DecodingResult, Hypothesis, HypothesisList, results_of

NEG_INF = float("-inf")


def check_log_probs(log_probs: torch.Tensor, log_probs_lens: torch.Tensor) -> None:
    if log_probs.dim() != 3:
        raise ValueError(f"log_probs must be (B, T, V), got shape {tuple(log_probs.shape)}; for one utterance use "
                         "log_probs.unsqueeze(0)")
    B, T = log_probs.shape[:2]
    if log_probs_lens.shape != (B,):
        raise ValueError(f"log_probs_lens must have shape ({B},), got {tuple(log_probs_lens.shape)}")
    if log_probs_lens.dtype.is_floating_point or log_probs_lens.dtype == torch.bool:
        raise ValueError(f"log_probs_lens must be an integer tensor, got {log_probs_lens.dtype}")
    if B and (int(log_probs_lens.min()) < 0 or int(log_probs_lens.max()) > T):
        raise ValueError(f"log_probs_lens must lie in [0, T={T}], got min {int(log_probs_lens.min())} max "
                         f"{int(log_probs_lens.max())}; pass the lengths returned by model.encode()")


def _check_blank(blank_id: int, V: int) -> None:
    if not 0 <= blank_id < V:
        raise ValueError(f"blank_id {blank_id} is not a token of a vocabulary of V={V}")


def _greedy_chunk(log_probs: torch.Tensor, lens: torch.Tensor, prev: torch.Tensor, blank_id: int,
                  frame_offset: torch.Tensor) -> tuple[list[list[int]], list[list[int]], torch.Tensor]:
    """Greedy search over one (B, T, V) block whose frames follow a frame whose argmax was ``prev`` (B,) (-1: none).
    Returns the new tokens and their frames (``frame_offset`` (B,) + t) per utterance and the updated ``prev``."""
    B, T, _ = log_probs.shape
    if T == 0:
        return [[] for _ in range(B)], [[] for _ in range(B)], prev
    best = log_probs.argmax(dim=-1)  # (B, T)
    before = torch.cat([prev.to(best.device)[:, None], best[:, :-1]], dim=1)  # each frame's predecessor's argmax
    valid = torch.arange(T, device=best.device)[None, :] < lens.to(best.device)[:, None]
    keep = (best != blank_id) & (best != before) & valid
    best, keep = best.cpu(), keep.cpu()
    counts = keep.sum(dim=1).tolist()
    tokens = best[keep].split(counts)
    frames = (torch.nonzero(keep)[:, 1] + frame_offset.cpu().repeat_interleave(torch.tensor(counts))).split(counts)
    lens_cpu = lens.cpu()
    last = best.gather(1, (lens_cpu - 1).clamp(min=0)[:, None])[:, 0]
    new_prev = torch.where(lens_cpu > 0, last, prev.cpu())
    return [t.tolist() for t in tokens], [f.tolist() for f in frames], new_prev


@torch.no_grad()
def ctc_greedy_search(
    log_probs: torch.Tensor,
    log_probs_lens: torch.Tensor,
    *,
    blank_id: int = 0,
    return_timestamps: bool = False,
    return_results: bool = False,
) -> list[list[int]] | tuple[list[list[int]], list[list[int]]] | list[DecodingResult]:
    """Greedy CTC decoding of a batch: the argmax token of every valid frame, repeats collapsed, blanks dropped.

    Legend: B utterances, T frames, V vocabulary (blank included).

    Args:
        log_probs: (B, T, V) log-probabilities from ``model.ctc_log_probs`` (logits give the same result), any float
            dtype.
        log_probs_lens: (B,) integer valid frames per utterance; 0 is allowed (gives ``[]``).
        blank_id: the blank's id.
        return_timestamps: also return, for each token, the first frame of its run (as sherpa-onnx reports it,
            k2-fsa/sherpa-onnx ``sherpa-onnx/csrc/offline-ctc-greedy-search-decoder.cc``).
        return_results: return B :class:`~asrprec.decoding.DecodingResult` (tokens and those frames).
    Returns:
        B lists of token ids in the input order; with ``return_timestamps``, ``(tokens, timestamps)``.
    """
    check_log_probs(log_probs, log_probs_lens)
    B, _, V = log_probs.shape
    _check_blank(blank_id, V)
    if B == 0:
        return ([], []) if return_timestamps and not return_results else []
    prev = torch.full((B,), -1, dtype=torch.int64)
    tokens, frames, _ = _greedy_chunk(log_probs, log_probs_lens, prev, blank_id, torch.zeros(B, dtype=torch.int64))
    if return_results:
        return results_of(tokens, frames)
    return (tokens, frames) if return_timestamps else tokens


class StreamingCtcGreedySearch:
    """:func:`ctc_greedy_search` fed a chunk at a time: each stream remembers its last frame's argmax, so a run of a
    token across a chunk boundary is emitted once (as sherpa-onnx's ``online-ctc-greedy-search-decoder.cc`` does).
    :attr:`hyps` (and :attr:`timestamps`, frames counted from each stream's start) hold the result so far."""

    def __init__(self, batch_size: int, blank_id: int = 0):
        self.blank_id = blank_id
        self.hyps: list[list[int]] = [[] for _ in range(batch_size)]
        self.timestamps: list[list[int]] = [[] for _ in range(batch_size)]
        self._prev = torch.full((batch_size,), -1, dtype=torch.int64)
        self._frames = torch.zeros(batch_size, dtype=torch.int64)

    @torch.no_grad()
    def accept(self, log_probs: torch.Tensor, log_probs_lens: torch.Tensor) -> None:
        """Consume the next chunk: log_probs (B, T, V), log_probs_lens (B,) valid frames of it (0 for a stream that
        has ended)."""
        check_log_probs(log_probs, log_probs_lens)
        if log_probs.shape[0] != len(self.hyps):
            raise ValueError(f"this search has {len(self.hyps)} streams, got a chunk of {log_probs.shape[0]}")
        _check_blank(self.blank_id, log_probs.shape[2])
        tokens, frames, self._prev = _greedy_chunk(log_probs, log_probs_lens, self._prev, self.blank_id,
                                                   self._frames)
        for i, (tok, fr) in enumerate(zip(tokens, frames)):
            self.hyps[i] += tok
            self.timestamps[i] += fr
        self._frames += log_probs_lens.cpu().to(torch.int64)

    def results(self) -> list[DecodingResult]:
        """Each stream's tokens so far with the first frame of each token's run."""
        return results_of(self.hyps, self.timestamps)


class StreamingCtcPrefixBeamSearch:
    """CTC prefix beam search for B streams, advanced frame by frame as chunks arrive; :func:`ctc_prefix_beam_search`
    runs it over whole utterances. :meth:`best` and :meth:`hypotheses` give the result so far.

    State (K = ``beam`` slots per stream, float64 scores): ``pb`` / ``pnb`` (B, K) log-probability of the frames so
    far over the alignments that collapse to the slot's label sequence and end in blank / in its last token;
    ``tokens`` (B, K, L) and ``stamps`` (B, K, L) with ``length`` (B, K) valid entries; ``last`` (B, K) the last token
    (-1 for the empty sequence); ``alive`` (B, K) which slots hold a hypothesis.

    With ``fusion`` (:mod:`asrprec.decoding.fusion`; stream b is the batch's utterance b), ``bonus`` (B, K) holds the
    LM / phrase bonus of each slot's label sequence and ``fstate`` (B, K, 4) its fusion state: a new token adds its
    bonus, a blank or a repeat adds none. Slots compete (and the final choice is made) on the acoustic score plus
    the bonus; ``pb`` / ``pnb`` stay acoustic, so sequences merge as without fusion (equal sequences have equal
    bonuses). With hot phrases, a frame's candidate tokens are its ``beam`` most probable ones and up to ``beam``
    more that would get a phrase bonus (best by log-probability + bonus): a word the acoustic model ranks below the
    beam can still be boosted (a rare name; without them the search recalled none of the names in
    ``benchmarks/RESULTS.md``, "Language models and hot phrases").
    """

    def __init__(self, batch_size: int, beam: int = 4, blank_id: int = 0, device: torch.device | str = "cpu",
                 fusion: BatchFusion | None = None):
        if not isinstance(beam, int) or beam < 1:
            raise ValueError(f"beam must be an integer >= 1, got {beam!r}")
        B, K = batch_size, beam
        self.beam, self.blank_id, self.device = beam, blank_id, torch.device(device)
        f64 = dict(dtype=torch.float64, device=self.device)
        i64 = dict(dtype=torch.int64, device=self.device)
        self.pb = torch.full((B, K), NEG_INF, **f64)
        self.pb[:, 0] = 0.0  # the empty sequence, before any frame, "ends in blank" with probability 1
        self.pnb = torch.full((B, K), NEG_INF, **f64)
        self.alive = torch.zeros(B, K, dtype=torch.bool, device=self.device)
        self.alive[:, 0] = True
        self.tokens = torch.zeros(B, K, 0, **i64)
        self.stamps = torch.zeros(B, K, 0, **i64)
        self.length = torch.zeros(B, K, **i64)
        self.last = torch.full((B, K), -1, **i64)
        self.frames = torch.zeros(B, **i64)  # frames consumed per stream
        self.fusion = fusion
        self.bonus = torch.zeros(B, K, **f64)
        if fusion is not None:
            fusion.to(self.device)
            self.fstate = fusion.start(torch.arange(B, device=self.device))[:, None, :].repeat(1, K, 1)

    @torch.no_grad()
    def accept(self, log_probs: torch.Tensor, log_probs_lens: torch.Tensor) -> None:
        """Consume the next chunk: log_probs (B, T, V), log_probs_lens (B,) valid frames of it (0 for a stream that
        has ended)."""
        check_log_probs(log_probs, log_probs_lens)
        if log_probs.shape[0] != self.pb.shape[0]:
            raise ValueError(f"this search has {self.pb.shape[0]} streams, got a chunk of {log_probs.shape[0]}")
        _check_blank(self.blank_id, log_probs.shape[2])
        lp = log_probs.to(self.device, torch.float64)
        lens = log_probs_lens.to(self.device, torch.int64)
        for t in range(int(lens.max()) if lens.numel() else 0):
            self._step(lp[:, t], t < lens, self.frames + t)
        self.frames += lens

    def _with_phrase_tokens(self, lp: torch.Tensor, top_lp: torch.Tensor, top_tok: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """The frame's (B, M) most probable tokens and up to M more: the tokens a held prefix would get a phrase bonus
        for, best by log-probability + that bonus, so that boosting reaches a word the acoustic model ranks below the
        beam (a rare name). A slot that is not needed holds the blank at -inf (never chosen, never merged)."""
        B, K = self.pb.shape
        V, M = lp.shape[1], top_tok.shape[1]
        bonus = self.fusion.phrase_scores(self.fstate.reshape(B * K, 4)).view(B, K, V).double()
        bonus = bonus.masked_fill(~self.alive[:, :, None], 0.0).amax(dim=1)  # (B, V): the best any prefix gets
        wanted = bonus > 0
        wanted[:, self.blank_id] = False
        wanted.scatter_(1, top_tok, False)  # already considered
        extra_lp, extra_tok = (lp + bonus).masked_fill(~wanted, NEG_INF).topk(M, dim=1)
        found = extra_lp > NEG_INF
        extra_tok = torch.where(found, extra_tok, torch.full_like(extra_tok, self.blank_id))
        extra_lp = torch.where(found, lp.gather(1, extra_tok), NEG_INF)
        return torch.cat([top_lp, extra_lp], dim=1), torch.cat([top_tok, extra_tok], dim=1)

    def _step(self, lp: torch.Tensor, active: torch.Tensor, frame: torch.Tensor) -> None:
        """One frame: lp (B, V) float64 log-probabilities, ``frame`` (B,) its index in each stream (a token's
        timestamp); streams where ``active`` (B,) is False keep their state."""
        B, K = self.pb.shape
        V = lp.shape[1]
        M = min(self.beam, V)
        blank = self.blank_id
        top_lp, top_tok = lp.topk(M, dim=1)  # (B, M): the tokens considered on this frame
        total = torch.logaddexp(self.pb, self.pnb)  # (B, K)

        # the slot's own sequence continues: a blank, or its last token repeated (collapsed)
        blank_lp = torch.where((top_tok == blank).any(dim=1), lp[:, blank], NEG_INF)  # (B,)
        last_lp = lp.gather(1, self.last.clamp(min=0))  # (B, K)
        last_kept = (top_tok[:, None, :] == self.last[:, :, None]).any(dim=2) & (self.last >= 0)
        if self.fusion is not None and self.fusion.has_phrases and M < V:
            top_lp, top_tok = self._with_phrase_tokens(lp, top_lp, top_tok)
            M = top_tok.shape[1]
        stay_pb = total + blank_lp[:, None]
        stay_pnb = self.pnb + torch.where(last_kept, last_lp, NEG_INF)

        # the slot's sequence extended by token c: after a blank only if c repeats the last token (else "aa" -> "a")
        src = torch.where(top_tok[:, None, :] == self.last[:, :, None], self.pb[:, :, None], total[:, :, None])
        ext = src + top_lp[:, None, :]  # (B, K, M)
        ext = ext.masked_fill((top_tok == blank)[:, None, :] | ~self.alive[:, :, None], NEG_INF)

        # an extension equal to a sequence already held (slot j = slot k + one token) merges into it
        L = self.tokens.shape[2]
        pos = torch.arange(L, device=self.device)
        same = (self.tokens[:, :, None, :] == self.tokens[:, None, :, :]) | (pos >= self.length[:, :, None, None])
        parent = (same.all(dim=3) & (self.length[:, None, :] == self.length[:, :, None] + 1)
                  & self.alive[:, :, None] & self.alive[:, None, :])  # (B, K, J): slot j extends slot k
        hits = parent[:, :, None, :] & (top_tok[:, None, :, None] == self.last[:, None, None, :])  # (B, K, M, J)
        merged = torch.where(hits, ext[..., None], NEG_INF).logsumexp(dim=(1, 2))  # (B, J)
        # a slot's last token takes this frame as its time when the alignments starting it here outweigh those that
        # started it earlier (a sequence first reached on a frame of little probability moves to its spike)
        retime = merged > torch.logaddexp(stay_pb, stay_pnb)
        stay_pnb = torch.logaddexp(stay_pnb, merged)
        ext = ext.masked_fill(hits.any(dim=3), NEG_INF)

        stay = torch.logaddexp(stay_pb, stay_pnb).masked_fill(~self.alive, NEG_INF)
        acoustic = torch.cat([stay, ext.reshape(B, K * M)], dim=1)  # (B, K + K·M)
        if self.fusion is None:
            _, choice = acoustic.topk(K, dim=1)  # (B, K)
        else:  # rank by acoustic score + the sequence's bonus (+ the new token's, for an extension)
            states = self.fstate[:, :, None, :].expand(B, K, M, 4).reshape(-1, 4)
            delta, to = self.fusion.step(states, top_tok[:, None, :].expand(B, K, M).reshape(-1))
            delta, to = delta.view(B, K, M).double(), to.view(B, K * M, 4)
            bonus_all = torch.cat([self.bonus, (self.bonus[:, :, None] + delta).reshape(B, K * M)], dim=1)
            _, choice = (acoustic + bonus_all).topk(K, dim=1)
        scores = acoustic.gather(1, choice)
        is_ext = choice >= K
        k = torch.where(is_ext, (choice - K) // M, choice)
        tok = top_tok.gather(1, ((choice - K) % M).clamp(min=0))
        length = self.length.gather(1, k)
        width = max(L, int((length + is_ext).max()))  # the buffers grow by one token when some sequence does
        old_tokens, old_stamps = F.pad(self.tokens, (0, width - L)), F.pad(self.stamps, (0, width - L))
        tokens = old_tokens.gather(1, k[..., None].expand(B, K, width))
        stamps = old_stamps.gather(1, k[..., None].expand(B, K, width))
        if width:  # write the new token (and its frame) at position `length` of the extended sequences
            at = length.clamp(max=width - 1)[..., None]
            tokens.scatter_(2, at, torch.where(is_ext, tok, tokens.gather(2, at)[..., 0])[..., None])
            stamps.scatter_(2, at, torch.where(is_ext, frame[:, None], stamps.gather(2, at)[..., 0])[..., None])
            re = ~is_ext & retime.gather(1, k) & (length > 0)
            last_at = (length - 1).clamp(min=0)[..., None]
            stamps.scatter_(2, last_at, torch.where(re, frame[:, None], stamps.gather(2, last_at)[..., 0])[..., None])
        new = {
            "pb": torch.where(is_ext, NEG_INF, stay_pb.gather(1, k)),
            "pnb": torch.where(is_ext, scores, stay_pnb.gather(1, k)),
            "alive": scores > NEG_INF,
            "length": length + is_ext,
            "last": torch.where(is_ext, tok, self.last.gather(1, k)),
        }
        if self.fusion is not None:
            ext_at = (choice - K).clamp(min=0)
            new["bonus"] = torch.where(is_ext, bonus_all.gather(1, choice), self.bonus.gather(1, k))
            new["fstate"] = torch.where(is_ext[..., None], to.gather(1, ext_at[..., None].expand(B, K, 4)),
                                        self.fstate.gather(1, k[..., None].expand(B, K, 4)))
        keep = active[:, None]
        for name, value in new.items():
            if value.dim() == 3:
                setattr(self, name, torch.where(keep[..., None], value, getattr(self, name)))
                continue
            setattr(self, name, torch.where(keep, value, getattr(self, name)))
        self.tokens = torch.where(keep[..., None], tokens, old_tokens)
        self.stamps = torch.where(keep[..., None], stamps, old_stamps)

    def hypotheses(self) -> list[HypothesisList]:
        """Each stream's surviving label sequences, scored by log(P(ends in blank) + P(ends in its last token)) (plus
        the fusion bonus, with fusion)."""
        score = torch.logaddexp(self.pb, self.pnb) + self.bonus
        if self.fusion is not None:  # an unfinished phrase gives its bonus back
            B, K = self.bonus.shape
            score = score + self.fusion.final(self.fstate.reshape(B * K, 4)).view(B, K).double()
        score = score.cpu().tolist()
        alive, length = self.alive.cpu().tolist(), self.length.cpu().tolist()
        tokens, stamps = self.tokens.cpu().tolist(), self.stamps.cpu().tolist()
        out = []
        for b in range(len(score)):
            order = sorted((k for k in range(len(score[b])) if alive[b][k]), key=lambda k: -score[b][k])
            out.append(HypothesisList([Hypothesis(tuple(tokens[b][k][: length[b][k]]), score[b][k],
                                                  tuple(stamps[b][k][: length[b][k]])) for k in order]))
        return out

    def best(self) -> list[list[int]]:
        """The most probable label sequence of each stream so far."""
        return [list(h.get_most_probable().tokens) if len(h) else [] for h in self.hypotheses()]

    def results(self) -> list[DecodingResult]:
        """The most probable label sequence of each stream so far, with each token's frame (see
        :func:`ctc_prefix_beam_search`) and its score."""
        return [h.get_most_probable().result() if len(h) else DecodingResult((), (), None, None)
                for h in self.hypotheses()]


@torch.no_grad()
def ctc_prefix_beam_search(
    log_probs: torch.Tensor,
    log_probs_lens: torch.Tensor,
    beam: int = 4,
    *,
    blank_id: int = 0,
    return_hypotheses: bool = False,
    fusion: BatchFusion | None = None,
    return_results: bool = False,
) -> list[list[int]] | list[HypothesisList] | list[DecodingResult]:
    """CTC prefix beam search over a batch: the label sequences of highest probability summed over their alignments.

    On each frame only the ``beam`` most probable tokens are considered (icefall's first pruning); of the resulting
    sequences the ``beam`` most probable survive. With ``beam=1`` this is :func:`ctc_greedy_search` (one token per
    frame keeps every score a single alignment's); with ``beam`` at least V and at least the number of distinct
    label sequences, nothing is pruned and every score is exact. Scores are the log-probabilities given, summed in
    float64. The final choice is by raw score (icefall's ``get_most_probable()``; CTC scores carry no per-token cost
    that length normalisation would have to offset).

    Legend: B utterances, T frames, V vocabulary (blank included).

    Args:
        log_probs: (B, T, V) log-probabilities from ``model.ctc_log_probs`` (normalised: the scores add them).
        log_probs_lens: (B,) integer valid frames per utterance; 0 is allowed (gives ``[]``).
        beam: label sequences kept per utterance, and tokens considered per frame (>= 1).
        blank_id: the blank's id.
        return_hypotheses: return each utterance's :class:`HypothesisList` (token timestamps: the frame where the
            sequence gained the token, moved to a later frame where more probability started it: the first frame of
            its spike) instead of the best tokens.
        fusion: LM / phrase bonuses added when a sequence gains a token (:class:`StreamingCtcPrefixBeamSearch`).
        return_results: return B :class:`~asrprec.decoding.DecodingResult` (:meth:`StreamingCtcPrefixBeamSearch.results`).
    Returns:
        B lists of token ids in the input order, or B ``HypothesisList``.
    """
    if not isinstance(beam, int) or beam < 1:
        raise ValueError(f"beam must be an integer >= 1, got {beam!r}")
    check_log_probs(log_probs, log_probs_lens)
    _check_blank(blank_id, log_probs.shape[2])
    search = StreamingCtcPrefixBeamSearch(log_probs.shape[0], beam, blank_id, device=log_probs.device, fusion=fusion)
    search.accept(log_probs, log_probs_lens)
    if return_results:
        return search.results()
    return search.hypotheses() if return_hypotheses else search.best()
