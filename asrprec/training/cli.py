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

from asrprec.models.transducer import JOINT_MODES, LOSSES
from asrprec.precision import POLICIES

from .config import OPTIMIZERS, SCAN_OOM_MODES, TrainConfig

PRECISION_HELP = (
    "precision policy: fp32 (float32 everywhere); amp-fp16 (autocast float16 + grad scaler); "
    "amp-bf16 (autocast bfloat16, fp32 weights); bf16 (whole model cast to bfloat16, fp32 master "
    "weights in the optimizer). Losses, log-softmax and normalisation statistics always run in fp32."
)


def add_precision_args(p: argparse.ArgumentParser, default: str = "fp32") -> None:
    p.add_argument("--precision", choices=POLICIES, default=default, help=PRECISION_HELP)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available, else cpu)")
    p.add_argument("--bf16-update", choices=("master", "none"), default="master",
                   help="bf16 policy only: fp32 master weights (default) or naive bf16 updates (for comparison)")


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
                   help="full: exact RNN-T; pruned: k2-style pruned RNN-T (simple loss + band of --prune-range)")
    p.add_argument("--joint-mode", choices=JOINT_MODES, default="full",
                   help="lean: exact loss computed tile by tile without materialising (B,T,U+1,V) logits")
    p.add_argument("--loss-backend", default="auto", help="rnnt_loss backend (see asrprec.losses.available_backends)")
    p.add_argument("--prune-range", type=int, default=5)
    p.add_argument("--loss-warmup-batches", type=int, default=2000,
                   help="pruned loss: batches over which the simple/pruned loss scales ramp (icefall warm_step)")


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
    from asrprec.models import LossConfig, build_transducer, resolved_encoder_overrides

    model = build_transducer(
        encoder=args.encoder, size=args.size, vocab_size=tokenizer.vocab_size, blank_id=tokenizer.blank_id,
        context_size=args.context_size, encoder_overrides=encoder_overrides_from_args(args),
        loss=LossConfig(loss=args.loss, joint_mode=args.joint_mode, backend=args.loss_backend,
                        prune_range=args.prune_range, loss_warmup_batches=args.loss_warmup_batches),
        **kwargs,
    )
    model_config = {"encoder": args.encoder, "size": args.size, "vocab_size": tokenizer.vocab_size,
                    "blank_id": tokenizer.blank_id, "context_size": args.context_size,
                    "encoder_overrides": resolved_encoder_overrides(model),
                    "loss": {"loss": args.loss, "joint_mode": args.joint_mode, "backend": args.loss_backend,
                             "prune_range": args.prune_range}}
    return model, model_config


def add_training_args(p: argparse.ArgumentParser, **defaults: Any) -> None:
    d = TrainConfig(**{"exp_dir": "exp", **defaults})
    p.add_argument("--exp-dir", default=d.exp_dir)
    p.add_argument("--num-epochs", type=int, default=d.num_epochs)
    p.add_argument("--start-epoch", type=int, default=d.start_epoch, help="resume from epoch-(N-1).pt")
    p.add_argument("--start-batch", type=int, default=d.start_batch, help="resume mid-epoch from checkpoint-N.pt")
    p.add_argument("--resume", default=d.resume, metavar="latest|FILE",
                   help="resume from the newest complete checkpoint in --exp-dir (latest) or from FILE; the resumed "
                        "run continues exactly where the checkpoint was written")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new run in an --exp-dir that holds another run's checkpoints (deleting them), or "
                        "resume from an older checkpoint (deleting the newer ones)")
    p.add_argument("--max-skipped-fraction", type=float, default=d.max_skipped_fraction,
                   help="stop with an error (after a checkpoint) when more than this share of an epoch's batches is "
                        "skipped (unreadable data, non-finite loss); an epoch without a trained batch always stops")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=d.optimizer)
    p.add_argument("--base-lr", type=float, default=d.base_lr)
    p.add_argument("--lr-batches", type=float, default=d.lr_batches)
    p.add_argument("--lr-epochs", type=float, default=d.lr_epochs)
    p.add_argument("--warmup-batches", type=int, default=d.warmup_batches)
    p.add_argument("--ref-duration", type=float, default=d.ref_duration,
                   help="seconds of audio one schedule batch stands for: Eden, the loss warm-up and the encoder "
                        "schedules count steps × world size × max-duration / this (icefall: 600); 0 = the "
                        "per-rank --max-duration, i.e. steps × world size (one process: its steps)")
    p.add_argument("--encoder-schedule-scale", type=float, default=d.encoder_schedule_scale,
                   help="encoder schedules (Zipformer dropout/skip rates) see the (adjusted) batch count × this")
    p.add_argument("--grad-clip", type=float, default=d.grad_clip)
    p.add_argument("--log-interval", type=int, default=d.log_interval)
    p.add_argument("--valid-interval", type=int, default=d.valid_interval)
    p.add_argument("--save-every-n", type=int, default=d.save_every_n)
    p.add_argument("--keep-last-k", type=int, default=d.keep_last_k)
    p.add_argument("--average-period", type=int, default=d.average_period,
                   help="keep a running mean of the weights every N batches in each checkpoint, for decoding with "
                        "--use-averaged-model (icefall's model_avg); 0 = off")
    p.add_argument("--max-batches-per-epoch", type=int, default=d.max_batches_per_epoch)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--scan-oom", choices=SCAN_OOM_MODES, default=d.scan_oom,
                   help="before the first epoch, run forward+backward on the riskiest batches (longest cut, most "
                        "audio, most cuts ...) so a --max-duration that does not fit fails at once with the fix; "
                        "auto = on CUDA only")
    p.add_argument("--no-tensorboard", dest="tensorboard", action="store_false")
    p.add_argument("--no-progress-bar", dest="progress_bar", action="store_false")


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
    program with its message (and in the log) instead of a traceback."""
    from asrprec.checkpoint import CheckpointError
    from asrprec.data.validate import DataCheckError

    from .experiment import ExperimentError
    from .loop import TooManySkippedBatches
    from .resume import ResumeMismatchError

    try:
        main()
    except (ExperimentError, CheckpointError, FileNotFoundError, TooManySkippedBatches, ResumeMismatchError,
            DataCheckError) as e:
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
    keys = TrainConfig.__dataclass_fields__.keys()
    try:
        return TrainConfig(**{k: getattr(args, k) for k in keys if hasattr(args, k)})
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
    p.add_argument("--decoding-method", choices=("greedy_search", "modified_beam_search"), default="greedy_search")
    p.add_argument("--beam-size", type=int, default=4)
    p.add_argument("--max-sym-per-frame", type=int, default=1)
    p.add_argument("--greedy-method", choices=("label_looping", "frame_looping"), default="label_looping",
                   help="greedy_search by label looping (asrprec.decoding.LabelLoopingGreedy: batched, CUDA graphs on "
                        "a GPU) or by frame looping (asrprec.decoding.greedy_search); the same results")
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
