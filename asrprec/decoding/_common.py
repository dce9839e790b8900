"""Shared plumbing of the transducer decoders: the interface they search through, input checks, length
bookkeeping, fp32 log-softmax.

Legend: B utterances, T encoder frames, D_enc encoder width, J joiner width, V vocabulary (blank
included), K durations, N rows (utterances or hypotheses) in one joiner call, C the decoder's context size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from asrprec.precision import fp32_island


class SearchableTransducer(Protocol):
    """What a transducer search reads of a model (:class:`asrprec.models.Transducer` implements it).

    The searches project the encoder output once, run the decoder only when a hypothesis gains a token, and join
    the two projections on every (frame, hypothesis) pair they score (torchaudio's ``RNNT`` transcribe / predict /
    join split, pytorch/audio ``torchaudio/models/rnnt.py``)."""

    @property
    def blank_id(self) -> int: ...

    @property
    def vocab_size(self) -> int:
        """V, the token logits (blank included)."""

    @property
    def context_size(self) -> int:
        """C, the tokens the decoder sees."""

    @property
    def durations(self) -> tuple[int, ...]:
        """The TDT durations (frames) of the joiner's duration head; ``()`` for an RNN-T joiner."""

    def project_encoder(self, encoder_out: torch.Tensor) -> torch.Tensor:
        """(..., D_enc) any float dtype → (..., J)."""

    def project_decoder(self, contexts: torch.Tensor) -> torch.Tensor:
        """(N, C) int64 token contexts → (N, J) projected decoder output."""

    def join_projected(self, encoder_proj: torch.Tensor, decoder_proj: torch.Tensor) -> torch.Tensor:
        """Broadcastable (..., J) and (..., J) → (..., V + K) logits (K = len(durations))."""


def check_inputs(encoder_out: torch.Tensor, encoder_out_lens: torch.Tensor) -> None:
    if encoder_out.dim() != 3:
        raise ValueError(
            f"encoder_out must be (B, T, D_enc), got shape {tuple(encoder_out.shape)}; "
            "for one utterance use encoder_out.unsqueeze(0)"
        )
    B, T = encoder_out.shape[:2]
    if encoder_out_lens.shape != (B,):
        raise ValueError(f"encoder_out_lens must have shape ({B},), got {tuple(encoder_out_lens.shape)}")
    if encoder_out_lens.dtype.is_floating_point or encoder_out_lens.dtype == torch.bool:
        raise ValueError(f"encoder_out_lens must be an integer tensor, got {encoder_out_lens.dtype}")
    if B and (int(encoder_out_lens.min()) < 0 or int(encoder_out_lens.max()) > T):
        raise ValueError(
            f"encoder_out_lens must lie in [0, T={T}], got min {int(encoder_out_lens.min())} "
            f"max {int(encoder_out_lens.max())}; pass the lengths returned by model.encode()"
        )


@dataclass
class SortedBatch:
    """Utterances sorted by decreasing length, so the ones still active at frame t are a prefix.

    This is the bookkeeping of ``torch.nn.utils.rnn.pack_padded_sequence`` (which icefall uses), done by
    hand because packing rejects zero-length utterances, which decoding must accept.

    Attributes:
        encoder_proj: (B, T, J) the joiner's encoder projection of the sorted encoder output.
        batch_sizes: ``batch_sizes[t]`` = number of utterances with more than t frames (non-increasing).
        order: (B,) ``order[i]`` is the original index of sorted utterance i.
    """

    encoder_proj: torch.Tensor
    batch_sizes: list[int]
    order: list[int]

    def unsort(self, results: list) -> list:
        out: list = [None] * len(results)
        for i, orig in enumerate(self.order):
            out[orig] = results[i]
        return out


def sort_and_project(model: SearchableTransducer, encoder_out: torch.Tensor, encoder_out_lens: torch.Tensor) -> SortedBatch:
    check_inputs(encoder_out, encoder_out_lens)
    lens = encoder_out_lens.detach().to("cpu", torch.int64)
    order = torch.argsort(lens, descending=True, stable=True)
    lens_sorted = lens[order]
    T_max = int(lens_sorted[0]) if len(lens_sorted) else 0
    batch_sizes = (lens_sorted[None, :] > torch.arange(T_max)[:, None]).sum(dim=1).tolist()
    x = encoder_out.index_select(0, order.to(encoder_out.device))
    return SortedBatch(encoder_proj=model.project_encoder(x), batch_sizes=batch_sizes, order=order.tolist())


@fp32_island
def log_softmax_fp32(logits: torch.Tensor) -> torch.Tensor:
    """(N, V) logits in any dtype → (N, V) float32 log-probabilities (bf16 log-softmax loses ~3 digits)."""
    return logits.log_softmax(dim=-1)


def model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def graph_mode(device: torch.device, use_cuda_graphs: bool | None, static_shapes: bool | None) -> tuple[bool, bool]:
    """``(use_cuda_graphs, static_shapes)`` of a search's arguments: graphs on CUDA by default, static shapes with
    graphs by default; a ValueError names the fix for graphs off CUDA or graphs without static shapes."""
    if use_cuda_graphs and device.type != "cuda":
        raise ValueError(
            f"use_cuda_graphs=True needs a model on a CUDA device, but it is on {device}. "
            "Fix: move the model to CUDA, or pass use_cuda_graphs=None (capture only on CUDA)."
        )
    graphs = device.type == "cuda" if use_cuda_graphs is None else bool(use_cuda_graphs)
    static = graphs if static_shapes is None else bool(static_shapes)
    if graphs and not static:
        raise ValueError("CUDA graphs need static_shapes=True (or None)")
    return graphs, static
