"""Batched beam search for RNN-T and TDT (``malsd_batch``): every hypothesis of every utterance in tensors.

Modified alignment-length synchronous decoding (ALSD, Saon et al., ICASSP 2020) in the batched form of NeMo's
``malsd_batch`` (Grigoryan et al., arXiv 2506.00185; NVIDIA/NeMo
``nemo/collections/asr/parts/submodules/transducer_decoding/rnnt_malsd_batched_computer.py``, read for its rules;
the code is ours). The B × K hypotheses (K = beam) each keep their own frame pointer, as label looping does
(:mod:`asrprec.decoding.label_looping`), and one step expands all of them at once:

1. the joiner at each hypothesis's frame and its decoder output gives log-probabilities (fp32); the LM / phrase
   bonus of :mod:`asrprec.decoding.fusion` is added to non-blank tokens;
2. each active hypothesis proposes its K best labels (RNN-T) or (label, duration) pairs (TDT); a finished
   hypothesis (past its utterance's last frame) proposes itself, unchanged;
3. the K best of each utterance's K × K candidates survive (one ``topk`` for the batch);
4. a blank moves the hypothesis one frame on, a label stays on the frame (RNN-T) or jumps by its duration (TDT:
   a blank jumps max(d, 1)); the ``max_sym_per_frame``-th label on a frame moves one frame on, no blank scored
   (the rule of greedy search and of :mod:`asrprec.decoding.tdt`; with 1, icefall's one symbol per frame of
   ``modified_beam_search``, where NeMo's ``malsd_batch`` scores a forced blank after its cap of 10); only
   hypotheses that took a label run the decoder;
5. hypotheses of one utterance with the same label sequence on the same frame merge: the best keeps the log-sum of
   their scores, the others leave the beam (NeMo's ``recombine_hyps_``: equal transcript hash, last label and
   length; the frame is implied there for RNN-T and compared for TDT; we compare it always, and also the labels
   already emitted on the frame, which decide what a hypothesis may still do there, so a merge never joins two
   different futures; the sequences are compared by a 64-bit rolling hash with their lengths and last labels).

The loop ends when every hypothesis is finished; the result is the best by length-normalised score (icefall's rule,
as :func:`asrprec.decoding.modified_beam_search`) or raw score. On a CUDA device each step has static shapes (the
host reads one flag: any hypothesis active?), the structure a CUDA graph captures (label looping's ``no_while_loops``
mode; here it runs eagerly); elsewhere the joiner runs only for active hypotheses and the decoder only for those
that took a label, once per distinct context (its output depends on the last C tokens only; kept for the call when
V^C is at most 65,536). With K = 1 it makes greedy search's decisions.

Legend: B utterances, K beam, T encoder frames, J joiner width, V vocabulary (blank included), D durations,
L the longest label sequence (T · max_sym_per_frame), C the decoder's context size.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import log_softmax_fp32, model_device, sort_and_project
from .fusion import BatchFusion
from .hypothesis import DecodingResult, results_of

__all__ = ["malsd_beam_search"]

NEG_INF = float("-inf")
_HASH_MUL = 1_000_003  # the rolling hash h' = h · M + (token + 1), wrapping in int64


@torch.no_grad()
def malsd_beam_search(model: nn.Module, encoder_out: torch.Tensor, encoder_out_lens: torch.Tensor, beam: int = 4,
                      max_sym_per_frame: int = 1, *, length_norm: bool = True, fusion: BatchFusion | None = None,
                      return_scores: bool = False, static_shapes: bool | None = None, return_results: bool = False,
                      ) -> list[list[int]] | tuple[list[list[int]], list[float]] | list[DecodingResult]:
    """Batched ALSD beam search over an RNN-T or TDT transducer (the rules in the module docstring).

    Args:
        model: a transducer (:class:`~asrprec.decoding.SearchableTransducer`); a TDT model
            (``model.durations``) is searched over (label, duration) pairs. Any precision.
        encoder_out: (B, T, D_enc) from ``model.encode``. encoder_out_lens: (B,) integer valid frames (0 allowed).
        beam: hypotheses per utterance (>= 1). max_sym_per_frame: labels per frame (>= 1).
        length_norm: final choice by ``score / (context_size + len(tokens))`` (icefall) or by raw score.
        fusion: LM / LODR / phrase bonuses for non-blank labels (:mod:`asrprec.decoding.fusion`); an unfinished phrase
            gives its bonus back before the final choice.
        return_scores: also return the chosen hypotheses' scores (float64 sums of fp32 log-probabilities).
        static_shapes: compute every hypothesis at every step (the default on CUDA) instead of only those that move
            (the default elsewhere); the same results.
        return_results: return B :class:`~asrprec.decoding.DecodingResult`: each token's frame (where the chosen
            hypothesis emitted it), a TDT model's durations (of the chosen (label, duration) pairs), the score.
    Returns:
        B token-id lists in the input order (and, with ``return_scores``, B floats).
    """
    if not isinstance(beam, int) or beam < 1:
        raise ValueError(f"beam must be an integer >= 1, got {beam!r}")
    if not isinstance(max_sym_per_frame, int) or max_sym_per_frame < 1:
        raise ValueError(f"max_sym_per_frame must be an integer >= 1, got {max_sym_per_frame!r}")
    batch = sort_and_project(model, encoder_out, encoder_out_lens)
    B, T = encoder_out.shape[:2]
    if B == 0 or T == 0:
        empty = [[] for _ in range(B)]
        if return_results:
            return results_of(empty, empty, empty if model.durations else None, [0.0] * B)
        return (empty, [0.0] * B) if return_scores else empty
    device = model_device(model)
    blank, C = model.blank_id, model.context_size
    durations = list(model.durations)
    tdt = bool(durations)
    V = model.vocab_size
    K, S = beam, max_sym_per_frame
    order = torch.tensor(batch.order, device=device)
    lens = encoder_out_lens.to(device, torch.int64).index_select(0, order)  # (B,) sorted
    enc = batch.encoder_proj  # (B, T, J)
    L = max(T * S, 1) + 1

    i64 = dict(dtype=torch.int64, device=device)
    score = torch.full((B, K), NEG_INF, dtype=torch.float64, device=device)
    score[:, 0] = 0.0
    t = torch.zeros(B, K, **i64)
    sym = torch.zeros(B, K, **i64)
    length = torch.zeros(B, K, **i64)
    last = torch.full((B, K), -1, **i64)
    seq_hash = torch.zeros(B, K, **i64)
    tokens = torch.zeros(B, K, L, **i64)
    # each label's frame (and TDT duration), kept only when asked for: (B, K, L) each
    stamps = torch.zeros(B, K, L, **i64) if return_results else None
    durs = torch.zeros(B, K, L, **i64) if return_results and tdt else None
    contexts = torch.full((B * K, C), blank, **i64)
    dec = model.project_decoder(contexts)  # (B·K, J)
    fstate = fusion.start(order).repeat_interleave(K, dim=0).view(B, K, 4) if fusion is not None else None
    rows = torch.arange(B, device=device)[:, None].expand(B, K)
    # every row at every step (CUDA-graph shapes), or eagerly only the rows that move
    static = device.type == "cuda" if static_shapes is None else bool(static_shapes)
    # eagerly, the decoder's output of each context (its last C tokens: a stateless decoder) is kept for the call
    cache = known = place = None
    if not static and V ** C <= 1 << 16:
        place = V ** torch.arange(C - 1, -1, -1, **i64)  # context -> its index in the cache
        cache = dec.new_zeros(V ** C, dec.shape[-1])
        known = torch.zeros(V ** C, dtype=torch.bool, device=device)
    earlier = torch.arange(K, device=device)[None, None, :] < torch.arange(K, device=device)[None, :, None]
    if tdt:
        dur = torch.tensor(durations, **i64)
        D = dur.numel()
        pair_label = torch.arange(V * D, device=device) // D  # candidate pair -> label
        pair_jump = dur.repeat(V)
        pair_jump = torch.where(pair_label == blank, pair_jump.clamp(min=1), pair_jump)

    while True:
        active = (t < lens[:, None]) & (score > NEG_INF)  # (B, K)
        if not bool(active.any()):  # the one host read per step
            break
        frames = t.clamp(max=T - 1)
        if static:
            logits = model.join_projected(enc[rows, frames].reshape(B * K, -1), dec)  # (B·K, V [+ D])
        else:  # eager: the joiner only for the active hypotheses (the others' rows are masked below)
            live = active.view(-1).nonzero().squeeze(1)
            part = model.join_projected(enc[rows, frames].reshape(B * K, -1).index_select(0, live),
                                dec.index_select(0, live))
            logits = part.new_zeros(B * K, part.shape[-1]).index_copy(0, live, part)
        lp = log_softmax_fp32(logits[:, :V]).double()
        if fusion is not None:
            bonus, next_fstate = fusion.scores(fstate.view(B * K, 4))  # (B·K, V), (B·K, V, 4)
            lp = lp + bonus.double()
        if tdt:
            cand = (lp[:, :, None] + log_softmax_fp32(logits[:, V:]).double()[:, None, :]).view(B, K, V * D)
        else:
            cand = lp.view(B, K, V)
        W = cand.shape[-1]
        M = min(K, W)
        top, idx = cand.topk(M, dim=-1)  # (B, K, M): each hypothesis's best proposals
        top = top + score[..., None]
        finished = ~active  # a finished (or empty) hypothesis proposes itself in slot 0
        top = torch.where(finished[..., None], NEG_INF, top)
        top[..., 0] = torch.where(finished, score, top[..., 0])
        best, choice = top.view(B, K * M).topk(K, dim=-1)  # (B, K)
        src = choice // M
        picked = idx.view(B, K * M).gather(1, choice)  # label (RNN-T) or pair (TDT)
        was_finished = finished.gather(1, src)
        label = pair_label[picked] if tdt else picked
        emit = (label != blank) & ~was_finished & (best > NEG_INF)

        # reorder the survivors' state by their source hypothesis
        t, sym, length, last, seq_hash = (x.gather(1, src) for x in (t, sym, length, last, seq_hash))
        tokens = tokens.gather(1, src[..., None].expand(B, K, L))
        if stamps is not None:
            stamps = stamps.gather(1, src[..., None].expand(B, K, L))
        if durs is not None:
            durs = durs.gather(1, src[..., None].expand(B, K, L))
        flat_src = (rows * K + src).reshape(-1)
        contexts = contexts.index_select(0, flat_src)
        dec = dec.index_select(0, flat_src)
        if fusion is not None:
            moved = next_fstate.view(B, K, V, 4)[rows, src, label.clamp(min=0)]  # (B, K, 4)
            fstate = torch.where(emit[..., None], moved, fstate.gather(1, src[..., None].expand(B, K, 4)))

        pos = length.clamp(max=L - 1)[..., None]
        if stamps is not None:  # the frame the label is emitted on: the hypothesis's before it moves
            stamps.scatter_(2, pos, torch.where(emit[..., None], t[..., None], stamps.gather(2, pos)))
        if durs is not None:
            durs.scatter_(2, pos, torch.where(emit[..., None], dur[picked % D][..., None], durs.gather(2, pos)))
        # advance frames: blank one frame (TDT: its jump), a label stays (RNN-T) or jumps its duration (TDT)
        jump = pair_jump[picked] if tdt else (~emit).long()
        stay = emit & (jump == 0)
        new_sym = torch.where(stay, sym + 1, 0)
        capped = stay & (new_sym >= S)  # the last label the frame takes: one frame on
        jump = torch.where(capped, 1, jump)
        sym = torch.where(capped, 0, new_sym)
        t = torch.where(was_finished | (best == NEG_INF), t, t + jump)
        tokens.scatter_(2, pos, torch.where(emit[..., None], label[..., None], tokens.gather(2, pos)))
        seq_hash = torch.where(emit, seq_hash * _HASH_MUL + label + 1, seq_hash)
        last = torch.where(emit, label, last)
        length = length + emit.long()
        score = best
        e = emit.view(-1)
        new_ctx = torch.cat([contexts[:, 1:], label.clamp(min=0).view(-1, 1)], dim=1)
        contexts = torch.where(e[:, None], new_ctx, contexts)
        if static:
            dec = torch.where(e[:, None], model.project_decoder(contexts), dec)
        else:  # eager: the decoder only for the hypotheses that took a label, each context computed once
            took = e.nonzero().squeeze(1)
            if took.numel():
                ctx = contexts.index_select(0, took)
                if cache is None:
                    dec = dec.index_copy(0, took, model.project_decoder(ctx))
                else:
                    ids = (ctx * place).sum(dim=1)
                    new = ids[~known[ids]].unique()
                    if new.numel():
                        cache[new] = model.project_decoder(new[:, None] // place % V)
                        known[new] = True
                    dec = dec.index_copy(0, took, cache[ids])

        # merge equal label sequences on the same frame: the best of each group takes their log-sum
        at = t.clamp(max=lens[:, None])  # every jump past the last frame ends in the same place
        same = ((seq_hash[:, :, None] == seq_hash[:, None, :]) & (length[:, :, None] == length[:, None, :])
                & (last[:, :, None] == last[:, None, :]) & (at[:, :, None] == at[:, None, :])
                & ((sym[:, :, None] == sym[:, None, :]) | (at[:, :, None] >= lens[:, None, None]))
                & (score[:, :, None] > NEG_INF) & (score[:, None, :] > NEG_INF))  # (B, K, K)
        total = torch.where(same, score[:, None, :], NEG_INF).logsumexp(dim=2)  # row k: the log-sum of k's group
        ahead = (score[:, None, :] > score[:, :, None]) | ((score[:, None, :] == score[:, :, None]) & earlier)
        leader = ~(same & ahead).any(dim=2)  # no better member in its group (a lone hypothesis leads itself)
        score = torch.where(leader, torch.where(score > NEG_INF, total, score), NEG_INF)

    final = score.clone()
    if fusion is not None:
        final = final + fusion.final(fstate.view(B * K, 4)).view(B, K).double()
    rank = final / (C + length) if length_norm else final
    rank = torch.where(final > NEG_INF, rank, NEG_INF)
    best_k = rank.argmax(dim=1)  # (B,)
    n = length[rows[:, 0], best_k].tolist()
    toks = tokens[rows[:, 0], best_k].tolist()
    hyps = batch.unsort([row[:k] for row, k in zip(toks, n)])
    if return_results:
        def chosen(buf: torch.Tensor) -> list[list[int]]:
            return batch.unsort([row[:k] for row, k in zip(buf[rows[:, 0], best_k].tolist(), n)])

        return results_of(hyps, chosen(stamps), chosen(durs) if durs is not None else None,
                          batch.unsort(final[rows[:, 0], best_k].tolist()))
    if return_scores:
        return hyps, batch.unsort(final[rows[:, 0], best_k].tolist())
    return hyps
