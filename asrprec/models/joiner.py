"""Transducer joiner: project encoder and decoder outputs to a joint space, add, tanh, project to V (+ durations)."""

from __future__ import annotations

import torch
from torch import nn


class Joiner(nn.Module):
    """``output_linear(tanh(encoder_proj(enc) + decoder_proj(dec)))``.

    The projections are separate modules so decoders and the memory-lean loss can project once and
    call ``forward(..., project_input=False)`` on every (t, u) pair.

    A token-and-duration transducer (TDT; Xu et al. 2023, arXiv 2304.06795) adds a duration head: the last
    ``len(durations)`` outputs score how many frames the emission advances, as in NeMo, whose joint network is one
    linear layer of width V + len(durations) (NVIDIA/NeMo ``nemo/collections/asr/modules/rnnt.py``,
    ``RNNTJoint`` with ``num_extra_outputs``). One layer keeps the logits in the layout ``asrprec.losses.tdt_loss``
    reads.

    Args:
        encoder_dim: D_enc. decoder_dim: D_dec. joiner_dim: J, the hidden width. vocab_size: V.
        durations: the TDT durations (frames, ascending, distinct, >= 0), or ``()`` for an RNN-T joiner.
    """

    def __init__(self, encoder_dim: int, decoder_dim: int, joiner_dim: int, vocab_size: int,
                 durations: tuple[int, ...] | list[int] = ()):
        super().__init__()
        durations = tuple(int(d) for d in durations)
        if durations and (any(d < 0 for d in durations) or list(durations) != sorted(set(durations))
                          or max(durations) == 0):
            raise ValueError(f"durations must be distinct non-negative frame counts in ascending order with at least "
                             f"one above 0 (e.g. 0,1,2,3,4), got {durations}")
        self.encoder_proj = nn.Linear(encoder_dim, joiner_dim)
        self.decoder_proj = nn.Linear(decoder_dim, joiner_dim)
        self.output_linear = nn.Linear(joiner_dim, vocab_size + len(durations))
        # Start the projections small so tanh starts in its linear range: otherwise the decoder (which
        # learns the token prior fastest) saturates tanh and the encoder's gradient vanishes, leaving a
        # model that only knows the prior. icefall uses ScaledLinear(initial_scale=0.25) for the same
        # reason (k2-fsa/icefall egs/librispeech/ASR/zipformer/joiner.py).
        with torch.no_grad():
            for lin in (self.encoder_proj, self.decoder_proj):
                lin.weight.mul_(0.25)
                lin.bias.mul_(0.25)
        self.joiner_dim = joiner_dim
        self.vocab_size = vocab_size
        self.durations = durations

    def forward(self, encoder_out: torch.Tensor, decoder_out: torch.Tensor, project_input: bool = True) -> torch.Tensor:
        """Joint logits.

        Args:
            encoder_out: (..., D_enc), or (..., J) when ``project_input`` is False.
            decoder_out: (..., D_dec), or (..., J); broadcastable against ``encoder_out``
                (e.g. (B, T, 1, ·) with (B, 1, U+1, ·) gives the full lattice).
        Returns:
            (..., V) unnormalised logits, in the compute dtype (autocast or the parameters' dtype); a TDT joiner's
            (..., V + len(durations)): token logits (blank included), then duration logits.
        """
        if project_input:
            encoder_out = self.encoder_proj(encoder_out)
            decoder_out = self.decoder_proj(decoder_out)
        return self.output_linear(torch.tanh(encoder_out + decoder_out))
