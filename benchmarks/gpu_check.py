"""The Python steps of ``benchmarks/gpu_check.sh``; each prints a markdown table.

    python benchmarks/gpu_check.py SECTION [--device cuda] [--dry-run]

Sections: ``loss-check`` (numba-cuda against the float64 reference; exit 1 on a failed case), ``tdt-check``
(the same for the TDT loss, then TDT vs RNN-T numba-cuda time and peak memory), ``lean`` (joint +
loss memory and time: full logits with numba-cuda vs the memory-lean loss), ``train-step`` (a transducer training
step per precision policy), ``step-memory`` (a whole step's peak allocated and reserved memory against
its fake-tensor projection), ``optimizer`` (ScaledAdam, stacked vs per tensor), ``bf16-update`` (optimizer
step time and state per ``--bf16-update`` rule) and ``streaming-check`` (streaming vs simulated streaming).
``--dry-run`` runs the same code at toy sizes on the CPU (numba-cuda in its simulator when
``NUMBA_ENABLE_CUDASIM=1``), so that a GPU run cannot fail on a typo.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _peak_reset(device: str) -> int:
    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _peak_gb(device: str, base: int = 0) -> str:
    if device != "cuda":
        return "-"
    torch.cuda.synchronize()
    return f"{(torch.cuda.max_memory_allocated() - base) / 2**30:.2f}"


# -- 1. numba-cuda against the float64 reference -----------------------------------------------------------
def loss_check(device: str, dry: bool) -> int:
    from asrprec.losses import numba_cuda, rnnt_loss
    from asrprec.losses.numba_cuda import numba_cuda_forward, numba_cuda_probe

    if dry:
        numba_cuda.set_threads_per_block(v=4, dp=4)  # the simulator runs one Python thread per CUDA thread
    ok, reason = numba_cuda_probe()
    print(f"probe: ok={ok} {reason}")
    if not ok:
        return 1
    fails = 0

    def case(name, B, T, U, V, dtype, blank=0, clamp=None, lam=0.0, ragged=False):
        nonlocal fails
        g = torch.Generator().manual_seed(0)
        x = (torch.randn(B, T, U + 1, V, generator=g) * 2).to(dtype).to(device)
        labels = torch.tensor([v for v in range(V) if v != blank])
        tg = labels[torch.randint(0, len(labels), (B, U), generator=g)].to(device)
        tl = torch.full((B,), T, device=device)
        ul = torch.full((B,), U, device=device)
        if ragged and B > 1:
            tl[1] = max(1, T // 2)
            ul[1] = U // 2
        xr = x.double().requires_grad_()
        ref = rnnt_loss(xr, tg, tl, ul, blank=blank, backend="torch", reduction="none", clamp=clamp, fastemit_lambda=lam)
        ref.sum().backward()
        xx = x.clone().requires_grad_()
        _sync(device)
        t0 = time.time()
        got = rnnt_loss(xx, tg, tl, ul, blank=blank, backend="numba-cuda", reduction="none", clamp=clamp,
                        fastemit_lambda=lam)
        got.sum().backward()
        _sync(device)
        rel = ((got.double() - ref) / ref).abs().max().item()
        gerr = (xx.grad.double() - xr.grad).abs().max().item()
        pad = 0.0
        if ragged and B > 1:
            pad = max(xx.grad[1, int(tl[1]):].abs().max().item() if int(tl[1]) < T else 0.0,
                      xx.grad[1, :, int(ul[1]) + 1:].abs().max().item())
        tol = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
        good = rel < 1e-5 and gerr < tol and pad == 0.0
        fails += not good
        print(f"| {name} | {str(dtype)[6:]} | {B},{T},{U},{V} | {rel:.2e} | {gerr:.2e} | {pad:.1e} | "
              f"{time.time() - t0:.2f} | {'PASS' if good else 'FAIL'} |", flush=True)

    print("| case | dtype | B,T,U,V | max rel Δloss | max abs Δgrad | max pad grad | s | result |")
    print("|---|---|---|---|---|---|---|---|")
    small = dry  # toy shapes in the simulator; U = 2000 on a GPU (beyond NeMo's U+1 <= 1024 launch limit)
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        case("basic", *((3, 4, 3, 8) if small else (4, 50, 20, 128)), dt, ragged=True)
        case("blank=V-1", *((1, 3, 2, 6) if small else (2, 30, 10, 64)), dt, blank=5 if small else 63)
        case("clamp+fastemit", *((1, 3, 2, 6) if small else (2, 30, 10, 64)), dt, clamp=0.1, lam=0.5)
        case("long U", *((1, 2, 9, 4) if small else (1, 8, 2000, 16)), dt)
    g = torch.Generator().manual_seed(1)
    B, T, U, V = (1, 3, 2, 8) if small else (2, 40, 20, 256)
    x = (torch.randn(B, T, U + 1, V, generator=g) * 2).half().to(device)
    tg = torch.randint(1, V, (B, U), generator=g).to(device)
    tl, ul = torch.full((B,), T, device=device), torch.full((B,), U, device=device)
    xr = x.double().requires_grad_()
    rnnt_loss(xr, tg, tl, ul, backend="torch", reduction="sum").backward()
    print()
    for gdt in (None, torch.float32):
        _, grad = numba_cuda_forward(x, tg, tl, ul, 0, None, 0.0, True, grad_dtype=gdt)
        err = (grad.double() - xr.grad).abs().max().item()
        print(f"gradient of fp16 logits stored as {str(grad.dtype)[6:]}: max |Δgrad| vs fp64 reference = {err:.2e}")
    print(f"\nfailed cases: {fails}")
    return 1 if fails else 0


# -- 1b. the TDT loss: numba-cuda against the float64 reference, then its speed next to the RNN-T kernels ----
def tdt_check(device: str, dry: bool) -> int:
    from asrprec.losses import numba_cuda, rnnt_loss, tdt_loss
    from asrprec.losses.numba_cuda import numba_cuda_probe

    if dry:
        numba_cuda.set_threads_per_block(v=4, dp=4)
    ok, reason = numba_cuda_probe()
    print(f"probe: ok={ok} {reason}")
    if not ok:
        return 1
    fails = 0

    def inputs(B, T, U, V, dtype, durations, blank=0, seed=0):
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(B, T, U + 1, V + len(durations), generator=g) * 2).to(dtype).to(device)
        labels = torch.tensor([v for v in range(V) if v != blank])
        tg = labels[torch.randint(0, len(labels), (B, U), generator=g)].to(device)
        return x, tg, torch.full((B,), T, device=device), torch.full((B,), U, device=device)

    def case(name, B, T, U, V, dtype, durations, blank=0, sigma=0.0, ragged=False):
        nonlocal fails
        x, tg, tl, ul = inputs(B, T, U, V, dtype, durations, blank)
        if ragged and B > 1:
            tl[1], ul[1] = max(1, T // 2), U // 2
        kw = dict(durations=durations, blank=blank, sigma=sigma, reduction="none")
        xr = x.double().requires_grad_()
        ref = tdt_loss(xr, tg, tl, ul, backend="torch", **kw)
        ref.sum().backward()
        xx = x.clone().requires_grad_()
        _sync(device)
        t0 = time.time()
        got = tdt_loss(xx, tg, tl, ul, backend="numba-cuda", **kw)
        got.sum().backward()
        _sync(device)
        rel = ((got.double() - ref) / ref).abs().max().item()
        gerr = (xx.grad.double() - xr.grad).abs().max().item()
        pad = 0.0
        if ragged and B > 1:
            pad = max(xx.grad[1, int(tl[1]):].abs().max().item() if int(tl[1]) < T else 0.0,
                      xx.grad[1, :, int(ul[1]) + 1:].abs().max().item())
        tol = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
        good = rel < 1e-5 and gerr < tol and pad == 0.0
        fails += not good
        print(f"| {name} | {str(dtype)[6:]} | {durations} | {B},{T},{U},{V} | {rel:.2e} | {gerr:.2e} | {pad:.1e} | "
              f"{time.time() - t0:.2f} | {'PASS' if good else 'FAIL'} |", flush=True)

    print("| case | dtype | durations | B,T,U,V | max rel Δloss | max abs Δgrad | max pad grad | s | result |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        case("basic, ragged", *((2, 3, 2, 5) if dry else (4, 50, 20, 128)), dt, (0, 1, 2, 3, 4), ragged=True)
        case("sigma, blank=V-1", *((1, 4, 2, 6) if dry else (2, 30, 10, 64)), dt, (1, 2, 4),
             blank=5 if dry else 63, sigma=0.05)
        # U+1 beyond 1024: NeMo's TDT kernels launch one thread per u
        case("long U", *((1, 2, 9, 3) if dry else (1, 8, 1500, 16)), dt, (0, 1, 2))
    print(f"\nfailed TDT cases: {fails}\n")

    durations = (0, 1, 2, 3, 4)
    print(f"fwd+bwd, median of {1 if dry else 3} after a warm-up, the two losses in alternation; "
          f"TDT durations {durations}\n")
    print("| B,T,U,V | dtype | RNN-T numba-cuda ms | TDT numba-cuda ms | TDT / RNN-T | RNN-T peak GB | TDT peak GB |")
    print("|---|---|---|---|---|---|---|")
    for B, T, U, V in [(1, 2, 1, 4)] if dry else [(8, 200, 100, 1024), (32, 200, 100, 1024)]:
        for dt in (torch.float32,) if dry else (torch.float32, torch.bfloat16):
            xt, tg, tl, ul = inputs(B, T, U, V, dt, durations)
            xr = xt[..., :V].contiguous()
            runs = {
                "rnnt": lambda z: rnnt_loss(z, tg, tl, ul, backend="numba-cuda", reduction="sum"),
                "tdt": lambda z: tdt_loss(z, tg, tl, ul, durations=durations, backend="numba-cuda", reduction="sum"),
            }
            args = {"rnnt": xr, "tdt": xt}
            times, peaks = {k: [] for k in runs}, {}
            for i in range(2 if dry else 4):
                for k, fn in runs.items():
                    z = args[k].detach().requires_grad_()
                    base = _peak_reset(device)
                    t0 = time.perf_counter()
                    fn(z).backward()
                    _sync(device)
                    if i:
                        times[k].append(time.perf_counter() - t0)
                    peaks[k] = _peak_gb(device, base)
                    del z
            ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            print(f"| {B},{T},{U},{V} | {str(dt)[6:]} | {ms['rnnt']:.1f} | {ms['tdt']:.1f} | "
                  f"{ms['tdt'] / ms['rnnt']:.2f}x | {peaks['rnnt']} | {peaks['tdt']} |", flush=True)
    return 1 if fails else 0


# -- 2. memory-lean loss vs full logits ---------------------------------------------------------------------
def lean(device: str, dry: bool) -> int:
    from asrprec.losses import available_backends, rnnt_loss, rnnt_loss_lean
    from asrprec.models import Joiner

    B, T, U, V, H = (2, 8, 5, 16, 32) if dry else (32, 200, 200, 1024, 640)
    full_backend = "numba-cuda" if device == "cuda" else "torch"
    assert "numba-cuda" in {b["name"] for b in available_backends()}  # the GPU run's backend name
    torch.manual_seed(0)
    joiner = Joiner(H, H, H, V).to(device)
    g = torch.Generator().manual_seed(0)
    enc = torch.randn(B, T, H, generator=g).to(device)
    dec = torch.randn(B, U + 1, H, generator=g).to(device)
    tg = torch.randint(1, V, (B, U), generator=g).to(device)
    tl, ul = torch.full((B,), T, device=device), torch.full((B,), U, device=device)
    print(f"B={B}, T={T}, U={U}, V={V}, H=J={H}; logits {B * T * (U + 1) * V * 4 / 2**30:.2f} GB in fp32\n")
    print("| path | autocast | fwd+bwd ms (median of 3) | peak GB beyond inputs | loss |")
    print("|---|---|---|---|---|")
    for amp in (None, torch.bfloat16):
        for path in (f"full logits + {full_backend}", "lean (tiles)"):
            times, peak, loss = [], "-", float("nan")
            for run in range(4):
                e = joiner.encoder_proj(enc).detach().requires_grad_()
                d = joiner.decoder_proj(dec).detach().requires_grad_()
                base = _peak_reset(device)
                _sync(device)
                t0 = time.perf_counter()
                with torch.autocast(device, dtype=amp) if amp else contextlib.nullcontext():
                    if path.startswith("lean"):
                        out = rnnt_loss_lean(joiner, e, d, tg, tl, ul, reduction="sum")
                    else:
                        logits = joiner(e[:, :, None], d[:, None], project_input=False)
                        out = rnnt_loss(logits, tg, tl, ul, backend=full_backend, reduction="sum")
                out.backward()
                _sync(device)
                if run:
                    times.append(time.perf_counter() - t0)
                peak, loss = _peak_gb(device, base), float(out.detach())
                joiner.zero_grad(set_to_none=True)
                del e, d, out
            print(f"| {path} | {'bf16' if amp else 'off'} | {statistics.median(times) * 1e3:.1f} | {peak} | {loss:.2f} |",
                  flush=True)
    return 0


# -- 3. a transducer training step per precision policy -----------------------------------------------------
def train_step(device: str, dry: bool) -> int:
    from asrprec.models import LossConfig, build_transducer, count_parameters, set_batch_count
    from asrprec.optim import ScaledAdam
    from asrprec.precision import POLICIES, UnsupportedPrecisionError, get_policy

    size, B, frames, U, V = ("tiny", 2, 120, 6, 64) if dry else ("medium", 32, 1500, 60, 500)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(B, frames, 80, generator=g).to(device)
    lens = torch.linspace(frames * 0.6, frames, B).long().to(device)
    targets = torch.randint(1, V, (B, U), generator=g).to(device)
    tlens = torch.full((B,), U, device=device)
    print(f"Zipformer {size}, pruned loss, ScaledAdam; batch {B} x {frames / 100:.0f} s, U={U}, V={V}\n")
    print("| policy | parameters | step ms (median of 3) | peak GB | peak / fp32 | peak / amp-fp16 |")
    print("|---|---|---|---|---|---|")
    peaks = {}
    for name in POLICIES:
        try:
            policy = get_policy(name, device)
        except UnsupportedPrecisionError as e:
            print(f"| {name} | - | unsupported here: {e} | - | - | - |")
            continue
        torch.manual_seed(0)
        model = build_transducer(encoder="zipformer", size=size, vocab_size=V, loss=LossConfig(loss="pruned"))
        model = policy.prepare_model(model).train()
        set_batch_count(model, 20000.0)
        opt = policy.build_optimizer(list(model.parameters()), lambda ps: ScaledAdam(ps, lr=0.045, clipping_scale=2.0))
        scaler = policy.make_scaler()
        times = []
        for i in range(4):  # one warm-up step, three timed
            if i == 1:
                _peak_reset(device)
            _sync(device)
            t0 = time.perf_counter()
            with policy.autocast():
                loss = model(feats, lens, targets, tlens)["loss"]
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            if i >= 1:
                times.append(time.perf_counter() - t0)
        peak = _peak_gb(device, 0)
        if peak != "-":
            peaks[name] = float(peak)
        ratios = [f"{peaks[name] / peaks[ref]:.2f}" if name in peaks and ref in peaks else "-"
                  for ref in ("fp32", "amp-fp16")]
        print(f"| {name} | {count_parameters(model):,} | {statistics.median(times) * 1e3:.0f} | {peak} | "
              f"{' | '.join(ratios)} |", flush=True)
        del model, opt, scaler, loss
        if device == "cuda":
            torch.cuda.empty_cache()
    return 0


# -- 4. ScaledAdam: stacked by shape vs one tensor at a time ------------------------------------------------
def optimizer(device: str, dry: bool) -> int:
    from asrprec.models import build_transducer
    from asrprec.optim import ScaledAdam

    size = "tiny" if dry else "medium"
    m = build_transducer(encoder="zipformer", size=size, vocab_size=500).to(device)
    n = sum(1 for _ in m.parameters())
    print(f"Zipformer {size} transducer\n")
    print("| update | tensors | ms per step (median) |")
    print("|---|---|---|")
    steps = 3 if dry else 25
    for batched in (False, True):
        opt = ScaledAdam(m.parameters(), lr=0.045, clipping_scale=2.0, batched=batched)
        for p in m.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        times = []
        for i in range(steps):
            _sync(device)
            t0 = time.perf_counter()
            opt.step()
            _sync(device)
            if i >= min(5, steps - 1):
                times.append(time.perf_counter() - t0)
        print(f"| {'stacked by shape' if batched else 'per tensor'} | {n} | {statistics.median(times) * 1e3:.1f} |")
    return 0


# -- 4b. bf16 weight updates: optimizer step time and state per update ------------------------------------
def bf16_update(device: str, dry: bool) -> int:
    from asrprec.models import build_transducer
    from asrprec.optim import ScaledAdam
    from asrprec.precision import get_policy

    size = "tiny" if dry else "medium"
    steps = 3 if dry else 20
    print(f"Zipformer {size} transducer, bf16 policy: optimizer step (median of {steps} after 2 warm-up steps) and "
          "optimizer state (fp32 masters included) per update rule\n")
    print("| optimizer | update | ms per step | optimizer state GiB |")
    print("|---|---|---|---|")
    factories = {"scaled_adam": lambda ps: ScaledAdam(ps, lr=0.045, clipping_scale=2.0),
                 "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3)}
    for name, factory in factories.items():
        for update, moments in (("master", False), ("kahan", False), ("stochastic", False), ("none", False),
                                ("stochastic", True)):
            torch.manual_seed(0)
            pol = get_policy("bf16", device, bf16_update=update, bf16_moments=moments)
            m = pol.prepare_model(build_transducer(encoder="zipformer", size=size, vocab_size=500))
            opt = pol.build_optimizer([p for p in m.parameters()], factory)
            times = []
            for i in range(steps + 2):
                for p in m.parameters():
                    p.grad = torch.randn_like(p) * 1e-3
                _sync(device)
                t0 = time.perf_counter()
                opt.step()
                _sync(device)
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            state = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
            state += list(getattr(opt, "_masters", []))
            gib = sum(t.numel() * t.element_size() for t in state) / 2**30
            label = update + (" + bf16 moments" if moments else "")
            print(f"| {name} | {label} | {statistics.median(times) * 1e3:.1f} | {gib:.3f} |")
            del m, opt, state
    return 0


# -- 5. streaming vs simulated streaming --------------------------------------------------------------------
def streaming_check(device: str, dry: bool) -> int:
    from asrprec.decoding import streaming_encode
    from asrprec.models import build_transducer, configure_streaming

    torch.manual_seed(0)
    size = "tiny" if dry else "small"
    m = build_transducer(encoder="zipformer", size=size, vocab_size=500, encoder_overrides={"causal": True})
    m = m.to(device).eval()
    frames = 300 if dry else 1500
    x = torch.randn(4, frames, 80, device=device)
    lens = torch.tensor([frames, frames * 4 // 5, frames * 3 // 5, frames * 2 // 5], device=device)
    print(f"Zipformer {size} (causal), chunk 32, left context 128\n")
    print("| model dtype | max abs difference, streaming vs simulated, relative to max abs output (valid frames) |")
    print("|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        m = m.to(dtype)
        with torch.inference_mode():
            got, n = streaming_encode(m, x, lens, 32, 128)
            configure_streaming(m, 32, 128)
            want, n2 = m.encode(x, lens)
        assert torch.equal(n, n2)
        err = max(float((got[i, :k] - want[i, :k]).abs().max()) for i, k in enumerate(n.tolist()))
        print(f"| {str(dtype)[6:]} | {err / float(want.abs().max()):.2e} |")
    return 0


# -- 3b. a whole training step's memory: measured against the fake-tensor projection --------------------------
def step_memory(device: str, dry: bool) -> int:
    """One training step per policy, after a first step that creates the optimizer state: peak allocated and
    reserved memory against ``benchmarks/memory_step.py``'s projection of the same step (taken from
    ``benchmarks/data/results.json``; the dry run projects its toy step on the spot and "measures" it with
    LiveMemoryTracker on real CPU tensors)."""
    import json
    from pathlib import Path

    from asrprec.precision import POLICIES, UnsupportedPrecisionError, get_policy
    from asrprec.precision.memory_step import project_step

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from memory_step import asrprec_step, batch_maker, optimizer_factory

    size, B, frames, U, V = ("tiny", 2, 120, 4, 64) if dry else ("medium", 64, 1500, 45, 500)
    build, loss_fn = asrprec_step(size, V, "pruned", "full", 5)
    make, opt = batch_maker(B, frames, U, V), optimizer_factory("scaled_adam")
    policies = ("bf16",) if dry else POLICIES  # the dry run's fake Zipformer step takes a minute per policy
    results = Path(__file__).resolve().parent / "data" / "results.json"
    projected = {} if dry else json.loads(results.read_text()).get("step_memory", {}).get("gpu_check", {})
    print(f"Zipformer {size}, pruned loss, ScaledAdam, one GPU (no DDP); batch {B} x {frames / 100:g} s, U={U}, "
          f"V={V}; MB = 10^6 bytes\n")
    print("| policy | projected peak MB (lower bound) | max_memory_allocated MB | memory_reserved MB | "
          "projected / allocated | projected / reserved |")
    print("|---|---|---|---|---|---|")
    for name in policies:
        try:
            policy = get_policy(name, device)
        except UnsupportedPrecisionError as e:
            print(f"| {name} | unsupported here: {e} | - | - | - | - |")
            continue
        if dry:
            proj = project_step(build, make, loss_fn, name, opt, cuda_forward=False).peak_cuda_estimate
            real = project_step(build, make, loss_fn, name, opt, fake=False)
            alloc, reserved = real.peak, None
        else:
            proj = projected.get(name, {}).get("peak_cuda_estimate")
            model = policy.prepare_model(build()).train()
            params = [p for p in model.parameters() if p.requires_grad]
            optim = policy.build_optimizer(params, opt)
            scaler = policy.make_scaler()
            batch = make(torch.device(device))
            for i in range(2):  # the first step creates the optimizer state; the second is measured
                if i == 1:
                    _peak_reset(device)
                with policy.autocast():
                    loss = loss_fn(model, batch)
                scaler.scale(loss).backward()
                del loss
                scaler.step(optim)
                scaler.update()
                optim.zero_grad(set_to_none=True)
            _sync(device)
            alloc, reserved = torch.cuda.max_memory_allocated(), torch.cuda.memory_reserved()
            del model, optim, scaler, batch, params
            torch.cuda.empty_cache()

        def mb(n):
            return f"{n / 1e6:,.0f}" if n else "-"

        def ratio(n):
            return f"{proj / n:.2f}" if proj and n else "-"

        print(f"| {name} | {mb(proj)} | {mb(alloc)} | {mb(reserved)} | {ratio(alloc)} | {ratio(reserved)} |",
              flush=True)
    return 0


SECTIONS = {"loss-check": loss_check, "tdt-check": tdt_check, "lean": lean, "train-step": train_step,
            "step-memory": step_memory,
            "optimizer": optimizer, "bf16-update": bf16_update, "streaming-check": streaming_check}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("section", choices=sorted(SECTIONS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU")
    args = p.parse_args(argv)
    device = "cpu" if args.dry_run else args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run to rehearse on the CPU", file=sys.stderr)
        return 2
    if device == "cpu":
        torch.set_num_threads(1)
    return SECTIONS[args.section](device, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
