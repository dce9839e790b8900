"""Distributed data-parallel training through torchrun: process group, devices, the DDP wrapper, agreement.

Launch with torchrun, which starts one process per device and sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``::

    torchrun --nproc_per_node=8 recipes/espeak/train.py ...                       # one machine, 8 GPUs
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT train.py ...

A recipe calls :func:`setup_distributed` once, before it builds its data loaders; under torchrun it joins the
process group (NCCL on CUDA, gloo on CPU) and pins this process to ``cuda:LOCAL_RANK``; under a plain
``python train.py`` it does nothing and the run stays single-process. :func:`asrprec.training.train` then
wraps the model (:func:`wrap_model`), checks that the training loader is this rank's shard (the lhotse
samplers take ``rank`` and ``world_size``; :class:`asrprec.data.AsrDataModule` passes them) and keeps the
ranks in lockstep:

* **gradients are summed over ranks**, not averaged (DDP's default). Each rank's loss is a sum over its
  utterances, so the summed gradient is the gradient of the loss summed over the global batch: N ranks take
  the same step as one process given the union of their batches. (icefall sums per rank and lets DDP average,
  i.e. its gradient is 1/N of that; ScaledAdam and Adam are nearly invariant to the scale, an absolute
  ``grad_clip`` is not.) bf16/fp16 gradient buckets are summed in fp32 and rounded once.
* ``find_unused_parameters`` where a step can leave a parameter without gradient (:func:`may_leave_parameters_unused`):
  the Zipformer skips its positional projection at random, so some parameters get no gradient in some steps, on
  some ranks only (icefall always sets it, k2-fsa/icefall ``egs/librispeech/ASR/zipformer/train.py``); with the
  full loss the transducer's "simple" projections get none at all. A parameter no rank used keeps no gradient;
  one some rank used gets the sum. Other models go without it (DDP warns when it finds nothing unused).
* every gradient has its parameter's strides, those of DDP's bucket views (:func:`_match_bucket_layout`).
* decisions that change the number of collective calls are taken together: :func:`flags_by_rank` (one small
  all-reduce) tells every rank which ranks have no batch left, failed in the forward pass, or got a non-finite
  loss, so all ranks stop, raise or skip the step together and none waits forever in an all-reduce the others
  never enter. A failure inside the backward pass (after the gradient all-reduce has started) cannot be agreed
  on; the failing process exits with its error and torchrun ends the others.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from asrprec.devices import (  # the rank helpers' home; the names stay importable from here
    get_local_rank, get_rank, get_world_size, is_main_process, rank_device, torchrun_world,
)


class RankFailedError(RuntimeError):
    """Another rank failed; this one stops too. The message quotes the failing rank's error."""


@dataclass(frozen=True)
class DistributedEnv:
    """Where this process sits: ``rank`` of ``world_size`` processes, ``local_rank`` on its machine, the
    ``device`` it trains on and the process-group ``backend`` (None for a single process)."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def setup_distributed(device: str | None = None, *, backend: str | None = None,
                      timeout: timedelta | None = None) -> DistributedEnv:
    """Join torchrun's process group, if launched by torchrun with more than one process; else do nothing.

    Call it first thing in a recipe's ``main()``, before building data loaders (samplers read the rank and
    world size) and before :func:`~asrprec.devices.resolve_device` (which then answers
    ``cuda:LOCAL_RANK``). The backend is NCCL for a CUDA device and gloo for the CPU, unless ``backend`` says
    otherwise; ``timeout`` bounds how long a collective may wait for a missing rank (torch's default when
    None). The group is destroyed at interpreter exit. Calling it again returns the same environment.

    Raises RuntimeError when torchrun's variables are partly set, or LOCAL_RANK has no GPU on this machine.
    """
    tr = torchrun_world()
    dev = rank_device(device)
    if tr is None or tr[2] == 1:
        return DistributedEnv(rank=0, local_rank=0, world_size=1, device=dev, backend=None)
    rank, local_rank, world = tr
    if not dist.is_available():
        raise RuntimeError("torchrun started several processes, but this torch build has no torch.distributed")
    if not dist.is_initialized():
        backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
        kwargs: dict[str, Any] = {}
        if timeout is not None:
            kwargs["timeout"] = timeout
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            kwargs["device_id"] = dev  # binds NCCL's communicator to this GPU at once
        store = _attempt_store(rank, timeout)
        if store is None:
            kwargs["init_method"] = "env://"
        else:
            kwargs["store"] = store
        dist.init_process_group(backend=backend, rank=rank, world_size=world, **kwargs)
        atexit.register(teardown_distributed)
    return DistributedEnv(rank=rank, local_rank=local_rank, world_size=world, device=dev,
                          backend=dist.get_backend())


def _attempt_store(rank: int, timeout: timedelta | None) -> Any:
    """Under torchrun: its store (``MASTER_ADDR:MASTER_PORT``) seen through a prefix of this attempt
    (``TORCHELASTIC_RESTART_COUNT``); None outside torchrun.

    Every attempt of ``torchrun --max-restarts N`` meets in the same store. With ``env://``, the workers of a
    restart read the keys the dead attempt left there (its gloo addresses): they connect to dead ports
    ("Gloo connectFullMesh failed ... Connection refused") or wait until the timeout. A namespace per attempt
    gives each attempt a clean rendezvous.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    # torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE); otherwise rank 0 does, as env:// would
    hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=rank == 0 and not hosted, timeout=timeout or timedelta(minutes=30))
    return dist.PrefixStore(f"asrprec/attempt{attempt}", store)


