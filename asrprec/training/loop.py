"""The one training loop. It never branches on precision: the policy hands it an autocast context,
a scaler (a no-op unless ``amp-fp16``) and an optimizer wrapper (fp32 master weights under ``bf16``).

Plain functions: :func:`train` (epochs, resume, checkpoints), :func:`train_one_epoch`,
:func:`compute_loss`, :func:`validate`. Under torchrun (after
:func:`~asrprec.training.distributed.setup_distributed`) the same loop trains data-parallel: the model is
wrapped in DDP with summed gradients, every rank reads its own shard, the ranks agree each step on whether
to go on, skip or stop (:mod:`asrprec.training.distributed`), validation and the logged losses are summed
over ranks, and only rank 0 writes checkpoints, tensorboard and the running average.

Schedules count data, not steps (:func:`schedule_batches_per_step`): Eden's batch index, the transducer's
warm-ups and the encoder's schedules see ``adjusted_batch_count``, which grows by
``world_size × max_duration / ref_duration`` per optimizer step (icefall's ``get_adjusted_batch_count``), so
a run on more GPUs follows the same schedule per hour of audio.
"""

from __future__ import annotations

import logging
import math
import random
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from asrprec import checkpoint as ckpt
from asrprec.models.builders import set_batch_count
from asrprec.precision import PrecisionPolicy, effective_dtypes

from .config import TrainConfig
from .distributed import (
    RankFailedError,
    all_reduce_sum,
    barrier,
    check_sharded,
    describe,
    flags_by_rank,
    get_rank,
    get_world_size,
    is_main_process,
    raise_failure,
    raise_if_any_failed,
    sum_over_ranks,
    unwrap,
    wrap_model,
)
from .oom import (
    describe_batch,
    is_out_of_memory,
    out_of_memory_error,
    sampler_max_duration,
    save_batch,
    scan_pessimistic_batches,
)
from .tb import SummaryWriterOrNull

log = logging.getLogger("asrprec.train")


@dataclass
class TrainState:
    epoch: int = 1
    batch_idx_train: int = 0
    # the batch count the schedules see (see schedule_batches_per_step); = batch_idx_train for one process
    adjusted_batch_count: float = 0.0
    best_valid_loss: float = math.inf
    best_valid_epoch: int = -1
    history: list[dict[str, float]] = field(default_factory=list)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # numpy is a torch dependency in practice
        pass


