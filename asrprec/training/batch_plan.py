"""``--max-memory``: the batch planner (:mod:`asrprec.precision.batch_plan`) applied to a run.

:func:`step_projector` projects the run's own step (its model, policy, loss, optimizer and world size) at any
(B, T, U); :func:`plan_for_run` places the corpus's duration buckets, plans them under the budget, writes
``batch_plan.json`` to the experiment folder (a resumed run reads it back, so its batches stay those of the run it
continues) and logs the table; :func:`check_plan_on_device` runs the first steps of the worst bucket on the GPU and
lowers the plan when the measured peak breaks the plan's safety.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any, Callable, Optional

import torch
from torch import nn

from asrprec.precision.batch_plan import (
    BatchPlan, Bucket, lower_plan, parse_memory_size, plan_batches, read_plan, write_plan,
)

log = logging.getLogger(__name__)

__all__ = ["batches_for_run", "check_plan_on_device", "joint_factor", "plan_for_run", "step_projector"]

# every schedule at its final value (no layer skipping, dropout settled): the most memory, as the OOM scan
PLAN_BATCH_COUNT = 1e9


def joint_factor(loss: str, joint_mode: str, vocab_size: int) -> int:
    """J of the cost model: V where the loss materialises (B, T, U + 1, V) logits (full RNN-T with the full joint,
    TDT), else 1 (pruned: its lattices are (B, T, U); lean joint: tiles over T)."""
    return vocab_size if (loss == "full" and joint_mode == "full") or loss == "tdt" else 1


def _optimizer(name: str, lr: float = 1e-3) -> Callable:
    from asrprec.optim import ScaledAdam

    if name == "scaled_adam":  # batched, as on a GPU (same-shaped tensors stacked for the update)
        return lambda ps: ScaledAdam(ps, lr=lr, clipping_scale=2.0, batched=True)
    return lambda ps: torch.optim.AdamW(ps, lr=lr, foreach=True)


def step_projector(model: nn.Module, *, vocab_size: int, policy: str, optimizer: str = "scaled_adam",
                   bf16_update: str = "master", bf16_moments: bool = False, world_size: int = 1,
                   num_mel_bins: int = 80, fake: bool = True) -> Callable[[int, int, int], Any]:
    """``(B, T, U) -> StepMemory`` of one training step of a copy of ``model`` (fp32, CPU) with (B, T, F) features
    and (B, U) tokens, every schedule at its final value; DDP's gradient buckets when ``world_size`` > 1."""
    from asrprec.models import set_batch_count
    from asrprec.precision.memory_step import project_step

    template = copy.deepcopy(model).float().cpu()
    set_batch_count(template, PLAN_BATCH_COUNT)

    def build() -> nn.Module:
        return copy.deepcopy(template)

    def project(B: int, T: int, U: int):
        def make(device):
            return (torch.randn(B, T, num_mel_bins, device=device), torch.full((B,), T, device=device),
                    torch.randint(1, vocab_size, (B, U), device=device), torch.full((B,), U, device=device))

        return project_step(build, make, lambda m, batch: m(*batch)["loss"], policy, _optimizer(optimizer),
                            bf16_update=bf16_update, bf16_moments=bf16_moments, ddp=world_size > 1, fake=fake,
                            cuda_forward=fake and torch.backends.cuda.is_built())

    return project


def _device_bytes(device: torch.device) -> Optional[int]:
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(device).total_memory)
    return None


