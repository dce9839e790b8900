"""Numba CUDA simulator cases of the TDT kernels for ``test_tdt_numba_cuda_sim.py``; run in a subprocess.

NUMBA_ENABLE_CUDASIM must be set before numba is imported, so this script sets it first, runs the TDT
numba-cuda kernels on tiny CPU tensors with 4-thread blocks (so the striding over V + D and over the cells
of an anti-diagonal with U+1 ≫ block size is exercised) and prints one JSON line per case with the largest
errors against the float64 ``torch`` TDT reference. The pytest side asserts on them.
"""

import os

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import json  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

from asrprec.losses import numba_cuda, tdt_loss  # noqa: E402


def _case(name, B, T, U, V, dtype, durations, *, blank=0, sigma=0.0, lens=None, grad_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, T, U + 1, V + len(durations), generator=g, dtype=torch.float64) * 2).to(dtype)
    labels = [v for v in range(V) if v != blank]
    tg = torch.tensor(labels)[torch.randint(0, len(labels), (B, U), generator=g)]
    tl, ul = lens if lens else (torch.full((B,), T), torch.full((B,), U))
    kw = dict(durations=durations, blank=blank, sigma=sigma, reduction="none")
    ref_x = x.double().requires_grad_()  # the reference sees the same (rounded) logits, in fp64
    ref = tdt_loss(ref_x, tg, tl, ul, backend="torch", **kw)
    ref[torch.isfinite(ref)].sum().backward()
    xx = x.clone().requires_grad_()
    prev = numba_cuda.set_grad_dtype(grad_dtype)
    try:
        got = tdt_loss(xx, tg, tl, ul, backend="numba-cuda", **kw)
        got[torch.isfinite(got)].sum().backward()
    finally:
        numba_cuda.set_grad_dtype(prev)
    fin = torch.isfinite(ref)
    pad = torch.ones_like(xx, dtype=torch.bool)
    for b in range(B):
        pad[b, : int(tl[b]), : int(ul[b]) + 1] = False
    return {
        "name": name,
        "same_inf": bool(torch.equal(torch.isinf(got), torch.isinf(ref))),
        "loss_rel": ((got.double() - ref.detach()).abs() / ref.detach().abs())[fin].max().item(),
        "grad_err": (xx.grad.double() - ref_x.grad).abs().max().item(),
        "pad_max": xx.grad[pad].abs().max().item() if pad.any() else 0.0,
        "grad_dtype": str(xx.grad.dtype),
    }


def _storage_error() -> dict:
    """|Δgrad| of the kept gradient stored in the logits' dtype (bf16) vs in fp32, for the same bf16 logits."""
    from asrprec.losses.tdt_numba_cuda import tdt_numba_cuda_forward

    g = torch.Generator().manual_seed(1)
    B, T, U, V, durations = 2, 4, 2, 6, (0, 1, 2)
    x = (torch.randn(B, T, U + 1, V + len(durations), generator=g) * 2).bfloat16()
    tg = torch.randint(1, V, (B, U), generator=g)
    tl, ul = torch.full((B,), T), torch.full((B,), U)
    ref_x = x.double().requires_grad_()
    tdt_loss(ref_x, tg, tl, ul, durations=durations, reduction="sum", backend="torch").backward()
    out = {"name": "storage"}
    for tag, gdt in (("bf16", None), ("fp32", torch.float32)):
        _, grad = tdt_numba_cuda_forward(x, tg, tl, ul, durations, 0, 0.0, True, grad_dtype=gdt)
        out[f"err_{tag}"] = (grad.double() - ref_x.grad).abs().max().item()
        out[f"dtype_{tag}"] = str(grad.dtype)
    return out


def main() -> None:
    numba_cuda.set_threads_per_block(v=4, dp=4)
    ragged = (torch.tensor([5, 2, 1]), torch.tensor([3, 0, 2]))
    cases = [
        ("fp32", dict(B=2, T=4, U=2, V=5, dtype=torch.float32, durations=(0, 1, 2, 3, 4))),
        ("fp16", dict(B=2, T=4, U=2, V=5, dtype=torch.float16, durations=(0, 1, 2, 3, 4))),
        ("bf16", dict(B=2, T=4, U=2, V=5, dtype=torch.bfloat16, durations=(0, 1, 2, 3, 4))),
        # 0 is not a duration: the utterance (T_b = 1, U_b = 2) has no alignment
        ("ragged_sigma_no_zero", dict(B=3, T=5, U=3, V=6, dtype=torch.float32, durations=(1, 2, 4), blank=5,
                                      sigma=0.05, lens=ragged)),
        ("one_frame_per_symbol", dict(B=2, T=4, U=2, V=5, dtype=torch.float32, durations=(1,))),
        # U+1 = 41 ≫ 4 threads per block: the striding over each anti-diagonal
        ("long_u", dict(B=1, T=3, U=40, V=3, dtype=torch.float32, durations=(0, 1, 2))),
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
