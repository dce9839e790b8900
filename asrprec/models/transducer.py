"""The transducer: composes an encoder, a stateless decoder and a joiner, and computes the RNN-T loss.

Tensor legend used in every docstring here: B batch, T input frames (T' after the encoder's
subsampling), U target tokens (the lattice has U+1 rows), V vocabulary (blank included),
D_enc / D_dec model widths, J the joiner's hidden width, S the pruned band width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .decoder import Decoder
from .joiner import Joiner
from .masks import make_pad_mask
from .schedule import warmup_fraction

LOSSES = ("full", "pruned")
JOINT_MODES = ("full", "lean")


@dataclass
class LossConfig:
    """How :meth:`Transducer.forward` computes the loss.

    loss: ``"pruned"`` (the default, as in icefall's Zipformer recipes: k2-style pruned RNN-T, a smoothed
        "simple" loss on linear projections chooses a band of ``prune_range`` tokens per frame, and the real
        joiner runs only there) or ``"full"`` (exact RNN-T over the whole lattice).
    joint_mode: ``"full"`` materialises (B, T', U+1, V) logits; ``"lean"`` computes the exact same loss
        and gradients tile by tile, holding only per-lattice-cell state (``asrprec.losses.rnnt_loss_lean``).
    backend: the ``rnnt_loss`` backend for ``loss="full", joint_mode="full"`` (``"auto"`` picks the fastest).
    Loss-scale warm-up (icefall zipformer/train.py): the total is ``s·simple + p·pruned`` with s going
    1.0 → ``simple_loss_scale`` and p 0.1 → 1.0 over the first ``loss_warmup_batches`` batches.
    """

    loss: str = "pruned"
    joint_mode: str = "full"
    backend: str = "auto"
    prune_range: int = 5
    lm_only_scale: float = 0.25
    am_only_scale: float = 0.0
    simple_loss_scale: float = 0.5
    loss_warmup_batches: int = 2000
    lean_tile_t: int = 16

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.joint_mode not in JOINT_MODES:
            raise ValueError(f"joint_mode must be one of {JOINT_MODES}, got {self.joint_mode!r}")
        if self.loss == "pruned" and self.joint_mode == "lean":
            raise ValueError("joint_mode='lean' applies to loss='full'; the pruned loss is already band-limited")


def pruned_loss_scales(batch_count: float, cfg: LossConfig) -> tuple[float, float]:
    """(simple, pruned) loss scales at ``batch_count`` (icefall's linear warm-up)."""
    w = warmup_fraction(batch_count, cfg.loss_warmup_batches)
    return 1.0 - w * (1.0 - cfg.simple_loss_scale), 0.1 + 0.9 * w


class Transducer(nn.Module):
    """RNN-T model = encoder + stateless decoder + joiner (+ the two linear "simple" projections that
    the pruned loss uses; they are unused, but present, for the full loss so checkpoints interchange).

    Decoding algorithms rely only on :meth:`encode`, :meth:`predict`, :meth:`join` and the attributes
    ``decoder.blank_id``, ``decoder.context_size`` and ``joiner`` (``encoder_proj``/``decoder_proj``).
    """

    def __init__(
        self,
        encoder: nn.Module,
        decoder: Decoder,
        joiner: Joiner,
        *,
        loss: LossConfig | None = None,
        model_warmup_batches: int = 3000,
    ):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.joiner = joiner
        vocab = decoder.vocab_size
        self.simple_am_proj = nn.Linear(encoder.output_dim, vocab)
        self.simple_lm_proj = nn.Linear(decoder.output_dim, vocab)
        self.loss_config = loss or LossConfig()
        # Updated by the training loop through asrprec.models.set_batch_count (drives warm-ups).
        self.batch_count = 0.0
        self.model_warmup_batches = model_warmup_batches

    @property
    def blank_id(self) -> int:
        return self.decoder.blank_id

    @property
    def vocab_size(self) -> int:
        return self.decoder.vocab_size

    @property
    def min_input_frames(self) -> int:
        """The fewest feature frames an utterance may have (the encoder's ``min_input_frames``; 1 if it names none)."""
        return int(getattr(self.encoder, "min_input_frames", 1))

    def _input_dtype(self) -> torch.dtype:
        for p in self.encoder.parameters():
            return p.dtype
        return torch.float32

    def encode(
        self, features: torch.Tensor, feature_lens: torch.Tensor, warmup: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the encoder.

        Args:
            features: (B, T, F) float32 fbank; cast to the encoder's parameter dtype (bf16-cast models).
            feature_lens: (B,) int64 valid frames.
            warmup: model warm-up in [0, 1] for encoders that bypass layers early in training (the
                reworked Conformer); other encoders ignore it.
        Returns:
            encoder_out (B, T', D_enc) and encoder_out_lens (B,) int64.
        """
        if features.dim() != 3:
            raise ValueError(f"features must be (B, T, F), got shape {tuple(features.shape)}")
        if feature_lens.shape != (features.size(0),):
            raise ValueError(f"feature_lens must be ({features.size(0)},), got {tuple(feature_lens.shape)}")
        features = features.to(self._input_dtype())
        if getattr(self.encoder, "accepts_warmup", False):
            return self.encoder(features, feature_lens, warmup=warmup)
        return self.encoder(features, feature_lens)

    def predict(self, tokens: torch.Tensor) -> torch.Tensor:
        """Decoder output for the last ``context_size`` tokens: (N, context_size) int64 → (N, 1, D_dec)."""
        return self.decoder(tokens, need_pad=False)

    def join(self, encoder_out: torch.Tensor, decoder_out: torch.Tensor) -> torch.Tensor:
        """Joint logits of broadcastable (..., D_enc) and (..., D_dec) → (..., V)."""
        return self.joiner(encoder_out, decoder_out)

    def decoder_input(self, targets: torch.Tensor, target_lens: torch.Tensor) -> torch.Tensor:
        """Blank-prefixed targets with padding replaced by blank: (B, U) → (B, U+1)."""
        B, U = targets.shape
        pad = make_pad_mask(target_lens, U)
        t = targets.masked_fill(pad, self.blank_id)
        sos = torch.full((B, 1), self.blank_id, dtype=t.dtype, device=t.device)
        return torch.cat([sos, t], dim=1)

    def forward(
        self, features: torch.Tensor, feature_lens: torch.Tensor, targets: torch.Tensor, target_lens: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Compute the transducer loss.

        Args:
            features: (B, T, F) float32. feature_lens: (B,) int64.
            targets: (B, U) int64 padded token ids (no blank inside ``target_lens``). target_lens: (B,) int64.
        Returns:
            dict with ``"loss"`` (fp32 scalar, summed over the batch, what to back-propagate),
            ``"encoder_out_lens"`` (B,), and its parts: ``"transducer_loss"`` for the full loss;
            ``"simple_loss"`` and ``"pruned_loss"`` (unscaled sums) for the pruned loss.
        """
        if targets.dim() != 2 or targets.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"targets must be a padded (B, U) integer tensor, got {targets.dtype} {tuple(targets.shape)}")
        targets = targets.long()
        target_lens = target_lens.long()
        warmup = warmup_fraction(self.batch_count, self.model_warmup_batches) if self.training else 1.0
        encoder_out, encoder_out_lens = self.encode(features, feature_lens, warmup)
        decoder_out = self.decoder(self.decoder_input(targets, target_lens))  # (B, U+1, D_dec)
        cfg = self.loss_config
        out: dict[str, torch.Tensor] = {"encoder_out_lens": encoder_out_lens}
        if cfg.loss == "pruned":
            simple, pruned = self._pruned_losses(encoder_out, encoder_out_lens, decoder_out, targets, target_lens)
            s, p = pruned_loss_scales(self.batch_count, cfg) if self.training else (cfg.simple_loss_scale, 1.0)
            out.update(simple_loss=simple, pruned_loss=pruned, loss=s * simple + p * pruned)
            return out
        if cfg.joint_mode == "lean":
            from asrprec.losses import rnnt_loss_lean

            loss = rnnt_loss_lean(
                self.joiner,
                self.joiner.encoder_proj(encoder_out),
                self.joiner.decoder_proj(decoder_out),
                targets,
                encoder_out_lens,
                target_lens,
                blank=self.blank_id,
                reduction="sum",
                tile_t=cfg.lean_tile_t,
            )
        else:
            from asrprec.losses import rnnt_loss

            logits = self.joiner(encoder_out.unsqueeze(2), decoder_out.unsqueeze(1))  # (B, T', U+1, V)
            loss = rnnt_loss(
                logits, targets, encoder_out_lens, target_lens, blank=self.blank_id, reduction="sum",
                backend=cfg.backend,
            )
        out.update(transducer_loss=loss, loss=loss)
        return out

    def _pruned_losses(self, encoder_out, encoder_out_lens, decoder_out, targets, target_lens):
        from asrprec.losses import do_rnnt_pruning, get_rnnt_prune_ranges, rnnt_loss_pruned, rnnt_loss_smoothed

        cfg = self.loss_config
        lm = self.simple_lm_proj(decoder_out)  # (B, U+1, V)
        am = self.simple_am_proj(encoder_out)  # (B, T', V)
        simple, (px_grad, py_grad) = rnnt_loss_smoothed(
            lm, am, targets, encoder_out_lens, target_lens, blank=self.blank_id,
            lm_only_scale=cfg.lm_only_scale, am_only_scale=cfg.am_only_scale, reduction="sum", return_grad=True,
        )
        ranges = get_rnnt_prune_ranges(px_grad, py_grad, encoder_out_lens, target_lens, cfg.prune_range)
        am_pruned, lm_pruned = do_rnnt_pruning(
            self.joiner.encoder_proj(encoder_out), self.joiner.decoder_proj(decoder_out), ranges
        )
        logits = self.joiner(am_pruned, lm_pruned, project_input=False)  # (B, T', S, V)
        pruned = rnnt_loss_pruned(
            logits, targets, ranges, encoder_out_lens, target_lens, blank=self.blank_id, reduction="sum"
        )
        return simple, pruned
