"""Zipformer encoder: forward+backward time and activation memory per preset x precision policy.

Activation memory = bytes of the unique storages autograd saves for backward (counted with
``torch.autograd.graph.saved_tensors_hooks``; parameters themselves excluded, autocast's cast copies of them
included); on CUDA also the peak allocated memory of the step. Time = median of ``--runs`` fwd+bwd steps after
one warm-up, model in train mode with the batch count at 20000 (schedules near their final values), as CPU
seconds of this process (``time.process_time()``) and wall seconds.

On a CPU shared with other jobs, OpenMP's default busy-waiting makes CPU seconds grow with the machine's load
(a thread spins while its partner is descheduled: 11-21 CPU-s per step measured for the same work that takes
3.5 CPU-s on one thread). The script therefore sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment already
sets it (it must be set before torch loads OpenMP); pass ``OMP_WAIT_POLICY=ACTIVE`` to measure the default.

    python benchmarks/encoder.py --sizes small --policies fp32,amp-bf16,bf16 --batch 4 --frames 1000

``--project-gpu`` projects a GPU's peak memory for the same step on a machine without one: the step runs on
fake tensors (no data, no compute; ``asrprec.precision.memory``) and every live storage is counted, rounded
to the CUDA allocator's 512-byte blocks. Two columns: the memory alive at the end of the forward on fake CUDA
tensors under CUDA autocast (its fp32 cast lists), and the peak of forward+backward on fake CPU tensors under
CPU autocast (autograd cannot run a CUDA backward without a CUDA context). Not counted: cuBLAS/cuDNN
workspaces and allocator fragmentation.

    python benchmarks/encoder.py --project-gpu --sizes medium --batch 64 --frames 1500
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported; see the docstring

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Dict, List, Tuple  # noqa: E402

import torch  # noqa: E402

from asrprec.models import set_batch_count  # noqa: E402
from asrprec.models.zipformer import build_zipformer_encoder  # noqa: E402

POLICIES = ("fp32", "amp-fp16", "amp-bf16", "bf16")


def _context(policy: str, device: str):
    if policy == "amp-fp16":
        return torch.autocast(device, dtype=torch.float16)
    if policy == "amp-bf16":
        return torch.autocast(device, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _saved_bytes(model, x, lens, policy: str, device: str) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: Dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in params and ptr != 0:
            seen[ptr] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with _context(policy, device):
            y, _ = model(x, lens)
            loss = y.float().pow(2).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def bench(size: str, policy: str, batch: int, frames: int, runs: int,
          device: str) -> Tuple[float, float, int, int]:
    """Returns (median CPU seconds, median wall seconds, saved-for-backward bytes, peak CUDA bytes)."""
    torch.manual_seed(0)
    random.seed(0)  # Balancer/Whiten/skip decisions use Python's random
    model = build_zipformer_encoder(size=size).to(device).train()
    set_batch_count(model, 20000)
    x = torch.randn(batch, frames, 80, device=device)
    lens = torch.full((batch,), frames, device=device, dtype=torch.int64)
    if policy == "bf16":
        model = model.to(torch.bfloat16)
        x = x.to(torch.bfloat16)
    saved = _saved_bytes(model, x, lens, policy, device)
    if runs <= 0:
        return float("nan"), float("nan"), saved, 0
    cpu: List[float] = []
    wall: List[float] = []
    peak = 0
    for i in range(runs + 1):
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        c0, t0 = time.process_time(), time.perf_counter()
        with _context(policy, device):
            y, _ = model(x, lens)
            loss = y.float().pow(2).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
            peak = max(peak, torch.cuda.max_memory_allocated())
        if i > 0:
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - t0)
    return statistics.median(cpu), statistics.median(wall), saved, peak


def project(size: str, policy: str, batch: int, frames: int) -> Tuple[int, int]:
    """Projected GPU bytes of :func:`bench`'s step: (live at the end of the forward on fake CUDA tensors
    under CUDA autocast, fwd+bwd peak on fake CPU tensors). Python's random is seeded as in ``bench``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from asrprec.precision.memory import LiveMemoryTracker, autocast_on, fake_module_

    out = []
    for device in ("cuda", "cpu"):
        torch.manual_seed(0)
        random.seed(0)
        model = build_zipformer_encoder(size=size).train()
        set_batch_count(model, 20000)
        mode = FakeTensorMode()
        dtype = torch.bfloat16 if policy == "bf16" else torch.float32
        fake_module_(model, mode, device, dtype if policy == "bf16" else None)
        # int(lens.min()/max()) in the input checks and Whiten's metric read back a value: answer with T
        # (valid lengths; the metric then exceeds its limit and Whiten's backward does its extra work)
        tracker = LiveMemoryTracker(scalar=frames)
        amp = {"amp-fp16": torch.float16, "amp-bf16": torch.bfloat16}.get(policy)
        with mode, tracker:
            x = torch.randn(batch, frames, 80, device=device, dtype=dtype)
            lens = torch.full((batch,), frames, device=device, dtype=torch.int64)
            tracker.track(*model.parameters(), x, lens)
            with autocast_on(device, amp) if amp else contextlib.nullcontext():
                y, _ = model(x, lens)
                loss = y.float().pow(2).mean()
            if device == "cuda":
                tracker.sweep()
                out.append(tracker.current)
            else:
                loss.backward()
                out.append(tracker.peak)
    return out[0], out[1]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="small")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--frames", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=3, help="timed runs (0: memory only)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--project-gpu", action="store_true",
                    help="project GPU memory on fake tensors instead of running the step (see above)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.project_gpu:
        return main_project(args)
    hw = torch.cuda.get_device_name() if args.device == "cuda" else \
        f"{_cpu_name()}, {os.cpu_count()} CPUs, {args.threads} threads"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# Zipformer encoder fwd+bwd, B={args.batch}, T={args.frames} frames (100 Hz), device={args.device} "
          f"({hw}), torch {torch.__version__}, {datetime.date.today()}, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY')}, load average at start {load:.1f}")
    print("| preset | policy | CPU s (median) | wall s (median) | saved-for-backward MB | vs fp32 | peak GPU MB |")
    print("|---|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        base = None
        for policy in args.policies.split(","):
            if policy not in POLICIES:
                raise ValueError(f"unknown policy {policy!r}; choose from {POLICIES}")
            cpu, wall, saved, peak = bench(size, policy, args.batch, args.frames, args.runs, args.device)
            base = saved if policy == "fp32" else base
            ratio = f"{saved / base:.2f}" if base else "-"
            peak_s = f"{peak / 2**20:.0f}" if peak else "-"
            print(f"| {size} | {policy} | {cpu:.2f} | {wall:.2f} | {saved / 2**20:.0f} | {ratio} | {peak_s} |",
                  flush=True)


def main_project(args) -> None:
    if not torch.backends.cuda.is_built():
        # fake CUDA tensors need torch's CUDA dispatch keys, which a CPU-only build (torch x.y.z+cpu) lacks
        raise SystemExit(f"--project-gpu needs a CUDA build of torch (any CUDA build runs without a GPU); this one is "
                         f"{torch.__version__}, built without CUDA. Fix: pip install torch from PyPI's default index")
    print(f"# Projected GPU memory of a Zipformer encoder fwd+bwd step (fake tensors), B={args.batch}, "
          f"T={args.frames} frames (100 Hz), torch {torch.__version__}, {datetime.date.today()}")
    print("| preset | policy | forward-end live MB (fake CUDA) | fwd+bwd peak MB | vs fp32 | vs amp-fp16 |")
    print("|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        peaks: Dict[str, int] = {}
        for policy in args.policies.split(","):
            if policy not in POLICIES:
                raise ValueError(f"unknown policy {policy!r}; choose from {POLICIES}")
            live, peak = project(size, policy, args.batch, args.frames)
            peaks[policy] = peak
            ratios = [f"{peak / peaks[b]:.2f}" if b in peaks else "-" for b in ("fp32", "amp-fp16")]
            print(f"| {size} | {policy} | {live / 2**20:.0f} | {peak / 2**20:.0f} | {ratios[0]} | {ratios[1]} |",
                  flush=True)


if __name__ == "__main__":
    main()
