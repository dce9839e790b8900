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

Value reads (``.item()``, ``int(t)``, ``if t.any()``): a fake tensor has no data. The tracker can keep real
*shadow* values for small tensors (``shadow_numel``): every op whose inputs all have values (real tensors,
shadowed fakes, plain numbers) and whose outputs are small is also run on real CPU tensors, so reads of lengths,
masks and targets (input checks, ``int(lens.max())``) get their true values. A read with no shadow (a value
computed from activations) is answered by ``scalar`` (or raises when that is None).

Limits: autograd runs CUDA backward on a device thread that needs a real CUDA context, so on fake CUDA
tensors only the forward can run (use fake CPU tensors with CPU autocast for forward + backward).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Union

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

CUDA_BLOCK_BYTES = 512  # the CUDA caching allocator rounds every block to a multiple of this

__all__ = ["CUDA_BLOCK_BYTES", "LiveMemoryTracker", "autocast_on", "fake_module_"]


def _rounded(nbytes: int, block: int) -> int:
    return -(-nbytes // block) * block if block > 1 else nbytes


class LiveMemoryTracker(TorchDispatchMode):
    """Live bytes of the tensor storages created inside it (and of those given to :meth:`track`).

    ``current`` and ``peak`` are in bytes; storages shared by views count once; a storage counts from the
    op that created it until nothing refers to it. ``scalar``: the value returned when a program reads a
    number out of a *fake* tensor that has no shadow value (``_local_scalar_dense``): a number, or a function
    of the fake tensor (to answer by dtype); None raises instead. Real tensors are never answered for: their
    reads go through. ``shadow_numel``: fake outputs of at most this many elements computed only from known
    values get a real shadow value (0 disables; see the module docstring); ``shadow(t)`` returns it.
    Dead storages are dropped lazily, when an op's outputs would raise ``peak`` (the peak stays exact; the
    cost is one pass over the live storages per new peak, not per op); tracked tensors are checked every
    ``PINNED_SWEEP`` ops. Call :meth:`sweep` before reading ``current``.
    """

    def __init__(self, *, block: int = CUDA_BLOCK_BYTES,
                 scalar: Union[None, float, Callable[[torch.Tensor], Any]] = None,
                 shadow_numel: int = 0) -> None:
        super().__init__()
        self.block = block
        self.scalar = scalar
        self.shadow_numel = shadow_numel
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

    def pin(self) -> None:
        """Treat every storage alive now as long-lived (optimizer state, master weights): checked every
        ``PINNED_SWEEP`` ops instead of every op, which keeps a step with thousands of them fast."""
        self._pinned.update(self._live)
        self._live.clear()

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
            known = self.shadow(args[0])
            if known is not None:
                with _disable_current_modes():
                    return known.item()
            if self.scalar is None:
                raise RuntimeError(
                    "the program read a value out of a fake tensor (.item(), int(t), a Python `if` on a "
                    "tensor); fake tensors have no data. Pass LiveMemoryTracker(scalar=...) to answer such "
                    "reads with a fixed number, or track real tensors instead")
            value = self.scalar(args[0]) if callable(self.scalar) else self.scalar
            return bool(value) if args[0].dtype == torch.bool else \
                (float(value) if args[0].is_floating_point() else int(value))
        self.ops += 1
        if self.ops % self.PINNED_SWEEP == 0:
            self._sweep(self._pinned)
        out = func(*args, **kwargs)
        outs = tree_flatten(out)[0]
        for t in outs:
            if isinstance(t, torch.Tensor):
                self._add(t, self._live)
        if self.current > self.peak:  # perhaps a new peak: first drop what died since the last sweep
            self._sweep(self._live)
            self.peak = max(self.peak, self.current)
        if self.shadow_numel:
            self._run_shadow(func, args, kwargs, out, outs)
        return out

    SHADOW = "_asrprec_shadow"

    def shadow(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """The real CPU value kept for fake tensor ``t`` (None when it has none)."""
        return getattr(t, self.SHADOW, None)

    # ops whose values are not known even from known inputs: uninitialised memory and random numbers
    _UNKNOWN = ("empty", "new_empty", "rand", "normal", "uniform", "bernoulli", "exponential", "native_dropout",
                "multinomial", "cauchy", "geometric", "log_normal", "random")

    def _run_shadow(self, func, args, kwargs, out, outs) -> None:
        fakes = [t for t in outs if isinstance(t, torch.Tensor) and _is_fake(t)]
        if not fakes:
            return
        name = func.__name__.split(".")[0].lstrip("_")
        missing = any(t.numel() > self.shadow_numel for t in fakes) or name.startswith(self._UNKNOWN)

        def real(a):
            nonlocal missing
            if isinstance(a, torch.Tensor):
                if not _is_fake(a):
                    return a
                s = self.shadow(a)
                if s is None:
                    missing = True
                return s
            if isinstance(a, torch.device):
                return torch.device("cpu")
            return a

        with _disable_current_modes(), torch.no_grad():
            r_args, r_kwargs = tree_map(real, (args, kwargs)) if not missing else (None, None)
            for t in fakes:  # an in-place op returns its mutated argument: its old shadow no longer holds
                if hasattr(t, self.SHADOW):
                    delattr(t, self.SHADOW)
            if missing:
                return
            try:
                r_out = func(*r_args, **r_kwargs)
            except Exception:  # an op the shadow cannot replay (a device-only kernel): reads use `scalar`
                return
        for f, r in zip(outs, tree_flatten(r_out)[0]):
            if isinstance(f, torch.Tensor) and _is_fake(f) and isinstance(r, torch.Tensor):
                setattr(f, self.SHADOW, r)


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def fake_module_(module: nn.Module, mode, device: str | torch.device,
                 dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Replace ``module``'s parameters and buffers (in place) with fake tensors of ``mode`` on ``device``.

    Floating tensors take ``dtype`` when given (a whole-model cast); ``requires_grad`` is kept. Plain tensor
    attributes (a cache such as a positional-encoding table kept outside the buffers) become fake too, with their
    dtype. Build the module for real first (construction copies modules, which fake tensors do not allow), then
    call this.
    """
    for sub in module.modules():
        for name, t in list(vars(sub).items()):
            if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
                with mode:
                    setattr(sub, name, torch.empty(t.shape, dtype=t.dtype, device=device))
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