def pad_targets(token_ids: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists → padded (B, U) int64 targets (padding -1) and (B,) lengths."""
    lens = torch.tensor([len(t) for t in token_ids], dtype=torch.int64)
    u = int(lens.max()) if len(token_ids) else 0
    targets = torch.full((len(token_ids), max(u, 1)), -1, dtype=torch.int64)
    for i, t in enumerate(token_ids):
        if t:
            targets[i, : len(t)] = torch.tensor(t, dtype=torch.int64)
    return targets.to(device), lens.to(device)


def compute_loss(
    model: nn.Module, batch: dict[str, Any], tokenizer, policy: PrecisionPolicy
) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward one batch under the policy's autocast; return the summed fp32 loss and statistics."""
    device = policy.device
    features = batch["features"].to(device)
    feature_lens = batch["feature_lens"].to(device)
    targets, target_lens = pad_targets(tokenizer.encode(batch["texts"]), device)
    with policy.autocast():
        out = model(features, feature_lens, targets, target_lens)
    loss = out["loss"]
    frames = float(out["encoder_out_lens"].sum())
    info = {"frames": frames, "utterances": float(features.size(0)), "loss": float(loss.detach())}
    for k in ("simple_loss", "pruned_loss", "transducer_loss"):
        if k in out:
            info[k] = float(out[k].detach())
    return loss, info


def build_optimizer(model: nn.Module, cfg: TrainConfig, policy: PrecisionPolicy):
    """ScaledAdam (icefall's optimizer) or AdamW, wrapped by the policy (fp32 masters under bf16)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "scaled_adam":
        from asrprec.optim import ScaledAdam

        def factory(ps):
            return ScaledAdam(ps, lr=cfg.base_lr, clipping_scale=2.0)
    else:

        def factory(ps):
            return torch.optim.AdamW(ps, lr=cfg.base_lr, weight_decay=cfg.weight_decay)

    return policy.build_optimizer(params, factory)


def build_scheduler(optimizer, cfg: TrainConfig):
    from asrprec.optim import Eden

    return Eden(optimizer, lr_batches=cfg.lr_batches, lr_epochs=cfg.lr_epochs, warmup_batches=cfg.warmup_batches)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


@torch.no_grad()
def validate(model: nn.Module, loader: Iterable, tokenizer, policy: PrecisionPolicy) -> float:
    """Per-frame validation loss: each rank's loader (its shard) through the bare model (a DDP forward would
    synchronise buffers, and ranks may hold different numbers of batches), sums over ranks."""
    model = unwrap(model)
    was_training = model.training
    model.eval()
    tot = torch.zeros(2, dtype=torch.float64)
    for batch in loader:
        loss, info = compute_loss(model, batch, tokenizer, policy)
        tot += torch.tensor([info["loss"], info["frames"]], dtype=torch.float64)
    tot = all_reduce_sum(tot)
    model.train(was_training)
    return float(tot[0] / max(tot[1], 1.0))


def schedule_batches_per_step(cfg: TrainConfig, train_dl: Any) -> float:
    """How far the schedules' batch count moves per optimizer step: ``world_size × max_duration /
    ref_duration`` (k2-fsa/icefall ``egs/librispeech/ASR/zipformer/train.py``, ``get_adjusted_batch_count``),
    with ``max_duration`` the training sampler's per-rank value. ``ref_duration=0`` takes this run's
    ``max_duration``: each step then counts ``world_size`` batches, and a single process counts its steps."""
    world = get_world_size()
    if not cfg.ref_duration:
        return float(world)
    max_duration = sampler_max_duration(getattr(train_dl, "sampler", None))
    if max_duration is None:
        raise ValueError(f"ref_duration={cfg.ref_duration:g} needs the training sampler's max_duration, and this "
                         "loader's sampler has none (a lhotse sampler has). Fix: use a lhotse sampler, or "
                         "ref_duration=0 to count batches")
    return world * max_duration / cfg.ref_duration


def set_schedule_counts(model: nn.Module, scheduler, batch_count: float, cfg: TrainConfig) -> None:
    """Tell Eden, the model's warm-ups and (× ``encoder_schedule_scale``) the encoder's schedules where
    training is, in adjusted batches."""
    set_batch_count(model, batch_count)
    if cfg.encoder_schedule_scale != 1.0 and hasattr(model, "encoder"):
        set_batch_count(model.encoder, batch_count * cfg.encoder_schedule_scale)
    scheduler.step_batch(batch_count)


def batches_on_every_rank(loader: Iterable) -> Iterable:
    """The loader's batches while every rank still has one (one all-reduce per batch under DDP): a rank
    whose shard ran out stops the epoch for all, instead of leaving the others in a gradient all-reduce.
    lhotse's samplers give all ranks the same number of batches; other loaders need not."""
    it = iter(loader)
    while True:
        batch = next(it, None)
        if get_world_size() == 1:
            if batch is None:
                return
        else:
            empty = flags_by_rank(batch is None)[0]
            if empty:
                if batch is not None:
                    log.warning("rank(s) %s ran out of batches first: this epoch ends here on every rank", empty)
                return
        yield batch


def forward_on_every_rank(model: nn.Module, batch: dict[str, Any], tokenizer, policy: PrecisionPolicy,
                          what: str) -> tuple[torch.Tensor, dict[str, float], list[int]]:
    """:func:`compute_loss`, then one agreement over ranks before any gradient is exchanged: an error on one
    rank is raised on all (its own on it, :class:`RankFailedError` quoting it elsewhere). Returns the loss,
    its statistics and the ranks whose loss is not finite (the step is to be skipped on every rank then)."""
    error, loss, info = None, None, {"loss": math.nan}
    try:
        loss, info = compute_loss(model, batch, tokenizer, policy)
    except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks know
        error = e
    failed, nonfinite = flags_by_rank(error is not None, not math.isfinite(info["loss"]))
    if failed:
        raise_failure(error, failed, what)
    return loss, info, nonfinite


def _grad_norm(model: nn.Module) -> float:
    norms = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.stack(norms).norm()) if norms else 0.0


