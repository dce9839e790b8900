"""Conv2d front-end: 100 Hz filterbank frames -> 25 Hz model frames (4x subsampling).

Structure follows k2-fsa/icefall ``egs/librispeech/ASR/pruned_transducer_stateless2/conformer.py``
(``Conv2dSubsampling``, itself after ESPnet's): a 3x3 conv with padding 1 and stride 1, then two 3x3
convs with stride 2 and no padding, each followed by ActivationBalancer + DoubleSwish; the channels x
remaining frequency bins are flattened and projected to the model dim, then BasicNorm (fixed eps).

Length formula. The first conv keeps the length (padding 1); each unpadded stride-2 3x3 conv maps
n -> (n - 3)//2 + 1 = (n - 1)//2. Hence

    T' = ((T - 1)//2 - 1)//2          (T >= 7 gives T' >= 1)

and the same for the frequency axis: F' = ((F - 1)//2 - 1)//2 (19 for F = 80).

The convolutions run channels-last (see :class:`ScaledConv2d`; faster on CPU, same values).

Deviation from icefall: given lengths, padded input frames are zeroed before the convolutions, so an
utterance's outputs do not depend on the value the collate function padded with.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from asrprec.models.masks import check_feature_norm, utterance_mean_norm
from asrprec.models.scaling import ActivationBalancer, BasicNorm, DoubleSwish, ScaledConv2d, ScaledLinear

__all__ = ["Conv2dSubsampling", "conv2d_subsampling_output_lens", "MIN_INPUT_FRAMES"]

#: the shortest input that yields one output frame
MIN_INPUT_FRAMES = 7


def _halve(n):
    # one unpadded 3x3 stride-2 conv: (n - 3)//2 + 1 == (n - 1)//2
    return (n - 1) // 2


def conv2d_subsampling_output_lens(lens):
    """Output frame count of :class:`Conv2dSubsampling`: ``((lens - 1)//2 - 1)//2``.

    Works on ints and integer tensors (floor division; the result is < 1 for lens < 7).
    """
    return _halve(_halve(lens))


class Conv2dSubsampling(nn.Module):
    """Conv2d subsampling by 4 in time with projection to ``out_dim``.

    Args:
        num_features: input feature dim F (e.g. 80 fbank bins); must be >= 7.
        out_dim: model dim D.
        layer1_channels, layer2_channels, layer3_channels: conv channel counts (icefall: 8, 32, 128).
        feature_norm: ``"utterance"`` subtracts each utterance's mean per bin first; ``"none"`` (icefall).

    Legend: B batch, T input frames, F features, T' = ((T-1)//2 - 1)//2 output frames, D model dim.
    """

    def __init__(self, num_features: int, out_dim: int, layer1_channels: int = 8, layer2_channels: int = 32,
                 layer3_channels: int = 128, feature_norm: str = "none") -> None:
        super().__init__()
        self.feature_norm = check_feature_norm(feature_norm)  # "utterance": masks.utterance_mean_norm first
        if num_features < MIN_INPUT_FRAMES:
            raise ValueError(f"Conv2dSubsampling needs num_features >= 7 (two stride-2 3x3 convs), got {num_features}")
        self.num_features = num_features
        self.out_dim = out_dim
        self.conv = nn.Sequential(
            ScaledConv2d(1, layer1_channels, kernel_size=3, padding=1, channels_last=True),
            ActivationBalancer(channel_dim=1),
            DoubleSwish(),
            ScaledConv2d(layer1_channels, layer2_channels, kernel_size=3, stride=2, channels_last=True),
            ActivationBalancer(channel_dim=1),
            DoubleSwish(),
            ScaledConv2d(layer2_channels, layer3_channels, kernel_size=3, stride=2, channels_last=True),
            ActivationBalancer(channel_dim=1),
            DoubleSwish(),
        )
        self.freq_out = conv2d_subsampling_output_lens(num_features)
        self.out = ScaledLinear(layer3_channels * self.freq_out, out_dim)
        # eps not learned: ``out`` already has a learned scale (as in icefall).
        self.out_norm = BasicNorm(out_dim, learn_eps=False)
        # keep the output's per-channel median near zero (icefall: 0.45..0.55 positive)
        self.out_balancer = ActivationBalancer(channel_dim=-1, min_positive=0.45, max_positive=0.55)

    def forward(self, features: Tensor, feature_lens: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Subsample and project.

        Args:
            features: (B, T, F) float; T >= 7.
            feature_lens: (B,) int64 valid input frames, or None (all T valid).

        Returns:
            out: (B, T', D) in the activations' dtype, T' = ((T-1)//2 - 1)//2.
            out_lens: (B,) int64 = ((feature_lens-1)//2 - 1)//2, or None when feature_lens is None.
        """
        if features.ndim != 3 or features.shape[-1] != self.num_features:
            raise ValueError(
                f"Conv2dSubsampling expects features of shape (B, T, {self.num_features}), got {tuple(features.shape)}"
            )
        T = features.shape[1]
        if T < MIN_INPUT_FRAMES:
            raise ValueError(f"Conv2dSubsampling needs at least {MIN_INPUT_FRAMES} input frames, got T={T}")
        out_lens = None
        if self.feature_norm == "utterance":
            lens = torch.full(features.shape[:1], T) if feature_lens is None else feature_lens
            features = utterance_mean_norm(features, lens.to(features.device))
        if feature_lens is not None:
            frames = torch.arange(T, device=features.device)
            pad = frames[None, :] >= feature_lens.to(features.device)[:, None]  # (B, T) True at padding
            features = features.masked_fill(pad[..., None], 0.0)
            out_lens = conv2d_subsampling_output_lens(feature_lens)
        x = self.conv(features.unsqueeze(1))  # (B, C, T', F')
        b, c, t, f = x.shape
        x = self.out(x.transpose(1, 2).reshape(b, t, c * f))
        x = self.out_norm(x)
        x = self.out_balancer(x)
        return x, out_lens
