"""The model a run trains, as one flat dataclass of options: every recipe's model flags are its fields
(:func:`asrprec.config.add_dataclass_args`), and :func:`build_model` turns it into the transducer and the
``model.json`` record that decoding and export rebuild it from.

Head and objective names follow icefall's ``zipformer/train.py`` flags (k2-fsa/icefall
``egs/librispeech/ASR/zipformer/train.py``: ``--use-transducer``, ``--use-ctc``, ``--use-cr-ctc`` ...).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from asrprec.config import ConfigError, json_dict, option

from .builders import ENCODERS, build_transducer, resolved_encoder_overrides
from .ctc import CtcConfig
from .masks import FEATURE_NORMS
from .transducer import JOINT_MODES, LOSSES, TDT_AUX, LossConfig

__all__ = ["ModelOptions", "build_model"]


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"expected comma-separated integers such as 16,32,64,-1, got {text!r}") from None
    if any(v == 0 or v < -1 for v in values):
        raise ValueError(f"entries must be positive or -1 (full context), got {text!r}")
    return values


def _duration_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"expected comma-separated frame counts such as 0,1,2,3,4, got {text!r}") from None
    from asrprec.losses.tdt import validate_durations

    return validate_durations(values)


@dataclasses.dataclass
class ModelOptions:
    """Encoder, heads and loss of a run. The defaults are the library's recommended setup (a Zipformer trained
    with the pruned RNN-T loss), as :func:`asrprec.models.build_transducer`'s."""

    encoder: str = option("zipformer", choices=ENCODERS, help="encoder family")
    size: str = option("tiny", help="encoder preset: tiny, small, medium, large (see asrprec.models)")
    encoder_overrides: dict = option(
        default_factory=dict, parse=json_dict, metavar="JSON",
        help='preset fields to override, e.g. {"dropout": 0.0} (Conformer), {"frontend_channels": [8, 32, 128]}')
    # streaming-capable Zipformer (icefall zipformer/train.py --causal 1 --chunk-size ... --left-context-frames ...)
    causal: bool = option(False, help="causal Zipformer trained on chunks (streaming-capable)")
    chunk_size: tuple[int, ...] | None = option(
        None, parse=_int_list, metavar="N,N,...",
        help="causal: chunk sizes in 50 Hz frames, one drawn per batch (default 16,32,64,-1; -1 = full context)")
    left_context_frames: tuple[int, ...] | None = option(
        None, parse=_int_list, metavar="N,N,...",
        help="causal: left contexts in 50 Hz frames, one drawn per batch (default 64,128,256,-1)")
    feature_norm: str = option("none", choices=FEATURE_NORMS,
                               help="utterance: the encoder subtracts each utterance's mean per mel bin first "
                                    "(not with --causal); none: the features as given (icefall)")
    frontend_convnext: bool = option(
        True, takes_value=True,
        help="Zipformer: the front-end's ConvNeXt block (icefall's); false leaves it out, a cheaper front-end "
             "(the Conformer's front-end has none)")
    context_size: int = option(2, help="the stateless decoder's context: how many previous tokens it sees")
    decoder_dim: int | None = option(None, help="the decoder's width (default: 256 for tiny, else 512, icefall's)")
    joiner_dim: int | None = option(None, help="the joiner's hidden width (default: 256 for tiny, else 512)")
    loss: str = option("pruned", choices=LOSSES, help="full RNN-T, k2-style pruned RNN-T, or TDT")
    tdt_durations: tuple[int, ...] = option((0, 1, 2, 3, 4), parse=_duration_list, metavar="N,N,...",
                                            help="TDT: the frames an emission may advance (NeMo's durations)")
    tdt_sigma: float = option(0.0, help="TDT: logit under-normalisation (NeMo's sigma)")
    tdt_omega: float = option(0.0, help="TDT: probability of the plain RNN-T loss instead (NeMo's omega)")
    tdt_aux: str = option("simple", choices=TDT_AUX, help="TDT: add the pruned loss's smoothed simple loss, or none")
    joint_mode: str = option("full", choices=JOINT_MODES,
                             help="lean: the exact loss tile by tile, never holding (B, T, U+1, V) logits")
    loss_backend: str = option("auto", help="rnnt_loss backend (asrprec.losses.available_backends)")
    prune_range: int = option(5, help="pruned loss: symbols kept per frame")
    loss_warmup_batches: int = option(2000, help="pruned loss: batches over which its two scales ramp (icefall's "
                                                 "warm_step)")
    # heads and objectives, named as icefall's zipformer/train.py names them
    use_transducer: bool = option(True, takes_value=True, help="the transducer head (false + --use-ctc: CTC only)")
    use_ctc: bool = option(False, takes_value=True, help="a CTC head on the encoder")
    ctc_loss_scale: float | None = option(
        None, help="CTC loss weight (default: 1.0 alone, 0.2 beside a transducer, 0.1 with CR-CTC)")
    use_cr_ctc: bool = option(False, takes_value=True, help="consistency-regularised CTC (needs --use-ctc)")
    cr_loss_scale: float | None = option(
        None, help="CR-CTC consistency weight (default: 0.2 alone, 0.02 beside a transducer)")
    time_mask_ratio: float | None = option(
        None, help="CR-CTC time masking relative to SpecAugment's (default 2.5)")

    def ctc_config(self, time_warp_factor: int | None = None,
                   features_mask_size: int | None = None) -> CtcConfig | None:
        """The :class:`CtcConfig` of the CTC options (``time_warp_factor``, ``features_mask_size``: CR-CTC's warping
        and widest frequency mask, a recipe's SpecAugment settings), or None without ``use_ctc``.

        Raises:
            ValueError: a combination without a head, or a CTC or CR-CTC option without ``use_ctc`` /
                ``use_cr_ctc``.
        """
        if not self.use_transducer and not self.use_ctc:
            raise ValueError("--use-transducer false leaves the model without a head: add --use-ctc (a CTC-only "
                             "model) or keep the transducer")
        if not self.use_ctc:
            given = [f for f, v in (("--use-cr-ctc", self.use_cr_ctc), ("--ctc-loss-scale", self.ctc_loss_scale),
                                    ("--cr-loss-scale", self.cr_loss_scale),
                                    ("--time-mask-ratio", self.time_mask_ratio))
                     if v is not None and v is not False]
            if given:
                raise ValueError(f"{', '.join(given)} configure the CTC head: add --use-ctc")
            return None
        if not self.use_cr_ctc and (self.cr_loss_scale is not None or self.time_mask_ratio is not None):
            raise ValueError("--cr-loss-scale and --time-mask-ratio configure CR-CTC: add --use-cr-ctc")
        extra: dict[str, Any] = {} if self.time_mask_ratio is None else {"time_mask_ratio": self.time_mask_ratio}
        if self.use_cr_ctc:  # the model warps each utterance before duplicating it
            extra["time_warp_factor"] = time_warp_factor or None
            extra["features_mask_size"] = features_mask_size
        return CtcConfig(ctc_loss_scale=self.ctc_loss_scale, use_cr_ctc=self.use_cr_ctc,
                         cr_loss_scale=self.cr_loss_scale, **extra)

    def all_encoder_overrides(self) -> dict[str, Any]:
        """``encoder_overrides`` merged with ``causal``, ``chunk_size``, ``left_context_frames`` and
        ``feature_norm`` (written only when it is not ``"none"``), and ``frontend_convnext`` false as the
        Zipformer's ``convnext_hidden_ratio`` 0.

        Raises:
            ValueError: causal options for the Conformer, chunking without ``causal``, ``feature_norm`` other than
                ``"none"`` with ``causal``, or an override naming another ``feature_norm`` or a ConvNeXt that
                ``frontend_convnext`` false leaves out.
        """
        overrides = dict(self.encoder_overrides)
        if not self.frontend_convnext and self.encoder == "zipformer":
            if int(overrides.get("convnext_hidden_ratio", 0)) != 0:
                raise ConfigError(f"--model.encoder_overrides sets convnext_hidden_ratio "
                                  f"{overrides['convnext_hidden_ratio']} but --model.frontend_convnext is false: "
                                  "give one of them")
            overrides["convnext_hidden_ratio"] = 0
        if self.feature_norm != "none":
            if overrides.get("feature_norm", self.feature_norm) != self.feature_norm:
                raise ConfigError(f"--model.encoder_overrides sets feature_norm {overrides['feature_norm']!r} but "
                                  f"--model.feature_norm is {self.feature_norm!r}: give it once")
            if self.causal or overrides.get("causal", False):
                raise ConfigError(f"--model.feature_norm {self.feature_norm} needs the whole utterance, which a causal "
                                  "(streaming) model does not see: add --model.feature_norm none")
            overrides["feature_norm"] = self.feature_norm
        chunking = {k: v for k, v in (("chunk_size", self.chunk_size),
                                      ("left_context_frames", self.left_context_frames)) if v is not None}
        causal = self.causal or bool(overrides.get("causal", False))
        if (self.causal or chunking) and self.encoder != "zipformer":
            raise ConfigError(f"--causal, --chunk-size and --left-context-frames need --encoder zipformer "
                              f"(the {self.encoder} encoder has no causal mode)")
        if chunking and not causal:
            raise ConfigError("--chunk-size and --left-context-frames train a causal model: add --causal")
        if self.causal:
            overrides["causal"] = True
        overrides.update({k: list(v) for k, v in chunking.items()})
        return overrides

    def data_spec_augment(self, requested: bool) -> bool:
        """Whether the data module applies SpecAugment: as ``requested``, except under CR-CTC, whose model masks its
        two views of the unaugmented features itself (icefall trains CR-CTC with ``--enable-spec-aug 0``)."""
        return requested and not self.use_cr_ctc

    def tdt_fields(self) -> dict[str, Any]:
        """The TDT fields of :class:`LossConfig` (only for ``loss="tdt"``: the durations size the joiner, so
        ``model.json`` records them and decoding rebuilds the duration head from them)."""
        if self.loss != "tdt":
            return {}
        return {"tdt_durations": list(self.tdt_durations), "tdt_sigma": self.tdt_sigma, "tdt_omega": self.tdt_omega,
                "tdt_aux": self.tdt_aux}


