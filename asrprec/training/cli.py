"""Command-line flags shared by every recipe, so recipes stay a page long (no copied argparse).

Recipes add their dataset flags and defaults; these functions add the rest and turn the parsed
namespace into typed configs.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any, Callable

from asrprec.config import add_dataclass_args, dataclass_from_args
from asrprec.models.transducer import JOINT_MODES, LOSSES, TDT_AUX
from asrprec.precision import POLICIES

from .config import TrainConfig

#: the DataConfig fields that are flags (the other fields are a recipe's decisions)
DATA_FLAGS = ("max_duration", "num_buckets", "num_workers", "on_the_fly_feats", "spec_augment")

PRECISION_HELP = (
    "precision policy: fp32 (float32 everywhere); amp-fp16 (autocast float16 + grad scaler); "
    "amp-bf16 (autocast bfloat16, fp32 weights); bf16 (whole model cast to bfloat16, fp32 master "
    "weights in the optimizer). Losses, log-softmax and normalisation statistics always run in fp32."
)


def add_precision_args(p: argparse.ArgumentParser, default: str = "fp32") -> None:
    p.add_argument("--precision", choices=POLICIES, default=default, help=PRECISION_HELP)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available, else cpu)")
    p.add_argument("--bf16-update", choices=("master", "kahan", "stochastic", "none"), default="master",
                   help="bf16 policy only, how the optimizer writes bf16 weights: master (fp32 master weights, "
                        "+4 B/parameter; default), kahan (bf16 compensation buffer, +2 B), stochastic (stochastic "
                        "rounding, +0 B) or none (round to nearest: small updates are lost; for comparison)")
    p.add_argument("--bf16-moments", action="store_true",
                   help="bf16 policy with --bf16-update kahan|stochastic|none only: keep the optimizer's moment "
                        "buffers in bf16 too (-4 B/parameter)")


def policy_from_args(args: argparse.Namespace):
    """The precision policy the flags of :func:`add_precision_args` name, on this process's device."""
    from asrprec.precision import get_policy

    return get_policy(args.precision, resolve_device(args.device), bf16_update=args.bf16_update,
                      bf16_moments=args.bf16_moments)


def _json_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}); write e.g. '{{\"dropout\": 0.0}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of preset fields, got {type(value).__name__}")
    return value


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 16,32,64,-1, got {text!r}") from None
    if any(v == 0 or v < -1 for v in values):
        raise argparse.ArgumentTypeError(f"entries must be positive or -1 (full context), got {text!r}")
    return values


