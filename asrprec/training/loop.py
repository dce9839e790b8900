"""The one training loop. It never branches on precision: the policy hands it an autocast context,
a scaler (a no-op unless ``amp-fp16``) and an optimizer wrapper (fp32 master weights under ``bf16``).

Plain functions: :func:`train` (epochs, resume, checkpoints), :func:`train_one_epoch`,
:func:`compute_loss`, :func:`validate`. Rank-aware (only rank 0 logs and saves) so DDP through
torchrun slots in without rewriting.
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
from .distributed import all_reduce_sum, get_rank, get_world_size, is_main_process, unwrap
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
    """Per-frame validation loss (summed over ranks)."""
    was_training = model.training
    model.eval()
    tot = torch.zeros(2, dtype=torch.float64)
    for batch in loader:
        loss, info = compute_loss(model, batch, tokenizer, policy)
        tot += torch.tensor([info["loss"], info["frames"]], dtype=torch.float64)
    tot = all_reduce_sum(tot)
    model.train(was_training)
    return float(tot[0] / max(tot[1], 1.0))


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
    batches = enumerate(train_dl)
    if cfg.progress_bar and is_main_process():
        from tqdm import tqdm

        batches = tqdm(batches, desc=f"epoch {state.epoch}", mininterval=5.0, leave=False)
    for batch_idx, batch in batches:
        if cfg.max_batches_per_epoch and batch_idx >= cfg.max_batches_per_epoch:
            break
        state.batch_idx_train += 1
        set_batch_count(bare, state.batch_idx_train)
        if cfg.encoder_schedule_scale != 1.0 and hasattr(bare, "encoder"):
            set_batch_count(bare.encoder, state.batch_idx_train * cfg.encoder_schedule_scale)
        scheduler.step_batch(state.batch_idx_train)
        try:
            loss, info = compute_loss(model, batch, tokenizer, policy)
            if not math.isfinite(info["loss"]):
                log.warning("non-finite loss %.3g at batch %d (cuts %s...): batch skipped", info["loss"],
                            state.batch_idx_train, batch.get("cut_ids", [])[:3])
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
            if is_out_of_memory(e):
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
    return {"train_loss": tot_loss / max(tot_frames, 1.0), "epoch_seconds": elapsed}


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
    """
    exp_dir = Path(cfg.exp_dir)
    exp_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.seed)
    model = policy.prepare_model(model)
    dtypes = effective_dtypes(model)
    desc = policy.describe()
    log.info("precision: %s", ", ".join(f"{k}={v}" for k, v in desc.items()))
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
                   "best_valid_loss": state.best_valid_loss, "best_valid_epoch": state.best_valid_epoch},
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
        state.best_valid_loss = float(extra.get("best_valid_loss", math.inf))
        state.best_valid_epoch = int(extra.get("best_valid_epoch", -1))
        if cfg.start_batch > 0:
            state.epoch = int(extra.get("epoch", cfg.start_epoch))
            sampler_state = info.get("sampler")
        log.info("resumed from %s at batch %d", resume_from, state.batch_idx_train)

    if _scan_wanted(cfg.scan_oom, policy, train_dl):
        scan_pessimistic_batches(model, train_dl, tokenizer, policy, encoder_schedule_scale=cfg.encoder_schedule_scale)
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
    return state
