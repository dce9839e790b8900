"""Peak memory and time of joint + RNN-T loss (forward + backward) on CPU: lean vs plain paths.

Paths (all exact, all fp32, all produce gradients w.r.t. the projected encoder/decoder outputs and
the joiner's parameters):

* ``plain-torch``: joiner on the full (B, T, U+1) grid -> fp32 log_softmax -> gather blank/label ->
  lattice DP (:func:`asrprec.losses.lattice.rnnt_lattice_nll`), autograd through the joiner.
* ``plain-numba``: joiner on the full grid -> the ``numba`` backend (fused log-softmax, gradient
  computed in forward: one logits-sized buffer), when importable.
* ``lean``: :func:`asrprec.losses.lean.rnnt_loss_lean` (default tiles).

Memory method: every (path, shape) runs in a fresh subprocess. After building the inputs and one
tiny warm-up call (to load kernels / jit), the worker records VmRSS, resets the kernel's peak-RSS
counter (``echo 5 > /proc/self/clear_refs``), runs one forward+backward and reads VmHWM; the reported
peak is VmHWM - VmRSS(before), i.e. everything the step allocated at its peak (activations, logits,
gradients, allocator overhead). glibc's dynamic mmap threshold is pinned
(``MALLOC_MMAP_THRESHOLD_=65536``) so large tensors are returned to the OS when freed and RSS tracks
live tensors. Time: median wall time of ``--repeats`` further forward+backward steps, one thread
(torch and numba), since the benchmark machine's cores are shared.

Usage::

    python benchmarks/lean_joint.py                 # main table + V sweep, markdown to stdout
    python benchmarks/lean_joint.py --only-main
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, _ROOT)


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _worker(path: str, B: int, T: int, U: int, V: int, J: int, repeats: int) -> dict:
    import gc

    import torch

    torch.set_num_threads(1)
    from asrprec.losses.lattice import extend_targets, rnnt_lattice_nll
    from asrprec.losses.lean import rnnt_loss_lean
    from asrprec.models.joiner import Joiner

    def make(B, T, U):
        g = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        joiner = Joiner(J, J, J, V)
        enc = torch.randn(B, T, J, generator=g).requires_grad_()
        dec = torch.randn(B, U + 1, J, generator=g).requires_grad_()
        targets = torch.randint(1, V, (B, U), generator=g)
        return joiner, enc, dec, targets, torch.full((B,), T), torch.full((B,), U)

    simple_am = torch.nn.Linear(J, V)  # icefall's simple_am_proj / simple_lm_proj, for the pruned path
    simple_lm = torch.nn.Linear(J, V)

    def step(joiner, enc, dec, targets, ll, tl):
        if path == "pruned":  # approximate: simple loss + s_range=5 windows (icefall's recipe), not the same loss
            from asrprec.losses.pruned import do_rnnt_pruning, get_rnnt_prune_ranges, rnnt_loss_pruned, \
                rnnt_loss_smoothed

            simple, (px, py) = rnnt_loss_smoothed(simple_lm(dec), simple_am(enc), targets, ll, tl,
                                                  lm_only_scale=0.25, am_only_scale=0.0, return_grad=True)
            ranges = get_rnnt_prune_ranges(px, py, ll, tl, 5)
            e, d = do_rnnt_pruning(enc, dec, ranges)
            pruned = rnnt_loss_pruned(joiner(e, d, project_input=False), targets, ranges, ll, tl)
            loss = 0.5 * simple + pruned
        elif path == "lean":
            loss = rnnt_loss_lean(joiner, enc, dec, targets, ll, tl, reduction="sum")
        else:
            logits = joiner(enc.unsqueeze(2), dec.unsqueeze(1), project_input=False)
            if path == "plain-numba":
                from asrprec.losses.numba_cpu import rnnt_loss_numba

                loss = rnnt_loss_numba(logits, targets, ll, tl).sum()
            else:
                logp = logits.float().log_softmax(-1)
                del logits
                Bb, Tt, U1, _ = logp.shape
                idx = extend_targets(targets, tl, 0).view(Bb, 1, U1, 1).expand(Bb, Tt, U1, 1)
                blank_lp, label_lp = logp[..., 0], logp.gather(3, idx).squeeze(3)
                del logp
                loss = rnnt_lattice_nll(blank_lp, label_lp, ll, tl).sum()
        loss.backward()
        return loss.item()

    def clear(joiner, enc, dec):
        for p in [enc, dec, *joiner.parameters()]:
            p.grad = None
        gc.collect()

    warm = make(2, 4, 3)
    step(*warm)
    del warm
    args = make(B, T, U)
    clear(*args[:3])
    rss0 = _vm("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    loss = step(*args)
    peak = _vm("VmHWM") - rss0
    times = []
    for _ in range(repeats):
        clear(*args[:3])
        t0 = time.perf_counter()
        step(*args)
        times.append(time.perf_counter() - t0)
    return {"path": path, "B": B, "T": T, "U": U, "V": V, "J": J, "peak_bytes": peak, "loss": loss,
            "times": times, "median_s": statistics.median(times)}


def _run(path, B, T, U, V, J, repeats) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
               MKL_NUM_THREADS="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", path, *map(str, (B, T, U, V, J, repeats))]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"worker {path} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _paths() -> list[str]:
    paths = ["plain-torch"]
    try:
        import numba  # noqa: F401

        from asrprec.losses import numba_cpu  # noqa: F401

        paths.append("plain-numba")
    except ImportError:
        pass
    return paths + ["lean"]


def _table(rows: list[dict], title: str) -> str:
    mb = 1024**2
    out = [f"**{title}**", "",
           "| B | T | U | V | J | path | peak MB | median s | lean/path peak | lean/path time | loss |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    by_shape: dict = {}
    for r in rows:
        by_shape.setdefault((r["B"], r["T"], r["U"], r["V"], r["J"]), {})[r["path"]] = r
    for shape, d in by_shape.items():
        lean = d.get("lean")
        for path, r in d.items():
            ratio_m = f"{lean['peak_bytes'] / r['peak_bytes']:.3f}" if lean and path != "lean" else ""
            ratio_t = f"{lean['median_s'] / r['median_s']:.2f}" if lean and path != "lean" else ""
            out.append(f"| {' | '.join(map(str, shape))} | {path} | {r['peak_bytes'] / mb:.1f} | "
                       f"{r['median_s']:.2f} | {ratio_m} | {ratio_t} | {r['loss']:.3f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=7, metavar=("PATH", "B", "T", "U", "V", "J", "REPEATS"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sweep-repeats", type=int, default=1)
    ap.add_argument("--only-main", action="store_true")
    ap.add_argument("--sweep-B", type=int, default=2)
    ap.add_argument("--sweep-V", type=int, nargs="+", default=[128, 500, 2000])
    ap.add_argument("--only-sweep", action="store_true")
    ap.add_argument("--pruned", action="store_true", help="only the pruned path at the main shape")
    a = ap.parse_args()
    if a.worker:
        path, *nums = a.worker
        print(json.dumps(_worker(path, *map(int, nums))))
        return
    print(f"# lean joint benchmark: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}, {time.strftime('%Y-%m-%d')}")
    if a.pruned:
        rows = [_run("pruned", 8, 200, 100, 500, 512, 3)]
        print(_table(rows, "pruned (simple + s_range=5), B=8, T=200, U=100, V=500, J=512, fp32, median of 3"))
        return
    if not a.only_sweep:
        main_rows = [_run(p, 8, 200, 100, 500, 512, a.repeats) for p in _paths()]
        print(_table(main_rows, f"B=8, T=200, U=100, V=500, J=512, fp32, median of {a.repeats}"))
    if a.only_main:
        return
    # the sweep compares against the plain-torch path only (plain-numba had the same peak in the main table)
    sweep = [_run(p, a.sweep_B, 200, 100, V, 512, a.sweep_repeats) for V in a.sweep_V for p in ("plain-torch", "lean")]
    print()
    print(_table(sweep, f"V sweep, B={a.sweep_B}, T=200, U=100, J=512, fp32, median of {a.sweep_repeats}"))


if __name__ == "__main__":
    main()
