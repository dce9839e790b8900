"""A training step's accelerator memory, part by part, projected on fake tensors.

:func:`project_step` runs one whole training step of a model (forward under a precision policy, the loss,
backward, the optimizer's update, ``zero_grad``) under :class:`~asrprec.precision.memory.LiveMemoryTracker` and
reports what holds memory: parameters, gradients, optimizer state, fp32 master weights, DDP gradient buckets, the
batch, and the activations on top of them at the step's peak. The loss is whatever ``loss_fn`` computes (pruned,
full or memory-lean RNN-T, CTC, TDT), so a new objective needs no change here.

What a projection on fake tensors cannot see, so that its peak is a lower bound of ``torch.cuda.max_memory_allocated``:
cuBLAS/cuDNN workspaces, allocator fragmentation (``memory_reserved`` - allocated), the CUDA context, and the
tensors a CUDA kernel allocates that its CPU twin does not. Forward + backward run on fake CPU tensors (autograd
cannot run a CUDA backward without a CUDA context), so they follow CPU autocast's cast lists; CUDA autocast runs
more ops in fp32 (softmax, layer_norm, exp, sum, ...). ``cuda_autocast_extra`` measures that difference on the
forward (fake CUDA tensors under CUDA autocast against fake CPU tensors under CPU autocast): the activations
alive at the end of the forward are what backward starts from, so the difference carries to the peak.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from .master import MasterWeightOptimizer
from .memory import CUDA_BLOCK_BYTES, LiveMemoryTracker, autocast_on, fake_module_
from .policy import get_policy

__all__ = ["DDP_FIRST_BUCKET_MB", "StepMemory", "ddp_bucket_bytes", "project_step", "storage_bytes"]

# torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES (1 MiB): DDP caps its first gradient bucket there
DDP_FIRST_BUCKET_MB = 1.0
SHADOW_NUMEL = 1 << 20  # lengths, masks and targets get real values (LiveMemoryTracker's shadow_numel)


def _round(n: int, block: int) -> int:
    return -(-n // block) * block if block > 1 else n


def storage_bytes(tensors: Iterable[Optional[torch.Tensor]], block: int = CUDA_BLOCK_BYTES) -> int:
    """Bytes of the distinct storages behind ``tensors``, each rounded up to ``block`` (None entries skipped)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            continue
        st = t.untyped_storage()
        if st._cdata in seen:
            continue
        seen.add(st._cdata)
        total += _round(st.nbytes(), block)
    return total


def ddp_bucket_bytes(params: Iterable[torch.Tensor], bucket_cap_mb: float = 25.0,
                     first_bucket_mb: float = DDP_FIRST_BUCKET_MB) -> list[int]:
    """Bytes of each gradient bucket ``DistributedDataParallel`` allocates for ``params`` (those requiring grad).

    torch's rule (``compute_bucket_assignment_by_size`` in pytorch/pytorch ``torch/csrc/distributed/c10d/reducer.cpp``,
    called by ``torch/nn/parallel/distributed.py``): parameters in definition order, one open bucket per
    (dtype, device); a parameter joins its bucket, and the bucket closes once its bytes reach the cap; the first
    bucket of each kind is capped at ``first_bucket_mb``, later ones at ``bucket_cap_mb``. Each bucket is one flat
    tensor of the gradients' dtype kept for the whole run (with the default ``gradient_as_bucket_view=False`` it
    is in addition to the ``.grad`` tensors).
    """
    caps = [int(first_bucket_mb * 2**20), int(bucket_cap_mb * 2**20)]
    open_: dict[tuple, list[int]] = {}  # kind -> [bytes so far, index of its cap]
    out: list[int] = []
    for p in params:
        if not p.requires_grad:
            continue
        key = (p.dtype, p.device)
        acc = open_.setdefault(key, [0, 0])
        acc[0] += p.numel() * p.element_size()
        if acc[0] >= caps[acc[1]]:
            out.append(acc[0])
            open_[key] = [0, min(acc[1] + 1, len(caps) - 1)]
    out.extend(acc[0] for acc in open_.values() if acc[0])
    return out