def teardown_distributed() -> None:
    """Destroy the process group (no-op without one); registered at exit by :func:`setup_distributed`."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _collective_device() -> torch.device:
    """NCCL reduces CUDA tensors only; gloo (and a single process) the CPU ones."""
    if get_world_size() > 1 and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks (a copy; identity without a process group)."""
    if get_world_size() > 1:
        out = t.detach().to(_collective_device(), copy=True)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out.to(t.device)
    return t


def sum_over_ranks(*values: float) -> list[float]:
    """Each value summed over ranks (float64, one all-reduce; the values themselves for one process)."""
    if get_world_size() == 1:
        return [float(v) for v in values]
    return all_reduce_sum(torch.tensor(values, dtype=torch.float64)).tolist()


def summed_counts(counts: dict[str, int]) -> dict[str, int]:
    """Each key's count summed over ranks (the ranks' keys may differ; ``counts`` itself for one process)."""
    out: dict[str, int] = {}
    for rank_counts in gather_objects(dict(counts)):
        for k, v in rank_counts.items():
            out[k] = out.get(k, 0) + int(v)
    return out


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank ([obj] for one process)."""
    if get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def flags_by_rank(*flags: bool) -> list[list[int]]:
    """For each flag, the ranks on which it is True (one all-reduce; every rank gets the same answer).

    Every rank must call it at the same point, with the same number of flags: it is how ranks agree on a
    decision that changes what they do next (stop the epoch, skip a step, raise).
    """
    world, rank = get_world_size(), get_rank()
    if world == 1:
        return [[0] if f else [] for f in flags]
    votes = torch.zeros(len(flags), world, dtype=torch.int32)
    votes[:, rank] = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32)
    votes = all_reduce_sum(votes)
    return [[r for r in range(world) if votes[i, r]] for i in range(len(flags))]


def raise_if_any_failed(error: BaseException | None, what: str) -> None:
    """Agree on a failure: every rank calls this after ``what`` (with its exception or None). The failing rank
    re-raises its own error; the others raise :class:`RankFailedError` quoting it. Nothing happens when no
    rank failed. Use it only around code without collectives (the others would be waiting inside them)."""
    failed = flags_by_rank(error is not None)[0]
    if failed:
        raise_failure(error, failed, what)


def raise_failure(error: BaseException | None, failed: list[int], what: str) -> None:
    """Every rank calls this once ranks ``failed`` (from :func:`flags_by_rank`) failed during ``what``: it
    gathers their messages, re-raises ``error`` on a failing rank and raises :class:`RankFailedError` quoting
    the first failure on the others."""
    messages: list[Any] = [None] * get_world_size()
    if get_world_size() > 1:
        dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {str(error)[:2000]}")
    if error is not None:
        raise error
    first = failed[0]
    others = f" (and rank(s) {', '.join(map(str, failed[1:]))})" if len(failed) > 1 else ""
    raise RankFailedError(f"rank {first}{others} failed during {what}; every rank stops. Rank {first}: "
                          f"{messages[first]}")


def barrier() -> None:
    """Wait for every rank (no-op for one process)."""
    if get_world_size() > 1:
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()


def _sum_in_fp32_hook(group, bucket):  # no annotations: DDP checks them against its own, not strings
    """DDP communication hook (``dist.GradBucket`` -> ``Future[Tensor]``): sum (not average) the bucket over
    ranks; fp16/bf16 buckets are summed in fp32."""
    buf = bucket.buffer()
    wide = buf.float() if buf.dtype in (torch.float16, torch.bfloat16) else buf
    fut = dist.all_reduce(wide, group=group, async_op=True).get_future()

    def done(f: torch.futures.Future) -> torch.Tensor:
        out = f.value()[0]
        if out is not buf:
            buf.copy_(out)
        return buf

    return fut.then(done)


def may_leave_parameters_unused(model: nn.Module) -> bool:
    """Whether a training step of ``model`` can leave a parameter without a gradient, so that DDP must look for
    such parameters (``find_unused_parameters``: one more pass over the autograd graph every step):

    * a Zipformer attention module skips its positional projection at random (``pos_emb_skip_rate``; the other
      Zipformer skip rates mask sequences, which keeps every parameter in the graph);
    * the transducer's "simple" projections serve only the pruned loss and TDT's ``tdt_aux="simple"``.
    """
    if any(hasattr(m, "pos_emb_skip_rate") for m in model.modules()):
        return True
    cfg = getattr(model, "loss_config", None)
    if getattr(model, "simple_am_proj", None) is None or cfg is None:
        return False
    return not (cfg.loss == "pruned" or (cfg.loss == "tdt" and cfg.tdt_aux == "simple"))


def _match_bucket_layout(model: nn.Module) -> None:
    """Give each gradient the strides of its parameter, which DDP's bucket views have.

    Autograd keeps a new gradient's layout when it differs from the parameter's only in the strides of size-1
    dimensions (its layout contract ignores them), and DDP compares all strides: the CPU depthwise-convolution
    backward returns a (C, 1, K) weight gradient with strides (K, 1, 1) for a (K, K, 1) weight, and DDP then
    warns "Grad strides do not match bucket view strides" and copies through a slow path. The gradient is
    re-viewed with the parameter's strides (the same memory: a size-1 dimension's stride addresses nothing).
    """
    def restride(p: torch.Tensor) -> None:
        g = p.grad
        if g is not None and g.layout == torch.strided and g.stride() != p.stride() and g.is_contiguous():
            p.grad = g.as_strided(p.shape, p.stride())

    for p in model.parameters():
        if p.requires_grad and p.is_contiguous() and 1 in p.shape:
            p.register_post_accumulate_grad_hook(restride)


def wrap_model(model: nn.Module, device: torch.device, *, find_unused_parameters: bool | None = None) -> nn.Module:
    """``model`` in DistributedDataParallel with summed gradients (see the module doc), or ``model`` itself
    without a process group. Wrap after the precision policy has moved and cast it (DDP broadcasts rank 0's
    parameters and buffers and registers its hooks on the parameters as they are then) and before building
    the optimizer (the ``bf16`` master weights copy the broadcast values).

    ``find_unused_parameters``: None decides by :func:`may_leave_parameters_unused` (DDP warns, and pays a graph
    traversal per step, when the flag is on and nothing was unused)."""
    if get_world_size() == 1:
        return model
    if find_unused_parameters is None:
        find_unused_parameters = may_leave_parameters_unused(model)
    _match_bucket_layout(model)
    ddp = nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=find_unused_parameters)
    ddp.register_comm_hook(None, _sum_in_fp32_hook)
    return ddp


def check_sharded(loader: Any, what: str = "training") -> None:
    """Raise if ``loader``'s sampler (lhotse's) serves the whole data set to every rank of a process group."""
    world = get_world_size()
    sampler = getattr(loader, "sampler", None)
    have = getattr(sampler, "world_size", None)
    if world > 1 and have is not None and (have != world or getattr(sampler, "rank", None) != get_rank()):
        raise ValueError(
            f"the {what} sampler is built for rank {getattr(sampler, 'rank', '?')} of {have}, but this is rank "
            f"{get_rank()} of {world}: every rank would train on the same batches. Fix: call "
            "asrprec.training.setup_distributed() before making the data loaders, or pass rank= and world_size= "
            "to the sampler")


def describe() -> str:
    """One log line about the process layout."""
    if get_world_size() == 1:
        return "single process"
    return (f"rank {get_rank()} of {get_world_size()} (local rank {get_local_rank()}), backend "
            f"{dist.get_backend()}")
