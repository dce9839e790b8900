"""Typed training configuration (a dataclass; unknown keys are an error)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from asrprec.config import option, strict_from_dict
from asrprec.models.icefall import icefall_args_option
from asrprec.models.compile import COMPILE_DYNAMIC, COMPILE_MODES, COMPILE_REGIONS, COMPILE_SCHEDULES

OPTIMIZERS = ("scaled_adam", "adamw")
SCAN_OOM_MODES = ("auto", "on", "off")


@dataclass
class TrainConfig:
    """Everything the training loop needs besides the model, data and policy; each field is a flag of
    :func:`asrprec.training.cli.add_training_args`.

    The learning-rate schedule is Eden (:mod:`asrprec.training.optimizers`) for both optimizers.
    """

    exp_dir: str = option(help="the experiment folder: checkpoints, train.log, tensorboard/, config.json, "
                               "model.json, history.json")
    num_epochs: int = option(10, help="train up to and including this epoch")
    start_epoch: int = option(1, help="resume from epoch-(N-1).pt")
    start_batch: int = option(0, help="resume mid-epoch from checkpoint-N.pt")
    resume: str = option("", metavar="auto|latest|FILE",
                         help="resume from the newest complete checkpoint in --exp-dir (latest) or from FILE; the "
                              "resumed run continues exactly where the checkpoint was written. auto: as latest if "
                              "there is a complete checkpoint, else start a new run (one command line for the first "
                              "start and every restart by torchrun --max-restarts or a requeue)")
    init_from: str = option("", metavar="FILE|icefall:FILE",
                            help="fine-tune from FILE's weights (epoch-N.pt / checkpoint-N.pt of a run with this "
                                 "architecture), or from an icefall Zipformer checkpoint (icefall:FILE, whose "
                                 "architecture replaces the model flags); new optimizer and schedule")
    icefall_args: str = icefall_args_option()
    allow_nonfinite: bool = option(False, help="--init-from and --resume: load checkpoints whose weights hold NaN or "
                                               "Inf (refused by default, naming the tensor) with a warning, to debug a "
                                               "run that diverged")
    overwrite: bool = option(False, help="start a new run in an --exp-dir that holds another run's checkpoints "
                                         "(deleting them), or resume from an older checkpoint (deleting the newer "
                                         "ones)")
    max_skipped_fraction: float = option(
        0.1, help="stop with an error (after a checkpoint) when more than this share of an epoch's batches is "
                  "skipped (unreadable data, non-finite loss); an epoch without a trained batch always stops")
    optimizer: str = option("scaled_adam", choices=OPTIMIZERS, help="ScaledAdam (icefall's) or AdamW")
    base_lr: float = option(0.045, help="Eden's base learning rate")
    weight_decay: float = option(0.0, help="AdamW's weight decay (ScaledAdam has none)")
    lr_batches: float = option(7500.0, help="Eden: the (adjusted) batch count over which the rate decays")
    lr_epochs: float = option(3.5, help="Eden: the epoch count over which the rate decays")
    warmup_batches: int = option(500, help="Eden: linear warm-up over this many (adjusted) batches")
    ref_duration: float = option(
        0.0, help="seconds of audio one schedule batch stands for (icefall: 600); 0 = the per-rank "
                  "--max-duration (asrprec.training.schedules.schedule_batches_per_step explains the adjusted count)")
    encoder_schedule_scale: float = option(
        1.0, help="the encoder's own schedules (Zipformer dropout, layer skipping, balancers) see the adjusted batch "
                  "count x this; a tiny corpus trained for ~1,500 batches wants > 1")
    grad_clip: float = option(0.0, help="global-norm clipping for AdamW; 0 = off (ScaledAdam clips by itself)")
    log_interval: int = option(20, help="batches between log lines")
    valid_interval: int = option(0, help="batches between validations; 0 = at the end of each epoch only")
    save_every_n: int = option(0, help="batches between mid-epoch checkpoints; 0 = epoch checkpoints only")
    keep_last_k: int = option(5, help="mid-epoch checkpoints kept; 0 = all")
    average_period: int = option(
        200, help="keep a running mean of the weights every N batches in each checkpoint, for decoding with "
                  "--use-averaged-model (icefall's model_avg); 0 = off")
    max_batches_per_epoch: int = option(0, help="end each epoch after this many batches; 0 = the whole epoch")
    seed: int = option(42, help="random seed (rank r uses seed + r)")
    tensorboard: bool = option(True, help="write tensorboard logs (under --exp-dir)")
    progress_bar: bool = option(True, help="show a progress bar per epoch")
    scan_oom: str = option(
        "auto", choices=SCAN_OOM_MODES,
        help="before the first epoch, run forward+backward on the riskiest batches (longest cut, most audio, most "
             "cuts ...) so a --max-duration that does not fit fails at once with the fix; auto = on CUDA only")
    compile: bool = option(
        False, help="torch.compile the encoder (inductor) in place: every precision policy, DDP and checkpoints as "
                    "without it. Pays on runs much longer than the compile time (docs/compile.md)")
    compile_dynamic: str = option(
        "true", choices=COMPILE_DYNAMIC,
        help="with --compile: true = symbolic (B, T) from the first batch, one graph for every shape the bucketing "
             "sampler makes; auto = torch's default, a static graph first and a dynamic one at the first new shape; "
             "false = a graph per shape")
    compile_joiner: bool = option(False, help="with --compile: also compile the joiner (the loss's logits)")
    compile_regions: str = option(
        "model", choices=COMPILE_REGIONS,
        help="with --compile: model = the encoder as one compiled function (the fastest steps); layers = its "
             "front-end and each layer on their own, layers of one shape sharing their code: a compile several "
             "times shorter for deep models, at some of the step's speed-up (docs/compile.md)")
    compile_schedules: str = option(
        "constant", choices=COMPILE_SCHEDULES,
        help="with --compile: constant = a Zipformer schedule (dropout, skip rates, balancer limits) that has reached "
             "its last point is compiled in as a constant, each settling compiling the model again once; tensor = "
             "schedules stay run-time tensors, so settling compiles nothing, but rates that settled at 0 still draw "
             "their (keep-all) masks and the random stream departs from an eager run's (docs/compile.md)")
    compile_recompile_limit: int = option(
        24, help="with --compile: graphs each compiled function of the model may have before it runs eager. Early in "
                 "training the Zipformer specialises on schedules that settle, validation, one-utterance batches "
                 "(bounded, but past torch's default of 8 in the embedded recipe); the epoch log names any function "
                 "that reaches it")
    compile_optimizer: bool = option(
        False, help="with --compile: also compile ScaledAdam's update, one graph over every parameter (minutes more "
                    "compile; it pays where the per-tensor update costs much of a step: docs/compile.md)")
    compile_backend: str = option(
        "inductor", help="with --compile: the torch.compile backend. aot_eager traces forward and backward as inductor "
                         "does but runs eager kernels: a quick check that a model compiles and trains as in eager "
                         "mode before paying for inductor's code generation")
    compile_mode: str = option("default", choices=COMPILE_MODES,
                               help="with --compile: torch.compile's mode (max-autotune-no-cudagraphs: a longer "
                                    "compile that tries more GPU kernel configurations)")
    preempt_signals: tuple[str, ...] = option(
        ("SIGTERM", "SIGUSR1"), metavar="SIG,SIG,...",
        help="on one of these signals (SLURM --signal, Kubernetes before it kills a pod) every rank stops at the next "
             "step boundary, rank 0 writes a checkpoint at that batch and the process exits with code 75; the same "
             "command with --resume auto continues exactly. Empty = none")

    def __post_init__(self) -> None:
        if self.ref_duration < 0:
            raise ValueError(f"ref_duration must be >= 0 seconds (0 = this run's max_duration), got {self.ref_duration}")
        if not self.encoder_schedule_scale > 0:
            raise ValueError(f"encoder_schedule_scale must be > 0, got {self.encoder_schedule_scale}")
        if self.compile_recompile_limit < 1:
            raise ValueError(f"compile_recompile_limit must be >= 1, got {self.compile_recompile_limit}")
        if self.compile_optimizer and self.optimizer != "scaled_adam":
            raise ValueError(f"compile_optimizer compiles ScaledAdam's update, and the optimizer is {self.optimizer!r}; "
                             "fix: --optimizer scaled_adam, or leave --compile-optimizer off")
        if isinstance(self.compile_dynamic, bool):  # config.json of a run made when the flag was a switch
            self.compile_dynamic = "true" if self.compile_dynamic else "auto"
        if self.compile_dynamic not in COMPILE_DYNAMIC:
            raise ValueError(f"compile_dynamic must be one of {COMPILE_DYNAMIC}, got {self.compile_dynamic!r}")
        if self.compile_regions not in COMPILE_REGIONS:
            raise ValueError(f"compile_regions must be one of {COMPILE_REGIONS}, got {self.compile_regions!r}")
        if self.compile_schedules not in COMPILE_SCHEDULES:
            raise ValueError(f"compile_schedules must be one of {COMPILE_SCHEDULES}, got {self.compile_schedules!r}")
        if self.scan_oom not in SCAN_OOM_MODES:
            raise ValueError(f"scan_oom must be one of {SCAN_OOM_MODES}, got {self.scan_oom!r}")
        if self.average_period < 0:
            raise ValueError(f"average_period must be >= 0 (0 = no running average), got {self.average_period}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.num_epochs < 1 or self.start_epoch < 1:
            raise ValueError("num_epochs and start_epoch must be >= 1")
        if self.start_epoch > self.num_epochs:
            raise ValueError(f"start_epoch {self.start_epoch} > num_epochs {self.num_epochs}: nothing to train")
        if self.start_batch < 0:
            raise ValueError(f"start_batch must be >= 0 (0 = not a mid-epoch resume), got {self.start_batch}")
        given = [name for name, on in (("--resume", bool(self.resume)), ("--start-batch", self.start_batch > 0),
                                       ("--start-epoch", self.start_epoch > 1)) if on]
        if self.resume and len(given) > 1:
            raise ValueError(f"{' and '.join(given)} each name a checkpoint to resume from; pass only one")
        if not 0.0 <= self.max_skipped_fraction <= 1.0:
            raise ValueError(f"max_skipped_fraction must be in [0, 1] (a share of an epoch's batches), got "
                             f"{self.max_skipped_fraction}")
        from .preemption import parse_signals

        self.preempt_signals = tuple(self.preempt_signals)
        parse_signals(self.preempt_signals)  # raises naming the entry that is no signal
        if self.max_batches_per_epoch < 0:
            raise ValueError(f"max_batches_per_epoch must be >= 0 (0 = the whole epoch), got "
                             f"{self.max_batches_per_epoch}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        """Build from a plain dict (e.g. a checkpoint's config); unknown keys are an error naming them."""
        return strict_from_dict(cls, d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