@dataclass
class StepMemory:
    """One training step's memory (bytes, each storage rounded to the CUDA allocator's 512-byte blocks).

    Persistent across steps: ``parameters``, ``buffers``, ``master_weights`` (fp32 copies, bf16 with master
    weights), ``master_gradients`` (the fp32 gradients a master-weight optimizer keeps on its copies),
    ``optimizer_state`` (the optimizer's own state; masters excluded), ``ddp_buckets``, ``inputs`` (the batch).
    ``gradients``: the ``.grad`` of every parameter at the end of backward (freed by ``zero_grad``).
    ``forward_end``: live at the end of the forward (persistent + what autograd saved + the loss's tensors).
    ``peak``: the most live at once over forward, backward and update (DDP buckets included);
    ``peak_phase``: where it happened. ``optimizer_peak``: the most live during ``optimizer.step``;
    ``backward_peak``: over forward and backward (both with the DDP buckets).
    ``cuda_autocast_extra``: see the module docstring (0 when the policy does not autocast or it was not run).
    """

    policy: str
    parameters: int = 0
    buffers: int = 0
    master_weights: int = 0
    master_gradients: int = 0
    optimizer_state: int = 0
    ddp_buckets: int = 0
    inputs: int = 0
    gradients: int = 0
    forward_end: int = 0
    peak: int = 0
    peak_phase: str = ""
    optimizer_peak: int = 0
    backward_peak: int = 0
    cuda_autocast_extra: int = 0
    bucket_sizes: list = field(default_factory=list)

    @property
    def persistent(self) -> int:
        return (self.parameters + self.buffers + self.master_weights + self.master_gradients + self.optimizer_state
                + self.ddp_buckets + self.inputs)

    @property
    def activations_at_peak(self) -> int:
        """Everything at the peak beyond the persistent parts: saved activations, the gradients produced so far,
        temporaries."""
        return self.peak - self.persistent

    @property
    def peak_cuda_estimate(self) -> int:
        """``peak`` + ``cuda_autocast_extra``: still a projection on fake tensors, and still a lower bound."""
        return self.peak + self.cuda_autocast_extra

    def rows(self) -> list[tuple[str, int]]:
        """(part, bytes) in the order a table shows them."""
        return [("parameters", self.parameters), ("buffers", self.buffers), ("master weights", self.master_weights),
                ("master gradients", self.master_gradients), ("optimizer state", self.optimizer_state),
                ("DDP buckets", self.ddp_buckets), ("batch", self.inputs), ("gradients", self.gradients),
                ("activations at peak", self.activations_at_peak), ("peak", self.peak),
                ("CUDA autocast extra", self.cuda_autocast_extra), ("peak + CUDA autocast extra",
                                                                    self.peak_cuda_estimate)]

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(persistent=self.persistent, activations_at_peak=self.activations_at_peak,
                 peak_cuda_estimate=self.peak_cuda_estimate)
        return d


def _answer_unknown(frames: float) -> Callable[[torch.Tensor], Any]:
    """Answers a value read that no shadow knows (a value computed from activations): ``frames`` for floats (a
    metric read by a whitening or balancing check, taken large so the check does its work), 0 for integers and
    False for booleans (an input check that passes)."""
    def answer(t: torch.Tensor):
        if t.dtype == torch.bool:
            return False
        return float(frames) if t.is_floating_point() else 0
    return answer


