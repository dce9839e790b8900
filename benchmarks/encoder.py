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
    model.set_batch_count(20000)
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
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
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


if __name__ == "__main__":
    main()
