"""Command-line flags shared by every recipe, so recipes stay a page long (no copied argparse).

Recipes add their dataset flags and defaults; these functions add the rest and turn the parsed
namespace into typed configs.
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

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


def add_model_args(p: argparse.ArgumentParser, *, encoder: str = "conformer", size: str = "tiny") -> None:
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
    p.add_argument("--loss", choices=LOSSES, default="full",
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


def add_training_args(p: argparse.ArgumentParser, **defaults: Any) -> None:
    d = TrainConfig(**{"exp_dir": "exp", **defaults})
    p.add_argument("--exp-dir", default=d.exp_dir)
    p.add_argument("--num-epochs", type=int, default=d.num_epochs)
    p.add_argument("--start-epoch", type=int, default=d.start_epoch, help="resume from epoch-(N-1).pt")
    p.add_argument("--start-batch", type=int, default=d.start_batch, help="resume mid-epoch from checkpoint-N.pt")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=d.optimizer)
    p.add_argument("--base-lr", type=float, default=d.base_lr)
    p.add_argument("--lr-batches", type=float, default=d.lr_batches)
    p.add_argument("--lr-epochs", type=float, default=d.lr_epochs)
    p.add_argument("--warmup-batches", type=int, default=d.warmup_batches)
    p.add_argument("--encoder-schedule-scale", type=float, default=d.encoder_schedule_scale,
                   help="encoder schedules (Zipformer dropout/skip rates) see batch count × this")
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


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    keys = TrainConfig.__dataclass_fields__.keys()
    return TrainConfig(**{k: getattr(args, k) for k in keys if hasattr(args, k)})


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--epoch", type=int, required=True, help="decode with epoch-N.pt (averaged with --avg)")
    p.add_argument("--avg", type=int, default=1, help="average the last AVG epoch checkpoints ending at --epoch")
    p.add_argument("--use-averaged-model", action="store_true",
                   help="decode with the mean of the weights sampled (every --average-period batches) after epoch "
                        "EPOCH-AVG up to epoch EPOCH, from the running averages in the two checkpoints (icefall's "
                        "--use-averaged-model), instead of the mean of the AVG epoch-end weights")
    p.add_argument("--decoding-method", choices=("greedy_search", "modified_beam_search"), default="greedy_search")
    p.add_argument("--beam-size", type=int, default=4)
    p.add_argument("--max-sym-per-frame", type=int, default=1)
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
    import torch

    return name or ("cuda" if torch.cuda.is_available() else "cpu")


def setup_logging(log_file: str | None = None, rank: int = 0) -> None:
    """Log to stderr (rank 0) and to ``log_file``; other ranks log warnings only."""
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if log_file:
        handlers.append(logging.FileHandler(log_file))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s [%(name)s] %(message)s",
        handlers=handlers,
        force=True,
    )
