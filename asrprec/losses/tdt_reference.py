"""The ``torch`` TDT backend: a vectorised, autograd-differentiable TDT loss in plain PyTorch.

The slow, obviously correct twin of the fast TDT kernels, and the fallback on any device. Lattice and
conventions: :mod:`asrprec.losses.tdt`. Legend: B batch, T frames, U target tokens (U+1 lattice rows),
V vocabulary (blank included), D durations.

* log-softmax over the V token columns and over the D duration columns in fp32 (fp64 for fp64 logits);
  only the blank, label and duration log-probs of each cell are kept, and the recursion runs on them in
  float64.
* Every TDT arc goes from anti-diagonal n = t+u to a later one (a blank of duration d to n+d, a token of
  duration d to n+d+1), so α is computed one anti-diagonal at a time, vectorised over the batch and u:
  T+U Python steps, each a log-sum-exp over at most 2·D incoming arcs.
* Unreachable cells hold a finite "log 0" so that logaddexp's gradient stays NaN-free; an utterance with
  no alignment gets cost +inf and a zero gradient.
"""

from __future__ import annotations

import torch

from .kept_grad import cost_dtype
from .reference import gather_logprobs

_NEG = -1e30  # finite "log 0"
_INFEASIBLE = -1e29  # a log-likelihood below this has no real path in it


def tdt_logprobs(logits: torch.Tensor, targets: torch.Tensor, durations: tuple[int, ...], blank: int, sigma: float):
    """Per-cell log-probs of every TDT arc's two factors.

    Args:
        logits: (B, T, U+1, V+D) raw logits. targets: (B, U) int64.

    Returns:
        ``(lb, ly, ld)``: (B, T, U+1) blank and label log-probs (sigma subtracted; ly[..., U] is a dummy) and
        (B, T, U+1, D) duration log-probs, fp32 (fp64 for fp64 logits).
    """
    D = len(durations)
    V = logits.shape[-1] - D
    lb, ly = gather_logprobs(logits[..., :V], targets, blank)
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    ld = torch.log_softmax(logits[..., V:].to(compute), dim=-1)
    return lb - sigma, ly - sigma, ld


def _skew(x: torch.Tensor) -> torch.Tensor:
    """(B, T, U+1, D) -> (N, B, U+1, D), N = T+U: out[n, b, u] = x[b, n-u, u] (``_NEG`` off the grid)."""
    B, T, U1, D = x.shape
    N = T + U1 - 1
    n = torch.arange(N, device=x.device)[:, None]
    u = torch.arange(U1, device=x.device)[None, :]
    t = n - u
    valid = ((t >= 0) & (t < T))[None, :, :, None]
    out = x[:, t.clamp(0, T - 1), u.expand(N, U1)]  # (B, N, U1, D)
    return torch.where(valid, out, torch.full_like(out, _NEG)).permute(1, 0, 2, 3)


def tdt_nll_from_logprobs(lb: torch.Tensor, ly: torch.Tensor, ld: torch.Tensor, logit_lens: torch.Tensor,
                          target_lens: torch.Tensor, durations: tuple[int, ...]) -> torch.Tensor:
    """-log P per utterance, (B,) float64 (+inf when infeasible), from the per-cell log-probs of :func:`tdt_logprobs`.

    α(0,0) = 0; α(t,u) = logsumexp over d of α(t-d,u)+lb(t-d,u)+ld_d(t-d,u) (d > 0) and
    α(t-d,u-1)+ly(t-d,u-1)+ld_d(t-d,u-1); log P = logsumexp over d > 0 of α(T_b-d,U_b)+lb+ld_d at (T_b-d, U_b).
    """
    B, T, U1 = lb.shape
    dev = lb.device
    lb, ly, ld = lb.double(), ly.double(), ld.double()
    # arcs out of cells beyond the utterance, and labels out of row U_b, never exist
    t_ok = torch.arange(T, device=dev)[None, :, None] < logit_lens[:, None, None]
    u_idx = torch.arange(U1, device=dev)[None, None, :]
    neg = torch.tensor(_NEG, dtype=torch.float64, device=dev)
    lb = torch.where(t_ok & (u_idx <= target_lens[:, None, None]), lb, neg)
    ly = torch.where(t_ok & (u_idx < target_lens[:, None, None]), ly, neg)
    blank_arc = _skew(lb[..., None] + ld)  # (N, B, U1, D)
    label_arc = _skew(ly[..., None] + ld)
    N = T + U1 - 1
    n_idx = torch.arange(N, device=dev)[:, None]
    on_grid = ((n_idx - u_idx[0] >= 0) & (n_idx - u_idx[0] < T))  # (N, U1)
    neg_col = torch.full((B, 1), _NEG, dtype=torch.float64, device=dev)
    alphas = [torch.cat([torch.zeros_like(neg_col), neg_col.expand(B, U1 - 1)], dim=1)]
    for n in range(1, N):
        terms = []
        for j, d in enumerate(durations):
            if d > 0 and n - d >= 0:
                terms.append(alphas[n - d] + blank_arc[n - d, :, :, j])
            if n - d - 1 >= 0:
                came = alphas[n - d - 1] + label_arc[n - d - 1, :, :, j]  # from row u-1
                terms.append(torch.cat([neg_col, came[:, :-1]], dim=1))
        a = torch.logsumexp(torch.stack(terms), dim=0)
        alphas.append(torch.where(on_grid[n], a, neg_col))
    alpha = torch.stack(alphas)  # (N, B, U1), alpha[n, b, u] = α(n-u, u)
    b = torch.arange(B, device=dev)
    finals = []
    for j, d in enumerate(durations):
        if d == 0:
            continue
        t0 = logit_lens - d
        ok = t0 >= 0
        t0c = t0.clamp(min=0)
        a = alpha[(t0c + target_lens).clamp(max=N - 1), b, target_lens]
        arc = lb[b, t0c, target_lens] + ld[b, t0c, target_lens, j]
        finals.append(torch.where(ok, a + arc, neg.expand(B)))
    ll = torch.logsumexp(torch.stack(finals), dim=0)
    return torch.where(ll > _INFEASIBLE, -ll, torch.full_like(ll, float("inf")))


def tdt_loss_torch(logits: torch.Tensor, targets: torch.Tensor, logit_lens: torch.Tensor, target_lens: torch.Tensor, *,
                   durations: tuple[int, ...], blank: int = 0, sigma: float = 0.0) -> torch.Tensor:
    """Per-utterance TDT costs, plain PyTorch (validated inputs expected).

    Args:
        logits: (B, T, U+1, V+D) fp64/fp32/fp16/bf16 raw logits.
        targets: (B, U) int64. logit_lens, target_lens: (B,) int64.
        durations, blank, sigma: see :func:`asrprec.losses.tdt_loss`.

    Returns:
        (B,) costs, float64 for fp64 logits, else float32; differentiable w.r.t. ``logits``.
    """
    lb, ly, ld = tdt_logprobs(logits, targets, durations, blank, sigma)
    costs = tdt_nll_from_logprobs(lb, ly, ld, logit_lens, target_lens, durations)
    return costs.to(cost_dtype(logits.dtype))
