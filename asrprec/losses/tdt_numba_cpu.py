"""The ``numba`` TDT backend: a fused TDT loss for CPU tensors, on the RNN-T ``numba`` backend's row kernels.

Legend: B batch, T frames, U target tokens (U+1 lattice rows), V vocabulary (blank included), D durations.
Lattice and conventions: :mod:`asrprec.losses.tdt`.

The three passes of :mod:`asrprec.losses.numba_cpu`, with the duration columns added:

1. per lattice cell (prange over (b, t) rows): the token row's max and exp-sum (fp32 for fp32/fp16/bf16
   logits; exp(z - max) kept in the gradient buffer for fp32/fp64), the blank and label log-probs, and
   the D duration log-probs (float64; D is a handful of columns);
2. per utterance (prange over b): α and β in float64 over the TDT arcs (``tdt_alphas_betas``);
3. per cell: the gradient w.r.t. all V + D logits, in place, in the logits' dtype. With the posteriors
   of the arcs out of cell (t, u), γ_blank,d and γ_label,d (γ = exp(α + arc + β(target) - log P)),
   G_blank = Σ_d γ_blank,d, G_label = Σ_d γ_label,d, c = G_blank + G_label, H_d = γ_blank,d + γ_label,d:

       d cost / d z_v (token) = softmax_V(z)_v · c - [v = blank]·G_blank - [v = y_{u+1}]·G_label
       d cost / d w_d (duration) = softmax_D(w)_d · c - H_d

   (sigma shifts every token log-prob by a constant and so leaves this form unchanged.)

fp16/bf16 logits are read as raw 16-bit bits and the gradient rounded to nearest even, as in the RNN-T
backend; all arithmetic is fp32 (token rows) or float64 (durations, α, β, posteriors).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange

from .numba_cpu import (
    _KIND_NATIVE,
    _as_numpy,
    _empty_grad,
    _set_threads,
    cell_stats,
    exp_shift,
    finish_row,
    half_bits_to_f32,
    load_row,
    store_half,
)
from .kept_grad import fused_tdt_backend

_F = np.float32


@njit(inline="always")
def load_durations(x, b, t, u, V, kind, drow, ubuf, fbuf):
    """drow[j] = logit V + j of cell (b, t, u) as float64, from fp16 (kind 1) or bf16 (kind 2) bits; exact."""
    for j in range(drow.shape[0]):
        if kind == 1:
            drow[j] = half_bits_to_f32(x[b, t, u, V + j])
        else:
            ubuf[j] = np.uint32(x[b, t, u, V + j]) << 16
            drow[j] = fbuf[j]


@njit(inline="always")
def duration_logprobs(drow, ld, b, t, u):
    """ld[b, t, u] = log_softmax(drow) in float64 (D is a handful of columns)."""
    D = drow.shape[0]
    m = float(drow[0])
    for j in range(1, D):
        m = max(m, float(drow[j]))
    if m == -np.inf:
        m = 0.0
    s = 0.0
    for j in range(D):
        s += math.exp(float(drow[j]) - m)
    den = m + math.log(s)
    for j in range(D):
        ld[b, t, u, j] = float(drow[j]) - den


@njit(parallel=True, cache=True)
def tdt_native_denominators(x, V, targets, tlens, ulens, blank, lse, sums, lb, ly, ld, out, store):
    """Pass 1 for fp32/fp64 logits. With ``store``, exp(z - max) of the token row goes into ``out``."""
    B, T, U1, C = x.shape
    for r in prange(B * T):
        b = r // T
        t = r - b * T
        if t < tlens[b]:
            none = np.empty(0, x.dtype)
            for u in range(ulens[b] + 1):
                if store:
                    cell_stats(x[b, t, u, :V], out[b, t, u, :V], b, t, u, targets, ulens, blank, lse, sums, lb, ly)
                else:
                    cell_stats(x[b, t, u, :V], none, b, t, u, targets, ulens, blank, lse, sums, lb, ly)
                duration_logprobs(x[b, t, u, V:], ld, b, t, u)


@njit(parallel=True, cache=True)
def tdt_half_denominators(x, kind, V, targets, tlens, ulens, blank, lse, sums, lb, ly, ld):
    """Pass 1 for fp16/bf16 (uint16 bits) logits: each token row is decoded to fp32 once."""
    B, T, U1, C = x.shape
    D = C - V
    for r in prange(B * T):
        b = r // T
        t = r - b * T
        if t < tlens[b]:
            row = np.empty(V, np.float32)
            fbuf = np.empty(max(V, D), np.float32)
            ubuf = fbuf.view(np.uint32)
            drow = np.empty(D, np.float64)
            none = np.empty(0, np.float32)
            for u in range(ulens[b] + 1):
                load_row(x, b, t, u, kind, row, ubuf, fbuf)
                cell_stats(row, none, b, t, u, targets, ulens, blank, lse, sums, lb, ly)
                load_durations(x, b, t, u, V, kind, drow, ubuf, fbuf)
                duration_logprobs(drow, ld, b, t, u)


@njit(inline="always")
def log_sum(terms, n):
    """log Σ exp(terms[:n]) by one max and one exp per term (-inf when n = 0 or all terms are -inf)."""
    m = -np.inf
    for k in range(n):
        m = max(m, terms[k])
    if m == -np.inf:
        return m
    s = 0.0
    for k in range(n):
        s += math.exp(terms[k] - m)
    return m + math.log(s)


@njit(parallel=True, cache=True)
def tdt_alphas_betas(lb, ly, ld, durs, tlens, ulens, alpha, beta, ll, need_beta):
    """Pass 2: α, β (B, T, U+1) and log P (B,) over the TDT arcs, float64, one utterance per thread.
    Each cell sums its (at most 2·D) arcs with one max and one exp per arc."""
    B = lb.shape[0]
    D = durs.shape[0]
    for b in prange(B):
        terms = np.empty(2 * D, np.float64)
        Tb = tlens[b]
        Ub = ulens[b]
        for t in range(Tb):
            for u in range(Ub + 1):
                if t == 0 and u == 0:
                    alpha[b, 0, 0] = 0.0
                    continue
                n = 0
                for j in range(D):
                    s = t - durs[j]
                    if s < 0:
                        break  # durations increase
                    if durs[j] > 0:
                        terms[n] = alpha[b, s, u] + lb[b, s, u] + ld[b, s, u, j]
                        n += 1
                    if u > 0:
                        terms[n] = alpha[b, s, u - 1] + ly[b, s, u - 1] + ld[b, s, u - 1, j]
                        n += 1
                alpha[b, t, u] = log_sum(terms, n)
        n = 0
        for j in range(D):
            s = Tb - durs[j]
            if durs[j] > 0 and s >= 0:
                terms[n] = alpha[b, s, Ub] + lb[b, s, Ub] + ld[b, s, Ub, j]
                n += 1
        ll[b] = log_sum(terms, n)
        if need_beta:
            for t in range(Tb - 1, -1, -1):
                for u in range(Ub, -1, -1):
                    n = 0
                    for j in range(D):
                        e = t + durs[j]
                        if e > Tb:
                            break
                        if durs[j] > 0:
                            if e < Tb:
                                terms[n] = beta[b, e, u] + lb[b, t, u] + ld[b, t, u, j]
                                n += 1
                            elif u == Ub:  # e == Tb: the final blank
                                terms[n] = lb[b, t, u] + ld[b, t, u, j]
                                n += 1
                        if u < Ub and e < Tb:
                            terms[n] = beta[b, e, u + 1] + ly[b, t, u] + ld[b, t, u, j]
                            n += 1
                    beta[b, t, u] = log_sum(terms, n)


@njit(inline="always")
def arc_posteriors(b, t, u, Tb, Ub, durs, lb, ly, ld, alpha, beta, L, h):
    """h[j] = posterior of leaving (t, u) with duration j (either symbol); returns (G_blank, G_label)."""
    a = alpha[b, t, u]
    gb = 0.0
    gl = 0.0
    for j in range(durs.shape[0]):
        e = t + durs[j]
        pb = 0.0
        if durs[j] > 0:
            if e < Tb:
                pb = math.exp(a + lb[b, t, u] + ld[b, t, u, j] + beta[b, e, u] - L)
            elif e == Tb and u == Ub:
                pb = math.exp(a + lb[b, t, u] + ld[b, t, u, j] - L)
        py = 0.0
        if u < Ub and e < Tb:
            py = math.exp(a + ly[b, t, u] + ld[b, t, u, j] + beta[b, e, u + 1] - L)
        h[j] = pb + py
        gb += pb
        gl += py
    return gb, gl


@njit(parallel=True, cache=True)
def tdt_native_gradient(V, targets, durs, tlens, ulens, blank, sums, lb, ly, ld, alpha, beta, ll, out):
    """Pass 3 for fp32/fp64: ``out`` holds exp(z - max) of the live token rows from pass 1.
    Padding and infeasible utterances get exact zeros."""
    B, T, U1, C = out.shape
    D = C - V
    for r in prange(B * T):
        b = r // T
        t = r - b * T
        Tb = tlens[b]
        Ub = ulens[b]
        L = ll[b]
        h = np.empty(D, np.float64)
        for u in range(U1):
            g = out[b, t, u]
            if t >= Tb or u > Ub or L == -np.inf:
                for v in range(C):
                    g[v] = 0
                continue
            gb, gl = arc_posteriors(b, t, u, Tb, Ub, durs, lb, ly, ld, alpha, beta, L, h)
            c = gb + gl
            finish_row(g[:V], c / sums[b, t, u], blank, gb, targets[b, u] if u < Ub else -1, gl, -1.0)
            for j in range(D):
                g[V + j] = math.exp(ld[b, t, u, j]) * c - h[j]


@njit(parallel=True, cache=True)
def tdt_half_gradient(x, kind, V, targets, durs, tlens, ulens, blank, lse, lb, ly, ld, alpha, beta, ll, out):
    """Pass 3 for fp16/bf16: the 16-bit buffer is too coarse to keep exp(z - max) in, so each token row is
    decoded again and softmax·c = exp(z - lse + log c) recomputed (one fp32 exp per element)."""
    B, T, U1, C = x.shape
    D = C - V
    for r in prange(B * T):
        b = r // T
        t = r - b * T
        Tb = tlens[b]
        Ub = ulens[b]
        L = ll[b]
        h = np.empty(D, np.float64)
        row = np.empty(V, np.float32)
        rbits = row.view(np.uint32)
        fbuf = np.empty(V, np.float32)
        ubuf = fbuf.view(np.uint32)
        dval = np.empty(D, np.float32)
        dbits = dval.view(np.uint32)
        for u in range(U1):
            if t >= Tb or u > Ub or L == -np.inf:
                for v in range(C):
                    out[b, t, u, v] = 0
                continue
            gb, gl = arc_posteriors(b, t, u, Tb, Ub, durs, lb, ly, ld, alpha, beta, L, h)
            c = gb + gl
            load_row(x, b, t, u, kind, row, ubuf, fbuf)
            shift = _F(math.log(c) - lse[b, t, u]) if c > 0.0 else -_F(np.inf)
            exp_shift(row, shift)
            finish_row(row, 1.0, blank, gb, targets[b, u] if u < Ub else -1, gl, -1.0)
            for j in range(D):
                dval[j] = math.exp(ld[b, t, u, j]) * c - h[j]
            store_half(out, b, t, u, 0, row, rbits, kind)
            store_half(out, b, t, u, V, dval, dbits, kind)


def tdt_numba_cpu_forward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    logit_lens: torch.Tensor,
    target_lens: torch.Tensor,
    durations: tuple[int, ...],
    blank: int,
    sigma: float,
    need_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Costs (B,) float64 (+inf when infeasible) and, if ``need_grad``, the gradient (B, T, U+1, V+D) in the
    logits' dtype."""
    _set_threads()
    x = logits.detach()
    if not x.is_contiguous():
        x = x.contiguous()
    B, T, U1, C = x.shape
    D = len(durations)
    V = C - D
    xa, kind = _as_numpy(x)
    tg, tl, ul = targets.numpy(), logit_lens.numpy(), target_lens.numpy()
    durs = np.asarray(durations, dtype=np.int64)
    f64 = np.float64
    lse, sums, lb, ly = (np.empty((B, T, U1), f64) for _ in range(4))
    ld = np.empty((B, T, U1, D), f64)
    alpha, beta, ll = np.empty((B, T, U1), f64), np.empty((B, T, U1), f64), np.empty(B, f64)
    grad = _empty_grad(x) if need_grad else None
    ga = _as_numpy(grad)[0] if need_grad else np.empty((1, 1, 1, 0), xa.dtype)
    if kind == _KIND_NATIVE:
        tdt_native_denominators(xa, V, tg, tl, ul, blank, lse, sums, lb, ly, ld, ga, need_grad)
    else:
        tdt_half_denominators(xa, kind, V, tg, tl, ul, blank, lse, sums, lb, ly, ld)
    if sigma:
        lb -= sigma
        ly -= sigma
    tdt_alphas_betas(lb, ly, ld, durs, tl, ul, alpha, beta, ll, need_grad)
    if need_grad:
        if kind == _KIND_NATIVE:
            tdt_native_gradient(V, tg, durs, tl, ul, blank, sums, lb, ly, ld, alpha, beta, ll, ga)
        else:
            tdt_half_gradient(xa, kind, V, tg, durs, tl, ul, blank, lse, lb, ly, ld, alpha, beta, ll, ga)
    return -torch.from_numpy(ll), grad


tdt_loss_numba = fused_tdt_backend(
    "tdt_loss_numba",
    tdt_numba_cpu_forward,
    """Per-utterance TDT costs on CPU (validated inputs expected).

    Args:
        logits: (B, T, U+1, V+D) CPU fp64/fp32/fp16/bf16. targets: (B, U) int64.
        logit_lens, target_lens: (B,) int64. durations, blank, sigma: see :func:`asrprec.losses.tdt_loss`.

    Returns:
        (B,) costs, float32 (float64 for fp64 logits). The gradient is computed in forward and kept (one
        buffer of the logits' size and dtype) until backward.
    """,
)
