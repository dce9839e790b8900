"""The CTC head's objectives: CTC (Graves et al. 2006) and consistency-regularised CTC (CR-CTC; Yao et al. 2024,
arXiv 2410.05101), as k2-fsa/icefall trains them beside or instead of the transducer
(``egs/librispeech/ASR/zipformer/model.py`` and ``train.py``, flags ``--use-ctc`` ... ``--time-mask-ratio``).

CR-CTC feeds two differently masked copies of each utterance through the encoder, trains CTC on both and adds a
consistency term pulling each copy's CTC posteriors towards the other's (detached) ones. The copies need the
*un-augmented* features, so the model augments them itself (:func:`time_warp` once per utterance, then
:func:`spec_augment_views` per copy) and the data module's SpecAugment is off for CR-CTC, as icefall's
``--enable-spec-aug 0``.

Tensor legend: B batch, T frames (T' after the encoder), U target tokens, V vocabulary (blank included),
F feature bins, D_enc the encoder's width.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F

from asrprec.data.augment import frequency_mask_width
from asrprec.losses.validate import check_logits, validate_rnnt_inputs
from asrprec.precision.islands import fp32_island

from .masks import make_pad_mask

__all__ = ["CtcConfig", "cr_consistency_loss", "ctc_loss", "spec_augment_views", "time_warp"]


@dataclass
class CtcConfig:
    """A CTC head on the encoder and how it is trained (field names are icefall's flag names).

    ctc_loss_scale: weight of the CTC loss in the total. ``None`` takes the value of icefall's published
        LibriSpeech recipes for the combination: 1.0 for CTC alone, 0.2 beside a transducer (``--ctc-loss-scale``
        default), 0.1 beside a transducer with CR-CTC.
    use_cr_ctc: train with consistency regularisation (two SpecAugment views per utterance).
    cr_loss_scale: weight of the consistency term; ``None``: 0.2 for CR-CTC alone, 0.02 beside a transducer
        (icefall's commands for those models). It warms up linearly with the transducer's loss warm-up.
    time_mask_ratio: CR-CTC's larger time masking, relative to icefall's default SpecAugment:
        ``int(10·r)`` time masks covering at most ``0.15·r`` of the frames (icefall ``get_spec_augment``).
    time_warp_factor: CR-CTC's time warping (SpecAugment's, applied once to each utterance before it is
        duplicated, as icefall's model.py does); None or 0: none (the data module's SpecAugment, which would
        otherwise warp, is off under CR-CTC).
    features_mask_size: CR-CTC's widest frequency mask in bins (a recipe's SpecAugment setting); None: icefall's
        27 of every 80 bins, scaled to the features' width.
    dropout: dropout in front of the head's linear layer (icefall's ``ctc_output``).
    """

    ctc_loss_scale: float | None = None
    use_cr_ctc: bool = False
    cr_loss_scale: float | None = None
    time_mask_ratio: float = 2.5
    time_warp_factor: int | None = None
    features_mask_size: int | None = None
    dropout: float = 0.1

    def __post_init__(self) -> None:
        for name in ("ctc_loss_scale", "cr_loss_scale"):
            v = getattr(self, name)
            if v is not None and (not math.isfinite(v) or v < 0):
                raise ValueError(f"{name} must be a finite number >= 0 (or None for icefall's value), got {v}")
        if not self.time_mask_ratio > 0:
            raise ValueError(f"time_mask_ratio must be > 0 (icefall uses 2.5), got {self.time_mask_ratio}")
        if self.time_warp_factor is not None and self.time_warp_factor < 0:
            raise ValueError(f"time_warp_factor must be >= 0 (None or 0: no warping), got {self.time_warp_factor}")
        if self.features_mask_size is not None:
            frequency_mask_width(1, self.features_mask_size)  # checks it
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    def record(self) -> dict:
        """The fields as ``model.json`` records them: ``features_mask_size`` only when set, so that the record of
        a run from before the field still matches it on resume."""
        fields = asdict(self)
        if fields["features_mask_size"] is None:
            del fields["features_mask_size"]
        return fields

    def resolved(self, use_transducer: bool) -> "CtcConfig":
        """This config with the ``None`` scales replaced by icefall's values for the combination."""
        ctc = self.ctc_loss_scale
        if ctc is None:
            ctc = (0.1 if self.use_cr_ctc else 0.2) if use_transducer else 1.0
        cr = self.cr_loss_scale
        if cr is None:
            cr = 0.02 if use_transducer else 0.2
        return replace(self, ctc_loss_scale=float(ctc), cr_loss_scale=float(cr))


