"""Accelerator memory without the accelerator: live-storage accounting, optionally on fake tensors.

:class:`LiveMemoryTracker` is a ``TorchDispatchMode`` that adds up the bytes of every tensor storage the ops
inside it create, drops them when the storage dies, and keeps the peak: the quantity
``torch.cuda.max_memory_allocated`` reports, less the caching allocator's workspaces (cuBLAS, cuDNN) and
fragmentation. Sizes are rounded up to the CUDA caching allocator's 512-byte granularity.

Run on fake tensors (``torch._subclasses.FakeTensorMode``: shapes, dtypes and devices, no data, no compute),
it projects a GPU step's memory on a CPU-only machine, at full size and in seconds: :func:`fake_module_`
replaces a module's parameters and buffers with fake ones on any device, and :func:`autocast_on` turns
autocast on for a device type even when its runtime is absent, so ops see CUDA autocast's cast lists
(``aten/src/ATen/autocast_mode.cpp`` in pytorch/pytorch: softmax, exp, pow, sum, layer_norm ... in fp32).

Limits: autograd runs CUDA backward on a device thread that needs a real CUDA context, so on fake CUDA
tensors only the forward can run (use fake CPU tensors with CPU autocast for forward + backward); a value a
program reads back (``.item()``, ``int(t)``, ``if t.any()``) does not exist on a fake tensor, so the tracker
answers every such read with its ``scalar`` argument (or raises when that is None).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

CUDA_BLOCK_BYTES = 512  # the CUDA caching allocator rounds every block to a multiple of this

__all__ = ["CUDA_BLOCK_BYTES", "LiveMemoryTracker", "autocast_on", "fake_module_"]


def _rounded(nbytes: int, block: int) -> int:
    return -(-nbytes // block) * block if block > 1 else nbytes


class LiveMemoryTracker(TorchDispatchMode):
    """Live bytes of the tensor storages created inside it (and of those given to :meth:`track`).

    ``current`` and ``peak`` are in bytes; storages shared by views count once; a storage counts from the
    op that created it until nothing refers to it. ``scalar``: the value returned when a program reads a
    number out of a *fake* tensor (``_local_scalar_dense``); None raises instead. Real tensors are never
    answered for: their reads go through. ``sweep_every`` > 1 trades exactness for speed: storages that died
    are then noticed up to that many ops late, which can only raise ``peak`` (tracked tensors: up to
    ``PINNED_SWEEP`` ops late).
    """

    def __init__(self, *, block: int = CUDA_BLOCK_BYTES, scalar: Optional[float] = None,
                 sweep_every: int = 1) -> None:
        super().__init__()
        self.block = block
        self.scalar = scalar
        self.sweep_every = max(1, sweep_every)
        self.current = 0
        self.peak = 0
        self.ops = 0
        # StorageImpl address -> (weak ref, rounded bytes). The weak refs also keep a dead storage's address
        # from being reused until it is swept. Storages given to track() (parameters, inputs) live apart and
        # are checked only every PINNED_SWEEP ops: they rarely die inside a step.
        self._live: dict = {}
        self._pinned: dict = {}

    PINNED_SWEEP = 256

    def track(self, *tensors: torch.Tensor) -> None:
        """Count tensors that exist already (parameters, inputs) as live."""
        for t in tensors:
            self._add(t, self._pinned)
        self.peak = max(self.peak, self.current)

    def reset_peak(self) -> None:
        self.sweep()
        self.peak = self.current

    def sweep(self) -> None:
        """Drop the storages that died since the last sweep."""
        self._sweep(self._live)
        self._sweep(self._pinned)

    def _sweep(self, table: dict) -> None:
        expired = torch.UntypedStorage._expired
        dead = [k for k, (ref, _) in table.items() if expired(ref.cdata)]
        for k in dead:
            self.current -= table.pop(k)[1]

    def _add(self, t: torch.Tensor, table: dict) -> None:
        if t.layout != torch.strided:
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in self._pinned or key in self._live:
            return  # still held by our weak ref, so the same storage
        n = _rounded(st.nbytes(), self.block)
        table[key] = (StorageWeakRef(st), n)
        self.current += n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and _is_fake(args[0]):
            if self.scalar is None:
                raise RuntimeError(
                    "the program read a value out of a fake tensor (.item(), int(t), a Python `if` on a "
                    "tensor); fake tensors have no data. Pass LiveMemoryTracker(scalar=...) to answer such "
                    "reads with a fixed number, or track real tensors instead")
            value = self.scalar
            return bool(value) if args[0].dtype == torch.bool else \
                (float(value) if args[0].is_floating_point() else int(value))
        self.ops += 1
        if self.ops % self.sweep_every == 0:  # before the op: its outputs join what is alive now
            self._sweep(self._live)
        if self.ops % self.PINNED_SWEEP == 0:
            self._sweep(self._pinned)
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t, self._live)
        self.peak = max(self.peak, self.current)
        return out


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def fake_module_(module: nn.Module, mode, device: str | torch.device,
                 dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Replace ``module``'s parameters and buffers (in place) with fake tensors of ``mode`` on ``device``.

    Floating tensors take ``dtype`` when given (a whole-model cast); ``requires_grad`` is kept. Build the
    module for real first (construction copies modules, which fake tensors do not allow), then call this.
    """
    for sub in module.modules():
        for table, is_param in ((sub._parameters, True), (sub._buffers, False)):
            for name, t in list(table.items()):
                if t is None:
                    continue
                dt = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
                with mode:
                    f = torch.empty(t.shape, dtype=dt, device=device)
                table[name] = nn.Parameter(f, requires_grad=t.requires_grad) if is_param else f
    return module


@contextlib.contextmanager
def autocast_on(device_type: str, dtype: torch.dtype) -> Iterator[None]:
    """Autocast for ``device_type`` at the dispatcher level, without ``torch.autocast``'s check that the
    device's runtime is present (it disables CUDA autocast on a machine without CUDA). For fake tensors;
    on a real device use ``torch.autocast``."""
    prev_enabled = torch.is_autocast_enabled(device_type)
    prev_dtype = torch.get_autocast_dtype(device_type)
    torch.set_autocast_enabled(device_type, True)
    torch.set_autocast_dtype(device_type, dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled(device_type, prev_enabled)
        torch.set_autocast_dtype(device_type, prev_dtype)
