"""Benchmark the numba CPU TDT loss against the numba CPU RNN-T loss at the same (B, T, U, V).

    PYTHONPATH=. python benchmarks/tdt_loss.py --threads 2                      # CPU shapes, fp32 and bf16
    ... --shapes "8,200,50,500" --dtypes fp32 --durations 0,1,2,3,4 --repeats 5

The TDT logits have V + len(durations) columns, the RNN-T ones V. Time: median of ``--repeats`` fwd+bwd
runs (``reduction="sum"``) after one warm-up, the two losses timed in alternation so that on a shared
machine both medians see the same load. Memory: as ``benchmarks/rnnt_loss.py`` measures it on CPU, each
(loss, dtype, shape) in a fresh subprocess: peak RSS (VmHWM, reset after the inputs exist and the kernels
are compiled) during one fwd+bwd minus the RSS before it, an upper bound on what the loss allocates.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rnnt_loss as rnnt_bench  # noqa: E402  (the sibling benchmark: inputs and the RSS probes)

CPU_SHAPES = [(8, 200, 50, 500), (4, 400, 100, 1024)]


def make_inputs(loss, shape, dtype, durations, seed=0):
    """RNN-T inputs of ``shape``; for TDT the logits gain len(durations) columns."""
    x, tg, tl, ul = rnnt_bench.make_inputs(shape, dtype, "cpu", seed)
    if loss == "tdt":
        g = torch.Generator().manual_seed(seed + 1)
        dur = torch.randn(*x.shape[:3], len(durations), generator=g).to(dtype)
        x = torch.cat([x, dur], dim=-1)
    return x, tg, tl, ul


def fwd_bwd(loss, x, tg, tl, ul, durations):
    from asrprec.losses import rnnt_loss, tdt_loss

    xx = x.detach().requires_grad_()
    if loss == "tdt":
        out = tdt_loss(xx, tg, tl, ul, durations=durations, backend="numba", reduction="sum")
    else:
        out = rnnt_loss(xx, tg, tl, ul, backend="numba", reduction="sum")
    out.backward()
    return out.item()


def time_pair(shape, dtype, durations, repeats):
    """Median fwd+bwd seconds of the RNN-T and the TDT loss, timed in alternation."""
    inputs = {loss: make_inputs(loss, shape, dtype, durations) for loss in ("rnnt", "tdt")}
    for loss, args in inputs.items():
        fwd_bwd(loss, *args, durations)  # warm-up (compilation)
    times = {loss: [] for loss in inputs}
    for _ in range(repeats):
        for loss, args in inputs.items():
            t0 = time.perf_counter()
            fwd_bwd(loss, *args, durations)
            times[loss].append(time.perf_counter() - t0)
    nbytes = {loss: args[0].numel() * args[0].element_size() for loss, args in inputs.items()}
    return {loss: statistics.median(ts) for loss, ts in times.items()}, nbytes


def memory_child(loss, shape, dtype_name, durations) -> None:
    """Runs in a fresh process: prints {'extra': bytes} for one fwd+bwd."""
    dtype = rnnt_bench.DTYPES[dtype_name]
    fwd_bwd(loss, *make_inputs(loss, (1, 3, 2, 8), dtype, durations), durations)  # compile on a tiny problem
    x, tg, tl, ul = make_inputs(loss, shape, dtype, durations)
    import gc

    gc.collect()
    rss0 = rnnt_bench._rss_bytes()
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM so input construction does not count
        f.write("5")
    fwd_bwd(loss, x, tg, tl, ul, durations)
    print(json.dumps({"extra": rnnt_bench._vm_hwm_bytes() - rss0}))


def memory(loss, shape, dtype_name, durations, threads) -> int | None:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    cmd = [sys.executable, __file__, "--mem-child", loss, ",".join(map(str, shape)), dtype_name,
           "--durations", ",".join(map(str, durations)), "--threads", str(threads)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])["extra"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--durations", default="0,1,2,3,4")
    ap.add_argument("--shapes", default=None, help="semicolon list of B,T,U,V")
    ap.add_argument("--no-mem", action="store_true")
    ap.add_argument("--mem-child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    durations = tuple(int(d) for d in args.durations.split(","))
    if args.mem_child:
        loss, s, d = args.mem_child
        memory_child(loss, tuple(map(int, s.split(","))), d, durations)
        return
    shapes = [tuple(map(int, s.split(","))) for s in args.shapes.split(";")] if args.shapes else CPU_SHAPES
    print(f"durations {durations}; median of {args.repeats} fwd+bwd runs; {args.threads} threads")
    print("| dtype | B,T,U,V | RNN-T numba (ms) | TDT numba (ms) | TDT / RNN-T time | RNN-T extra memory (MB) | "
          "TDT extra memory (MB) | TDT extra / logits |")
    print("|" + "---|" * 8)
    for shape in shapes:
        for dname in args.dtypes.split(","):
            t, nbytes = time_pair(shape, rnnt_bench.DTYPES[dname], durations, args.repeats)
            mem = {} if args.no_mem else {loss: memory(loss, shape, dname, durations, args.threads) for loss in t}
            mb = {loss: "" if mem.get(loss) is None else f"{mem[loss] / 2**20:.0f}" for loss in t}
            ratio = "" if mem.get("tdt") is None else f"{mem['tdt'] / nbytes['tdt']:.2f}"
            print(f"| {dname} | {','.join(map(str, shape))} | {t['rnnt'] * 1e3:.1f} | {t['tdt'] * 1e3:.1f} | "
                  f"{t['tdt'] / t['rnnt']:.2f}x | {mb['rnnt']} | {mb['tdt']} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
