"""Label-looping greedy search for transducers: batched, with every loop variable in preallocated tensors.

Algorithm: Bataev et al., "Label-Looping: Highly Efficient Decoding for Transducers" (arXiv 2406.06220);
NVIDIA/NeMo implements it in ``nemo/collections/asr/parts/submodules/transducer_decoding/rnnt_label_looping.py``.
Frame-looping greedy search (:func:`asrprec.decoding.greedy_search`) moves the whole batch through frame t
together and, on each frame, loops while some utterance keeps emitting. Label looping instead keeps one frame
pointer per utterance: each *outer* step emits exactly one label for every active utterance; before it, an
*inner* loop moves the pointers of the utterances whose argmax is blank forward one frame at a time until every
active utterance has found a label (or run out of frames). The decoder then runs once, on all rows at once.

The decisions are those of frame-looping greedy search: on a frame, emit the argmax while it is not blank, at
most ``max_sym_per_frame`` times, then move to the next frame (a blank, or the cap, moves on). So both return
the same tokens and the same timestamps (the frame that emitted each token), up to floating-point differences
between joiner calls on different numbers of rows, which only matter at exact argmax ties.

Blank runs: a row's decoder output does not change while it consumes blanks, so the inner step looks at the
next ``window`` frames of every blank row in one joiner call and moves each row to its first non-blank frame
(``window=1`` is NeMo's one frame per step). Larger steps, fewer of them; the decisions are unchanged.

State: frame pointers, per-frame symbol counts, activity and blank masks, decoder contexts and outputs, and
(B, T·max_sym_per_frame) token and timestamp buffers are allocated before the loop and updated in place, so the
two loop bodies (the inner blank step and the outer emit step) can run with static shapes and addresses. On a
CUDA device each body is captured once as a CUDA graph and replayed, computing every row at every step; the host
reads only two flags (any active utterance? any blank left?) between replays, which is NeMo's "no_while_loops"
CUDA-graph mode (NVIDIA/NeMo PR #8972). Elsewhere the same bodies run eagerly on only the rows that move.

Legend: B utterances, T encoder frames, D_enc encoder width, J joiner width, C the decoder's context size,
V vocabulary (blank included).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

import torch
from torch import nn

from asrprec.precision.islands import autocast_dtype, autocast_without_cache

from ._common import graph_mode, model_device, sort_and_project
from .fusion import BatchFusion, fused_greedy_tokens
from .hypothesis import DecodingResult, results_of

log = logging.getLogger(__name__)

#: the two implementations of greedy_search (the same decisions): label looping (this module) is the default
GREEDY_METHODS = ("label_looping", "frame_looping")
DEFAULT_GREEDY_METHOD = "label_looping"


@dataclass
class LoopState:
    """The loop's variables, preallocated for up to ``B_cap`` utterances of up to ``T_cap`` frames.

    Attributes:
        enc: (B_cap, T_cap, J) projected encoder output (rows past the batch are zero and inactive).
        lens: (B_cap,) valid frames. rows: (B_cap,) ``arange``, the row index of the frame gather.
        t: (B_cap,) each utterance's current frame. sym: (B_cap,) labels emitted on that frame so far.
        active: (B_cap,) ``t < lens``. labels: (B_cap,) the argmax at (t, current decoder output).
        blank_mask: (B_cap,) active rows whose argmax is blank (the inner loop's rows).
        window: (W,) ``1 .. W``, the frame offsets the inner step scans at once.
        contexts: (B_cap, C) decoder input tokens. dec: (B_cap, J) projected decoder output; dec0 its start value.
        tokens, stamps: (B_cap, T_cap·max_sym + 1) emitted labels and their frames; the last column takes the
            writes of inactive rows. n_out: (B_cap,) labels emitted per row.
        flags: (2,) bool ``[any active, any blank_mask]``, read by the host after each step.
    """

    enc: torch.Tensor
    lens: torch.Tensor
    rows: torch.Tensor
    t: torch.Tensor
    sym: torch.Tensor
    active: torch.Tensor
    labels: torch.Tensor
    blank_mask: torch.Tensor
    window: torch.Tensor
    contexts: torch.Tensor
    dec: torch.Tensor
    dec0: torch.Tensor
    tokens: torch.Tensor
    stamps: torch.Tensor
    n_out: torch.Tensor
    flags: torch.Tensor

    def data_ptrs(self) -> dict[str, int]:
        """Storage address of every tensor (the loop must leave them unchanged: a CUDA graph replays on them)."""
        return {f.name: getattr(self, f.name).data_ptr() for f in fields(self)}


class LabelLoopingGreedy:
    """Label-looping greedy search bound to one model, keeping its state (and CUDA graphs) between calls.

    Reuse one instance for many batches: on a GPU the graphs are captured on the first call and replayed for
    every later batch that fits the allocated size (a larger batch reallocates and captures again).

    Args:
        model: a transducer (:class:`~asrprec.decoding.SearchableTransducer`); any
            precision (fp32, a cast model, or called under autocast).
        max_sym_per_frame: at most this many tokens per frame (>= 1).
        use_cuda_graphs: ``None`` captures CUDA graphs when the model is on a CUDA device and runs eagerly
            elsewhere (or when capture fails, with a warning); ``True`` requires them (an error on CPU);
            ``False`` never captures.
        window: frames the inner step scans at once (1 = one frame per step, as NeMo's inner loop). The decoder
            output of a row does not change while it consumes blanks, so the argmax of its next ``window``
            frames comes from one joiner call; the row moves to the first non-blank one. Fewer, larger steps.
        static_shapes: run every step on all rows (fixed shapes and addresses, what a CUDA graph replays;
            the default with graphs) instead of only on the rows that move (the default without).
    """

    _has_durations = False  # results with durations (TDT, whose state has ``durs``)

    def __init__(self, model: nn.Module, max_sym_per_frame: int = 1, *, use_cuda_graphs: bool | None = None,
                 window: int = 8, static_shapes: bool | None = None):
        if not isinstance(max_sym_per_frame, int) or max_sym_per_frame < 1:
            raise ValueError(f"max_sym_per_frame must be an integer >= 1, got {max_sym_per_frame!r}")
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        self.window = window
        self.model = model
        self.max_sym = max_sym_per_frame
        self.blank = model.blank_id
        self.device = model_device(model)
        self.use_cuda_graphs, self._static = graph_mode(self.device, use_cuda_graphs, static_shapes)
        self._required = bool(use_cuda_graphs)
        self.state: LoopState | None = None
        self._graphs: tuple | None = None
        self._key: tuple | None = None
        self._fusion: BatchFusion | None = None  # the batch's LM / phrase fusion (eager only)
        self._fstate: torch.Tensor | None = None  # (B_cap, 4) fusion states
        self._order: torch.Tensor | None = None  # (B,) the sorted rows' input indices

    @torch.no_grad()
    def __call__(
        self, encoder_out: torch.Tensor, encoder_out_lens: torch.Tensor, *, return_timestamps: bool = False,
        fusion: BatchFusion | None = None, return_results: bool = False,
    ) -> list[list[int]] | tuple[list[list[int]], list[list[int]]] | list[DecodingResult]:
        """Decode a batch: encoder_out (B, T, D_enc) any float dtype, encoder_out_lens (B,) integer (0 allowed).

        ``fusion``: LM / LODR / phrase bonuses (:mod:`asrprec.decoding.fusion`; the blank decision stays the acoustic
        model's). A batch with fusion runs eagerly, without CUDA graphs (its tables change from batch to batch).

        Returns B token-id lists in the input order (no blanks, no start context); with ``return_timestamps``,
        ``(tokens, timestamps)`` where ``timestamps[b][i]`` is the encoder frame that emitted ``tokens[b][i]``; with
        ``return_results``, B :class:`~asrprec.decoding.DecodingResult` (a TDT search's with durations).
        """
        batch = sort_and_project(self.model, encoder_out, encoder_out_lens)
        B, T = encoder_out.shape[:2]
        if B == 0 or T == 0:
            empty = [[] for _ in range(B)]
            if return_results:
                return results_of(empty, empty, empty if self._has_durations else None)
            return (empty, [[] for _ in range(B)]) if return_timestamps else empty
        order = torch.tensor(batch.order, device=self.device)
        lens = encoder_out_lens.to(self.device, torch.int64).index_select(0, order)
        self._fusion, self._order = fusion, order
        s = self._load(batch.encoder_proj, lens)
        self._run(s)
        n = s.n_out[:B].tolist()
        width = max(n)
        toks = s.tokens[:B, :width].tolist()
        stamps = s.stamps[:B, :width].tolist()
        hyps = batch.unsort([row[:k] for row, k in zip(toks, n)])
        frames = batch.unsort([row[:k] for row, k in zip(stamps, n)])
        if return_results:
            durs = None
            if self._has_durations:  # a TDT search's state keeps each label's duration beside it
                durs = batch.unsort([row[:k] for row, k in zip(s.durs[:B, :width].tolist(), n)])
            return results_of(hyps, frames, durs)
        if return_timestamps:
            return hyps, frames
        return hyps

    # -- state ------------------------------------------------------------------------------------
    def _context_key(self, enc: torch.Tensor) -> tuple:
        return (enc.shape[-1], enc.dtype, autocast_dtype(enc), torch.is_inference_mode_enabled())

    def _load(self, enc: torch.Tensor, lens: torch.Tensor) -> LoopState:
        """Put the batch into the state (reallocating, and dropping captured graphs, when it does not fit)."""
        B, T, _ = enc.shape
        key = self._context_key(enc)
        s = self.state
        fits = s is not None and key == self._key and B <= s.enc.shape[0] and T <= s.enc.shape[1]
        if not self.use_cuda_graphs:
            fits = fits and B == s.enc.shape[0] and T == s.enc.shape[1]  # eager: no padding rows
        if not fits:
            if self.use_cuda_graphs and s is not None:
                B, T = max(B, s.enc.shape[0]), max(T, s.enc.shape[1])
            s = self.state = self._allocate(B, T, enc)
            self._key, self._graphs = key, None
        s.enc.zero_()
        s.enc[: enc.shape[0], : enc.shape[1]].copy_(enc)
        s.lens.zero_()
        s.lens[: lens.shape[0]].copy_(lens)
        if self.use_cuda_graphs and self._graphs is None and self._fusion is None:
            self._graphs = self._capture(s)
        self._reset(s)
        return s

    def _allocate(self, B: int, T: int, enc: torch.Tensor) -> LoopState:
        i64 = dict(dtype=torch.int64, device=self.device)
        boolean = dict(dtype=torch.bool, device=self.device)
        contexts = torch.full((B, self.model.context_size), self.blank, **i64)
        dec0 = self.model.project_decoder(contexts)  # (B, J) in the decoder's compute dtype
        width = T * self.max_sym + 1
        return LoopState(
            enc=torch.zeros(B, T, enc.shape[-1], dtype=enc.dtype, device=self.device),
            lens=torch.zeros(B, **i64), rows=torch.arange(B, **i64), t=torch.zeros(B, **i64),
            sym=torch.zeros(B, **i64), active=torch.zeros(B, **boolean), labels=torch.zeros(B, **i64),
            blank_mask=torch.zeros(B, **boolean), window=torch.arange(1, self.window + 1, **i64),
            contexts=contexts, dec=dec0.clone(), dec0=dec0,
            tokens=torch.zeros(B, width, **i64), stamps=torch.zeros(B, width, **i64), n_out=torch.zeros(B, **i64),
            flags=torch.zeros(2, **boolean),
        )

    # -- the loop ---------------------------------------------------------------------------------
    def _run(self, s: LoopState) -> None:
        if self._graphs is not None and self._fusion is None:
            inner, emit = (g.replay for g in self._graphs)
        else:
            inner, emit = (lambda: self._inner(s)), (lambda: self._emit(s))
        while True:
            any_active, any_blank = s.flags.tolist()  # the only host read per step
            if any_blank:
                inner()
            elif any_active:
                emit()
            else:
                break

    def _reset(self, s: LoopState) -> None:
        self._restart(s)
        s.labels.copy_(self._argmax(s, s.rows))
        self._after_labels(s)

    def _restart(self, s: LoopState) -> None:
        """Every row back on frame 0, with no output and the start context."""
        s.t.zero_()
        s.sym.zero_()
        s.n_out.zero_()
        s.contexts.fill_(self.blank)
        s.dec.copy_(s.dec0)
        torch.lt(s.t, s.lens, out=s.active)
        if self._fusion is not None:  # padding rows (past the batch) take the first utterance's start state
            rows = torch.zeros(s.enc.shape[0], dtype=torch.int64, device=self.device)
            rows[: self._order.numel()] = self._order
            self._fstate = self._fusion.start(rows)

    def _argmax(self, s: LoopState, rows: torch.Tensor) -> torch.Tensor:
        """(N,) argmax of the joiner for ``rows`` at their current frame (clamped for finished rows)."""
        frames = torch.clamp(s.t.index_select(0, rows), max=s.enc.shape[1] - 1)
        logits = self.model.join_projected(s.enc[rows, frames], s.dec.index_select(0, rows))
        if self._fusion is None:
            return logits.argmax(dim=-1)
        return fused_greedy_tokens(logits, self._fusion, self._fstate.index_select(0, rows), self.blank)

    def _after_labels(self, s: LoopState) -> None:
        torch.logical_and(s.active, s.labels == self.blank, out=s.blank_mask)
        s.flags.copy_(torch.stack([s.active.any(), s.blank_mask.any()]))

    def _rows(self, s: LoopState, mask: torch.Tensor) -> torch.Tensor:
        """The rows a step computes: all of them for a CUDA graph (static shapes), only ``mask``'s rows eagerly."""
        return s.rows if self._static else mask.nonzero().squeeze(1)

    def _inner(self, s: LoopState) -> None:
        """Rows whose label is blank look at their next ``window`` frames at once, with the decoder output they
        already have (it only changes when a label is emitted): each moves to its first frame whose argmax is
        not blank and takes that label, or past the whole window when every frame is blank."""
        rows = self._rows(s, s.blank_mask)
        W, T = s.window.numel(), s.enc.shape[1]
        frames = s.t.index_select(0, rows)[:, None] + s.window  # (N, W): t+1 .. t+W
        inside = frames < s.lens.index_select(0, rows)[:, None]
        enc = s.enc[rows[:, None], frames.clamp(max=T - 1)]  # (N, W, J)
        logits = self.model.join_projected(enc, s.dec.index_select(0, rows)[:, None])  # (N, W, V)
        found = logits.argmax(dim=-1)  # (N, W)
        if self._fusion is not None:  # the non-blank choice with the bonus of the row's (unchanged) fusion state
            bonus, _ = self._fusion.scores(self._fstate.index_select(0, rows))
            fused = logits.float() + bonus[:, None, :]
            fused[..., self.blank] = float("-inf")
            found = torch.where(found == self.blank, found, fused.argmax(dim=-1))
        hit_at = torch.where((found != self.blank) & inside, s.window, W + 1).amin(dim=1)  # 1..W, or W+1: none
        hit = hit_at <= W
        label = found.gather(1, (hit_at - 1).clamp(max=W - 1)[:, None]).squeeze(1)
        m = s.blank_mask.index_select(0, rows)
        s.t.index_copy_(0, rows, s.t.index_select(0, rows) + torch.where(m, torch.clamp(hit_at, max=W), 0))
        kept = s.labels.index_select(0, rows)
        s.labels.index_copy_(0, rows, torch.where(m, torch.where(hit, label, self.blank), kept))
        s.sym.masked_fill_(s.blank_mask, 0)
        torch.lt(s.t, s.lens, out=s.active)
        self._after_labels(s)

    def _emit(self, s: LoopState) -> None:
        """Every active row emits its (non-blank) label at its frame; the decoder advances for those rows; a
        row that reached ``max_sym_per_frame`` labels on its frame moves on; then the next labels are found."""
        a, rows, _ = self._record_labels(s)
        s.sym.add_(a)
        capped = a & (s.sym >= self.max_sym)
        s.t.add_(capped)
        s.sym.masked_fill_(capped, 0)
        torch.lt(s.t, s.lens, out=s.active)
        s.labels.index_copy_(0, rows, self._argmax(s, rows))
        self._after_labels(s)

    def _record_labels(self, s: LoopState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every active row appends its label and frame to its output, and the decoder advances for those rows.
        Returns the active mask (``s.active`` itself), the rows computed (:meth:`_rows`) and which of them emitted."""
        a = s.active
        col = torch.where(a, s.n_out, s.tokens.shape[1] - 1)[:, None]
        s.tokens.scatter_(1, col, s.labels[:, None])
        s.stamps.scatter_(1, col, s.t[:, None])
        s.n_out.add_(a)
        rows = self._rows(s, a)
        emitting = a.index_select(0, rows)
        ctx = s.contexts.index_select(0, rows)
        ctx = torch.where(emitting[:, None], torch.cat([ctx[:, 1:], s.labels.index_select(0, rows)[:, None]], dim=1),
                          ctx)
        s.contexts.index_copy_(0, rows, ctx)
        s.dec.index_copy_(0, rows, torch.where(emitting[:, None], self.model.project_decoder(ctx),
                                               s.dec.index_select(0, rows)))
        if self._fusion is not None:
            old = self._fstate.index_select(0, rows)
            new = self._fusion.step(old, torch.where(emitting, s.labels.index_select(0, rows), self.blank))[1]
            self._fstate.index_copy_(0, rows, torch.where(emitting[:, None], new, old))
        return a, rows, emitting

    # -- CUDA graphs ------------------------------------------------------------------------------
    def _capture(self, s: LoopState) -> tuple | None:
        """Capture the inner and emit steps as two CUDA graphs (torch.cuda.graph), or None after a failed
        capture when graphs were not required."""
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            # warm-up on a side stream before capture (torch.cuda.graphs docs); it changes the state, which
            # _reset rewrites before every decode
            with torch.cuda.stream(stream), self._capture_autocast():
                for _ in range(2):
                    self._reset(s)
                    self._inner(s)
                    self._emit(s)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graphs, pool = [], None
            for body in (self._inner, self._emit):
                g = torch.cuda.CUDAGraph()
                with self._capture_autocast(), torch.cuda.graph(g, pool=pool, stream=stream):
                    body(s)
                pool = g.pool()
                graphs.append(g)
            return tuple(graphs)
        except Exception as e:  # a model op that cannot be captured
            if self._required:
                raise RuntimeError(f"CUDA-graph capture of label-looping greedy search failed: {e}") from e
            log.warning("label-looping greedy search runs without CUDA graphs: capture failed (%s)", e)
            self.use_cuda_graphs = self._static = False
            return None

    def _capture_autocast(self):
        """Autocast as the caller has it, without the weight-cast cache (see the function)."""
        return autocast_without_cache(self.device.type)


def label_looping_greedy_search(model: nn.Module, encoder_out: torch.Tensor, encoder_out_lens: torch.Tensor,
                                max_sym_per_frame: int = 1, *, return_timestamps: bool = False,
                                use_cuda_graphs: bool | None = None,
                                window: int = 8, fusion: BatchFusion | None = None, return_results: bool = False,
                                ) -> list[list[int]] | tuple[list[list[int]], list[list[int]]] | list[DecodingResult]:
    """Greedy transducer decoding of a batch by label looping (same results as ``greedy_search``).

    Legend: B utterances, T encoder frames, D_enc encoder width.

    Args:
        model: a transducer (see :class:`LabelLoopingGreedy`), any precision.
        encoder_out: (B, T, D_enc) from ``model.encode``, any float dtype.
        encoder_out_lens: (B,) integer valid frames per utterance; 0 is allowed (gives ``[]``).
        max_sym_per_frame: at most this many tokens per frame (>= 1).
        return_timestamps: also return, for each token, the encoder frame that emitted it.
        use_cuda_graphs, window: see :class:`LabelLoopingGreedy`. A one-off call captures its graphs anew; to
            decode many batches, keep one :class:`LabelLoopingGreedy`.
        fusion: LM / LODR / phrase bonuses (:mod:`asrprec.decoding.fusion`).
        return_results: return B :class:`~asrprec.decoding.DecodingResult` (tokens and frames).
    Returns:
        B lists of token ids in the input order, without blanks and the start context; with
        ``return_timestamps``, ``(tokens, timestamps)``.
    """
    search = LabelLoopingGreedy(model, max_sym_per_frame, use_cuda_graphs=use_cuda_graphs, window=window)
    return search(encoder_out, encoder_out_lens, return_timestamps=return_timestamps, fusion=fusion,
                  return_results=return_results)