def plan_for_run(model: nn.Module, *, model_options: Any, policy: Any, train_cfg: Any, data_cfg: Any, cuts: Any,
                 tokenizer: Any, resuming: bool = False, verify: str = "worst") -> BatchPlan:
    """The run's plan: the one in ``train_cfg.exp_dir`` when ``resuming`` (a resumed run keeps its batches) or when it
    was made for the same model, policy, budget and buckets (a ``--plan-only`` run's: under torchrun, plan with
    ``--plan-only`` first, so that no rank waits on the projections), else a new one for ``data_cfg.max_memory``
    under ``policy`` (its name, bf16 update, device), written there (rank 0 plans; every rank reads its file).

    Raises:
        ValueError: a ``--max-memory`` that is no size, or a fraction without a GPU.
        BudgetTooSmall: one utterance of the longest bucket does not fit.
    """
    from pathlib import Path

    from asrprec.devices import get_rank, get_world_size

    from .distributed import barrier

    exp_dir = Path(train_cfg.exp_dir)
    budget = parse_memory_size(data_cfg.max_memory, _device_bytes(policy.device))
    stored = read_plan(exp_dir)
    if resuming and stored is not None:
        if stored.budget_bytes != budget:
            log.warning("batch plan: the resumed run keeps its plan (%.2f GB); --max-memory now asks %.2f GB",
                        stored.budget_bytes / 1e9, budget / 1e9)
        log.info("batch plan of the resumed run (%s):\n%s", exp_dir / "batch_plan.json", stored.table())
        return stored
    if get_rank() == 0:
        buckets = run_buckets(data_cfg, cuts, tokenizer)
        o = model_options
        world = get_world_size()
        describe = {"policy": policy.name, "bf16_update": policy.bf16_update, "bf16_moments": policy.bf16_moments,
                    "encoder": o.encoder, "size": o.size, "loss": o.loss, "joint_mode": o.joint_mode,
                    "optimizer": train_cfg.optimizer, "world_size": world, "vocab_size": tokenizer.vocab_size,
                    "device": str(policy.device)}
        if stored is not None and stored.describe == describe and stored.budget_bytes == budget \
                and stored.safety == data_cfg.memory_safety and stored.edges == [b.max_duration for b in buckets]:
            # the plan of the same flags and data (e.g. a --plan-only run's): nothing to project again
            log.info("batch plan: %s is this run's plan already (same model, policy, budget and buckets)",
                     exp_dir / "batch_plan.json")
        else:
            project = step_projector(model, vocab_size=tokenizer.vocab_size, policy=policy.name,
                                     optimizer=train_cfg.optimizer, bf16_update=policy.bf16_update,
                                     bf16_moments=policy.bf16_moments, world_size=world,
                                     num_mel_bins=data_cfg.num_mel_bins)
            log.info("batch plan: projecting the step at a few shapes for %d buckets (fake tensors)", len(buckets))
            plan = plan_batches(project, buckets, budget, safety=data_cfg.memory_safety,
                                joint=joint_factor(o.loss, o.joint_mode, tokenizer.vocab_size), verify=verify,
                                describe=describe)
            write_plan(plan, exp_dir)
        log.info("%s", read_plan(exp_dir).table())
    barrier()
    return read_plan(exp_dir)


def batches_for_run(model: nn.Module, *, model_options: Any, policy: Any, train_cfg: Any, data_cfg: Any, cuts: Any,
                    tokenizer: Any, resuming: bool) -> Optional[BatchPlan]:
    """What a recipe calls: None without ``--max-memory``; else the run's plan (:func:`plan_for_run`), printed under
    ``--plan-only``, and on a GPU checked by the first steps of its worst bucket (:func:`check_plan_on_device`; a
    lowered plan is written back, rank 0 checking for all)."""
    from asrprec.devices import get_rank

    from .distributed import barrier

    if not data_cfg.max_memory:
        return None
    plan = plan_for_run(model, model_options=model_options, policy=policy, train_cfg=train_cfg, data_cfg=data_cfg,
                        cuts=cuts, tokenizer=tokenizer, resuming=resuming)
    if data_cfg.plan_only:
        if get_rank() == 0:
            print(plan.table())
        return plan
    if policy.device.type == "cuda" and not resuming:
        if get_rank() == 0:
            checked, note = check_plan_on_device(model, plan, policy=policy, optimizer=train_cfg.optimizer,
                                                 vocab_size=tokenizer.vocab_size, num_mel_bins=data_cfg.num_mel_bins)
            if note is not None:
                write_plan(checked, train_cfg.exp_dir)
        barrier()
        plan = read_plan(train_cfg.exp_dir)
    return plan


