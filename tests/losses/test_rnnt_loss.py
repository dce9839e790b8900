"""RNN-T loss API and CPU backends against an independent oracle.

The oracle enumerates every monotonic alignment of tiny lattices in float64 and differentiates
the resulting log-sum-exp with autograd, so it shares no code (and no recursion) with the
backends. The reference is additionally gradchecked. numba-cuda runs in ``test_numba_cuda_sim.py``.
"""

from __future__ import annotations

import inspect
import itertools

import numpy as np
import pytest
import torch

from asrprec.losses import (
    available_backends,
    resolve_backend,
    rnnt_loss,
    rnnt_loss_lean,
    rnnt_loss_pruned,
    rnnt_loss_smoothed,
    validate_rnnt_inputs,
)

AVAILABLE = {b["name"] for b in available_backends() if b["available"]}
CPU_BACKENDS = [b for b in ("torch", "numba", "torchaudio") if b in AVAILABLE]
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
# gradient tolerance = about one rounding of values of order 1 in the gradient's storage dtype
GRAD_TOL = {torch.float64: 1e-10, torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def oracle(logits, targets, logit_lens, target_lens, blank=0, fastemit_lambda=0.0, clamp=None):
    """(costs (B,), grads (B,T,U+1,V)) by enumerating all alignments, float64.

    FastEmit: the gradient w.r.t. the label log-probs is scaled by (1+λ) and pushed through the
    log-softmax Jacobian by hand; the cost is (1+λ)·NLL (NeMo's convention).
    """
    x = logits.detach().double()
    B, T, U1, V = x.shape
    costs, grads = torch.zeros(B, dtype=torch.float64), torch.zeros_like(x)
    for b in range(B):
        Tb, Ub = int(logit_lens[b]), int(target_lens[b])
        y = [int(v) for v in targets[b, :Ub]]
        logp = torch.log_softmax(x[b], dim=-1).detach().requires_grad_()
        scores = []
        for labels_at in itertools.combinations(range(Tb + Ub - 1), Ub):  # the last symbol is a blank
            t = u = 0
            s = 0.0
            for k in range(Tb + Ub):
                if k in labels_at:
                    s = s + logp[t, u, y[u]]
                    u += 1
                else:
                    s = s + logp[t, u, blank]
                    t += 1
            scores.append(s)
        nll = -torch.logsumexp(torch.stack(scores), 0)
        (g_logp,) = torch.autograd.grad(nll, logp)
        label_mask = torch.ones(V, dtype=torch.bool)
        label_mask[blank] = False
        g_logp = torch.where(label_mask, g_logp * (1 + fastemit_lambda), g_logp)
        p = logp.detach().exp()
        g = g_logp - p * g_logp.sum(-1, keepdim=True)  # log-softmax backward
        if clamp is not None:
            g = g.clamp(-clamp, clamp)
        g[Tb:] = 0
        g[:, Ub + 1 :] = 0
        grads[b] = g
        costs[b] = nll.detach() * (1 + fastemit_lambda)
    return costs, grads


def make_batch(B=3, T=4, U=3, V=6, blank=0, seed=0, ragged=True, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, U + 1, V, generator=g, dtype=torch.float64) * scale
    labels = torch.tensor([v for v in range(V) if v != blank])
    tg = labels[torch.randint(0, len(labels), (B, U), generator=g)]
    if ragged:
        tl = torch.tensor([T, max(1, T - 2), 1] + [T] * (B - 3))[:B]
        ul = torch.tensor([U, 0, min(2, U)] + [U] * (B - 3))[:B]
    else:
        tl, ul = torch.full((B,), T), torch.full((B,), U)
    tg = torch.where(torch.arange(U)[None] < ul[:, None], tg, -1)  # padding that is not a valid id
    return x, tg, tl, ul


def supports(backend, dtype, fastemit=False, clamp=None):
    try:
        resolve_backend(backend, "cpu", dtype, clamp, fastemit)
        return True
    except ValueError:
        return False


def backend_dtypes(dtypes):
    """The (backend, dtype) pairs a CPU backend accepts (torchaudio takes fp32 and fp16 only; its refusal of the
    others is tested in test_auto_picks_numba_on_cpu_and_never_casts)."""
    return [pytest.param(b, d, id=f"{b}-{str(d).replace('torch.', '')}") for b in CPU_BACKENDS for d in dtypes
            if supports(b, d)]


def run(backend, x, tg, tl, ul, **kw):
    xx = x.clone().requires_grad_()
    costs = rnnt_loss(xx, tg, tl, ul, backend=backend, reduction="none", **kw)
    costs.sum().backward()
    return costs.detach().double(), xx.grad.double()


# ---------------------------------------------------------------- correctness against the oracle


@pytest.mark.parametrize("backend,dtype", backend_dtypes(DTYPES))
@pytest.mark.parametrize("blank", [0, 5])
def test_backend_matches_enumeration(backend, dtype, blank):
    x, tg, tl, ul = make_batch(blank=blank)
    x = x.to(dtype)
    ref_cost, ref_grad = oracle(x, tg, tl, ul, blank=blank)
    cost, grad = run(backend, x, tg, tl, ul, blank=blank)
    assert cost.dtype == torch.float64 and rnnt_loss(x, tg, tl, ul, blank=blank, backend=backend).dtype == (
        torch.float64 if dtype == torch.float64 else torch.float32
    )
    loss_rtol = 1e-3 if (backend == "torchaudio" and dtype == torch.float16) else 1e-10 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(cost, ref_cost, rtol=loss_rtol, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=GRAD_TOL[dtype])


@pytest.mark.parametrize("backend", [b for b in CPU_BACKENDS if b != "torchaudio"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_fastemit_and_clamp_match_enumeration(backend, dtype):
    x, tg, tl, ul = make_batch(seed=3)
    x = x.to(dtype)
    for lam, clamp in [(0.5, None), (0.0, 0.05), (0.3, 0.1)]:
        ref_cost, ref_grad = oracle(x, tg, tl, ul, fastemit_lambda=lam, clamp=clamp)
        cost, grad = run(backend, x, tg, tl, ul, fastemit_lambda=lam, clamp=clamp)
        torch.testing.assert_close(cost, ref_cost, rtol=1e-10 if dtype == torch.float64 else 2e-6, atol=0)
        torch.testing.assert_close(grad, ref_grad, rtol=0, atol=GRAD_TOL[dtype])
        if clamp is not None:
            assert grad.abs().max() <= clamp * (1 + 1e-2)


def test_reference_gradcheck():
    x, tg, tl, ul = make_batch(B=3, T=3, U=2, V=4)
    x = x.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda z: rnnt_loss(z, tg, tl, ul, backend="torch", reduction="none"), (x,), eps=1e-6, atol=1e-7
    )


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_empty_targets(backend):
    x = torch.randn(2, 5, 1, 4)
    tg = torch.zeros(2, 0, dtype=torch.long)
    tl, ul = torch.tensor([5, 3]), torch.tensor([0, 0])
    ref_cost, ref_grad = oracle(x, tg, tl, ul)
    cost, grad = run(backend, x, tg, tl, ul)
    torch.testing.assert_close(cost, ref_cost, rtol=2e-6, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=2e-6)


# ---------------------------------------------------------------- agreement at a larger size


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_numba_matches_reference_medium(dtype):
    if "numba" not in AVAILABLE:
        pytest.skip("numba missing")
    x, tg, tl, ul = make_batch(B=4, T=30, U=12, V=40, seed=7)
    x = x.to(dtype)
    ref_cost, ref_grad = run("torch", x.double(), tg, tl, ul)  # fp64 reference on the same rounded logits
    cost, grad = run("numba", x, tg, tl, ul)
    torch.testing.assert_close(cost, ref_cost, rtol=2e-6, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=GRAD_TOL[dtype])


@pytest.mark.skipif("torchaudio" not in AVAILABLE, reason="torchaudio not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_numba_matches_torchaudio(dtype):
    x, tg, tl, ul = make_batch(B=3, T=20, U=8, V=30, seed=11)
    x = x.to(dtype)
    ta_cost, ta_grad = run("torchaudio", x, tg, tl, ul, clamp=0.3)
    cost, grad = run("numba", x, tg, tl, ul, clamp=0.3)
    torch.testing.assert_close(cost, ta_cost, rtol=1e-3 if dtype == torch.float16 else 2e-6, atol=0)
    # torchaudio's own fp32 gradient error against the enumeration is about 10x ours
    torch.testing.assert_close(grad, ta_grad, rtol=0, atol=2e-5 if dtype == torch.float32 else 2e-3)


# ---------------------------------------------------------------- reductions, padding, extremes


def test_every_loss_function_defaults_to_the_batch_mean():
    """One reduction default, "mean" over the batch, as k2 and torchaudio; the values are checked per function
    in test_lean.py and test_pruned.py."""
    for fn in (rnnt_loss, rnnt_loss_pruned, rnnt_loss_smoothed, rnnt_loss_lean):
        assert inspect.signature(fn).parameters["reduction"].default == "mean", fn.__name__


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_reductions_and_grad_output_scaling(backend):
    x, tg, tl, ul = make_batch(seed=5)
    x = x.float()
    ref_cost, ref_grad = oracle(x, tg, tl, ul)
    none = rnnt_loss(x, tg, tl, ul, backend=backend, reduction="none")
    torch.testing.assert_close(none.double(), ref_cost, rtol=2e-6, atol=0)
    for reduction, scale in (("sum", 1.0), ("mean", 1.0 / x.shape[0])):
        xx = x.clone().requires_grad_()
        loss = rnnt_loss(xx, tg, tl, ul, backend=backend, reduction=reduction)
        assert loss.shape == ()
        torch.testing.assert_close(loss.double(), ref_cost.sum() * scale, rtol=2e-6, atol=0)
        (loss * 3.0).backward()  # a non-unit grad_output reaches the backend's backward
        torch.testing.assert_close(xx.grad.double(), ref_grad * 3.0 * scale, rtol=0, atol=1e-5)


@pytest.mark.parametrize("backend,dtype", backend_dtypes(DTYPES))
def test_padding_gradient_exactly_zero(backend, dtype):
    x, tg, tl, ul = make_batch(B=3, T=6, U=4, V=7, seed=2)
    x = x.to(dtype)
    _, grad = run(backend, x, tg, tl, ul)
    for b in range(3):
        assert torch.all(grad[b, int(tl[b]) :] == 0)
        assert torch.all(grad[b, :, int(ul[b]) + 1 :] == 0)
        assert grad[b, : int(tl[b]), : int(ul[b]) + 1].abs().sum() > 0


BIG = {torch.float32: 1e4, torch.float16: 65504.0, torch.bfloat16: 1e4}  # entries near each dtype's range


@pytest.mark.parametrize("backend,dtype", backend_dtypes(BIG))
def test_extreme_logits_are_finite(backend, dtype):
    big = BIG[dtype]
    g = torch.Generator().manual_seed(4)
    x = (torch.randint(0, 3, (2, 5, 4, 6), generator=g).double() - 1.0) * big  # entries in {-big, 0, big}
    tg = torch.randint(1, 6, (2, 3), generator=g)
    tl, ul = torch.tensor([5, 4]), torch.tensor([3, 2])
    x = x.to(dtype)
    cost, grad = run(backend, x, tg, tl, ul)
    if backend == "torchaudio" and dtype == torch.float16 and not torch.isfinite(cost).all():
        pytest.xfail("torchaudio returns fp16 costs, which overflow for losses > 65504 (asrprec returns fp32)")
    assert torch.isfinite(cost).all() and torch.isfinite(grad).all()
    ref_cost, _ = run("torch", x.double(), tg, tl, ul)
    torch.testing.assert_close(cost, ref_cost, rtol=1e-3 if dtype == torch.float16 and backend == "torchaudio" else 1e-5, atol=0)


def test_numba_second_backward_refuses():
    if "numba" not in AVAILABLE:
        pytest.skip("numba missing")
    x, tg, tl, ul = make_batch()
    x = x.float().requires_grad_()
    loss = rnnt_loss(x, tg, tl, ul, backend="numba")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError):
        loss.backward()  # the kept gradient was scaled in place; reuse is detected, not silent


def test_numba_half_conversions_match_torch():
    """The numba kernels' fp32 -> fp16/bf16 round-to-nearest-even against torch's casts."""
    from asrprec.losses.numba_cpu import _get_kernels

    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    normal = (rng.standard_normal(200_000) * np.exp(rng.uniform(-25, 12, 200_000))).astype(np.float32)
    for f in (bits, normal):
        out = np.zeros((2, f.size), np.uint16)
        _get_kernels()["to_half_bits"](np.ascontiguousarray(f), out)
        t = torch.from_numpy(f)
        ok = ~np.isnan(f)
        assert np.array_equal(out[0][ok], t.half().view(torch.int16).numpy().view(np.uint16)[ok])
        assert np.array_equal(out[1][ok], t.bfloat16().view(torch.int16).numpy().view(np.uint16)[ok])
        assert np.isnan(out[0][~ok].view(np.float16)).all()


# ---------------------------------------------------------------- dispatch


def test_auto_picks_numba_on_cpu_and_never_casts():
    assert resolve_backend("auto", "cpu", torch.float32).name == ("numba" if "numba" in AVAILABLE else "torch")
    assert resolve_backend("auto", "cpu", torch.bfloat16).name in ("numba", "torch")
    for dtype in (torch.bfloat16, torch.float64):
        with pytest.raises(ValueError, match=str(dtype).replace("torch.", "")):
            resolve_backend("torchaudio", "cpu", dtype)
    with pytest.raises(ValueError, match="FastEmit"):
        resolve_backend("torchaudio", "cpu", torch.float32, None, 0.5)
    with pytest.raises(ValueError, match="cuda"):
        resolve_backend("numba-cuda", "cpu", torch.float32)
    with pytest.raises(ValueError, match="unknown"):
        resolve_backend("warp", "cpu", torch.float32)


def test_available_backends_describes_all():
    info = {b["name"]: b for b in available_backends()}
    assert set(info) >= {"torch", "numba", "numba-cuda", "torchaudio", "k2"}
    for b in info.values():
        assert set(b) >= {"name", "available", "reason", "devices", "dtypes", "install_hint"}
        assert b["available"] or b["reason"]


def test_k2_missing_is_a_clear_error():
    if "k2" in AVAILABLE:
        pytest.skip("k2 installed")
    x, tg, tl, ul = make_batch()
    with pytest.raises(ValueError, match="k2"):
        rnnt_loss(x.float(), tg, tl, ul, backend="k2")


# ---------------------------------------------------------------- validation


def _good():
    x = torch.randn(2, 4, 3, 5)
    return x, torch.tensor([[1, 2], [3, 0]]), torch.tensor([4, 3]), torch.tensor([2, 1])


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: (a[0][0], *a[1:]), "shape \\(B, T, U\\+1, V\\)"),
        (lambda a: (a[0].int(), *a[1:]), "float64, float32"),
        (lambda a: (a[0], a[1].float(), *a[2:]), "integer tensor"),
        (lambda a: (a[0], a[1][:, :1], *a[2:]), "U\\+1"),
        (lambda a: (a[0], a[1][:1], *a[2:]), "batch sizes disagree"),
        (lambda a: (a[0][:, :0], *a[1:]), "T == 0"),
        (lambda a: (a[0], a[1], torch.tensor([5, 3]), a[3]), "exceeds T"),
        (lambda a: (a[0], a[1], torch.tensor([0, 3]), a[3]), "at least one frame"),
        (lambda a: (a[0], a[1], a[2], torch.tensor([3, 1])), "exceeds U"),
        (lambda a: (a[0], a[1], a[2], torch.tensor([-1, 1])), "negative"),
        (lambda a: (a[0], torch.tensor([[1, 0], [3, 0]]), a[2], a[3]), "blank"),
        (lambda a: (a[0], torch.tensor([[1, 5], [3, 0]]), a[2], a[3]), "outside \\[0, V"),
        (lambda a: (a[0], torch.tensor([[1, -2], [3, 0]]), a[2], a[3]), "outside \\[0, V"),
        (lambda a: (a[0], a[1], a[2].float(), a[3]), "logit_lens must be an integer"),
        (lambda a: (a[0], a[1], a[2][None], a[3]), "logit_lens must have 1"),
    ],
)
def test_validator_messages(mutate, match):
    args = mutate(_good())
    with pytest.raises(ValueError, match=match):
        validate_rnnt_inputs(*args, blank=0)
    with pytest.raises(ValueError, match=match):
        rnnt_loss(*args)


def test_validator_blank_and_options():
    x, tg, tl, ul = _good()
    with pytest.raises(ValueError, match="out of range"):
        rnnt_loss(x, tg, tl, ul, blank=5)
    with pytest.raises(ValueError, match="reduction"):
        rnnt_loss(x, tg, tl, ul, reduction="mean_volume")
    with pytest.raises(ValueError, match="clamp"):
        rnnt_loss(x, tg, tl, ul, clamp=0.0)
    # padding beyond target_lens may hold anything (here the blank id and -1)
    rnnt_loss(x, torch.tensor([[1, 2], [3, -1]]), tl, ul)
    rnnt_loss(x, torch.tensor([[1, 2], [3, 0]]), tl, ul)
