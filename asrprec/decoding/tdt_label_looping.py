"""Label-looping greedy search for token-and-duration transducers (TDT), with CUDA graphs on a GPU.

NeMo's algorithm for TDT (NVIDIA/NeMo ``nemo/collections/asr/parts/submodules/tdt_loop_labels_computer.py``,
``GreedyBatchedTDTLoopLabelsComputer``): one frame pointer per utterance; each *outer* step emits one label for every
active utterance and runs the decoder once for all of them; before it, an *inner* loop moves the utterances whose
best token is blank forward by their predicted duration (at least one frame), one joiner call per move, until each
has a label or has run out of frames. After a label the pointer jumps by the label's duration (0 stays on the
frame; ``max_sym_per_frame`` labels on one frame move it one frame on, NeMo's "force blank").

The state, the two loop bodies and their CUDA-graph capture are those of :class:`asrprec.decoding.LabelLoopingGreedy`
(see :mod:`asrprec.decoding.label_looping`), with each row's pending jump added; the RNN-T search's look-ahead window
does not apply (a blank's jump is only known once its frame has been evaluated), so each inner step moves one jump,
as NeMo's does. The decisions are :func:`asrprec.decoding.tdt_greedy_search`'s (the rules in :mod:`asrprec.decoding.tdt`,
which keep a token whose jump passes the last frame, where NeMo's computer drops it), so both return the same tokens
and timestamps up to floating-point differences between joiner calls on different numbers of rows (argmax ties).

Legend: B utterances, T encoder frames, D_enc encoder width, J joiner width, K durations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .label_looping import LabelLoopingGreedy, LoopState
from .tdt import TDT_MAX_SYM_PER_FRAME, best_token_and_jump, tdt_durations

__all__ = ["TdtLabelLoopingGreedy", "tdt_label_looping_greedy_search"]


@dataclass
class TdtLoopState(LoopState):
    """:class:`asrprec.decoding.label_looping.LoopState` plus, per row, the jump of its current label (``jump``,
    (B_cap,): the label's duration, at least 1 for blank), the joiner evaluations so far (``joiner_steps``), the
    duration table (``durations``, (K,)) and each emitted label's duration (``durs``, beside ``tokens``)."""

    jump: torch.Tensor = None
    joiner_steps: torch.Tensor = None
    durations: torch.Tensor = None
    durs: torch.Tensor = None


class TdtLabelLoopingGreedy(LabelLoopingGreedy):
    """Label-looping TDT greedy search bound to one model, keeping its state (and CUDA graphs) between calls.

    Args:
        model: a TDT transducer (``model.durations`` non-empty), any precision.
        max_sym_per_frame: at most this many tokens on one frame (>= 1).
        use_cuda_graphs, static_shapes: as for :class:`asrprec.decoding.LabelLoopingGreedy`.

    After a call, :meth:`frame_stats` gives the frames and joiner evaluations of the batch just decoded.
    """

    _has_durations = True

    def __init__(self, model: nn.Module, max_sym_per_frame: int = TDT_MAX_SYM_PER_FRAME, *,
                 use_cuda_graphs: bool | None = None, static_shapes: bool | None = None):
        super().__init__(model, max_sym_per_frame, use_cuda_graphs=use_cuda_graphs, window=1,
                         static_shapes=static_shapes)
        self.durations = tdt_durations(model)
        self.vocab = model.vocab_size
        self._batch = 0

    def __call__(self, encoder_out: torch.Tensor, encoder_out_lens: torch.Tensor, *, return_timestamps: bool = False,
                 return_results: bool = False):
        """Decode a batch: encoder_out (B, T, D_enc) any float dtype, encoder_out_lens (B,) integer (0 allowed).

        Returns B token-id lists in the input order; with ``return_timestamps``, ``(tokens, timestamps)``; with
        ``return_results``, B :class:`~asrprec.decoding.DecodingResult` with each token's frame and duration."""
        self._batch = encoder_out.shape[0]
        self._last_lens = encoder_out_lens.detach().to("cpu", torch.int64)
        return super().__call__(encoder_out, encoder_out_lens, return_timestamps=return_timestamps,
                                return_results=return_results)


    def frame_stats(self) -> dict[str, int]:
        """``frames`` (valid encoder frames) and ``joiner_steps`` (joiner evaluations) of the last batch: frames per
        step = frames / joiner_steps (1 frame per blank step and 0 per token step for an RNN-T search without
        look-ahead)."""
        if self.state is None or not self._batch:
            return {"frames": 0, "joiner_steps": 0}
        return {"frames": int(self._last_lens.sum()), "joiner_steps": int(self.state.joiner_steps[: self._batch].sum())}

    # -- state ------------------------------------------------------------------------------------
    def _allocate(self, B: int, T: int, enc: torch.Tensor) -> TdtLoopState:
        base = super()._allocate(B, T, enc)
        fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
        return TdtLoopState(**fields, jump=torch.zeros(B, dtype=torch.int64, device=self.device),
                            joiner_steps=torch.zeros(B, dtype=torch.int64, device=self.device),
                            durations=torch.tensor(self.durations, dtype=torch.int64, device=self.device),
                            durs=torch.zeros_like(base.tokens))

    # -- the loop ---------------------------------------------------------------------------------
    def _predict(self, s: TdtLoopState, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N,) best token and its jump for ``rows`` at their current frame (clamped for finished rows)."""
        frames = torch.clamp(s.t.index_select(0, rows), max=s.enc.shape[1] - 1)
        logits = self.model.join_projected(s.enc[rows, frames], s.dec.index_select(0, rows))
        return best_token_and_jump(logits, self.vocab, s.durations, self.blank)

    def _update_labels(self, s: TdtLoopState, rows: torch.Tensor, moved: torch.Tensor) -> None:
        """New label and jump for the ``moved`` rows among ``rows`` (a mask over ``rows``); count their steps."""
        labels, jumps = self._predict(s, rows)
        s.labels.index_copy_(0, rows, torch.where(moved, labels, s.labels.index_select(0, rows)))
        s.jump.index_copy_(0, rows, torch.where(moved, jumps, s.jump.index_select(0, rows)))
        s.joiner_steps.index_add_(0, rows, (moved & s.active.index_select(0, rows)).long())

    def _reset(self, s: TdtLoopState) -> None:
        self._restart(s)
        s.joiner_steps.zero_()
        labels, jumps = self._predict(s, s.rows)
        s.labels.copy_(labels)
        s.jump.copy_(jumps)
        s.joiner_steps.add_(s.active.long())
        self._after_labels(s)

    def _inner(self, s: TdtLoopState) -> None:
        """Rows whose label is blank jump by its duration and take the label at their new frame (same decoder
        output: it changes only when a label is emitted)."""
        rows = self._rows(s, s.blank_mask)
        m = s.blank_mask.index_select(0, rows)
        s.t.index_copy_(0, rows, s.t.index_select(0, rows) + torch.where(m, s.jump.index_select(0, rows), 0))
        s.sym.masked_fill_(s.blank_mask, 0)
        torch.lt(s.t, s.lens, out=s.active)
        self._update_labels(s, rows, m)
        self._after_labels(s)

    def _record_labels(self, s: TdtLoopState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The base class's, and each emitted label's duration (its jump: a label's is not clamped) beside it."""
        col = torch.where(s.active, s.n_out, s.durs.shape[1] - 1)[:, None]
        s.durs.scatter_(1, col, s.jump[:, None])
        return super()._record_labels(s)

    def _emit(self, s: TdtLoopState) -> None:
        """Every active row emits its label at its frame; the decoder advances for those rows; each row jumps by
        the label's duration (a duration 0 stays, unless it is the ``max_sym_per_frame``-th label on the frame:
        then one frame on); then the next labels are found."""
        a, rows, emitting = self._record_labels(s)
        stay = a & (s.jump == 0)
        s.sym.add_(stay)
        capped = stay & (s.sym >= self.max_sym)
        s.t.add_(torch.where(a & ~stay, s.jump, 0) + capped)
        s.sym.masked_fill_((a & ~stay) | capped, 0)
        torch.lt(s.t, s.lens, out=s.active)
        self._update_labels(s, rows, emitting)
        self._after_labels(s)


def tdt_label_looping_greedy_search(model: nn.Module, encoder_out: torch.Tensor, encoder_out_lens: torch.Tensor,
                                    max_sym_per_frame: int = TDT_MAX_SYM_PER_FRAME, *,
                                    return_timestamps: bool = False,
                                    use_cuda_graphs: bool | None = None, return_results: bool = False,
                                    ) -> list[list[int]] | tuple[list[list[int]], list[list[int]]] | list:
    """TDT greedy decoding of a batch by label looping (same results as :func:`asrprec.decoding.tdt_greedy_search`).

    Args:
        model: a TDT transducer, any precision. encoder_out: (B, T, D_enc). encoder_out_lens: (B,) integer (0 allowed).
        max_sym_per_frame: at most this many tokens on one frame (>= 1).
        return_timestamps: also return each token's frame. use_cuda_graphs: see :class:`TdtLabelLoopingGreedy`.
        return_results: return B :class:`~asrprec.decoding.DecodingResult` (tokens, frames, durations).
    Returns:
        B token-id lists in the input order; with ``return_timestamps``, ``(tokens, timestamps)``.
    """
    search = TdtLabelLoopingGreedy(model, max_sym_per_frame, use_cuda_graphs=use_cuda_graphs)
    return search(encoder_out, encoder_out_lens, return_timestamps=return_timestamps, return_results=return_results)