def check_plan_on_device(model: nn.Module, plan: BatchPlan, *, policy: Any, optimizer: str, vocab_size: int,
                         num_mel_bins: int = 80, steps: int = 2,
                         measure: Optional[Callable[[], int]] = None) -> tuple[BatchPlan, Optional[str]]:
    """The first ``steps`` training steps of the plan's worst bucket (a copy of ``model``, random features and
    tokens of the bucket's padded shape, forward + backward + update under ``policy``), then its peak against the
    projection (:func:`~asrprec.precision.batch_plan.lower_plan`). ``measure``: the peak in bytes (default
    ``torch.cuda.max_memory_allocated`` of the policy's device). Returns (the plan to use, the note when lowered)."""
    from asrprec.models import set_batch_count

    worst = plan.worst()
    device = policy.device
    cuda = device.type == "cuda"
    if measure is None:
        if not cuda:
            raise ValueError("check_plan_on_device measures a GPU's peak; on another device pass measure=")
        measure = lambda: torch.cuda.max_memory_allocated(device)  # noqa: E731
    probe = copy.deepcopy(model).float().cpu()
    set_batch_count(probe, PLAN_BATCH_COUNT)
    probe = policy.prepare_model(probe).train()
    params = [p for p in probe.parameters() if p.requires_grad]
    opt = policy.build_optimizer(params, _optimizer(optimizer))
    B, T, U = worst.batch_size, worst.frames, max(1, worst.tokens)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(steps):
        batch = (torch.randn(B, T, num_mel_bins, device=device), torch.full((B,), T, device=device),
                 torch.randint(1, vocab_size, (B, U), device=device), torch.full((B,), U, device=device))
        with policy.autocast():
            loss = probe(*batch)["loss"]
        loss.backward()
        del loss, batch
        opt.step()
        opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize(device)
    measured = int(measure())
    del probe, opt, params
    if cuda:
        torch.cuda.empty_cache()
    lower, note = lower_plan(plan, measured_bytes=measured, projected_bytes=worst.projected_peak_bytes)
    if lower is None:
        log.info("%s", note)
        return plan, None
    log.warning("%s", note)
    return lower, note


def padding_line(totals: Any) -> str:
    """One log line of an epoch's :class:`asrprec.data.buckets.PaddingTotals`."""
    if not totals.frames:
        return "padding: no batches"
    return (f"padding: {totals.frame_fraction:.1%} of the frames ({totals.padded_frames:,.0f} of {totals.frames:,.0f}), "
            f"{totals.joint_fraction:.1%} of the joint cells ({totals.padded_joint:,.0f} of {totals.joint:,.0f})")


def run_buckets(data_cfg: Any, cuts: Any, tokenizer: Any) -> list[Bucket]:
    """The duration buckets training will use: ``data_cfg``'s duration limits and bucket count over ``cuts`` (the
    first ``bucketing_buffer_size`` of a lazy set), tokens counted with ``tokenizer``."""
    from asrprec.data.buckets import corpus_buckets
    from asrprec.data.durations import filter_durations

    kept = filter_durations(cuts, data_cfg.min_cut_s, data_cfg.max_cut_s)
    lazy = bool(getattr(cuts, "is_lazy", False))
    stats = corpus_buckets(kept, data_cfg.num_buckets, count_tokens=lambda text: len(tokenizer.encode([text])[0]),
                           look=(data_cfg.bucketing_buffer_size or 100_000) if lazy else 10**12)
    return bucket_list(stats, data_cfg.max_cut_s if lazy else None)


def bucket_list(stats: list, max_cut_s: Optional[float] = None) -> list[Bucket]:
    """:class:`~asrprec.precision.batch_plan.Bucket` of each :class:`asrprec.data.buckets.BucketStats`; the last
    bucket's edge raised to ``max_cut_s`` (the longest cut training keeps, which a lazily read corpus may hold past
    the cuts that were looked at)."""
    out = [Bucket(s.max_duration, s.max_tokens, s.min_duration, s.cuts, s.seconds) for s in stats]
    if out and max_cut_s is not None and math.isfinite(max_cut_s) and max_cut_s > out[-1].max_duration:
        last = out[-1]
        tokens = int(math.ceil(last.max_tokens * max_cut_s / last.max_duration))
        out[-1] = Bucket(float(max_cut_s), tokens, last.min_duration, last.cuts, last.seconds)
    return out