@fp32_island
def ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor, logit_lens: torch.Tensor, target_lens: torch.Tensor,
             *, blank: int = 0, reduction: str = "sum") -> torch.Tensor:
    """``torch.nn.functional.ctc_loss`` on batch-first inputs, in fp32 (float64 stays float64).

    Args:
        log_probs: (B, T', V) log-softmax outputs. logit_lens: (B,) valid frames.
        targets: (B, U) padded token ids (entries past ``target_lens`` are ignored). target_lens: (B,).
        blank: the blank id in [0, V).
        reduction: ``"sum"`` (−log P summed over the batch, icefall's), ``"mean"`` (over the batch) or ``"none"``
            ((B,) −log P). An utterance with too few frames for its targets has an infinite loss.
    Returns:
        a float32 (or float64) scalar, or (B,) for ``"none"``.
    Raises:
        ValueError: naming the argument, as :func:`asrprec.losses.rnnt_loss` (the shared validator,
            :func:`asrprec.losses.validate.validate_rnnt_inputs`): a float ``log_probs`` with B, T', V > 0; integer
            ``targets`` whose first ``target_lens[b]`` ids lie in [0, V) and are not ``blank``;
            1 ≤ ``logit_lens[b]`` ≤ T'; 0 ≤ ``target_lens[b]`` ≤ U; ``blank`` in [0, V).
    """
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"reduction must be 'sum', 'mean' or 'none', got {reduction!r}")
    check_logits(log_probs, "(B, T', V)", name="log_probs", ndim=3)
    # torch's kernel reads out-of-range ids out of bounds (wrong finite numbers, or a crash): the RNN-T losses'
    # checks, on a stand-in of the lattice shape they expect (only shape, dtype and device are read)
    B, T, V = log_probs.shape
    U = targets.shape[1] if isinstance(targets, torch.Tensor) and targets.dim() == 2 else 0
    lattice = torch.empty((), dtype=log_probs.dtype, device=log_probs.device).expand(B, T, U + 1, V)
    targets, logit_lens, target_lens = validate_rnnt_inputs(lattice, targets, logit_lens, target_lens, blank=blank,
                                                            logits_name="log_probs")
    # The concatenated layout with int32 lengths on the CPU is the one cuDNN's CTC accepts (torch's ctc_loss
    # documentation); torch falls back to its own kernels where cuDNN's other conditions do not hold.
    valid = ~make_pad_mask(target_lens, targets.size(1))
    flat = targets[valid].to(torch.int32).cpu()
    loss = F.ctc_loss(log_probs.transpose(0, 1), flat, logit_lens.to(torch.int32).cpu(),
                      target_lens.to(torch.int32).cpu(), blank=blank, reduction="none", zero_infinity=False)
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.mean()