def train_one_epoch(
    *,
    model: nn.Module,
    optimizer,
    scheduler,
    scaler,
    policy: PrecisionPolicy,
    tokenizer,
    train_dl,
    valid_dl,
    cfg: TrainConfig,
    state: TrainState,
    writer: SummaryWriterOrNull,
    save,
    averager: ckpt.RunningAverage | None = None,
) -> dict[str, float]:
    """Train for one epoch; returns per-frame average training loss and throughput."""
    model.train()
    bare = unwrap(model)
    tot_loss = tot_frames = 0.0
    t0 = time.time()
    window_frames, window_t = 0.0, time.time()
    per_step = schedule_batches_per_step(cfg, train_dl)
    batches = enumerate(batches_on_every_rank(train_dl))
    if cfg.progress_bar and is_main_process():
        from tqdm import tqdm

        batches = tqdm(batches, desc=f"epoch {state.epoch}", mininterval=5.0, leave=False)
    for batch_idx, batch in batches:
        if cfg.max_batches_per_epoch and batch_idx >= cfg.max_batches_per_epoch:
            break
        state.batch_idx_train += 1
        state.adjusted_batch_count += per_step
        set_schedule_counts(bare, scheduler, state.adjusted_batch_count, cfg)
        try:
            loss, info, nonfinite_ranks = forward_on_every_rank(model, batch, tokenizer, policy,
                                                                f"training batch {state.batch_idx_train}")
            if nonfinite_ranks:  # skipped on every rank, so that all ranks run the same collectives
                if math.isfinite(info["loss"]):
                    log.warning("batch %d skipped on every rank: non-finite loss on rank(s) %s",
                                state.batch_idx_train, nonfinite_ranks)
                else:
                    where = f" on rank {get_rank()} (skipped on every rank)" if get_world_size() > 1 else ""
                    log.warning("non-finite loss %.3g at batch %d%s (cuts %s...): batch skipped", info["loss"],
                                state.batch_idx_train, where, batch.get("cut_ids", [])[:3])
                optimizer.zero_grad(set_to_none=True)
                continue
            scaler.scale(loss).backward()
            if cfg.grad_clip > 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            grad_norm = _grad_norm(model) if batch_idx % cfg.log_interval == 0 else float("nan")
            scaler.step(optimizer)
            scaler.update()
            scaler.check_health(state.batch_idx_train, on_collapse=lambda: save("bad-model.pt"))
            optimizer.zero_grad(set_to_none=True)
            if averager is not None:
                averager.maybe_update(bare, state.batch_idx_train)
        except Exception as e:
            save("bad-model.pt")
            if is_out_of_memory(e) and not isinstance(e, RankFailedError):
                rank = f"-rank{get_rank()}" if get_world_size() > 1 else ""
                path = save_batch(batch, Path(cfg.exp_dir) / f"oom-batch-{state.batch_idx_train}{rank}.pt")
                if policy.device.type == "cuda":
                    log.error("CUDA memory at the OOM:\n%s", torch.cuda.memory_summary(policy.device, abbreviated=True))
                raise out_of_memory_error(
                    f"training batch {state.batch_idx_train} ({describe_batch(batch)}; saved to {path})", policy, e,
                    sampler_max_duration(getattr(train_dl, "sampler", None))) from e
            raise
        tot_loss += info["loss"]
        tot_frames += info["frames"]
        window_frames += batch["features"].shape[0] * batch["features"].shape[1]
        if batch_idx % cfg.log_interval == 0:
            info = _summed_over_ranks(info)  # the global batch's loss; frames/s of all ranks together
            window_frames = sum_over_ranks(window_frames)[0]
            now = time.time()
            fps = window_frames / max(now - window_t, 1e-9)
            window_frames, window_t = 0.0, now
            lr = optimizer.param_groups[0]["lr"]
            per_frame = info["loss"] / max(info["frames"], 1.0)
            log.info("epoch %d batch %d: loss %.4f/frame, lr %.3g, grad scale %.3g, grad norm %.3g, %.0f frames/s",
                     state.epoch, state.batch_idx_train, per_frame, lr, scaler.get_scale(), grad_norm, fps)
            step = state.batch_idx_train
            writer.add_scalar("train/loss", per_frame, step)
            for k in ("simple_loss", "pruned_loss"):
                if k in info:
                    writer.add_scalar(f"train/{k}", info[k] / max(info["frames"], 1.0), step)
            writer.add_scalar("train/learning_rate", lr, step)
            writer.add_scalar("train/grad_scale", scaler.get_scale(), step)
            writer.add_scalar("train/grad_norm", grad_norm, step)
            writer.add_scalar("train/frames_per_second", fps, step)
            writer.add_scalar("train/peak_memory_mb", peak_memory_mb(policy.device), step)
        if cfg.valid_interval and state.batch_idx_train % cfg.valid_interval == 0:
            v = validate(model, valid_dl, tokenizer, policy)
            writer.add_scalar("valid/loss", v, state.batch_idx_train)
            log.info("validation loss %.4f/frame", v)
        if cfg.save_every_n and state.batch_idx_train % cfg.save_every_n == 0:
            save(f"checkpoint-{state.batch_idx_train}.pt", sampler=getattr(train_dl, "sampler", None))
            if is_main_process():
                ckpt.keep_last_k(cfg.exp_dir, "checkpoint-*.pt", cfg.keep_last_k)
    elapsed = time.time() - t0
    tot_loss, tot_frames = sum_over_ranks(tot_loss, tot_frames)
    return {"train_loss": tot_loss / max(tot_frames, 1.0), "epoch_seconds": elapsed}


