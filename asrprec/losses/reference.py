"""The ``torch`` backend: a vectorised, autograd-differentiable RNN-T loss in plain PyTorch.

It is the slow, obviously correct twin of the fast kernels, and the fallback on any device.

* log-softmax over V in fp32 (fp64 for fp64 logits), then only the blank and label log-probs
  (B, T, U+1) are gathered; the forward–backward recursion runs on those in float64, one
  anti-diagonal t+u = n at a time (T+U-1 vectorised steps), so autograd keeps O(B·T·U) state for
  the recursion plus the log-softmax output.
* FastEmit (NeMo's definition, arXiv 2010.11148): the gradient through the *label* log-probs is
  scaled by (1+λ), the blank one is not, and the returned cost is (1+λ)·NLL.
* ``clamp`` clamps each utterance's gradient w.r.t. the logits to [-clamp, clamp] *before* it is
  multiplied by the incoming gradient (as torchaudio and NeMo do); the gradient is then computed in
  forward with autograd and kept for backward (:mod:`asrprec.losses.kept_grad`).
"""

from __future__ import annotations

import torch

from .kept_grad import KeptGradient, cost_dtype

_NEG = -1e30  # finite "log 0": keeps logaddexp's gradient NaN-free in unreachable cells


def gather_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, blank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blank and label log-probabilities of every lattice cell.

    Args:
        logits: (B, T, U+1, V) raw logits, any float dtype.
        targets: (B, U) int64; padding may hold any value (it is clamped into range, never used).
        blank: blank id.

    Returns:
        ``(lb, ly)``, each (B, T, U+1): log p(blank | t, u) and log p(y_{u+1} | t, u) (ly[..., U] is
        a dummy), in fp32, or fp64 for fp64 logits.
    """
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logp = torch.log_softmax(logits.to(compute), dim=-1)
    B, T, U1, V = logits.shape
    lb = logp[..., blank]
    idx = torch.zeros(B, U1, dtype=torch.int64, device=logits.device)
    idx[:, : U1 - 1] = targets.clamp(0, V - 1)
    ly = logp.gather(3, idx[:, None, :, None].expand(B, T, U1, 1)).squeeze(3)
    return lb, ly


def _skew(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, U+1) -> (B, N, U+1) with out[:, n, u] = x[:, n-u, u] (N = T+U diagonals); and validity."""
    B, T, U1 = x.shape
    N = T + U1 - 1
    n = torch.arange(N, device=x.device)[:, None]
    u = torch.arange(U1, device=x.device)[None, :]
    t = n - u
    valid = (t >= 0) & (t < T)
    out = x[:, t.clamp(0, T - 1), u.expand(N, U1)]
    return torch.where(valid, out, torch.full_like(out, _NEG)), valid


def nll_from_logprobs(
    lb: torch.Tensor, ly: torch.Tensor, logit_lens: torch.Tensor, target_lens: torch.Tensor
) -> torch.Tensor:
    """Negative log-likelihood per utterance from (B, T, U+1) blank/label log-probs; returns (B,) float64.

    α(t,u) = logaddexp(α(t-1,u) + lb(t-1,u), α(t,u-1) + ly(t,u-1)), α(0,0) = 0;
    loss = -(α(T_b-1, U_b) + lb(T_b-1, U_b)). Runs over anti-diagonals n = t+u.
    """
    lb = lb.double()
    ly = ly.double()
    B, T, U1 = lb.shape
    lb_s, valid = _skew(lb)
    ly_s, _ = _skew(ly)
    neg_col = torch.full((B, 1), _NEG, dtype=torch.float64, device=lb.device)
    alpha = torch.cat([torch.zeros_like(neg_col), neg_col.expand(B, U1 - 1)], dim=1)
    diags = [alpha]
    for n in range(1, T + U1 - 1):
        from_blank = alpha + lb_s[:, n - 1]
        from_label = torch.cat([neg_col, (alpha + ly_s[:, n - 1])[:, :-1]], dim=1)
        alpha = torch.where(valid[n], torch.logaddexp(from_blank, from_label), neg_col)
        diags.append(alpha)
    alphas = torch.stack(diags, dim=1)  # (B, N, U+1)
    b = torch.arange(B, device=lb.device)
    last_t = logit_lens - 1
    ll = alphas[b, last_t + target_lens, target_lens] + lb[b, last_t, target_lens]
    return -ll


def _costs(logits, targets, logit_lens, target_lens, blank, fastemit_lambda):
    lb, ly = gather_logprobs(logits, targets, blank)
    if fastemit_lambda:
        # same value, gradient through the label log-probs scaled by (1+λ)
        ly = ly * (1.0 + fastemit_lambda) - ly.detach() * fastemit_lambda
    nll = nll_from_logprobs(lb, ly, logit_lens, target_lens)
    if fastemit_lambda:
        nll = nll + fastemit_lambda * nll.detach()  # reported cost (1+λ)·NLL, as NeMo
    return nll


def _clamped_costs_and_grad(logits, targets, logit_lens, target_lens, blank, clamp, fastemit_lambda, need_grad):
    """Costs and their gradient w.r.t. the logits by autograd, clamped (for :class:`KeptGradient`)."""
    with torch.enable_grad():
        leaf = logits.detach().requires_grad_(True)
        costs = _costs(leaf, targets, logit_lens, target_lens, blank, fastemit_lambda)
        # utterances are independent, so d(sum)/d logits[b] is utterance b's own gradient
        (grad,) = torch.autograd.grad(costs.sum(), leaf)
    return costs.detach(), grad.clamp_(-clamp, clamp)


def rnnt_loss_torch(logits: torch.Tensor, targets: torch.Tensor, logit_lens: torch.Tensor, target_lens: torch.Tensor, *,
                    blank: int = 0, clamp: float | None = None, fastemit_lambda: float = 0.0) -> torch.Tensor:
    """Per-utterance RNN-T costs, plain PyTorch (validated inputs expected).

    Legend: B batch, T frames, U target tokens (U+1 lattice rows), V vocabulary (blank included).

    Args:
        logits: (B, T, U+1, V) fp64/fp32/fp16/bf16 raw logits.
        targets: (B, U) int64. logit_lens: (B,) int64. target_lens: (B,) int64.
        blank, clamp, fastemit_lambda: see :func:`asrprec.losses.rnnt_loss`.

    Returns:
        (B,) costs, float64 for fp64 logits, else float32; differentiable w.r.t. ``logits``.
    """
    if clamp is not None and logits.requires_grad and torch.is_grad_enabled():
        return KeptGradient.apply(
            _clamped_costs_and_grad, False, logits, targets, logit_lens, target_lens, blank, float(clamp), fastemit_lambda
        )
    return _costs(logits, targets, logit_lens, target_lens, blank, fastemit_lambda).to(cost_dtype(logits.dtype))
