"""Numba CUDA simulator cases for ``test_numba_cuda_sim.py``; run in a subprocess.

NUMBA_ENABLE_CUDASIM must be set before numba is imported, so this script sets it first, runs
the numba-cuda kernels on tiny CPU tensors with tiny blocks (4 threads, so the striding over V
and over u with U+1 ≫ block size is exercised) and prints one JSON line per case with the
largest errors against the float64 ``torch`` reference. The pytest side asserts on them.
"""

import os

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from asrprec.losses import numba_cuda, rnnt_loss  # noqa: E402


def _case(name, B, T, U, V, dtype, *, blank=0, clamp=None, lam=0.0, lens=None, grad_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x64 = torch.randn(B, T, U + 1, V, generator=g, dtype=torch.float64) * 2
    x = x64.to(dtype)
    labels = [v for v in range(V) if v != blank]
    tg = torch.tensor(labels)[torch.randint(0, len(labels), (B, U), generator=g)]
    tl, ul = lens if lens else (torch.full((B,), T), torch.full((B,), U))
    ref_x = x.double().requires_grad_()  # the reference sees the same (rounded) logits, in fp64
    ref = rnnt_loss(ref_x, tg, tl, ul, blank=blank, reduction="none", backend="torch", clamp=clamp, fastemit_lambda=lam)
    ref.sum().backward()
    xx = x.clone().requires_grad_()
    prev = numba_cuda.set_grad_dtype(grad_dtype)
    t0 = time.time()
    try:
        got = rnnt_loss(xx, tg, tl, ul, blank=blank, reduction="none", backend="numba-cuda", clamp=clamp, fastemit_lambda=lam)
        got.sum().backward()
    finally:
        numba_cuda.set_grad_dtype(prev)
    pad = torch.ones_like(xx, dtype=torch.bool)
    for b in range(B):
        pad[b, : int(tl[b]), : int(ul[b]) + 1] = False
    return {
        "name": name,
        "dtype": str(dtype),
        "loss_err": (got.double() - ref.detach()).abs().max().item(),
        "loss_rel": ((got.double() - ref.detach()).abs() / ref.detach().abs()).max().item(),
        "grad_err": (xx.grad.double() - ref_x.grad).abs().max().item(),
        "grad_max": ref_x.grad.abs().max().item(),
        "pad_max": xx.grad[pad].abs().max().item() if pad.any() else 0.0,
        "grad_dtype": str(xx.grad.dtype),
        "seconds": time.time() - t0,
    }


def _storage_error() -> dict:
    """|Δgrad| of the kept gradient stored in fp16 vs fp32, for the same fp16 logits."""
    g = torch.Generator().manual_seed(1)
    B, T, U, V = 2, 3, 2, 6
    x = (torch.randn(B, T, U + 1, V, generator=g) * 2).half()
    tg = torch.randint(1, V, (B, U), generator=g)
    tl, ul = torch.full((B,), T), torch.full((B,), U)
    ref_x = x.double().requires_grad_()
    rnnt_loss(ref_x, tg, tl, ul, reduction="sum", backend="torch").backward()
    out = {"name": "storage"}
    for tag, gdt in (("fp16", None), ("fp32", torch.float32)):
        _, grad = numba_cuda.numba_cuda_forward(x, tg, tl, ul, 0, None, 0.0, True, grad_dtype=gdt)
        out[f"err_{tag}"] = (grad.double() - ref_x.grad).abs().max().item()
        out[f"dtype_{tag}"] = str(grad.dtype)
    return out


def main() -> None:
    numba_cuda.set_threads_per_block(v=4, dp=4)
    ok, reason = numba_cuda.numba_cuda_probe()
    print(json.dumps({"name": "probe", "ok": ok, "reason": reason}), flush=True)
    ragged = (torch.tensor([4, 2, 1]), torch.tensor([3, 0, 2]))
    cases = [
        ("fp32", dict(B=2, T=3, U=2, V=5, dtype=torch.float32)),
        ("fp16", dict(B=2, T=3, U=2, V=5, dtype=torch.float16)),
        ("bf16", dict(B=2, T=3, U=2, V=5, dtype=torch.bfloat16)),
        ("ragged_blank_last", dict(B=3, T=4, U=3, V=6, dtype=torch.float32, blank=5, lens=ragged)),
        ("clamp_fastemit", dict(B=2, T=3, U=2, V=5, dtype=torch.float32, clamp=0.1, lam=0.5)),
        # U+1 = 41 ≫ 4 threads per block: the striding over each anti-diagonal (what U ≥ 2000 uses on a GPU)
        ("long_u", dict(B=1, T=2, U=40, V=3, dtype=torch.float32)),
    ]
    only = set(sys.argv[1:])
    if not only or "storage" in only:
        print(json.dumps(_storage_error()), flush=True)
    for name, kw in cases:
        if only and name not in only:
            continue
        print(json.dumps(_case(name, **kw)), flush=True)


if __name__ == "__main__":
    main()