@fp32_island
def cr_consistency_loss(log_probs: torch.Tensor, logit_lens: torch.Tensor) -> torch.Tensor:
    """CR-CTC's consistency term over two views stacked along the batch: rows ``i`` and ``i + B`` are the same
    utterance. Each view's posteriors learn towards the other view's detached ones:

        sum over views v, valid frames t, tokens k of  p̄_w(k|t) · (log p̄_w(k|t) − log p_v(k|t)),

    w the other view and p̄ detached (KL(p̄_w ‖ p_v); icefall ``forward_cr_ctc`` with ``kl_div(log_target=True)``).

    Args:
        log_probs: (2B, T', V) CTC log-probabilities. logit_lens: (2B,) valid frames (the views agree).
    Returns:
        a float32 (or float64) scalar, summed (not halved).
    """
    n = log_probs.size(0)
    if n % 2:
        raise ValueError(f"log_probs must stack two views of each utterance (an even batch), got {n} rows")
    other = torch.roll(log_probs.detach(), n // 2, dims=0)
    kl = F.kl_div(log_probs, other, reduction="none", log_target=True)  # (2B, T', V)
    pad = make_pad_mask(logit_lens, log_probs.size(1)).unsqueeze(-1)
    return kl.masked_fill(pad, 0.0).sum()


def spec_augment_views(features: torch.Tensor, feature_lens: torch.Tensor, *, copies: int = 2,
                       time_mask_ratio: float = 2.5, num_feature_masks: int = 2, features_mask_size: int | None = None,
                       frames_mask_size: int = 100, p: float = 0.9) -> tuple[torch.Tensor, torch.Tensor]:
    """``copies`` stacked copies of the batch, each utterance of each copy masked independently.

    lhotse's ``SpecAugment`` masking (``lhotse/dataset/signal_transforms.py``) with icefall's CR-CTC settings
    (``get_spec_augment``: ``int(10·r)`` time masks, at most ``0.15·r`` of the frames, mask width up to
    ``frames_mask_size``; 2 frequency masks up to 27 bins of 80), on the valid frames only and filled with the
    utterance's mean; applied to each utterance with probability ``p``. Time warping is not applied (the data
    module's default leaves it off). Random numbers come from torch's CPU generator (so a resumed run draws the
    same), the masks are built on ``features``' device.

    Args:
        features: (B, T, F) float features, unaugmented. feature_lens: (B,) int64.
        features_mask_size: the widest frequency mask; None: icefall's 27 bins scaled to F (27 of 80 bins, 13
            of 40), so that narrower features are not masked more.
    Returns:
        (copies·B, T, F) masked features (copy c is rows c·B ... c·B + B − 1) and (copies·B,) lengths.
    """
    B, T, Fdim = features.shape
    features_mask_size = frequency_mask_width(Fdim, features_mask_size)
    n = copies * B
    x = features.repeat(copies, 1, 1)
    lens = feature_lens.repeat(copies)
    if n == 0 or T == 0:
        return x, lens
    lens_cpu = lens.detach().cpu().to(torch.float64)
    valid = ~make_pad_mask(lens, T)  # (n, T)
    mean = (x * valid.unsqueeze(-1)).sum((1, 2)) / (lens.clamp_min(1) * Fdim)  # (n,)

    def spans(size: torch.Tensor, max_width: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        # width ~ U{0 .. max_width-1}, start ~ floor(U[0,1) · (size − width)), per row and mask (lhotse's draw)
        width = (torch.rand(n, count, dtype=torch.float64) * max_width.unsqueeze(1)).floor()
        start = (torch.rand(n, count, dtype=torch.float64) * (size.unsqueeze(1) - width)).floor()
        return start, start + width

    # time masks: lhotse limits their number and width by the utterance's length
    num_time_masks = int(10 * time_mask_ratio)
    max_total = 0.15 * time_mask_ratio * lens_cpu
    n_masks = torch.minimum(torch.full_like(max_total, num_time_masks),
                            (max_total / frames_mask_size).ceil()).clamp_min(1)
    max_w = torch.minimum(torch.full_like(max_total, frames_mask_size), (max_total / n_masks).floor())
    t_start, t_end = spans(lens_cpu, max_w, num_time_masks)
    unused = torch.arange(num_time_masks).unsqueeze(0) >= n_masks.unsqueeze(1)
    t_end = torch.where(unused, t_start, t_end)
    f_start, f_end = spans(torch.full((n,), float(Fdim), dtype=torch.float64),
                           torch.full((n,), float(features_mask_size), dtype=torch.float64), num_feature_masks)
    apply = torch.rand(n, dtype=torch.float64) < p

    dev = features.device
    t = torch.arange(T, device=dev, dtype=torch.float64).view(1, T, 1)
    f = torch.arange(Fdim, device=dev, dtype=torch.float64).view(1, Fdim, 1)
    in_time = ((t >= t_start.to(dev).unsqueeze(1)) & (t < t_end.to(dev).unsqueeze(1))).any(-1)  # (n, T)
    in_freq = ((f >= f_start.to(dev).unsqueeze(1)) & (f < f_end.to(dev).unsqueeze(1))).any(-1)  # (n, F)
    mask = (in_time.unsqueeze(-1) | in_freq.unsqueeze(1)) & valid.unsqueeze(-1) & apply.to(dev).view(n, 1, 1)
    x = torch.where(mask, mean.view(n, 1, 1).to(x.dtype), x)
    return x, lens


def time_warp(features: torch.Tensor, feature_lens: torch.Tensor, factor: int, *, p: float = 0.9) -> torch.Tensor:
    """SpecAugment's time warping of each utterance's valid frames, with probability ``p`` each.

    lhotse's ``time_warp`` (``lhotse/dataset/signal_transforms.py``): a centre frame c drawn from
    [factor + 1, n − factor) moves to w drawn from [c − factor, c + factor]; frames [0, c) are stretched onto
    [0, w) and [c, n) onto [w, n) by bicubic interpolation. Utterances of at most ``2·factor + 1`` frames stay as they
    are. Random numbers come from torch's CPU generator.

    Args:
        features: (B, T, F) float. feature_lens: (B,) int64. factor: the largest shift, in frames.
    Returns:
        (B, T, F), padding untouched.
    """
    out = features.clone()
    for i, n in enumerate(feature_lens.tolist()):
        draw = torch.rand(3, dtype=torch.float64)
        if n - factor <= factor + 1 or float(draw[0]) >= p:
            continue
        centre = factor + 1 + int(float(draw[1]) * (n - 2 * factor - 1))
        warped = centre - factor + int(float(draw[2]) * (2 * factor + 1))
        if warped == centre:
            continue
        x = features[i, :n].unsqueeze(0).unsqueeze(0)
        left = F.interpolate(x[:, :, :centre], size=(warped, x.size(3)), mode="bicubic", align_corners=False)
        right = F.interpolate(x[:, :, centre:], size=(n - warped, x.size(3)), mode="bicubic", align_corners=False)
        out[i, :n] = torch.cat((left, right), dim=2)[0, 0]
    return out
