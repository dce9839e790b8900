"""The transducer: composes an encoder, a stateless decoder and a joiner, and computes the RNN-T loss; a CTC head
(:mod:`asrprec.models.ctc`) may sit beside the transducer or replace it.

Tensor legend used in every docstring here: B batch, T input frames (T' after the encoder's
subsampling), U target tokens (the lattice has U+1 rows), V vocabulary (blank included),
D_enc / D_dec model widths, J the joiner's hidden width, S the pruned band width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from asrprec.precision.islands import fp32_island, upcast

from .ctc import CtcConfig, cr_consistency_loss, ctc_loss, spec_augment_views, time_warp
from .decoder import Decoder
from .joiner import Joiner
from .masks import make_pad_mask, utterance_mean_norm
from .schedule import warmup_fraction
from .tracing import compiled_regions

LOSSES = ("full", "pruned", "tdt")
TDT_AUX = ("simple", "none")
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
    ``loss="tdt"``: the token-and-duration transducer loss (``asrprec.losses.tdt_loss``; the joiner then has a
        duration head of ``len(tdt_durations)`` outputs) with NeMo's ``durations``, ``sigma`` and ``omega``.
        ``tdt_aux="simple"`` adds the pruned loss's smoothed "simple" loss on the linear projections, with the same
        warm-up (``s·simple + p·tdt``), the direct encoder signal that the embedded recipe's tiny model needs with
        the exact RNN-T loss; ``"none"`` trains on the TDT loss alone, which on that recipe learned as fast over
        three epochs. "simple" is the default because it is the setting measured over the whole recipe
        (``benchmarks/RESULTS.md``).
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
    tdt_durations: tuple[int, ...] = (0, 1, 2, 3, 4)
    tdt_sigma: float = 0.0
    tdt_omega: float = 0.0
    tdt_aux: str = "simple"

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        self.tdt_durations = tuple(self.tdt_durations)  # model.json gives a list
        if self.loss == "tdt":
            from asrprec.losses.tdt import validate_durations

            validate_durations(self.tdt_durations)
        if self.tdt_aux not in TDT_AUX:
            raise ValueError(f"tdt_aux must be one of {TDT_AUX}, got {self.tdt_aux!r}")
        if self.loss == "tdt" and self.joint_mode == "lean":
            raise ValueError("joint_mode='lean' applies to loss='full'; the TDT loss materialises its logits")
        if not 0.0 <= self.tdt_omega <= 1.0:
            raise ValueError(f"tdt_omega is a probability in [0, 1], got {self.tdt_omega}")
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

    Decoding algorithms rely only on :meth:`encode`, the searchable-transducer interface
    (:class:`asrprec.decoding.SearchableTransducer`: :meth:`project_encoder`, :meth:`project_decoder`,
    :meth:`join_projected`, ``blank_id``, ``vocab_size``, ``context_size``, ``durations``) and, for the CTC head,
    :meth:`ctc_log_probs`.

    Heads (icefall's ``AsrModel``, zipformer/model.py): ``use_transducer`` (a decoder and a joiner; both None
    without it) and ``use_ctc`` (``ctc_output``, Dropout + Linear(D_enc, V), read through :meth:`ctc_log_probs`;
    ``ctc=CtcConfig(...)``). A CTC-only model takes ``vocab_size`` and ``blank_id`` from the constructor.
    """

    def __init__(
        self,
        encoder: nn.Module,
        decoder: Decoder | None,
        joiner: Joiner | None,
        *,
        loss: LossConfig | None = None,
        ctc: CtcConfig | None = None,
        vocab_size: int | None = None,
        blank_id: int = 0,
        model_warmup_batches: int = 3000,
    ):
        super().__init__()
        if (decoder is None) != (joiner is None):
            raise ValueError("a transducer head needs both a decoder and a joiner; pass both, or neither for a "
                             "CTC-only model")
        if decoder is None and ctc is None:
            raise ValueError("the model has no head: pass a decoder and a joiner (transducer), a ctc=CtcConfig() "
                             "(CTC), or both")
        if decoder is None and vocab_size is None:
            raise ValueError("a CTC-only model (no decoder) needs vocab_size")
        self.encoder = encoder
        self.decoder = decoder
        self.joiner = joiner
        self.use_transducer = decoder is not None
        self._vocab_size = decoder.vocab_size if decoder is not None else int(vocab_size)
        self._blank_id = decoder.blank_id if decoder is not None else int(blank_id)
        if vocab_size is not None and vocab_size != self._vocab_size:
            raise ValueError(f"vocab_size={vocab_size} disagrees with the decoder's {self._vocab_size}")
        vocab = self._vocab_size
        self.simple_am_proj = nn.Linear(encoder.output_dim, vocab) if self.use_transducer else None
        self.simple_lm_proj = nn.Linear(decoder.output_dim, vocab) if self.use_transducer else None
        # icefall's ctc_output (zipformer/model.py) without its LogSoftmax, which ctc_log_probs runs in fp32
        self.use_ctc = ctc is not None
        self.ctc_config = ctc.resolved(self.use_transducer) if ctc is not None else None
        self.ctc_output = nn.Sequential(nn.Dropout(ctc.dropout), nn.Linear(encoder.output_dim, vocab)) \
            if ctc is not None else None
        self.loss_config = loss or LossConfig()
        durations = self.loss_config.tdt_durations if self.loss_config.loss == "tdt" else ()
        if joiner is not None and tuple(getattr(joiner, "durations", ())) != durations:
            raise ValueError(f"loss={self.loss_config.loss!r} needs a joiner with durations {durations}, got one with "
                             f"{tuple(getattr(joiner, 'durations', ()))}; build it with "
                             "asrprec.models.build_transducer(loss=...), which sizes the joiner's duration head")
        # Updated by the training loop through asrprec.models.set_batch_count (drives warm-ups).
        self.batch_count = 0.0
        self.model_warmup_batches = model_warmup_batches

    @property
    def blank_id(self) -> int:
        return self.decoder.blank_id if self.decoder is not None else self._blank_id

    @property
    def vocab_size(self) -> int:
        """V, blank included (the token logits; a TDT joiner's duration logits follow them)."""
        return self.decoder.vocab_size if self.decoder is not None else self._vocab_size

    @property
    def context_size(self) -> int:
        """C, the tokens the decoder sees (``project_decoder`` takes (N, C) contexts)."""
        return self.decoder.context_size

    @property
    def feature_norm(self) -> str:
        """The encoder front-end's feature normalisation (``"none"`` or ``"utterance"``)."""
        return getattr(getattr(self.encoder, "encoder_embed", None), "feature_norm", "none")

    @property
    def use_cr_ctc(self) -> bool:
        return self.ctc_config is not None and self.ctc_config.use_cr_ctc

    @property
    def durations(self) -> tuple[int, ...]:
        """The TDT durations of the joiner's duration head; ``()`` for an RNN-T model."""
        return tuple(getattr(self.joiner, "durations", ()))

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
            if self.training and compiled_regions(self.encoder):
                # torch.compile compiles a float argument in as a constant: a new warm-up value every batch would
                # compile the encoder again each batch; a 0-dim tensor is read at run time
                warmup = torch.tensor(float(warmup), dtype=torch.float64)
            return self.encoder(features, feature_lens, warmup=warmup)
        return self.encoder(features, feature_lens)

    def predict(self, tokens: torch.Tensor) -> torch.Tensor:
        """Decoder output for the last ``context_size`` tokens: (N, context_size) int64 → (N, 1, D_dec)."""
        return self.decoder(tokens, need_pad=False)

    def join(self, encoder_out: torch.Tensor, decoder_out: torch.Tensor) -> torch.Tensor:
        """Joint logits of broadcastable (..., D_enc) and (..., D_dec) → (..., V)."""
        return self.joiner(encoder_out, decoder_out)

    def project_encoder(self, encoder_out: torch.Tensor) -> torch.Tensor:
        """The joiner's encoder projection: (..., D_enc) in any float dtype → (..., J) in the joiner's dtype.

        Decoding accepts an encoder output of any float dtype: a bf16-cast model's is bf16 already, an fp32 one fed
        to a bf16-cast joiner would not run otherwise."""
        proj = self.joiner.encoder_proj
        return proj(encoder_out.to(proj.weight.dtype))

    def project_decoder(self, contexts: torch.Tensor) -> torch.Tensor:
        """The projected decoder output for the last C tokens of each row: (N, C) int64 → (N, J)."""
        return self.joiner.decoder_proj(self.predict(contexts)).squeeze(1)

    def join_projected(self, encoder_proj: torch.Tensor, decoder_proj: torch.Tensor) -> torch.Tensor:
        """Joint logits of broadcastable projections (..., J) and (..., J) → (..., V) (a TDT joiner's
        (..., V + len(durations)): token logits, then duration logits), in the compute dtype."""
        return self.joiner(encoder_proj, decoder_proj, project_input=False)

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
        """Compute the training loss of every head.

        Args:
            features: (B, T, F) float32. feature_lens: (B,) int64.
            targets: (B, U) int64 padded token ids (no blank inside ``target_lens``). target_lens: (B,) int64.
        Returns:
            dict with ``"loss"`` (fp32 scalar, summed over the batch, what to back-propagate),
            ``"encoder_out_lens"`` (B,), and its parts (unscaled sums): the transducer's ``"transducer_loss"``
            (full and TDT losses), ``"simple_loss"`` and ``"pruned_loss"`` (pruned loss); the CTC head's
            ``"ctc_loss"`` and, when training with CR-CTC, ``"cr_loss"``. ``loss`` = the transducer's weighted
            total + ``ctc_loss_scale``·ctc_loss + ``cr_loss_scale``·cr_loss (the latter warmed up over
            ``loss_warmup_batches``, as icefall's zipformer/train.py).

        CR-CTC (training only): the batch is time-warped (``time_warp_factor``), duplicated and each copy masked by
        :func:`~asrprec.models.ctc.spec_augment_views` (the features must arrive unaugmented); every loss is then
        halved, as in icefall's zipformer/model.py, so that all values are per utterance of the batch given. An encoder
        with ``feature_norm="utterance"`` gets the batch normalised before the views are made, so that their masks
        hold the normalised features' mean (zero), not the raw one.
        """
        if targets.dim() != 2 or targets.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"targets must be a padded (B, U) integer tensor, got {targets.dtype} {tuple(targets.shape)}")
        targets = targets.long()
        target_lens = target_lens.long()
        batch_size = features.size(0)
        cr = self.training and self.use_cr_ctc
        if cr:
            if self.feature_norm == "utterance":  # before the views' masks, which fill with the utterance's mean
                features = utterance_mean_norm(features, feature_lens)
            if self.ctc_config.time_warp_factor:
                features = time_warp(features, feature_lens, self.ctc_config.time_warp_factor)
            features, feature_lens = spec_augment_views(features, feature_lens,
                                                        time_mask_ratio=self.ctc_config.time_mask_ratio,
                                                        features_mask_size=self.ctc_config.features_mask_size)
            targets, target_lens = targets.repeat(2, 1), target_lens.repeat(2)
        half = 0.5 if cr else 1.0
        warmup = warmup_fraction(self.batch_count, self.model_warmup_batches) if self.training else 1.0
        encoder_out, encoder_out_lens = self.encode(features, feature_lens, warmup)
        out: dict[str, torch.Tensor] = {"encoder_out_lens": encoder_out_lens[:batch_size]}
        terms = []
        if self.use_transducer:
            parts = self._transducer_losses(encoder_out, encoder_out_lens, targets, target_lens)
            terms.append(half * parts.pop("loss"))
            out.update({k: half * v for k, v in parts.items()})
        if self.use_ctc:
            cfg = self.ctc_config
            log_probs = self.ctc_log_probs(encoder_out)
            out["ctc_loss"] = half * ctc_loss(log_probs, targets, encoder_out_lens, target_lens, blank=self.blank_id)
            terms.append(cfg.ctc_loss_scale * out["ctc_loss"])
            if cr:
                out["cr_loss"] = half * cr_consistency_loss(log_probs, encoder_out_lens)
                w = warmup_fraction(self.batch_count, self.loss_config.loss_warmup_batches)
                terms.append(w * cfg.cr_loss_scale * out["cr_loss"])
        out["loss"] = sum(terms[1:], terms[0])
        return out

    @fp32_island
    def ctc_log_probs(self, encoder_out: torch.Tensor) -> torch.Tensor:
        """The CTC head's log-probabilities: (B, T', D_enc) -> (B, T', V) float32 (float64 for a float64 model).

        The head's linear layer runs in the model's dtype (whatever the policy gives it); its log-softmax in fp32.
        """
        if self.ctc_output is None:
            raise ValueError("this model has no CTC head; build it with ctc=CtcConfig() (--use-ctc)")
        logits = self.ctc_output(encoder_out.to(self.ctc_output[1].weight.dtype))
        return upcast(logits).log_softmax(dim=-1)

    def _transducer_losses(self, encoder_out, encoder_out_lens, targets, target_lens) -> dict[str, torch.Tensor]:
        """The transducer's loss parts and their weighted ``"loss"`` (see :meth:`forward`)."""
        decoder_out = self.decoder(self.decoder_input(targets, target_lens))  # (B, U+1, D_dec)
        cfg = self.loss_config
        out: dict[str, torch.Tensor] = {}
        if cfg.loss == "tdt":
            out.update(self._tdt_losses(encoder_out, encoder_out_lens, decoder_out, targets, target_lens))
            return out
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

    def _tdt_losses(self, encoder_out, encoder_out_lens, decoder_out, targets, target_lens) -> dict[str, torch.Tensor]:
        """``transducer_loss`` (TDT), ``simple_loss`` with ``tdt_aux="simple"``, and their weighted ``loss``."""
        from asrprec.losses import rnnt_loss_smoothed, tdt_loss

        cfg = self.loss_config
        logits = self.joiner(encoder_out.unsqueeze(2), decoder_out.unsqueeze(1))  # (B, T', U+1, V + len(durations))
        tdt = tdt_loss(logits, targets, encoder_out_lens, target_lens, durations=cfg.tdt_durations,
                       blank=self.blank_id, sigma=cfg.tdt_sigma, omega=cfg.tdt_omega, reduction="sum",
                       backend=cfg.backend)
        if cfg.tdt_aux == "none":
            return {"transducer_loss": tdt, "loss": tdt}
        simple = rnnt_loss_smoothed(
            self.simple_lm_proj(decoder_out), self.simple_am_proj(encoder_out), targets, encoder_out_lens, target_lens,
            blank=self.blank_id, lm_only_scale=cfg.lm_only_scale, am_only_scale=cfg.am_only_scale, reduction="sum",
        )
        s, p = pruned_loss_scales(self.batch_count, cfg) if self.training else (cfg.simple_loss_scale, 1.0)
        return {"transducer_loss": tdt, "simple_loss": simple, "loss": s * simple + p * tdt}

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