def _summed_over_ranks(info: dict[str, float]) -> dict[str, float]:
    keys = sorted(k for k in info if k in ("loss", "frames", "utterances", "simple_loss", "pruned_loss",
                                            "transducer_loss"))
    return {**info, **dict(zip(keys, sum_over_ranks(*(info[k] for k in keys))))}


def _scan_wanted(mode: str, policy: PrecisionPolicy, train_dl: Any) -> bool:
    """``scan_oom``: "on" always (a loader without a lhotse sampler is then an error), "off" never, "auto" on
    CUDA with a lhotse loader (a CPU run rarely hits its memory limit, and the scan costs a few steps' time)."""
    if mode == "on":
        return True
    if mode == "off" or policy.device.type != "cuda":
        return False
    return hasattr(getattr(train_dl, "sampler", None), "state_dict") and hasattr(train_dl, "dataset")


def train(
    *,
    model: nn.Module,
    policy: PrecisionPolicy,
    tokenizer,
    train_dl,
    valid_dl,
    cfg: TrainConfig,
    config_for_checkpoint: dict[str, Any] | None = None,
) -> TrainState:
    """Train ``model`` under ``policy``: resume if asked, run the epochs, save a checkpoint per epoch.

    ``train_dl`` is a DataLoader whose sampler may offer ``set_epoch`` and ``state_dict``.
    Checkpoints go to ``cfg.exp_dir`` as ``epoch-N.pt`` (and ``checkpoint-<batch>.pt`` with
    ``save_every_n``); ``--avg`` decoding averages the last N epoch files.

    Under an initialised process group (torchrun + :func:`~asrprec.training.distributed.setup_distributed`)
    every rank calls this with its own shard in ``train_dl`` / ``valid_dl`` (a lhotse sampler built for
    another world size is an error); ``policy.device`` is the rank's device. Rank r seeds its random
    generators (dropout, layer skipping, SpecAugment) with ``cfg.seed + r``; DDP starts every rank from rank
    0's weights. Returns when every rank is done and rank 0's last checkpoint is on disk.
    """
    exp_dir = Path(cfg.exp_dir)
    exp_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.seed + get_rank())
    check_sharded(train_dl, "training")
    model = policy.prepare_model(model)
    if _scan_wanted(cfg.scan_oom, policy, train_dl):
        # before DDP: a backward pass through the bare model of a DDP wrapper leaves DDP's record of the
        # parameters used in the step wrong, and its first step then fails
        _scan_on_every_rank(model, train_dl, tokenizer, policy, cfg)
    # DDP after the cast (it broadcasts and hooks the parameters as they are) and before the optimizer (the
    # bf16 master weights copy rank 0's broadcast values)
    model = wrap_model(model, policy.device)
    dtypes = effective_dtypes(model)
    desc = policy.describe()
    log.info("precision: %s", ", ".join(f"{k}={v}" for k, v in desc.items()))
    log.info("processes: %s", describe())
    log.info("parameter dtypes: %s", ", ".join(f"{k}: {v:,}" for k, v in dtypes.items()))
    optimizer = build_optimizer(model, cfg, policy)
    scheduler = build_scheduler(optimizer, cfg)
    scaler = policy.make_scaler()
    scaler.watch(unwrap(model))
    state = TrainState(epoch=cfg.start_epoch)
    full_config = {"train": cfg.to_dict(), **(config_for_checkpoint or {})}
    # rank 0 only: the replicas are identical, and only rank 0 saves
    averager = ckpt.RunningAverage(unwrap(model), cfg.average_period) \
        if cfg.average_period and is_main_process() else None

    def save(name: str, sampler=None) -> None:
        if not is_main_process():
            return
        ckpt.save_checkpoint(
            exp_dir / name, model=unwrap(model), optimizer=optimizer, scheduler=scheduler, scaler=scaler,
            sampler=sampler, policy=policy, config=full_config, model_avg=averager,
            extra={"epoch": state.epoch, "batch_idx_train": state.batch_idx_train,
                   "best_valid_loss": state.best_valid_loss, "best_valid_epoch": state.best_valid_epoch,
                   "adjusted_batch_count": state.adjusted_batch_count, "world_size": get_world_size()},
        )

    resume_from = None
    if cfg.start_batch > 0:
        resume_from = exp_dir / f"checkpoint-{cfg.start_batch}.pt"
    elif cfg.start_epoch > 1:
        resume_from = exp_dir / f"epoch-{cfg.start_epoch - 1}.pt"
    sampler_state = None
    if resume_from is not None:
        info = ckpt.load_checkpoint(resume_from, model=unwrap(model), optimizer=optimizer, scheduler=scheduler,
                                    scaler=scaler)
        if averager is not None:
            saved_avg = ckpt.read_checkpoint(resume_from).get("model_avg")
            if isinstance(saved_avg, dict) and "count" in saved_avg:
                averager.load_state_dict(saved_avg)
                averager.period = cfg.average_period
            else:
                log.warning("%s holds no running average of the weights: it restarts here, so decoding with "
                            "--use-averaged-model can only average epochs trained from now on", resume_from)
        extra = info.get("extra", {})
        state.batch_idx_train = int(extra.get("batch_idx_train", 0))
        state.adjusted_batch_count = float(extra.get(
            "adjusted_batch_count", state.batch_idx_train * schedule_batches_per_step(cfg, train_dl)))
        state.best_valid_loss = float(extra.get("best_valid_loss", math.inf))
        state.best_valid_epoch = int(extra.get("best_valid_epoch", -1))
        if cfg.start_batch > 0:
            state.epoch = int(extra.get("epoch", cfg.start_epoch))
            sampler_state = info.get("sampler")
        log.info("resumed from %s at batch %d", resume_from, state.batch_idx_train)

    with SummaryWriterOrNull(exp_dir / "tensorboard", enabled=cfg.tensorboard and is_main_process()) as writer:
        writer.add_text("precision", "\n".join(f"{k}: {v}" for k, v in {**desc, **dtypes}.items()), 0)
        for epoch in range(state.epoch, cfg.num_epochs + 1):
            state.epoch = epoch
            scheduler.step_epoch(epoch - 1)
            sampler = getattr(train_dl, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            if sampler_state is not None and hasattr(sampler, "load_state_dict"):
                sampler.load_state_dict(sampler_state)
                sampler_state = None
            stats = train_one_epoch(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                                    policy=policy, tokenizer=tokenizer, train_dl=train_dl, valid_dl=valid_dl,
                                    cfg=cfg, state=state, writer=writer, save=save, averager=averager)
            stats["valid_loss"] = validate(model, valid_dl, tokenizer, policy)
            stats["peak_memory_mb"] = peak_memory_mb(policy.device)
            if stats["valid_loss"] < state.best_valid_loss:
                state.best_valid_loss, state.best_valid_epoch = stats["valid_loss"], epoch
            state.history.append({"epoch": epoch, **stats})
            writer.add_scalar("valid/loss", stats["valid_loss"], state.batch_idx_train)
            writer.add_scalar("train/epoch", epoch, state.batch_idx_train)
            log.info("epoch %d done in %.1f s: train loss %.4f, valid loss %.4f (per frame), peak memory %.0f MB",
                     epoch, stats["epoch_seconds"], stats["train_loss"], stats["valid_loss"], stats["peak_memory_mb"])
            save(f"epoch-{epoch}.pt")
    barrier()  # rank 0's last checkpoint is written before any rank returns (and may resume from it)
    return state


def _scan_on_every_rank(model: nn.Module, train_dl, tokenizer, policy: PrecisionPolicy, cfg: TrainConfig) -> None:
    """The OOM scan of each rank's riskiest batches, on the model before DDP wraps it (no gradient all-reduce:
    ranks may try different numbers of batches; the memory of DDP's gradient buckets, one more copy of the
    gradients, is not included); a rank whose batch does not fit stops every rank with its message."""
    error = None
    try:
        scan_pessimistic_batches(model, train_dl, tokenizer, policy,
                                 encoder_schedule_scale=cfg.encoder_schedule_scale)
    except Exception as e:  # noqa: BLE001 - re-raised by raise_if_any_failed
        error = e
    raise_if_any_failed(error, "the out-of-memory scan of the riskiest batches")
