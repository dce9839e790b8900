"""Typed training configuration: :class:`TrainConfig` (the loop's section; unknown keys are an error) and
:class:`TrainingConfig`, the config of a whole run (model, precision, data, train, checks), which a recipe extends
with its own section and reads from flags and YAML files (:func:`training_command_line`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

from asrprec.config import option, strict_from_dict
from asrprec.data import CheckOptions, DataConfig
from asrprec.models import ModelOptions
from asrprec.models.compile import COMPILE_SCHEDULES, CompileOptions
from asrprec.models.icefall import icefall_args_option
from asrprec.precision import PrecisionOptions

OPTIMIZERS = ("scaled_adam", "adamw")
SCAN_OOM_MODES = ("auto", "on", "off")


@dataclass
class TrainConfig(CompileOptions):
    """Everything the training loop needs besides the model, data and policy (the ``train`` section). The compile
    fields it shares with decoding are :class:`~asrprec.models.compile.CompileOptions`'; the why of each field is
    in docs/configuration.md.

    The learning-rate schedule is Eden (:mod:`asrprec.training.optimizers`) for both optimizers.
    """

    exp_dir: str = option(help="the experiment folder (checkpoints, logs, config.yaml, model.json)", kw_only=True)
    num_epochs: int = option(10, help="train up to and including this epoch")
    start_epoch: int = option(1, help="resume from epoch-(N-1).pt")
    start_batch: int = option(0, help="resume mid-epoch from checkpoint-N.pt")
    resume: str = option("", metavar="auto|latest|FILE",
                         help="resume: the newest checkpoint (latest), FILE, or latest if any (auto)")
    init_from: str = option("", metavar="FILE|icefall:FILE",
                            help="fine-tune from FILE's weights or an icefall checkpoint (new optimizer)")
    icefall_args: str = icefall_args_option()
    allow_nonfinite: bool = option(False, help="load checkpoints holding NaN or Inf weights (to debug a divergence)")
    overwrite: bool = option(False, help="delete another run's checkpoints in --exp-dir (or newer ones on resume)")
    max_skipped_fraction: float = option(0.1, help="stop when more than this share of an epoch's batches is skipped")
    optimizer: str = option("scaled_adam", choices=OPTIMIZERS, help="ScaledAdam (icefall's) or AdamW")
    base_lr: float = option(0.045, help="Eden's base learning rate")
    weight_decay: float = option(0.0, help="AdamW's weight decay (ScaledAdam has none)")
    lr_batches: float = option(7500.0, help="Eden: the (adjusted) batch count over which the rate decays")
    lr_epochs: float = option(3.5, help="Eden: the epoch count over which the rate decays")
    warmup_batches: int = option(500, help="Eden: linear warm-up over this many (adjusted) batches")
    ref_duration: float = option(0.0, help="seconds of audio one schedule batch stands for (icefall: 600; 0 = "
                                           "--max-duration)")
    encoder_schedule_scale: float = option(1.0, help="the encoder's own schedules see the adjusted batch count x "
                                                     "this")
    grad_clip: float = option(0.0, help="global-norm clipping for AdamW; 0 = off (ScaledAdam clips by itself)")
    log_interval: int = option(20, help="batches between log lines")
    valid_interval: int = option(0, help="batches between validations; 0 = at the end of each epoch only")
    save_every_n: int = option(0, help="batches between mid-epoch checkpoints; 0 = epoch checkpoints only")
    keep_last_k: int = option(5, help="mid-epoch checkpoints kept; 0 = all")
    average_period: int = option(200, help="batches between samples of the weights' running average; 0 = off")
    max_batches_per_epoch: int = option(0, help="end each epoch after this many batches; 0 = the whole epoch")
    seed: int = option(42, help="random seed (rank r uses seed + r)")
    threads: int = option(0, help="torch threads (0 = torch's default)")
    tensorboard: bool = option(True, help="write tensorboard logs (under --exp-dir)")
    progress_bar: bool = option(True, help="show a progress bar per epoch")
    scan_oom: str = option("auto", choices=SCAN_OOM_MODES,
                           help="run the riskiest batches before the first epoch; auto = on CUDA only")
    compile_joiner: bool = option(False, help="with compile: also compile the joiner")
    compile_schedules: str = option("constant", choices=COMPILE_SCHEDULES,
                                    help="with compile: settled Zipformer schedules as constants or tensors")
    compile_recompile_limit: int = option(24, help="with compile: graphs per compiled function before it runs eager")
    compile_optimizer: bool = option(False, help="with compile: also compile ScaledAdam's update")
    compile_backend: str = option("inductor", help="with compile: torch.compile's backend (aot_eager: a quick check)")
    preempt_signals: tuple[str, ...] = option(("SIGTERM", "SIGUSR1"), metavar="SIG,SIG,...",
                                              help="signals that stop at a step boundary with a checkpoint (exit 75)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0 = torch's default), got {self.threads}")
        if self.ref_duration < 0:
            raise ValueError(f"ref_duration must be >= 0 seconds (0 = this run's max_duration), got {self.ref_duration}")
        if not self.encoder_schedule_scale > 0:
            raise ValueError(f"encoder_schedule_scale must be > 0, got {self.encoder_schedule_scale}")
        if self.compile_recompile_limit < 1:
            raise ValueError(f"compile_recompile_limit must be >= 1, got {self.compile_recompile_limit}")
        if self.compile_optimizer and self.optimizer != "scaled_adam":
            raise ValueError(f"compile_optimizer compiles ScaledAdam's update, and the optimizer is {self.optimizer!r}; "
                             "fix: --optimizer scaled_adam, or leave --compile-optimizer off")
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


@dataclass
class TrainingConfig:
    """The config of a training run, one section per concern; a recipe subclasses it to add its own section (the
    dataset's choices). ``data.seed`` follows ``train.seed`` (:data:`DERIVED`)."""

    model: ModelOptions = field(default_factory=ModelOptions)
    precision: PrecisionOptions = field(default_factory=PrecisionOptions)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(exp_dir="exp"))
    checks: CheckOptions = field(default_factory=CheckOptions)

    def __post_init__(self) -> None:
        if self.data.seed != self.train.seed:
            from dataclasses import replace

            self.data = replace(self.data, seed=self.train.seed)