def _duration_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated frame counts such as 0,1,2,3,4, got {text!r}") from None
    from asrprec.losses.tdt import validate_durations

    try:
        return validate_durations(values)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_model_args(p: argparse.ArgumentParser, *, encoder: str = "zipformer", size: str = "tiny") -> None:
    """Model flags; the defaults are the library's recommended setup (Zipformer, pruned RNN-T loss), as
    :func:`asrprec.models.build_transducer`'s."""
    p.add_argument("--encoder", choices=("conformer", "zipformer"), default=encoder)
    p.add_argument("--size", default=size, help="encoder preset: tiny, small, ... (see asrprec.models)")
    p.add_argument("--encoder-overrides", type=_json_dict, default={}, metavar="JSON",
                   help='override preset fields, e.g. \'{"dropout": 0.0, "layer_dropout": 0.0}\' (Conformer) or '
                        '\'{"frontend_channels": [8, 32, 128]}\' (Zipformer)')
    # streaming-capable Zipformer (icefall zipformer/train.py --causal 1 --chunk-size ... --left-context-frames ...)
    p.add_argument("--causal", action="store_true",
                   help="Zipformer: causal, streaming-capable model trained on chunks (decode with --chunk-size)")
    p.add_argument("--chunk-size", type=_int_list, default=None, metavar="N,N,...",
                   help="causal Zipformer: chunk sizes in 50 Hz frames, one drawn per batch (default 16,32,64,-1; "
                        "-1 = full context)")
    p.add_argument("--left-context-frames", type=_int_list, default=None, metavar="N,N,...",
                   help="causal Zipformer: left contexts in 50 Hz frames, one drawn per batch (default 64,128,256,-1)")
    p.add_argument("--context-size", type=int, default=2)
    p.add_argument("--loss", choices=LOSSES, default="pruned",
                   help="full: exact RNN-T; pruned: k2-style pruned RNN-T (simple loss + band of --prune-range); "
                        "tdt: token-and-duration transducer (the joiner also predicts --tdt-durations)")
    p.add_argument("--tdt-durations", type=_duration_list, default=(0, 1, 2, 3, 4), metavar="N,N,...",
                   help="--loss tdt: the frames an emission may advance (NeMo's durations)")
    p.add_argument("--tdt-sigma", type=float, default=0.0,
                   help="--loss tdt: logit under-normalisation subtracted from token log-probs (NeMo's sigma)")
    p.add_argument("--tdt-omega", type=float, default=0.0,
                   help="--loss tdt: probability of the plain RNN-T loss on the token logits instead (NeMo's omega)")
    p.add_argument("--tdt-aux", choices=TDT_AUX, default="simple",
                   help="--loss tdt: add the pruned loss's smoothed simple loss (warmed up as there), or none")
    p.add_argument("--joint-mode", choices=JOINT_MODES, default="full",
                   help="lean: exact loss computed tile by tile without materialising (B,T,U+1,V) logits")
    p.add_argument("--loss-backend", default="auto", help="rnnt_loss backend (see asrprec.losses.available_backends)")
    p.add_argument("--prune-range", type=int, default=5)
    p.add_argument("--loss-warmup-batches", type=int, default=2000,
                   help="pruned loss: batches over which the simple/pruned loss scales ramp (icefall warm_step)")
    # heads and objectives, named as icefall's zipformer/train.py names them
    p.add_argument("--use-transducer", type=_bool, nargs="?", const=True, default=True, metavar="true|false",
                   help="the transducer head (decoder + joiner); false with --use-ctc trains a CTC-only model")
    p.add_argument("--use-ctc", type=_bool, nargs="?", const=True, default=False, metavar="true|false",
                   help="a CTC head on the encoder (beside the transducer, or alone with --use-transducer false)")
    p.add_argument("--ctc-loss-scale", type=float, default=None,
                   help="weight of the CTC loss (default: icefall's recipes' value: 1.0 alone, 0.2 beside a "
                        "transducer, 0.1 beside a transducer with --use-cr-ctc)")
    p.add_argument("--use-cr-ctc", type=_bool, nargs="?", const=True, default=False, metavar="true|false",
                   help="consistency-regularised CTC (arXiv 2410.05101): two SpecAugment views per utterance, masked "
                        "by the model (the data module's SpecAugment is then off); needs --use-ctc")
    p.add_argument("--cr-loss-scale", type=float, default=None,
                   help="weight of CR-CTC's consistency term (default: 0.2 alone, 0.02 beside a transducer)")
    p.add_argument("--time-mask-ratio", type=float, default=None,
                   help="CR-CTC's time masking relative to the usual SpecAugment: int(10*r) masks over at most "
                        "0.15*r of the frames (default 2.5)")


def _bool(text: str) -> bool:
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false (or 1/0), got {text!r}")


