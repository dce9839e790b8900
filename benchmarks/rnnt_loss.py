"""Benchmark the RNN-T loss backends: fwd+bwd time and peak memory beyond the inputs.

    PYTHONPATH=. python benchmarks/rnnt_loss.py --threads 2                 # CPU shapes
    PYTHONPATH=. python benchmarks/rnnt_loss.py --device cuda --grid       # NeMo blog grid on a GPU
    ... --out benchmarks/RESULTS.md                                          # append the table

Time: median of ``--repeats`` fwd+bwd runs after one warm-up (the torchaudio peer may use fewer,
``--peer-repeats``, because it is slow on CPU; the row says how many). Backend and peer runs
alternate, so that on a shared machine the speed-up compares times taken under the same load. Memory:
* CUDA: ``torch.cuda.max_memory_allocated()`` during fwd+bwd minus the bytes allocated before
  (inputs and their .grad excluded by resetting the peak after a first warm-up).
* CPU: each (backend, dtype, shape) runs in a fresh subprocess; the peak-RSS mark (VmHWM) is reset
  through /proc/self/clear_refs after the inputs exist and the kernels are compiled on a tiny
  problem, and extra = VmHWM after one fwd+bwd minus the RSS before it. This counts
  every allocation (gradient, workspaces, allocator slack), so it is an upper bound on what the
  loss keeps. Ratio column = extra / logits bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

CPU_SHAPES = [(8, 200, 50, 500), (4, 400, 100, 1024)]
GPU_GRID = [(b, t, u, v) for v in (28, 1024) for t in (200, 400) for u in (100, 200) for b in (1, 4, 16, 32)]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def make_inputs(shape, dtype, device, seed=0):
    B, T, U, V = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, U + 1, V, generator=g).to(dtype).to(device)
    tg = torch.randint(1, V, (B, U), generator=g).to(device)
    tl = torch.full((B,), T, device=device)
    ul = torch.full((B,), U, device=device)
    return x, tg, tl, ul


def fwd_bwd(backend, x, tg, tl, ul):
    from asrprec.losses import rnnt_loss

    xx = x.detach().requires_grad_()
    loss = rnnt_loss(xx, tg, tl, ul, backend=backend, reduction="sum")
    loss.backward()
    return loss.item()


def time_it(backend, shape, dtype, device, repeats, peer=None, peer_repeats=0):
    """Median fwd+bwd seconds of ``backend`` (and of ``peer`` if given), the CUDA peak and the logits' bytes.

    With a peer, the two are timed in alternation (backend, peer, backend, peer, ...; the surplus
    repeats of either at the end), so that on a shared machine both medians see the same load and
    their ratio is meaningful even when the absolute times drift.
    """
    x, tg, tl, ul = make_inputs(shape, dtype, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    todo = [(backend, repeats)] + ([(peer, peer_repeats)] if peer else [])
    for be, _ in todo:
        fwd_bwd(be, x, tg, tl, ul)  # warm-up (compilation)
    times = {be: [] for be, _ in todo}
    for i in range(max(n for _, n in todo)):
        for be, n in todo:
            if i < n:
                sync()
                t0 = time.perf_counter()
                fwd_bwd(be, x, tg, tl, ul)
                sync()
                times[be].append(time.perf_counter() - t0)
    mem = None
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd(backend, x, tg, tl, ul)
        torch.cuda.synchronize()
        mem = torch.cuda.max_memory_allocated() - base
    peer_t = statistics.median(times[peer]) if peer else None
    return statistics.median(times[backend]), mem, x.numel() * x.element_size(), peer_t


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cpu_memory_child(backend, shape, dtype_name) -> None:
    """Runs in a fresh process: prints {'extra': bytes} for one fwd+bwd."""
    dtype = DTYPES[dtype_name]
    fwd_bwd(backend, *make_inputs((1, 3, 2, 8), dtype, "cpu"))  # compile on a tiny problem
    x, tg, tl, ul = make_inputs(shape, dtype, "cpu")
    import gc

    gc.collect()
    rss0 = _rss_bytes()
    try:  # reset the kernel's peak-RSS mark (VmHWM) so input construction does not count
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        fwd_bwd(backend, x, tg, tl, ul)
        peak = _vm_hwm_bytes()
    except OSError:
        fwd_bwd(backend, x, tg, tl, ul)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"extra": peak - rss0}))


def _vm_hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM")


def cpu_memory(backend, shape, dtype_name, threads) -> int | None:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    cmd = [sys.executable, __file__, "--mem-child", backend, ",".join(map(str, shape)), dtype_name, "--threads", str(threads)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])["extra"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--peer-repeats", type=int, default=5, help="repeats for the torchaudio peer")
    ap.add_argument("--backends", default=None, help="comma list; default numba (CPU) or numba-cuda (GPU)")
    ap.add_argument("--dtypes", default="fp32,fp16,bf16")
    ap.add_argument("--grid", action="store_true", help="GPU: the NeMo blog grid (B 1-32, T 200/400, U 100/200, V 28/1024)")
    ap.add_argument("--shapes", default=None, help="semicolon list of B,T,U,V")
    ap.add_argument("--no-mem", action="store_true")
    ap.add_argument("--out", default=None, help="append the markdown table to this file")
    ap.add_argument("--title", default=None)
    ap.add_argument("--mem-child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.mem_child:
        b, s, d = args.mem_child
        cpu_memory_child(b, tuple(map(int, s.split(","))), d)
        return
    if args.shapes:
        shapes = [tuple(map(int, s.split(","))) for s in args.shapes.split(";")]
    else:
        shapes = GPU_GRID if (args.device == "cuda" and args.grid) else CPU_SHAPES if args.device == "cpu" else GPU_GRID[:4]
    backends = (args.backends or ("numba" if args.device == "cpu" else "numba-cuda")).split(",")
    from asrprec.losses import available_backends

    have_ta = any(b["name"] == "torchaudio" and b["available"] for b in available_backends())
    rows = []
    hdr = "| backend | dtype | B,T,U,V | fwd+bwd median (ms) | torchaudio (ms) | speed-up | extra memory (MB) | extra / logits |"
    print(hdr)
    print("|" + "---|" * 8)
    for shape in shapes:
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            peer = "torchaudio" if have_ta and dname in ("fp32", "fp16") else None
            for be in backends:
                t, mem, nbytes, peer_t = time_it(be, shape, dtype, args.device, args.repeats, peer, args.peer_repeats)
                peer_ms = None if peer_t is None else peer_t * 1e3
                if mem is None and args.device == "cpu" and not args.no_mem:
                    mem = cpu_memory(be, shape, dname, args.threads)
                ms = t * 1e3
                row = (
                    f"| {be} | {dname} | {','.join(map(str, shape))} | {ms:.1f} | "
                    f"{'' if peer_ms is None else f'{peer_ms:.0f} (n={args.peer_repeats})'} | "
                    f"{'' if peer_ms is None else f'{peer_ms / ms:.1f}x'} | "
                    f"{'' if mem is None else f'{mem / 2**20:.0f}'} | {'' if mem is None else f'{mem / nbytes:.2f}'} |"
                )
                print(row, flush=True)
                rows.append(row)
    if args.out:
        with open(args.out, "a") as f:
            if args.title:
                f.write(f"\n{args.title}\n\n")
            f.write(hdr + "\n|" + "---|" * 8 + "\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
