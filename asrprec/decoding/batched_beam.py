"""Batched beam search for RNN-T and TDT (``malsd_batch``): every hypothesis of every utterance in tensors.

Modified alignment-length synchronous decoding (ALSD, Saon et al., ICASSP 2020) in the batched form of NeMo's
``malsd_batch`` (Grigoryan et al., arXiv 2506.00185; NVIDIA/NeMo
``nemo/collections/asr/parts/submodules/transducer_decoding/rnnt_malsd_batched_computer.py``, read for its rules;
the code is ours). The B × K hypotheses (K = beam) each keep their own frame pointer, as label looping does
(:mod:`asrprec.decoding.label_looping`), and one step expands all of them at once (TDT: those on the earliest frame):

1. the joiner at each hypothesis's frame and its decoder output gives log-probabilities (fp32); the LM / phrase
   bonus of :mod:`asrprec.decoding.fusion` is added to non-blank tokens;
2. RNN-T: each active hypothesis proposes every label; a finished hypothesis (at its utterance's last frame)
   proposes itself, unchanged;
3. RNN-T: the K best of each utterance's K · V candidates survive, best first (one ``topk`` for the batch; the same
   K as the best K of each hypothesis's best K). TDT is frame-synchronous instead, with the rules of
   :func:`asrprec.decoding.tdt_modified_beam_search`: only the best K hypotheses on their utterance's earliest frame
   expand (the others there leave the beam), into (label, duration) pairs whose K best join the hypotheses that wait
   on later frames or have finished. Expanded in step (NeMo's TDT ``malsd_batch``, ``tdt_malsd_batched_computer.py``,
   expands every hypothesis on each step, each label with its most probable duration only), two alignments of one
   label sequence would stay on different frames and fill the beam with copies of one sequence; taken frame by frame
   they meet and merge. A TDT search keeps K · (d_max + 1) slots (d_max the longest jump): K for each frame ahead
   and for the finished ones; with fewer, it would prune hypotheses that modified beam search keeps;
4. a blank moves the hypothesis one frame on, a label stays on the frame (RNN-T) or jumps by its duration (TDT:
   a blank jumps max(d, 1)); the ``max_sym_per_frame``-th label on a frame moves one frame on, no blank scored
   (the rule of greedy search and of :mod:`asrprec.decoding.tdt`; with 1, icefall's one symbol per frame of
   ``modified_beam_search``, where NeMo's ``malsd_batch`` scores a forced blank after its cap of 10); only
   hypotheses that took a label run the decoder;
5. hypotheses of one utterance with the same label sequence on the same frame merge: the best keeps the log-sum of
   their scores, the others leave the beam (NeMo's ``recombine_hyps_``: equal transcript hash, last label and
   length; the frame is implied there for RNN-T and compared for TDT; we compare it always, and also the labels
   already emitted on the frame, which decide what a hypothesis may still do there, so a merge never joins two
   different futures; the sequences are compared by a 64-bit rolling hash with their lengths, last labels and
   decoder contexts).

The loop ends when every hypothesis is finished; the result is the best by length-normalised score (icefall's rule,
as :func:`asrprec.decoding.modified_beam_search`) or raw score. With K = 1 it makes greedy search's decisions.

One step is a fixed list of tensor operations on the whole (B, K) block, with no Python loop over utterances,
hypotheses or labels: one joiner call on each expanding hypothesis's frame (gathered from the encoder projection
made once for the call), one ``topk`` over each utterance's K · V candidates (TDT: two), one row copy of the
survivors' packed state, and the merge as (B, K, K) comparisons of state rows. The state lives in preallocated
tensors (:class:`BeamState`) updated in place, so the step has static shapes and addresses: on a CUDA device
:class:`MalsdBeamSearch` captures it once as a CUDA graph and replays it, the host reading one flag (any hypothesis
active?) between replays (label looping's ``no_while_loops`` mode, :mod:`asrprec.decoding.label_looping`), and the
decoder runs on every row. Elsewhere (eagerly) each step computes only the utterances up to the last one still
active (the batch is sorted by length), and the decoder runs only for new contexts: its output depends on the last C
tokens only, and is kept by context when V^C is at most 65,536 (by :class:`MalsdBeamSearch` from call to call, while
the weights stay the same). On the CPU the bookkeeping after the ``topk`` (reordering, appending, moving, merging)
is one compiled call (:mod:`asrprec.decoding.batched_beam_cpu`, the twin of the tensor form; a batch with fusion
takes the tensor form).

Legend: B utterances, K hypotheses per utterance (the beam; TDT: beam · (d_max + 1)), T encoder frames, J joiner
width, V vocabulary (blank included), D durations, L the longest label sequence (T · max_sym_per_frame), C the
decoder's context size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

import torch
from torch import nn

from asrprec.precision.islands import autocast_dtype, autocast_without_cache

from ._common import graph_mode, log_softmax_fp32, model_device, sort_and_project
from .batched_beam_cpu import advance_kernel, tdt_select_kernel
from .fusion import BatchFusion
from .hypothesis import DecodingResult, results_of

__all__ = ["BeamState", "MalsdBeamSearch", "malsd_beam_search"]

log = logging.getLogger(__name__)

NEG_INF = float("-inf")
_HASH_MUL = 1_000_003  # the rolling hash h' = h · M + (token + 1), wrapping in int64
_T, _SYM, _LEN, _LAST, _HASH, _CTX = range(6)  # the fields of BeamState.ints


@dataclass
class BeamState:
    """The search's variables, preallocated for up to ``B_cap`` utterances of up to ``T_cap`` frames.

    Attributes:
        enc: (B_cap, T_cap, J) projected encoder output (rows past the batch are zero, with length 0).
        lens: (B_cap,) valid frames. score: (B_cap, K) float64 log-probabilities (-inf: an empty slot).
        ints: (B_cap, K, 6) int64, per hypothesis: frame (at most the utterance's length: every jump past the end
            lands there), labels emitted on it (0 once finished), label count, last label (-1: none), rolling hash
            of the labels, the decoder's context (its C tokens as one number in base V). One row copy reorders them
            all, and two hypotheses with equal rows merge.
        active: (B_cap, K) bool, hypotheses before their utterance's end and not empty.
        tokens: (B_cap, K, L) labels; stamps: (B_cap, K, L) each label's frame; durs: (B_cap, K, L) its TDT
            duration (the last two only when asked for; else (B_cap, K, 1), unused). Columns past a hypothesis's
            label count hold junk.
        dec: (B_cap, K, J) projected decoder output of each hypothesis's context; dec0: (J,) the start context's.
        flag: (1,) bool, any hypothesis active (read by the host after each step).
        frame0: (B_cap, 1) each utterance's first row in ``enc`` seen as (B_cap · T_cap, J); hyp0: (B_cap, 1) its
            first hypothesis's row in (B_cap · K) (row copies by ``index_select``, cheaper than ``gather``).
    """

    enc: torch.Tensor
    lens: torch.Tensor
    score: torch.Tensor
    ints: torch.Tensor
    active: torch.Tensor
    tokens: torch.Tensor
    stamps: torch.Tensor
    durs: torch.Tensor
    dec: torch.Tensor
    dec0: torch.Tensor
    flag: torch.Tensor
    frame0: torch.Tensor
    hyp0: torch.Tensor

    def data_ptrs(self) -> dict[str, int]:
        """Storage address of every tensor (the steps must leave them unchanged: a CUDA graph replays on them)."""
        return {f.name: getattr(self, f.name).data_ptr() for f in fields(self)}


def _version(t: torch.Tensor) -> int:
    """``t``'s in-place version counter; -1 for an inference tensor (made under ``torch.inference_mode``, e.g. weights
    loaded there), which keeps none: its storage address alone then stands for the weights."""
    try:
        return t._version
    except RuntimeError:
        return -1


class MalsdBeamSearch:
    """``malsd_batch`` bound to one model, keeping its state (and CUDA graph) between calls.

    Args:
        model: a transducer (:class:`~asrprec.decoding.SearchableTransducer`); a TDT model (``model.durations``) is
            searched over (label, duration) pairs. Any precision.
        beam: hypotheses per utterance (>= 1; TDT: per frame). max_sym_per_frame: labels per frame (>= 1).
        length_norm: final choice by ``score / (context_size + len(tokens))`` (icefall) or by raw score.
        use_cuda_graphs: ``None`` captures the step as a CUDA graph when the model is on a CUDA device and runs
            eagerly elsewhere (or when capture fails, with a warning); ``True`` requires it (an error on CPU);
            ``False`` never captures.
        static_shapes: compute every hypothesis at every step (fixed shapes and addresses, what a CUDA graph
            replays; the default with graphs) instead of only the utterances still active and the decoder only for
            new contexts (the default without); the same results.

    Eagerly, the decoder's output of each context is kept from call to call (dropped when a weight changes), so a
    context's output may come from a decoder call on other rows than a one-off call would make: scores can then
    differ from :func:`malsd_beam_search`'s in their last bits.
    """

    def __init__(self, model: nn.Module, beam: int = 4, max_sym_per_frame: int = 1, *, length_norm: bool = True,
                 use_cuda_graphs: bool | None = None, static_shapes: bool | None = None):
        if not isinstance(beam, int) or beam < 1:
            raise ValueError(f"beam must be an integer >= 1, got {beam!r}")
        if not isinstance(max_sym_per_frame, int) or max_sym_per_frame < 1:
            raise ValueError(f"max_sym_per_frame must be an integer >= 1, got {max_sym_per_frame!r}")
        self.model, self.K, self.S, self.length_norm = model, beam, max_sym_per_frame, length_norm
        self.beam = beam
        self.device = model_device(model)
        self.use_cuda_graphs, self._static = graph_mode(self.device, use_cuda_graphs, static_shapes)
        self._required = bool(use_cuda_graphs)
        self.blank, self.C, self.V = model.blank_id, model.context_size, model.vocab_size
        i64 = dict(dtype=torch.int64, device=self.device)
        durations = list(model.durations)
        self.tdt = bool(durations)
        if self.tdt:  # candidate pair p = label · D + duration index
            self.dur = torch.tensor(durations, **i64)
            self.D = self.dur.numel()
            self.pair_label = torch.arange(self.V * self.D, device=self.device) // self.D
            jump = self.dur.repeat(self.V)
            self.pair_jump = torch.where(self.pair_label == self.blank, jump.clamp(min=1), jump)
        else:
            self.D = 1
        W = self.V * self.D
        # a finished hypothesis's candidates: itself (as a blank, pair (blank, first duration)), nothing else
        self.keep_self = torch.full((W,), NEG_INF, dtype=torch.float64, device=self.device)
        self.keep_self[self.blank * self.D] = 0.0
        if self.tdt:  # slots: `beam` for each frame a jump reaches (waiting hypotheses) and for the finished ones
            self.K = beam * (int(self.pair_jump.max()) + 1)
        K = self.K
        self.earlier = torch.arange(K, device=self.device)[None, :] < torch.arange(K, device=self.device)[:, None]
        if self.V ** self.C >= 1 << 62:
            raise ValueError(f"malsd_batch keeps a decoder context as one int64 number, V^C < 2^62; got V={self.V}, "
                             f"C={self.C}")
        self.place = self.V ** torch.arange(self.C - 1, -1, -1, **i64)  # context tokens -> the number
        self.ctx0 = sum(self.blank * self.V ** i for i in range(self.C))  # the start context's
        self.drop = self.V ** (self.C - 1)  # a context modulo it: its last C - 1 tokens
        self.state: BeamState | None = None
        self._graph = None
        self._key: tuple | None = None
        self._fusion: BatchFusion | None = None
        self._fstate: torch.Tensor | None = None  # (B_cap, K, 4) fusion states (eager only)
        self._cache = self._known = self._weights = None
        self._arrays: tuple | None = None  # numpy views of the state for the compiled CPU step
        self._params = list(model.parameters())

    @torch.no_grad()
    def __call__(self, encoder_out: torch.Tensor, encoder_out_lens: torch.Tensor, *, fusion: BatchFusion | None = None,
                 return_scores: bool = False, return_results: bool = False,
                 ) -> list[list[int]] | tuple[list[list[int]], list[float]] | list[DecodingResult]:
        """Decode a batch: encoder_out (B, T, D_enc) from ``model.encode``, encoder_out_lens (B,) integer (0 allowed).

        ``fusion``: LM / LODR / phrase bonuses for non-blank labels (:mod:`asrprec.decoding.fusion`; a batch with
        fusion runs without the CUDA graph and, on the CPU, without the compiled step); an unfinished phrase gives
        its bonus back before the final choice. Returns B token-id lists in the input order; with ``return_scores``
        also B floats (float64 sums of fp32 log-probabilities); with ``return_results`` B
        :class:`~asrprec.decoding.DecodingResult`: each token's frame (where the chosen hypothesis emitted it), a
        TDT model's durations (of the chosen (label, duration) pairs), the score.
        """
        batch = sort_and_project(self.model, encoder_out, encoder_out_lens)
        B, T = encoder_out.shape[:2]
        if B == 0 or T == 0:
            empty = [[] for _ in range(B)]
            if return_results:
                return results_of(empty, empty, empty if self.tdt else None, [0.0] * B)
            return (empty, [0.0] * B) if return_scores else empty
        order = torch.tensor(batch.order, device=self.device)
        lens = encoder_out_lens.to(self.device, torch.int64).index_select(0, order)
        self._fusion = fusion
        s = self._load(batch.encoder_proj, lens, return_results)
        if fusion is not None:  # padding rows (past the batch) take the first utterance's start state
            rows = torch.zeros(s.enc.shape[0], dtype=torch.int64, device=self.device)
            rows[:B] = order
            self._fstate = fusion.start(rows)[:, None, :].repeat(1, self.K, 1)
        self._run(s)

        score, ints = s.score[:B], s.ints[:B]
        final = score.clone()
        if fusion is not None:
            final = final + fusion.final(self._fstate[:B].reshape(-1, 4)).view(B, self.K).double()
        length = ints[..., _LEN]
        rank = final / (self.C + length) if self.length_norm else final
        rank = torch.where(final > NEG_INF, rank, NEG_INF)
        best_k = rank.argmax(dim=1)  # (B,)
        rows = torch.arange(B, device=self.device)
        n = length[rows, best_k].tolist()

        def chosen(buf: torch.Tensor) -> list[list[int]]:
            return batch.unsort([row[:k] for row, k in zip(buf[:B][rows, best_k].tolist(), n)])

        hyps = chosen(s.tokens)
        scores = batch.unsort(final[rows, best_k].tolist())
        if return_results:
            return results_of(hyps, chosen(s.stamps), chosen(s.durs) if self.tdt else None, scores)
        return (hyps, scores) if return_scores else hyps

    # -- state ------------------------------------------------------------------------------------
    def _load(self, enc: torch.Tensor, lens: torch.Tensor, stamps: bool) -> BeamState:
        """Put the batch into the state (reallocating, and dropping a captured graph, when it does not fit)."""
        B, T, _ = enc.shape
        key = (enc.shape[-1], enc.dtype, autocast_dtype(enc), torch.is_inference_mode_enabled())
        s = self.state
        graphs = self.use_cuda_graphs and self._fusion is None
        static = self._static  # static shapes: a smaller batch fills the state's first rows (the rest have length 0)
        fits = (s is not None and key == self._key and B <= s.enc.shape[0] and T <= s.enc.shape[1]
                and (static or (B == s.enc.shape[0] and T == s.enc.shape[1])))  # eager: no padding rows
        fits = fits and (static or stamps <= (s.stamps.shape[-1] > 1))
        if not fits:
            if static and s is not None and key == self._key:
                B, T = max(B, s.enc.shape[0]), max(T, s.enc.shape[1])
            s = self.state = self._allocate(B, T, enc, stamps or static)
            self._key, self._graph = key, None
        s.enc.zero_()
        s.enc[: enc.shape[0], : enc.shape[1]].copy_(enc)
        s.lens.zero_()
        s.lens[: lens.shape[0]].copy_(lens)
        if graphs and self._graph is None:
            self._graph = self._capture(s)
        self._reset(s)
        self._arrays = None
        if self.device.type == "cpu" and not self._static:  # numpy views of the state for the compiled step
            if self.tdt:
                pairs = (self.pair_label, self.pair_jump, self.dur.repeat(self.V))
            else:  # one (label, duration 0) pair per label: a blank jumps one frame
                labels = torch.arange(self.V)
                pairs = (labels, (labels == self.blank).long(), torch.zeros_like(labels))
            self._arrays = (tuple(x.numpy() for x in (s.active, s.ints, s.tokens, s.stamps, s.durs)),
                            tuple(x.numpy() for x in pairs) + (s.lens.numpy(),))
        return s

    def _allocate(self, B: int, T: int, enc: torch.Tensor, stamps: bool) -> BeamState:
        K, C = self.K, self.C
        i64 = dict(dtype=torch.int64, device=self.device)
        dec0 = self.model.project_decoder(torch.full((1, C), self.blank, **i64))[0]  # (J,)
        L = T * self.S + 1
        Ls = L if stamps else 1
        return BeamState(
            enc=torch.zeros(B, T, enc.shape[-1], dtype=enc.dtype, device=self.device),
            lens=torch.zeros(B, **i64), score=torch.zeros(B, K, dtype=torch.float64, device=self.device),
            ints=torch.zeros(B, K, 6, **i64), active=torch.zeros(B, K, dtype=torch.bool, device=self.device),
            tokens=torch.zeros(B, K, L, **i64),
            stamps=torch.zeros(B, K, Ls, **i64), durs=torch.zeros(B, K, Ls if self.tdt else 1, **i64),
            dec=dec0.expand(B, K, -1).clone(), dec0=dec0, flag=torch.zeros(1, dtype=torch.bool, device=self.device),
            frame0=torch.arange(B, **i64)[:, None] * T, hyp0=torch.arange(B, **i64)[:, None] * K,
        )

    def _reset(self, s: BeamState) -> None:
        """Every utterance back to one empty hypothesis on frame 0 with the start context."""
        s.score.fill_(NEG_INF)
        s.score[:, 0] = 0.0
        s.ints.zero_()
        s.ints[..., _LAST] = -1
        s.ints[..., _CTX] = self.ctx0
        s.dec0.copy_(self.model.project_decoder(torch.full((1, self.C), self.blank, device=self.device))[0])
        s.dec.copy_(s.dec0.expand_as(s.dec))
        torch.logical_and(s.score > NEG_INF, s.lens[:, None] > 0, out=s.active)
        torch.any(s.active.view(1, -1), dim=1, out=s.flag)
        if self._static or self.V ** self.C > 1 << 16:
            self._cache = self._known = None
            return
        # the eager decoder cache, kept between calls while the weights and the compute dtype stay the same
        weights = (self._key, tuple((p.data_ptr(), _version(p)) for p in self._params))
        if self._cache is None or weights != self._weights:
            self._cache = s.dec.new_empty(self.V ** self.C, s.dec.shape[-1])
            self._known = torch.zeros(self.V ** self.C, dtype=torch.bool, device=self.device)
            self._weights = weights

    # -- the loop ---------------------------------------------------------------------------------
    def _run(self, s: BeamState) -> None:
        if self._graph is not None and self._fusion is None:
            while bool(s.flag):  # the one host read per step
                self._graph.replay()
            return
        n = s.enc.shape[0]
        if self._static:
            while bool(s.flag):
                self._step(s, n)
            return
        while n:  # the one host read per step: eagerly, the utterances up to the last one still active
            n = self._step(s, n)

    def _step(self, s: BeamState, n: int) -> int:
        """One expansion of the first ``n`` utterances' hypotheses (the rules in the module docstring), in place.
        Returns (eagerly) how many utterances the next step needs: up to the last one still active."""
        K, V, S, blank = self.K, self.V, self.S, self.blank
        T, J, L = s.enc.shape[1], s.dec.shape[-1], s.tokens.shape[-1]
        score, ints, lens, active = s.score[:n], s.ints[:n], s.lens[:n, None], s.active[:n]
        fusion = self._fusion
        if self.tdt:
            best, choice, expand, fusion_rows, next_fstate = self._tdt_candidates(s, n)
        else:  # every hypothesis expands (it moves one frame per blank: ALSD's alignment-length order)
            frames = ints[..., _T].clamp(max=T - 1)
            enc = s.enc.view(-1, J).index_select(0, (s.frame0[:n] + frames).view(-1)).view(n, K, J)
            lp = log_softmax_fp32(self.model.join_projected(enc, s.dec[:n])[..., :V]).double()  # (n, K, V)
            if fusion is not None:
                bonus, next_fstate = fusion.scores(self._fstate[:n].reshape(n * K, 4))  # (n·K, V), (n·K, V, 4)
                lp = lp + bonus.view(n, K, V).double()
                fusion_rows = None
            # a finished hypothesis proposes itself (as a blank); one topk over each utterance's K · V candidates,
            # best first (the merge below relies on the order)
            cand = torch.where(active[..., None], lp, self.keep_self) + score[..., None]  # (n, K, V)
            best, choice = cand.view(n, K * V).topk(K, dim=1)  # (n, K)
            expand = active
        W = self.V * self.D
        if self._arrays is not None and fusion is None:  # the rest in one compiled call
            return self._advance_cpu(s, n, best, choice, W, expand)
        src = torch.div(choice, W, rounding_mode="floor")
        picked = choice - src * W  # label (RNN-T) or (label, duration) pair (TDT)
        label = self.pair_label[picked] if self.tdt else picked
        alive = best > NEG_INF
        moving = expand.gather(1, src) & alive
        emit = (label != blank) & moving

        # the survivors' state, by their source hypothesis
        flat = (s.hyp0[:n] + src).view(-1)  # (n · K,) the source rows

        def reorder(x: torch.Tensor) -> torch.Tensor:  # (B_cap, K, F) -> the survivors' (n, K, F)
            return x.view(-1, x.shape[-1]).index_select(0, flat).view(n, K, -1)

        t, sym, length, last, seq_hash, ctx = reorder(s.ints).unbind(-1)
        pos = length.clamp(max=L - 1)[..., None]  # the next free column (a non-emitter writes junk there)
        s.tokens[:n] = reorder(s.tokens).scatter_(2, pos, label[..., None])
        if s.stamps.shape[-1] > 1:  # the frame the label is emitted on: the hypothesis's before it moves
            s.stamps[:n] = reorder(s.stamps).scatter_(2, pos, t[..., None])
            if self.tdt:
                s.durs[:n] = reorder(s.durs).scatter_(2, pos, self.dur[picked % self.D][..., None])
        if fusion is not None:
            rows = torch.arange(n, device=self.device)[:, None]
            origin = src if fusion_rows is None else fusion_rows.gather(1, src)  # the row of next_fstate
            moved = next_fstate.view(n, -1, V, 4)[rows, origin, label.clamp(min=0)]  # (n, K, 4)
            old = self._fstate[:n].gather(1, src[..., None].expand(n, K, 4))
            self._fstate[:n] = torch.where(emit[..., None], moved, old)

        # advance frames: blank one frame (TDT: its jump), a label stays (RNN-T) or jumps its duration (TDT); the
        # S-th label on a frame moves one frame on, no blank scored. A finished hypothesis stays at its end.
        jump = (self.pair_jump[picked] if self.tdt else (~emit).long()) * moving
        sym = (sym + 1) * (emit & (jump == 0))  # labels on the frame, counting this one when it stays
        capped = sym >= S
        t = torch.minimum(t + jump + capped, lens)
        sym = sym * ~capped * (t < lens)
        seq_hash = torch.where(emit, seq_hash * _HASH_MUL + label + 1, seq_hash)
        last = torch.where(emit, label, last)
        length = length + emit
        ctx = torch.where(emit, ctx % self.place[0] * V + label, ctx)  # drop the oldest token, append the label
        ints.copy_(torch.stack([t, sym, length, last, seq_hash, ctx], dim=-1))
        s.dec[:n] = self._decode(reorder(s.dec) if self._cache is None else None, ctx, emit)

        # merge hypotheses of one utterance with equal state rows (label sequence, frame, labels on the frame): the
        # first of each group (the best: candidates come best first) takes their log-sum, the others leave
        if K > 1:
            same = (ints[:, :, None] == ints[:, None]).all(dim=-1) & alive[:, None, :]  # (n, K, K)
            leader = ~(same & self.earlier).any(dim=2)
            total = best + torch.where(same, best[:, None, :] - best[:, :, None], NEG_INF).exp().sum(dim=2).log()
            best = torch.where(leader, total, NEG_INF)
        score.copy_(best)
        torch.logical_and(t < lens, best > NEG_INF, out=active)
        if self._static:  # the host's flag
            torch.any(active.view(1, -1), dim=1, out=s.flag)
            return n
        live = active.any(dim=1).nonzero()
        return int(live[-1]) + 1 if live.numel() else 0

    def _tdt_candidates(self, s: BeamState, n: int):
        """A TDT step's K best candidates, frame by frame (rule 2 of the module docstring): the best ``beam``
        hypotheses on each utterance's earliest frame expand (the others there leave the beam), their ``beam`` best
        (label, duration) pairs join the hypotheses that wait on later frames or have finished. Only the expanded
        rows meet the joiner. Returns (best, choice) as a ``topk`` over K · W candidates gives them, which rows
        expanded (n, K), and with fusion each slot's row in the fusion scores and those scores' next states."""
        K, E, V, T, J = self.K, self.beam, self.V, s.enc.shape[1], s.dec.shape[-1]
        score, frames, active = s.score[:n], s.ints[:n, :, _T], s.active[:n]
        earliest = torch.where(active, frames, T).amin(dim=1, keepdim=True)
        on_it = active & (frames == earliest)
        e_score, e_rows = torch.where(on_it, score, NEG_INF).topk(E, dim=1)  # (n, E) the rows that expand
        e_live = e_score > NEG_INF
        at = frames.gather(1, e_rows).clamp(max=T - 1)
        enc = s.enc.view(-1, J).index_select(0, (s.frame0[:n] + at).view(-1)).view(n, E, J)
        dec = s.dec.view(-1, J).index_select(0, (s.hyp0[:n] + e_rows).view(-1)).view(n, E, J)
        logits = self.model.join_projected(enc, dec)
        lp = log_softmax_fp32(logits[..., :V]).double()  # (n, E, V)
        fusion, next_fstate, fusion_rows = self._fusion, None, None
        if fusion is not None:
            states = self._fstate[:n].gather(1, e_rows[..., None].expand(n, E, 4))
            bonus, next_fstate = fusion.scores(states.reshape(n * E, 4))  # (n·E, V), (n·E, V, 4)
            lp = lp + bonus.view(n, E, V).double()
            fusion_rows = torch.zeros(n, K, dtype=torch.int64, device=self.device).scatter_(
                1, e_rows, torch.arange(E, device=self.device).expand(n, E).contiguous())
        W, D = V * self.D, self.D
        if self._arrays is not None and fusion is None:  # the selection in one compiled call
            best = torch.empty(n, K, dtype=torch.float64)
            choice = torch.empty(n, K, dtype=torch.int64)
            expand = torch.empty(n, K, dtype=torch.bool)
            tdt_select_kernel()(lp.numpy(), log_softmax_fp32(logits[..., V:]).double().numpy(), e_rows.numpy(),
                                e_score.numpy(), score.numpy(), on_it.numpy(), W, D, self.blank, best.numpy(),
                                choice.numpy(), expand.numpy())
            return best, choice, expand, None, None
        # the E best (label, duration) pairs of a hypothesis are among its E best labels x E best durations (the
        # two scores add): E · E candidates per row instead of V · D
        top_lp, top_label = lp.topk(min(E, V), dim=-1)  # (n, E, El)
        top_ld, top_dur = log_softmax_fp32(logits[..., V:]).double().topk(min(E, D), dim=-1)  # (n, E, Ed)
        pairs = (top_label[..., :, None] * D + top_dur[..., None, :]).view(n, -1)  # (n, E · El · Ed) pair ids
        cand = (top_lp[..., :, None] + top_ld[..., None, :]).view(n, E, -1) + e_score[..., None]
        cand = torch.where(e_live[..., None], cand, NEG_INF)
        new_best, new_idx = cand.view(n, -1).topk(E, dim=1)
        e = torch.div(new_idx, cand.shape[-1], rounding_mode="floor")
        new_choice = e_rows.gather(1, e) * W + pairs.gather(1, new_idx)
        held = torch.where(~on_it & (score > NEG_INF), score, NEG_INF)  # waiting or finished: itself, a blank
        held_choice = (torch.arange(K, device=self.device) * W + self.blank * self.D).expand(n, K)
        best, idx = torch.cat([new_best, held], 1).topk(K, dim=1)
        choice = torch.cat([new_choice, held_choice], 1).gather(1, idx)
        expand = torch.zeros(n, K, dtype=torch.bool, device=self.device).scatter_(1, e_rows, e_live)
        return best, choice, expand, fusion_rows, next_fstate

    def _advance_cpu(self, s: BeamState, n: int, best: torch.Tensor, choice: torch.Tensor, W: int,
                     expand: torch.Tensor) -> int:
        """The bookkeeping of :meth:`_step` after the ``topk`` by :mod:`asrprec.decoding.batched_beam_cpu`."""
        state, pairs = self._arrays
        src = torch.empty(n, self.K, dtype=torch.int64)
        emit = torch.empty(n, self.K, dtype=torch.bool)
        live = advance_kernel()(best.numpy(), choice.numpy(), W, expand.numpy(), *state, *pairs, self.S, self.blank,
                                self.V,
                                self.drop, src.numpy(), emit.numpy())
        s.score[:n] = best  # the kernel wrote the merged scores into it
        dec = None
        if self._cache is None:
            dec = s.dec.view(-1, s.dec.shape[-1]).index_select(0, (s.hyp0[:n] + src).view(-1)).view(n, self.K, -1)
        s.dec[:n] = self._decode(dec, s.ints[:n, :, _CTX], emit)
        return live

    def _decode(self, dec: torch.Tensor | None, ctx: torch.Tensor, emit: torch.Tensor) -> torch.Tensor:
        """(n, K, J) decoder outputs of the contexts ``ctx`` (n, K); ``dec`` (n, K, J) holds those of the
        hypotheses that did not emit (None: every context comes from the cache)."""
        n, K = ctx.shape
        if self._static:  # every row
            new = self.model.project_decoder((ctx.view(-1, 1) // self.place % self.V)).view(n, K, -1)
            return torch.where(emit[..., None], new, dec)
        if self._cache is None:  # the emitting rows
            took = emit.view(-1).nonzero().squeeze(1)
            if not took.numel():
                return dec
            c = ctx.view(-1).index_select(0, took)[:, None] // self.place % self.V
            return dec.view(n * K, -1).index_copy(0, took, self.model.project_decoder(c)).view(n, K, -1)
        ids = ctx.view(-1)
        fresh = ids[~self._known[ids]]
        if fresh.numel():
            fresh = fresh.unique()
            self._cache[fresh] = self.model.project_decoder(fresh[:, None] // self.place % self.V)
            self._known[fresh] = True
        return self._cache.index_select(0, ids).view(n, K, -1)

    # -- CUDA graphs ------------------------------------------------------------------------------
    def _capture(self, s: BeamState):
        """Capture one step on all rows as a CUDA graph (torch.cuda.graph), or None after a failed capture when
        graphs were not required."""
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            # warm-up on a side stream before capture (torch.cuda.graphs docs); _reset rewrites the state after
            with torch.cuda.stream(stream), autocast_without_cache(self.device.type):
                for _ in range(2):
                    self._reset(s)
                    self._step(s, s.enc.shape[0])
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with autocast_without_cache(self.device.type), torch.cuda.graph(graph, stream=stream):
                self._step(s, s.enc.shape[0])
            return graph
        except Exception as e:  # a model op that cannot be captured
            if self._required:
                raise RuntimeError(f"CUDA-graph capture of malsd_batch failed: {e}") from e
            log.warning("malsd_batch runs without CUDA graphs: capture failed (%s)", e)
            self.use_cuda_graphs = self._static = False
            return None


def malsd_beam_search(model: nn.Module, encoder_out: torch.Tensor, encoder_out_lens: torch.Tensor, beam: int = 4,
                      max_sym_per_frame: int = 1, *, length_norm: bool = True, fusion: BatchFusion | None = None,
                      return_scores: bool = False, static_shapes: bool | None = None, return_results: bool = False,
                      use_cuda_graphs: bool | None = False,
                      ) -> list[list[int]] | tuple[list[list[int]], list[float]] | list[DecodingResult]:
    """Batched ALSD beam search over an RNN-T or TDT transducer (the rules in the module docstring).

    Args:
        model: a transducer (:class:`~asrprec.decoding.SearchableTransducer`); a TDT model
            (``model.durations``) is searched over (label, duration) pairs. Any precision.
        encoder_out: (B, T, D_enc) from ``model.encode``. encoder_out_lens: (B,) integer valid frames (0 allowed).
        beam: hypotheses per utterance (>= 1; TDT: per frame). max_sym_per_frame: labels per frame (>= 1).
        length_norm: final choice by ``score / (context_size + len(tokens))`` (icefall) or by raw score.
        fusion: LM / LODR / phrase bonuses for non-blank labels (:mod:`asrprec.decoding.fusion`); an unfinished phrase
            gives its bonus back before the final choice.
        return_scores: also return the chosen hypotheses' scores (float64 sums of fp32 log-probabilities).
        static_shapes: compute every hypothesis at every step (the default on CUDA) instead of only those that move
            (the default elsewhere); the same results.
        return_results: return B :class:`~asrprec.decoding.DecodingResult`: each token's frame (where the chosen
            hypothesis emitted it), a TDT model's durations (of the chosen (label, duration) pairs), the score.
        use_cuda_graphs: see :class:`MalsdBeamSearch` (a one-off call would capture anew for every batch, so off
            by default here; to decode many batches with graphs, keep one :class:`MalsdBeamSearch`).
    Returns:
        B token-id lists in the input order (and, with ``return_scores``, B floats).
    """
    device = model_device(model)
    static = device.type == "cuda" if static_shapes is None else bool(static_shapes)
    search = MalsdBeamSearch(model, beam, max_sym_per_frame, length_norm=length_norm,
                             use_cuda_graphs=use_cuda_graphs, static_shapes=static)
    return search(encoder_out, encoder_out_lens, fusion=fusion, return_scores=return_scores,
                  return_results=return_results)
