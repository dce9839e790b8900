"""Padding masks of padded batches, and the per-utterance feature normalisation that needs them."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["FEATURE_NORMS", "check_feature_norm", "make_pad_mask", "utterance_mean_norm"]

#: the encoders' ``feature_norm`` values: ``"none"``, or ``"utterance"`` (:func:`utterance_mean_norm` first)
FEATURE_NORMS = ("none", "utterance")


def make_pad_mask(lens: Tensor, max_len: int) -> Tensor:
    """(B,) integer lengths -> (B, max_len) bool mask, True at padded positions (``t >= lens[b]``)."""
    return torch.arange(max_len, device=lens.device).unsqueeze(0) >= lens.unsqueeze(1)


def utterance_mean_norm(features: Tensor, feature_lens: Tensor) -> Tensor:
    """Cepstral mean normalisation of log-mel features, per utterance: each bin minus its mean over the
    utterance's valid frames; padded frames become 0. (B, T, F), (B,) -> (B, T, F).

    The classic channel and speaker normalisation of front-ends that see whole utterances (Kaldi's
    ``apply-cmvn --norm-vars=false`` with per-utterance statistics); it needs the whole utterance, so a
    streaming model cannot use it.
    """
    valid = ~make_pad_mask(feature_lens, features.shape[1])  # (B, T)
    weights = valid.unsqueeze(-1).to(features.dtype)
    mean = (features * weights).sum(1, keepdim=True) / feature_lens.clamp(min=1).to(features.dtype)[:, None, None]
    return (features - mean) * weights


def check_feature_norm(feature_norm: str, *, causal: bool = False) -> str:
    """``feature_norm`` if it is one of :data:`FEATURE_NORMS` (and whole-utterance statistics suit the model);
    a ValueError naming the choices otherwise."""
    if feature_norm not in FEATURE_NORMS:
        raise ValueError(f"feature_norm must be one of {', '.join(FEATURE_NORMS)}, got {feature_norm!r}")
    if causal and feature_norm == "utterance":
        raise ValueError("feature_norm 'utterance' needs the whole utterance, which a causal (streaming) model does "
                         "not see: use feature_norm 'none' with --causal")
    return feature_norm