def ctc_config_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~asrprec.models.CtcConfig` of ``--use-ctc`` ... ``--time-mask-ratio`` (and, for CR-CTC, a recipe's
    ``--spec-aug-time-warp-factor``), or None without ``--use-ctc``.

    Raises:
        ValueError: a combination without a head, or a CTC or CR-CTC flag without ``--use-ctc`` / ``--use-cr-ctc``.
    """
    from asrprec.models import CtcConfig

    if not args.use_transducer and not args.use_ctc:
        raise ValueError("--use-transducer false leaves the model without a head: add --use-ctc (a CTC-only model) "
                         "or keep the transducer")
    if not args.use_ctc:
        given = [f for f, v in (("--use-cr-ctc", args.use_cr_ctc), ("--ctc-loss-scale", args.ctc_loss_scale),
                                ("--cr-loss-scale", args.cr_loss_scale), ("--time-mask-ratio", args.time_mask_ratio))
                 if v is not None and v is not False]
        if given:
            raise ValueError(f"{', '.join(given)} configure the CTC head: add --use-ctc")
        return None
    if not args.use_cr_ctc and (args.cr_loss_scale is not None or args.time_mask_ratio is not None):
        raise ValueError("--cr-loss-scale and --time-mask-ratio configure CR-CTC: add --use-cr-ctc")
    extra = {} if args.time_mask_ratio is None else {"time_mask_ratio": args.time_mask_ratio}
    if args.use_cr_ctc:  # the model warps each utterance before duplicating it (a recipe's SpecAugment flag)
        extra["time_warp_factor"] = getattr(args, "spec_aug_time_warp_factor", None) or None
    return CtcConfig(ctc_loss_scale=args.ctc_loss_scale, use_cr_ctc=args.use_cr_ctc, cr_loss_scale=args.cr_loss_scale,
                     **extra)


def data_spec_augment(args: argparse.Namespace, requested: bool) -> bool:
    """Whether the data module applies SpecAugment: as ``requested``, except under ``--use-cr-ctc``, whose model
    masks its two views of the unaugmented features itself (icefall trains CR-CTC with ``--enable-spec-aug 0``)."""
    return requested and not getattr(args, "use_cr_ctc", False)


def encoder_overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """``--encoder-overrides`` merged with ``--causal``, ``--chunk-size`` and ``--left-context-frames``."""
    overrides = dict(args.encoder_overrides)
    chunking = {k: v for k, v in (("chunk_size", args.chunk_size), ("left_context_frames", args.left_context_frames))
                if v is not None}
    causal = args.causal or bool(overrides.get("causal", False))
    if (args.causal or chunking) and args.encoder != "zipformer":
        raise ValueError(f"--causal, --chunk-size and --left-context-frames need --encoder zipformer "
                         f"(the {args.encoder} encoder has no causal mode)")
    if chunking and not causal:
        raise ValueError("--chunk-size and --left-context-frames train a causal model: add --causal")
    if args.causal:
        overrides["causal"] = True
    overrides.update({k: list(v) for k, v in chunking.items()})
    return overrides


def build_model_from_args(args: argparse.Namespace, tokenizer, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """The transducer the flags of :func:`add_model_args` describe, for ``tokenizer``'s vocabulary, and its config
    for ``model.json``: the encoder's resolved fields (preset + overrides), so that decoding rebuilds this
    architecture even if the preset changes later. ``kwargs`` go to ``build_transducer`` (e.g.
    ``model_warmup_batches``)."""
    import dataclasses

    from asrprec.models import LossConfig, build_transducer, resolved_encoder_overrides

    ctc = ctc_config_from_args(args)
    model = build_transducer(
        encoder=args.encoder, size=args.size, vocab_size=tokenizer.vocab_size, blank_id=tokenizer.blank_id,
        context_size=args.context_size, encoder_overrides=encoder_overrides_from_args(args),
        use_transducer=args.use_transducer, ctc=ctc,
        loss=LossConfig(loss=args.loss, joint_mode=args.joint_mode, backend=args.loss_backend,
                        prune_range=args.prune_range, loss_warmup_batches=args.loss_warmup_batches,
                        **_tdt_fields(args)),
        **kwargs,
    )
    model_config = {"encoder": args.encoder, "size": args.size, "vocab_size": tokenizer.vocab_size,
                    "blank_id": tokenizer.blank_id, "context_size": args.context_size,
                    "encoder_overrides": resolved_encoder_overrides(model),
                    "loss": {"loss": args.loss, "joint_mode": args.joint_mode, "backend": args.loss_backend,
                             "prune_range": args.prune_range, **_tdt_fields(args)}}
    # written only when they differ from the defaults, so that the model.json of a transducer is unchanged
    if not args.use_transducer:
        model_config["use_transducer"] = False
    if model.ctc_config is not None:
        model_config["ctc"] = dataclasses.asdict(model.ctc_config)
    return model, model_config


def _tdt_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The TDT fields of :class:`asrprec.models.LossConfig` (only with ``--loss tdt``: the durations size the
    joiner, so ``model.json`` records them and decoding rebuilds the duration head from them)."""
    if args.loss != "tdt":
        return {}
    return {"tdt_durations": list(args.tdt_durations), "tdt_sigma": args.tdt_sigma, "tdt_omega": args.tdt_omega,
            "tdt_aux": args.tdt_aux}


def add_training_args(p: argparse.ArgumentParser, **defaults: Any) -> None:
    """One flag per :class:`TrainConfig` field (:func:`asrprec.config.add_dataclass_args`); ``defaults`` are the
    recipe's (checked by building a TrainConfig from them)."""
    TrainConfig(**{"exp_dir": "exp", **defaults})
    add_dataclass_args(p, TrainConfig, defaults={"exp_dir": "exp", **defaults})


def add_data_args(p: argparse.ArgumentParser, **defaults: Any) -> None:
    """The :class:`asrprec.data.DataConfig` fields a run chooses on the command line (:data:`DATA_FLAGS`), with the
    recipe's ``defaults``; :func:`data_config_from_args` reads them back."""
    from asrprec.data import DataConfig

    add_dataclass_args(p, DataConfig, only=DATA_FLAGS, defaults=defaults)


def data_config_from_args(args: argparse.Namespace, **decisions: Any):
    """The :class:`asrprec.data.DataConfig` of the :func:`add_data_args` flags, ``--seed``, and the recipe's
    ``decisions`` (fields that are no flag, or flags it overrides); an invalid value exits like an argparse
    error."""
    from asrprec.data import DataConfig

    try:
        return dataclass_from_args(DataConfig, argparse.Namespace(**{k: getattr(args, k) for k in (*DATA_FLAGS, "seed")
                                                                     if hasattr(args, k)}), **decisions)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def add_data_check_args(p: argparse.ArgumentParser) -> None:
    """``--validate-data`` and ``--max-oov-fraction`` (:func:`asrprec.data.check_cuts`)."""
    p.add_argument("--validate-data", choices=("fast", "full", "off"), default="fast",
                   help="before training/decoding, drop and report cuts that cannot be used (empty transcript, words "
                        "the tokenizer cannot spell, too short for the encoder, missing files); full also decodes "
                        "every feature/audio file")
    p.add_argument("--max-oov-fraction", type=float, default=0.0,
                   help="drop a training/dev cut when more than this share of its words lie outside the tokenizer's "
                        "vocabulary (they would train as <unk>)")


def check_splits(cuts: dict[str, Any], args: argparse.Namespace, tokenizer, min_frames: int, *,
                 max_duration: float | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each split's cuts without those that cannot be used (:func:`asrprec.data.check_cuts` with the flags of
    :func:`add_data_check_args`; dropped cuts are counted and named in the log), and each split's report."""
    from asrprec.data import check_cuts

    kept, checks = {}, {}
    for split, split_cuts in cuts.items():
        kwargs = {} if max_duration is None else {"max_duration": max_duration}
        kept[split], report = check_cuts(split_cuts, split=split, tokenizer=tokenizer, mode=args.validate_data,
                                         max_oov_fraction=args.max_oov_fraction, min_frames=min_frames, **kwargs)
        checks[split] = report.to_dict()
    return kept, checks


def run_main(main: Callable[[], Any], prog: str) -> None:
    """Run a recipe's ``main``; an error a user can fix (a bad folder, checkpoint, argument or data) ends the
    program with its message (and in the log) instead of a traceback. A preempted run
    (:class:`~asrprec.training.preemption.TrainingPreempted`) exits with
    :data:`~asrprec.training.preemption.PREEMPTED_EXIT_CODE` (75)."""
    import sys

    from asrprec.checkpoint import CheckpointError
    from asrprec.data.corpora import CorpusError
    from asrprec.data.validate import DataCheckError

    from .experiment import ExperimentError
    from .preemption import TrainingPreempted
    from .resume import ResumeMismatchError
    from .skips import TooManySkippedBatches

    try:
        main()
    except TrainingPreempted as e:
        logging.getLogger("asrprec").warning("%s", e)
        print(f"{prog}: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    except (ExperimentError, CheckpointError, FileNotFoundError, TooManySkippedBatches, ResumeMismatchError,
            DataCheckError, CorpusError) as e:
        logging.getLogger("asrprec").error("%s", e)
        raise SystemExit(f"{prog}: error: {e}") from None


def begin_training(args: argparse.Namespace) -> TrainConfig:
    """The first steps of a recipe's ``train.py``: join torchrun's process group (nothing under a plain ``python``),
    the typed config, the experiment folder and its log (rank 0), ``--threads``, and the seed (before the model is
    built, so that ``--seed`` fixes its initialisation too)."""
    import torch

    from asrprec.rng import seed_everything

    from .distributed import get_rank, setup_distributed

    setup_distributed(args.device)
    cfg = train_config_from_args(args)
    Path(args.exp_dir).mkdir(parents=True, exist_ok=True)
    setup_logging(str(Path(args.exp_dir) / "train.log"), rank=get_rank())
    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    return cfg


def announce(args: argparse.Namespace, model, policy) -> None:
    """Print the model and the precision (rank 0)."""
    from asrprec.models import count_parameters

    from .distributed import is_main_process

    if is_main_process():
        print(f"model: {args.encoder}/{args.size}, {count_parameters(model):,} parameters; "
              f"precision: {policy.describe()}")


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` of parsed flags; an invalid combination exits like an argparse error."""
    try:
        return dataclass_from_args(TrainConfig, args)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--epoch", type=int, required=True, help="decode with epoch-N.pt (averaged with --avg)")
    p.add_argument("--avg", type=int, default=1, help="average the last AVG epoch checkpoints ending at --epoch")
    p.add_argument("--use-averaged-model", action="store_true",
                   help="decode with the mean of the weights sampled (every --average-period batches) after epoch "
                        "EPOCH-AVG up to epoch EPOCH, from the running averages in the two checkpoints (icefall's "
                        "--use-averaged-model), instead of the mean of the AVG epoch-end weights")
    p.add_argument("--validate-data", choices=("fast", "full", "off"), default="fast",
                   help="leave out (and report) cuts the encoder cannot take or whose files are missing; full also "
                        "decodes every feature file first")
    from asrprec.decoding.api import METHODS
    from asrprec.decoding.label_looping import DEFAULT_GREEDY_METHOD, GREEDY_METHODS

    p.add_argument("--decoding-method", choices=METHODS, default="greedy_search",
                   help="greedy_search / modified_beam_search decode the transducer, ctc_greedy_search / "
                        "ctc_prefix_beam_search the CTC head (a hybrid model takes all four)")
    p.add_argument("--beam-size", type=int, default=4,
                   help="modified_beam_search and ctc_prefix_beam_search: hypotheses kept per utterance")
    p.add_argument("--max-sym-per-frame", type=int, default=1,
                   help="at most this many tokens per encoder frame: greedy_search, and both searches of a TDT model "
                        "(NeMo's max_symbols)")
    p.add_argument("--greedy-method", choices=GREEDY_METHODS, default=DEFAULT_GREEDY_METHOD,
                   help="greedy_search by label looping (asrprec.decoding.LabelLoopingGreedy: batched, CUDA graphs on "
                        "a GPU) or by frame looping (asrprec.decoding.greedy_search); the same results. A TDT model: "
                        "TdtLabelLoopingGreedy or tdt_greedy_search")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="causal Zipformer only (required there): decode in chunks of this many 50 Hz frames "
                        "(simulated streaming), or -1 for full context")
    p.add_argument("--left-context-frames", type=int, default=None,
                   help="causal Zipformer only: left context in 50 Hz frames for chunked decoding (-1 = all)")
    p.add_argument("--streaming", action="store_true",
                   help="causal Zipformer only: decode as live streams, chunk by chunk with the encoder's caches "
                        "(icefall's streaming_decode.py), instead of simulating streaming with a chunk mask; needs "
                        "--chunk-size > 0 and a finite --left-context-frames")
    p.add_argument("--tail-padding", type=float, default=0.0, metavar="SECONDS",
                   help="with --streaming: end each stream as a sherpa-onnx client does, with this much silence "
                        "appended to the audio (its examples: 0.66) and only whole chunks decoded; features are "
                        "then computed from the padded audio")


def resolve_device(name: str | None) -> str:
    """``name``, or cuda if available else cpu; under torchrun ``cuda`` is this process's ``cuda:LOCAL_RANK``."""
    from .distributed import rank_device

    return str(rank_device(name))


def setup_logging(log_file: str | None = None, rank: int | None = None) -> None:
    """Rank 0 (default: this process's rank) logs to stderr and ``log_file``; other ranks log warnings to
    stderr only, tagged with their rank (only rank 0 writes files)."""
    import os

    from .distributed import get_rank, get_world_size

    if rank is None:  # torchrun's RANK also before the process group exists
        rank = get_rank() if get_world_size() > 1 else int(os.environ.get("RANK", "0"))
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if log_file and rank == 0:
        handlers.append(logging.FileHandler(log_file))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s [%(name)s] " + (f"[rank {rank}] " if rank else "") + "%(message)s",
        handlers=handlers,
        force=True,
    )
