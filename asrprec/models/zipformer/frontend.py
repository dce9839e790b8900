"""Zipformer front-end: Conv2d subsampling (100 Hz -> 50 Hz) with one ConvNeXt block.

Structure follows k2-fsa/icefall ``egs/librispeech/ASR/zipformer/subsampling.py`` (Conv2dSubsampling, ConvNeXt);
the code is ours. Difference (``zero_padding=True``, the default): the ConvNeXt input is zeroed at frames past
each utterance's length, so a padded batch gives the same valid frames as each utterance alone (the 7x7 conv
otherwise sees padding-derived values, as icefall's does; ``zero_padding=False`` computes what icefall computes).
Layout: channels-last from the first conv on (the CPU depthwise-conv backward is several times faster), with
the same parameters and math as icefall's NCHW code.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..masks import check_feature_norm, utterance_mean_norm
from ..schedule import FloatLike, ScheduledFloat, is_zero, schedule_value
from ..tracing import is_tracing
from .activations import SwooshR, act_dropout_linear
from .conv import conv2d, depthwise_conv2d
from .dropout import Dropout3
from .grad_shaping import Balancer, ScaleGrad, Whiten
from .linear import Linear, linear
from .norm import BiasNorm


class ConvNeXt(nn.Module):
    """Depthwise 7x7 conv -> 1x1 up (x3) -> SwooshL -> 1x1 down (init scale 0.01) -> per-sequence layer skip ->
    residual. Input/output (B, C, T, F).

    Computed in channels-last layout: oneDNN's depthwise-conv backward is several times faster on CPU with
    channels-last than with NCHW, and the 1x1 convs become plain matmuls over the channel dim, so SwooshL and
    the second 1x1 conv can use the fused :func:`act_dropout_linear` (only the pre-activation is saved; icefall
    saves SwooshL's 8-bit derivative and its output). Parameters are those of icefall's ``ConvNeXt``
    (``nn.Conv2d`` weights of shape (out, in, 1, 1) for the 1x1 convs); the output is channels-last.
    """

    def __init__(self, channels: int, hidden_ratio: int = 3, kernel_size: Tuple[int, int] = (7, 7),
                 layerdrop_rate: Optional[FloatLike] = None):
        super().__init__()
        self.padding = ((kernel_size[0] - 1) // 2, (kernel_size[1] - 1) // 2)
        hidden = channels * hidden_ratio
        self.layerdrop_rate = layerdrop_rate if layerdrop_rate is not None else \
            ScheduledFloat((0.0, 0.2), (20000.0, 0.015))
        self.depthwise_conv = nn.Conv2d(channels, channels, groups=channels, kernel_size=kernel_size,
                                        padding=self.padding)
        self.pointwise_conv1 = nn.Conv2d(channels, hidden, kernel_size=1)
        # applied to the channels-last hidden activations, so the channel dim is the last one
        self.hidden_balancer = Balancer(hidden, channel_dim=-1, min_positive=0.3, max_positive=1.0, min_abs=0.75,
                                        max_abs=5.0)
        self.pointwise_conv2 = nn.Conv2d(hidden, channels, kernel_size=1)
        with torch.no_grad():
            self.pointwise_conv2.weight.mul_(0.01)
            nn.init.uniform_(self.pointwise_conv2.bias, -0.001, 0.001)
        self.out_balancer = Balancer(channels, channel_dim=1, min_positive=0.4, max_positive=0.6, min_abs=1.0,
                                     max_abs=6.0)
        self.out_whiten = Whiten(num_groups=1, whitening_limit=5.0, prob=(0.025, 0.25), grad_scale=0.01)

    def forward(self, x: Tensor) -> Tensor:
        x = x.contiguous(memory_format=torch.channels_last)
        conv = self.depthwise_conv
        y = depthwise_conv2d(x, conv.weight, conv.bias, self.padding)
        return self._pointwise(y, x)  # channels-last in, channels-last out

    def streaming_forward(self, x: Tensor, cached_left_pad: Tensor) -> Tuple[Tensor, Tensor]:
        """x (B, C, T, F) after ``cached_left_pad`` (B, C, 3, F), the frames just before it; eval mode.

        The 7x7 conv runs without time padding, so the output has T - 3 frames: those whose right context lies
        within x (each output frame needs 3 frames after it). Returns ((B, C, T-3, F), the new cache: the 3
        frames before the next output frame)."""
        pt = self.padding[0]
        x = torch.cat((cached_left_pad.to(x.dtype), x), dim=2).contiguous(memory_format=torch.channels_last)
        t = x.shape[2]
        if t < 4 * pt:
            raise ValueError(f"ConvNeXt streaming needs at least {3 * pt + 1} new frames, got {t - pt}")
        conv = self.depthwise_conv
        y = F.conv2d(x, conv.weight, conv.bias, padding=(0, self.padding[1]), groups=conv.groups)
        return self._pointwise(y, x[:, :, pt: t - pt]), x[:, :, t - 2 * pt: t - pt]

    def _pointwise(self, x: Tensor, bypass: Tensor) -> Tensor:
        """The rest of the block after the depthwise conv: x and the residual ``bypass`` (B, C, T, F)."""
        h = x.permute(0, 2, 3, 1)  # (B, T, F, C), contiguous
        h = linear(h, self.pointwise_conv1.weight.flatten(1), self.pointwise_conv1.bias)  # (B, T, F, 3C)
        h = self.hidden_balancer(h)
        h = act_dropout_linear(h, self.pointwise_conv2.weight.flatten(1), self.pointwise_conv2.bias, "SwooshL")
        x = h.permute(0, 3, 1, 2)  # (B, C, T, F), channels-last strides
        rate = schedule_value(self.layerdrop_rate)
        if self.training and not is_zero(rate):
            x = x * (torch.rand(x.shape[0], 1, 1, 1, device=x.device) > rate).to(x.dtype)
        x = self.out_balancer(bypass + x)
        if self.training and x.requires_grad:
            # icefall transposes to (B, F, T, C); the whitening metric ignores the order of frames, and
            # (B, T, F, C) is the channels-last memory order (no copy when the metric reshapes it).
            x = self.out_whiten(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return x


class ZipformerConv2dSubsampling(nn.Module):
    """(B, T, F) features at 100 Hz -> (B, (T-7)//2, D) at 50 Hz (icefall's Zipformer ``Conv2dSubsampling``).

    Conv2d 1->8 (3x3) -> ScaleGrad(0.2) -> Balancer -> SwooshR -> Conv2d 8->32 (3x3, stride 2) -> Balancer ->
    SwooshR -> Conv2d 32->128 (3x3, stride (1,2)) -> Balancer -> SwooshR -> ConvNeXt -> Linear(128*F', D) ->
    Whiten -> BiasNorm -> dropout shared over time. With F=80, D=192: 611,953 parameters.
    """

    def __init__(self, in_channels: int, out_channels: int, layer1_channels: int = 8, layer2_channels: int = 32,
                 layer3_channels: int = 128, dropout: FloatLike = 0.1, convnext_hidden_ratio: int = 3,
                 zero_padding: bool = True, feature_norm: str = "none"):
        super().__init__()
        if in_channels < 7:
            raise ValueError(f"ZipformerConv2dSubsampling needs at least 7 feature bins, got {in_channels}")
        self.in_channels = in_channels
        # "utterance": each utterance's features minus their mean (masks.utterance_mean_norm) before the convs
        self.feature_norm = check_feature_norm(feature_norm)
        # zero the frames past each utterance before the ConvNeXt (False: icefall's Conv2dSubsampling.forward, whose
        # 7x7 conv mixes the frames computed from the padding into each utterance's last 3 frames)
        self.zero_padding = zero_padding
        self.conv = nn.Sequential(
            nn.Conv2d(1, layer1_channels, kernel_size=3, padding=(0, 1)),
            ScaleGrad(0.2),
            Balancer(layer1_channels, channel_dim=1, max_abs=1.0),
            SwooshR(),
            nn.Conv2d(layer1_channels, layer2_channels, kernel_size=3, stride=2),
            Balancer(layer2_channels, channel_dim=1, max_abs=4.0),
            SwooshR(),
            nn.Conv2d(layer2_channels, layer3_channels, kernel_size=3, stride=(1, 2)),
            Balancer(layer3_channels, channel_dim=1, max_abs=4.0),
            SwooshR(),
        )
        if convnext_hidden_ratio < 0:
            raise ValueError(f"convnext_hidden_ratio must be >= 0 (0 = no ConvNeXt), got {convnext_hidden_ratio}")
        # icefall always has the ConvNeXt (hidden ratio 3); 0 leaves it out (a cheaper front-end for CPU models)
        self.convnext = ConvNeXt(layer3_channels, hidden_ratio=convnext_hidden_ratio, kernel_size=(7, 7)) \
            if convnext_hidden_ratio else None
        self.out_width = (((in_channels - 1) // 2) - 1) // 2
        self.out = Linear(self.out_width * layer3_channels, out_channels)
        self.out_whiten = Whiten(num_groups=1, whitening_limit=ScheduledFloat((0.0, 4.0), (20000.0, 8.0), default=4.0),
                                 prob=(0.025, 0.25), grad_scale=0.02)
        self.out_norm = BiasNorm(out_channels)
        self.dropout = Dropout3(dropout, shared_dim=1)

    def forward(self, x: Tensor, x_lens: Tensor) -> Tuple[Tensor, Tensor]:
        """x: (B, T, F) float; x_lens: (B,) int. Returns ((B, (T-7)//2, D), (B,) lengths (x_lens-7)//2)."""
        # channels-last from the first conv's output on (cheap at 8 channels): the later convs then produce
        # channels-last outputs, which the ConvNeXt wants (see there) and which makes the flatten below free.
        # (B, 1, T, F) is both layouts at once; marking it channels-last makes oneDNN run the 1 -> C1 conv and its
        # weight gradient channels-last (1.5x faster on CPU than NCHW plus a conversion; same math)
        if self.feature_norm == "utterance":
            x = utterance_mean_norm(x, x_lens)
        x = x.unsqueeze(1).contiguous(memory_format=torch.channels_last)
        for layer in self.conv:  # ends (B, C, (T-7)//2, F') with channels-last strides
            # the convs as asrprec's op (conv.py: inductor's own lowering fixes T under dynamic shapes)
            x = conv2d(x, layer.weight, layer.bias, layer.stride, layer.padding, layer.groups) \
                if isinstance(layer, nn.Conv2d) else layer(x)
        out_lens = torch.div(x_lens - 7, 2, rounding_mode="floor")
        if self.zero_padding:
            t = x.shape[2]
            valid = torch.arange(t, device=x.device).unsqueeze(0) < out_lens.unsqueeze(1)  # (B, T')
            # (the .all() test saves a multiply when nothing is padded; an exported graph cannot branch on data)
            if is_tracing() or not bool(valid.all()):
                x = x * valid[:, None, :, None].to(x.dtype)
        if self.convnext is not None:
            x = self.convnext(x)
        return self._output(x), out_lens

    def _output(self, x: Tensor) -> Tensor:
        """(B, C, T, F') channels-last -> (B, T, D): Linear, Whiten, BiasNorm, dropout."""
        b, c, t, f = x.shape
        # icefall flattens (B, T, C, F'); equivalently flatten the channels-last order (B, T, F', C) and permute
        # the (small) weight's input dim to match, avoiding a copy of the activations.
        w = self.out.weight.view(-1, c, f).transpose(1, 2).reshape(-1, f * c)
        x = linear(x.permute(0, 2, 3, 1).reshape(b, t, f * c), w, self.out.bias)
        return self.dropout(self.out_norm(self.out_whiten(x)))

    @property
    def streaming_lookahead(self) -> int:
        """Input frames (100 Hz) a streaming chunk needs beyond its own 2 x chunk frames: 7 for the convolutions
        plus 2 x 3 for the ConvNeXt's right context (icefall's ``pad_length`` of 13 in streaming_decode.py)."""
        return 7 + (2 * self.convnext.padding[0] if self.convnext is not None else 0)

    def init_cache(self, batch_size: int, device: Optional[torch.device] = None,
                   dtype: Optional[torch.dtype] = None) -> Tensor:
        """Zero ConvNeXt left context (B, C, 3, F') for streaming (B, C, 0, F') without the ConvNeXt."""
        c = self.conv[-3].out_channels
        t = self.convnext.padding[0] if self.convnext is not None else 0
        return torch.zeros(batch_size, c, t, self.out_width, device=device, dtype=dtype)

    def streaming_forward(self, x: Tensor, x_lens: Tensor, cached_left_pad: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """One streaming step, eval mode.

        x: (B, 2C + ``streaming_lookahead``, F) features: the chunk's 2C frames and the look-ahead after them;
        x_lens: (B,) valid frames of x (fewer at the end of an utterance; may be <= 0 once it has ended);
        cached_left_pad: from :meth:`init_cache` or the previous step.
        Returns ((B, C, D) for the chunk's C output frames (50 Hz), (B,) valid output frames, the new cache)."""
        if self.feature_norm != "none":
            raise ValueError(f"feature_norm {self.feature_norm!r} needs the whole utterance: it cannot stream")
        x = self.conv[0](x.unsqueeze(1).contiguous(memory_format=torch.channels_last))
        for layer in self.conv[1:]:
            x = layer(x)
        t = x.shape[2]
        out_lens = torch.div(x_lens - 7, 2, rounding_mode="floor").clamp(min=0, max=t)
        valid = torch.arange(t, device=x.device).unsqueeze(0) < out_lens.unsqueeze(1)
        # always (whatever zero_padding says): a stream's features past its end are arbitrary
        x = x * valid[:, None, :, None].to(x.dtype)
        if self.convnext is not None:
            x, cached_left_pad = self.convnext.streaming_forward(x, cached_left_pad)
        return self._output(x), out_lens.clamp(max=x.shape[2]), cached_left_pad