def project_step(
    build_model: Callable[[], nn.Module],
    make_batch: Callable[[torch.device], Sequence[torch.Tensor]],
    loss_fn: Callable[[nn.Module, Sequence[torch.Tensor]], torch.Tensor],
    policy: str,
    optimizer: Callable[[Any], torch.optim.Optimizer],
    *,
    bf16_update: str = "master",
    bf16_moments: bool = False,
    ddp: bool = False,
    bucket_cap_mb: float = 25.0,
    fake: bool = True,
    scalar: Any = None,
    cuda_forward: bool = True,
    block: int = CUDA_BLOCK_BYTES,
) -> StepMemory:
    """Project (``fake=True``) or count on real CPU tensors (``fake=False``) one training step's memory.

    Args:
        build_model: returns the model, fp32, on the CPU, ready to train (schedules set); called once per run.
        make_batch: ``device -> tensors`` of one batch, called inside the fake mode (so it may use ``torch.randn``).
        loss_fn: ``(model, batch) -> scalar loss``; runs under the policy's autocast.
        policy: ``"fp32"``, ``"amp-fp16"``, ``"amp-bf16"`` or ``"bf16"`` (``get_policy`` on the CPU: the model is
            cast and the optimizer wrapped exactly as training does).
        optimizer: factory ``params -> optimizer`` (``PrecisionPolicy.build_optimizer`` wraps it for bf16).
        bf16_update, bf16_moments: ``get_policy``'s arguments (how a ``bf16`` model is updated).
        ddp: add the gradient buckets of ``DistributedDataParallel`` (:func:`ddp_bucket_bytes`, ``bucket_cap_mb``).
        fake: False runs the same accounting on real CPU tensors (a check of the projection).
        scalar: the answer to value reads no shadow knows (number or ``tensor -> value``); default: see
            :func:`_answer_unknown` with the batch's padded frame count.
        cuda_forward: for autocast policies, also run the forward on fake CUDA tensors (needs a CUDA build of
            torch, no GPU) to fill ``cuda_autocast_extra``.

    The optimizer's state is created by one update on zero gradients before the measured step, as after the
    first training step. The loss scaler of ``amp-fp16`` is left out (a few scalars).
    """
    pol = get_policy(policy, "cpu", bf16_update=bf16_update, bf16_moments=bf16_moments)
    res = StepMemory(policy=policy)
    cpu = torch.device("cpu")
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    model = pol.prepare_model(build_model()).train()
    if fake:
        fake_module_(model, mode, cpu)
    tracker = LiveMemoryTracker(block=block, scalar=scalar, shadow_numel=SHADOW_NUMEL if fake else 0)
    params = [p for p in model.parameters() if p.requires_grad]
    res.parameters = storage_bytes(model.parameters(), block)
    res.buffers = storage_bytes(model.buffers(), block)
    if ddp:
        res.bucket_sizes = ddp_bucket_bytes(params, bucket_cap_mb)
        res.ddp_buckets = sum(_round(n, block) for n in res.bucket_sizes)
    with mode, tracker:
        batch = _make_batch(tracker, make_batch, cpu, fake)
        res.inputs = storage_bytes(batch, block)
        tracker.track(*model.parameters(), *model.buffers(), *batch)
        # the state is created by an update whose peak does not count: a peak out of reach spares the tracker
        # a pass over the (thousands of) new state tensors at every op; reset_peak below sweeps once
        tracker.peak = 1 << 62
        opt = pol.build_optimizer(params, optimizer)
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tracker.sweep()
        tracker.pin()
        masters = list(getattr(opt, "_masters", [])) if isinstance(opt, MasterWeightOptimizer) else []
        res.master_weights = storage_bytes(masters, block)
        res.master_gradients = storage_bytes((m.grad for m in masters), block)
        res.optimizer_state = storage_bytes(
            (t for st in opt.state.values() for t in tree_flatten(st)[0] if isinstance(t, torch.Tensor)), block)
        tracker.reset_peak()
        with pol.autocast():
            loss = loss_fn(model, batch)
        tracker.sweep()
        res.forward_end = tracker.current
        loss.backward()
        del loss
        tracker.sweep()
        tracker.pin()  # the gradients and what else lives on through the update
        res.gradients = storage_bytes((p.grad for p in params), block)
        backward_peak = tracker.peak
        tracker.reset_peak()
        opt.step()
        res.optimizer_peak = tracker.peak
        opt.zero_grad(set_to_none=True)
    res.peak, res.peak_phase = max((backward_peak, "forward+backward"), (res.optimizer_peak, "optimizer step"))
    res.peak += res.ddp_buckets
    res.optimizer_peak += res.ddp_buckets
    res.backward_peak = backward_peak + res.ddp_buckets
    res.forward_end += res.ddp_buckets
    if fake and cuda_forward and pol.autocast_enabled:
        cpu_fwd = _forward_live(build_model, make_batch, loss_fn, pol, cpu, tracker.scalar, block)
        cuda_fwd = _forward_live(build_model, make_batch, loss_fn, pol, torch.device("cuda"), tracker.scalar, block)
        res.cuda_autocast_extra = cuda_fwd - cpu_fwd
    return res


def _make_batch(tracker: LiveMemoryTracker, make_batch, device: torch.device, fake: bool) -> tuple:
    """The batch, made inside ``tracker``: lengths built with ``torch.full``/``tensor`` get their real values as
    shadows; random integer tensors (token ids) a shadow of ones (valid ids, never blank). Value reads no
    shadow answers get ``tracker.scalar``, by default :func:`_answer_unknown` with the batch's padded frames."""
    batch = tuple(make_batch(device))
    if fake:
        for t in batch:
            if not t.is_floating_point() and tracker.shadow(t) is None and t.numel() <= SHADOW_NUMEL:
                with _disable_current_modes():  # a real tensor, outside the fake mode and the count
                    setattr(t, LiveMemoryTracker.SHADOW, torch.ones(t.shape, dtype=t.dtype))
    if tracker.scalar is None:
        tracker.scalar = _answer_unknown(max((t.shape[1] for t in batch if t.dim() >= 2), default=1))
    return batch


def _forward_live(build_model, make_batch, loss_fn, pol, device: torch.device, scalar, block: int) -> int:
    """Bytes alive at the end of the forward beyond the model and the batch, on fake ``device`` tensors under
    that device's autocast (``autocast_on``: CUDA's cast lists without a CUDA runtime)."""
    mode = FakeTensorMode()
    model = pol.prepare_model(build_model()).train()
    fake_module_(model, mode, device)
    tracker = LiveMemoryTracker(block=block, scalar=scalar, shadow_numel=SHADOW_NUMEL)
    with mode, tracker:
        batch = _make_batch(tracker, make_batch, device, True)
        tracker.track(*model.parameters(), *model.buffers(), *batch)
        tracker.sweep()
        base = tracker.current
        with autocast_on(device.type, pol.compute_dtype):
            loss = loss_fn(model, batch)
        tracker.sweep()
        live = tracker.current - base
        del loss
    return live
