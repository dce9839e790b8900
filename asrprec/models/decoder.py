"""Stateless prediction network: an embedding of the last ``context_size`` tokens and a grouped conv.

Follows the stateless decoder of Ghodsi et al. 2020 as used by icefall
(k2-fsa/icefall egs/librispeech/ASR/zipformer/decoder.py): Embedding(V, D), then a Conv1d over the
context with groups D/4 and no bias, then ReLU. No recurrence, so decoding needs no state but the last
``context_size`` tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Decoder(nn.Module):
    """Stateless transducer decoder.

    Args:
        vocab_size: V, blank included.
        decoder_dim: D, the embedding and output width.
        blank_id: the blank token, also used as the start-of-sequence context.
        context_size: how many previous tokens the decoder sees (1 = bigram-free, 2 = icefall's default).
    """

    def __init__(self, vocab_size: int, decoder_dim: int, blank_id: int = 0, context_size: int = 2):
        super().__init__()
        if context_size < 1:
            raise ValueError(f"context_size must be >= 1, got {context_size}")
        if not 0 <= blank_id < vocab_size:
            raise ValueError(f"blank_id {blank_id} is outside the vocabulary [0, {vocab_size})")
        self.vocab_size = vocab_size
        self.decoder_dim = decoder_dim
        self.blank_id = blank_id
        self.context_size = context_size
        self.embedding = nn.Embedding(vocab_size, decoder_dim)
        if context_size > 1:
            groups = decoder_dim // 4 if decoder_dim % 4 == 0 else 1
            self.conv = nn.Conv1d(decoder_dim, decoder_dim, kernel_size=context_size, groups=groups, bias=False)
        else:
            self.conv = None

    @property
    def output_dim(self) -> int:
        return self.decoder_dim

    def forward(self, y: torch.Tensor, need_pad: bool = True) -> torch.Tensor:
        """Decoder output for every position of ``y``.

        Legend: N sequences, U positions, D ``decoder_dim``.

        Args:
            y: (N, U) int64 token ids; negative ids (padding) are treated as blank.
            need_pad: True in training (left-pad with ``context_size - 1`` blanks so every position is
                produced); False in decoding, where ``y`` holds exactly ``context_size`` tokens per row.
        Returns:
            (N, U) → (N, U, D) when ``need_pad``, else (N, U - context_size + 1, D), in the parameters' dtype.
        """
        if y.dim() != 2:
            raise ValueError(f"decoder input must be (N, U) token ids, got shape {tuple(y.shape)}")
        y = y.masked_fill(y < 0, self.blank_id)
        emb = self.embedding(y)  # (N, U, D)
        if self.conv is not None:
            x = emb.transpose(1, 2)
            if need_pad:
                x = F.pad(x, (self.context_size - 1, 0))
            elif y.size(1) < self.context_size:
                raise ValueError(
                    f"decoder got {y.size(1)} context tokens with need_pad=False; it needs {self.context_size}"
                )
            emb = self.conv(x).transpose(1, 2)
        return F.relu(emb)