#: config keys set from others: the data sampler's seed is the run's
DERIVED = {"data.seed": "train.seed"}

#: the plain flags of every recipe's train.py (any other field: --section.field VALUE or a --config file)
TRAIN_FLAGS: tuple[str, ...] = (
    "precision.precision", "precision.device", "precision.bf16_update",
    "model.encoder", "model.size", "model.causal", "model.loss", "model.use_transducer", "model.use_ctc",
    "model.use_cr_ctc",
    "data.max_duration", "data.num_buckets", "data.num_workers", "data.on_the_fly_feats", "data.max_memory",
    "data.plan_only",
    "train.exp_dir", "train.num_epochs", "train.resume", "train.init_from", "train.icefall_args", "train.overwrite",
    "train.seed", "train.threads", "train.base_lr", "train.compile",
    "checks.validate_data",
)


def training_command_line(cls: type = TrainingConfig, *, defaults: Mapping[str, Any] | None = None,
                          extra_flags: Sequence[str | tuple[str, str]] = (), description: str | None = None) -> Any:
    """The :class:`asrprec.cli.ConfigCommandLine` of a recipe's ``train.py``: ``cls`` (a :class:`TrainingConfig`,
    or a subclass with the recipe's section), its ``defaults`` (nested dict), :data:`TRAIN_FLAGS` and the recipe's
    ``extra_flags``."""
    from asrprec.cli import ConfigCommandLine

    return ConfigCommandLine(cls, (*extra_flags, *TRAIN_FLAGS), dict(defaults or {}), description, DERIVED)