def build_model(options: ModelOptions, vocab_size: int, blank_id: int = 0, *, time_warp_factor: int | None = None,
                features_mask_size: int | None = None, num_features: int | None = None,
                **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """The transducer ``options`` describe and its ``model.json`` record: the encoder's resolved fields (preset +
    overrides), so that decoding rebuilds this architecture even if the preset changes later.

    Args:
        options: the model options. vocab_size, blank_id: the tokenizer's.
        time_warp_factor, features_mask_size: CR-CTC's time warping and widest frequency mask (the recipe's
            SpecAugment settings; None: none, and 27 of every 80 bins).
        num_features: the features' width (the recipe's ``--data.num_mel_bins``); None: the encoder's default (80).
        kwargs: to :func:`build_transducer` (e.g. ``model_warmup_batches``).

    Raises:
        ValueError: ``encoder_overrides`` name a ``num_features`` other than ``num_features``.
    """
    o = options
    overrides = o.all_encoder_overrides()
    if num_features is not None:
        named = overrides.get("num_features", num_features)
        if int(named) != int(num_features):
            raise ConfigError(f"--model.encoder_overrides sets num_features {named} but the features have "
                              f"{num_features} bins (--data.num_mel_bins); drop num_features from the overrides")
        overrides["num_features"] = int(num_features)
    for name in ("decoder_dim", "joiner_dim"):
        if getattr(o, name) is not None and getattr(o, name) < 1:
            raise ConfigError(f"--model.{name} must be a positive width, got {getattr(o, name)}; leave it out for "
                              f"the preset's")
    model = build_transducer(
        encoder=o.encoder, size=o.size, vocab_size=vocab_size, blank_id=blank_id, context_size=o.context_size,
        decoder_dim=o.decoder_dim, joiner_dim=o.joiner_dim,
        encoder_overrides=overrides, use_transducer=o.use_transducer,
        ctc=o.ctc_config(time_warp_factor, features_mask_size),
        loss=LossConfig(loss=o.loss, joint_mode=o.joint_mode, backend=o.loss_backend, prune_range=o.prune_range,
                        loss_warmup_batches=o.loss_warmup_batches, **o.tdt_fields()),
        **kwargs,
    )
    model_config = {"encoder": o.encoder, "size": o.size, "vocab_size": vocab_size, "blank_id": blank_id,
                    "context_size": o.context_size, "encoder_overrides": resolved_encoder_overrides(model),
                    "loss": {"loss": o.loss, "joint_mode": o.joint_mode, "backend": o.loss_backend,
                             "prune_range": o.prune_range, **o.tdt_fields()}}
    # written only when they differ from the defaults, so that the model.json of a transducer is unchanged
    if not o.use_transducer:
        model_config["use_transducer"] = False
    for name in ("decoder_dim", "joiner_dim"):
        if getattr(o, name) is not None:
            model_config[name] = getattr(o, name)
    if model.ctc_config is not None:
        model_config["ctc"] = model.ctc_config.record()
    return model, model_config

