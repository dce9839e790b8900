"""The exact RNN-T lattice recursion on per-cell log-probabilities, in plain PyTorch.

Everything that needs "the RNN-T loss given the blank and label log-probs of each lattice cell" builds on
this module: the pruned loss (:mod:`asrprec.losses.pruned`, whose cells outside the prune window are
``-inf``) and the memory-lean joint+loss (:mod:`asrprec.losses.lean`, which never materialises the logits).

Legend: B batch, T encoder frames, U target tokens (the lattice has U+1 rows u = 0..U).
For utterance b only the cells ``t < T_b = logit_lens[b]`` and ``u <= U_b = target_lens[b]`` exist.

* ``blank_logp[b, t, u]`` = log p(blank | t, u): moves (t, u) -> (t+1, u). The blank at the last cell
  (T_b-1, U_b) terminates the utterance.
* ``label_logp[b, t, u]`` = log p(y_{u+1} | t, u): moves (t, u) -> (t, u+1), for u < U_b. Column U_b
  and above are unused.

Recursions (Graves, "Sequence Transduction with Recurrent Neural Networks", 2012)::

    alpha(0, 0) = 0
    alpha(t, u) = logaddexp(alpha(t-1, u) + blank(t-1, u), alpha(t, u-1) + label(t, u-1))
    beta(T_b-1, U_b) = blank(T_b-1, U_b)
    beta(t, u)  = logaddexp(beta(t+1, u) + blank(t, u), beta(t, u+1) + label(t, u))
    loss_b = -log P = -beta(0, 0) = -(alpha(T_b-1, U_b) + blank(T_b-1, U_b))

Both recursions run over anti-diagonals n = t + u (every cell on a diagonal depends only on the previous
one), vectorised over the batch and over u, so the Python loop has T+U steps and every step is exact
``logaddexp`` - no cumulative-sum tricks whose cancellation would lose precision in float32 or turn the
``-inf`` cells of a pruned lattice into NaN.

The gradient of the loss with respect to the per-cell log-probs is minus the transition posteriors
("occupancies")::

    d loss / d blank(t, u) = -exp(alpha(t, u) + blank(t, u) + beta(t+1, u) - log P)
    d loss / d label(t, u) = -exp(alpha(t, u) + label(t, u) + beta(t, u+1) - log P)

and the occupancy of a cell is the sum of its two outgoing posteriors. Utterances with no feasible
alignment (log P = -inf) get an infinite loss and zero posteriors.
"""

from __future__ import annotations

import torch

__all__ = [
    "rnnt_lattice_loss",
    "rnnt_lattice_posteriors",
    "rnnt_lattice_nll",
    "check_lattice_inputs",
    "extend_targets",
    "validate_targets",
    "reduce_loss",
]


def check_lattice_inputs(
    blank_logp: torch.Tensor, label_logp: torch.Tensor, logit_lens: torch.Tensor, target_lens: torch.Tensor
) -> None:
    """Raise ValueError naming the problem when the per-cell inputs are inconsistent."""
    if blank_logp.dim() != 3:
        raise ValueError(f"blank_logp must be (B, T, U+1), got shape {tuple(blank_logp.shape)}")
    if label_logp.shape != blank_logp.shape:
        raise ValueError(
            f"label_logp {tuple(label_logp.shape)} must have the shape of blank_logp {tuple(blank_logp.shape)}"
        )
    if not blank_logp.is_floating_point() or not label_logp.is_floating_point():
        raise ValueError("blank_logp and label_logp must be floating point tensors")
    B, T, U1 = blank_logp.shape
    for name, lens, hi, lo in (("logit_lens", logit_lens, T, 1), ("target_lens", target_lens, U1 - 1, 0)):
        if lens.shape != (B,):
            raise ValueError(f"{name} must have shape (B,)=({B},), got {tuple(lens.shape)}")
        if lens.dtype.is_floating_point:
            raise ValueError(f"{name} must be an integer tensor, got {lens.dtype}; fix: pass .long()")
        if B and (int(lens.min()) < lo or int(lens.max()) > hi):
            raise ValueError(
                f"{name} must lie in [{lo}, {hi}] for a lattice of shape {tuple(blank_logp.shape)}, "
                f"got min {int(lens.min())}, max {int(lens.max())}"
            )


def _promote(x: torch.Tensor) -> torch.Tensor:
    # The recursion runs in the input's precision when it is fp32 or fp64; half types are promoted.
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _masked(blank_logp, label_logp, logit_lens, target_lens):
    """Copies with -inf on every transition that leaves utterance b's lattice."""
    B, T, U1 = blank_logp.shape
    dev = blank_logp.device
    t = torch.arange(T, device=dev).view(1, T, 1)
    u = torch.arange(U1, device=dev).view(1, 1, U1)
    t_ok = t < logit_lens.to(dev).view(B, 1, 1)
    ul = target_lens.to(dev).view(B, 1, 1)
    neg_inf = torch.tensor(float("-inf"), dtype=blank_logp.dtype, device=dev)
    blank = torch.where(t_ok & (u <= ul), blank_logp, neg_inf)
    label = torch.where(t_ok & (u < ul), label_logp, neg_inf)
    return blank, label


def _skew(x: torch.Tensor, fill: float) -> torch.Tensor:
    """(B, T, U1) -> (N, B, U1) with N = T+U1-1 and out[n, b, u] = x[b, n-u, u] (``fill`` off the grid)."""
    B, T, U1 = x.shape
    N = T + U1 - 1
    dev = x.device
    n = torch.arange(N, device=dev).view(N, 1)
    u = torch.arange(U1, device=dev).view(1, U1)
    t = n - u  # (N, U1)
    ok = (t >= 0) & (t < T)
    flat = (t.clamp(0, T - 1) * U1 + u).view(1, N * U1).expand(B, N * U1)
    out = x.reshape(B, T * U1).gather(1, flat).view(B, N, U1)
    out = out.masked_fill(~ok.view(1, N, U1), fill)
    return out.permute(1, 0, 2).contiguous()


def _unskew(xs: torch.Tensor, T: int) -> torch.Tensor:
    """(N, B, U1) -> (B, T, U1), the inverse of :func:`_skew`."""
    N, B, U1 = xs.shape
    dev = xs.device
    t = torch.arange(T, device=dev).view(T, 1)
    u = torch.arange(U1, device=dev).view(1, U1)
    # xs is contiguous (N, B, U1): element (n, b, u) sits at n*B*U1 + b*U1 + u, and n = t + u.
    flat = ((t + u) * (B * U1) + u).view(1, T * U1) + (torch.arange(B, device=dev) * U1).view(B, 1)
    return xs.contiguous().view(-1)[flat].view(B, T, U1)


def _shift_up(x: torch.Tensor, fill: float) -> torch.Tensor:
    """out[..., u] = x[..., u-1]; out[..., 0] = fill."""
    return torch.cat([torch.full_like(x[..., :1], fill), x[..., :-1]], dim=-1)


def _shift_down(x: torch.Tensor, fill: float) -> torch.Tensor:
    """out[..., u] = x[..., u+1]; out[..., -1] = fill."""
    return torch.cat([x[..., 1:], torch.full_like(x[..., :1], fill)], dim=-1)


def _alpha(blank: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Forward variables (B, T, U1) of masked per-cell log-probs."""
    B, T, U1 = blank.shape
    bs = _skew(blank, float("-inf"))
    ls = _skew(label, float("-inf"))
    N = bs.shape[0]
    a = torch.full((B, U1), float("-inf"), dtype=blank.dtype, device=blank.device)
    a[:, 0] = 0.0
    diags = [a]
    for n in range(1, N):
        a = torch.logaddexp(a + bs[n - 1], _shift_up(a + ls[n - 1], float("-inf")))
        diags.append(a)
    return _unskew(torch.stack(diags), T)


def _beta_ext(blank: torch.Tensor, label: torch.Tensor, logit_lens: torch.Tensor, target_lens: torch.Tensor):
    """Backward variables on the lattice extended by one frame: (B, T+1, U1).

    Row t = T_b holds the virtual terminal node (T_b, U_b) with beta = 0 (reached by the final blank);
    every other cell at t >= T_b is -inf.
    """
    B, T, U1 = blank.shape
    pad = torch.full((B, 1, U1), float("-inf"), dtype=blank.dtype, device=blank.device)
    bs = _skew(torch.cat([blank, pad], 1), float("-inf"))
    ls = _skew(torch.cat([label, pad], 1), float("-inf"))
    N = bs.shape[0]  # T + U1
    dev = blank.device
    term_diag = (logit_lens.to(dev) + target_lens.to(dev)).view(B, 1)
    is_term_u = torch.arange(U1, device=dev).view(1, U1) == target_lens.to(dev).view(B, 1)
    zero = torch.zeros((), dtype=blank.dtype, device=dev)
    b = torch.full((B, U1), float("-inf"), dtype=blank.dtype, device=dev)
    diags = [None] * N
    for n in range(N - 1, -1, -1):
        if n < N - 1:
            b = torch.logaddexp(b + bs[n], _shift_down(b, float("-inf")) + ls[n])
        else:
            b = torch.full_like(b, float("-inf"))
        b = torch.where(is_term_u & (term_diag == n), zero, b)
        diags[n] = b
    return _unskew(torch.stack(diags), T + 1)


def _prepare(blank_logp, label_logp, logit_lens, target_lens):
    check_lattice_inputs(blank_logp, label_logp, logit_lens, target_lens)
    blank, label = _masked(_promote(blank_logp), _promote(label_logp), logit_lens, target_lens)
    return blank, label


@torch.no_grad()
def rnnt_lattice_loss(
    blank_logp: torch.Tensor, label_logp: torch.Tensor, logit_lens: torch.Tensor, target_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact RNN-T negative log-likelihood from per-cell log-probs (no autograd; see :func:`rnnt_lattice_nll`).

    Args:
        blank_logp: (B, T, U+1) float, log p(blank | t, u).
        label_logp: (B, T, U+1) float, log p(y_{u+1} | t, u); column u >= target_lens[b] is ignored.
        logit_lens: (B,) int, valid frames T_b (1 <= T_b <= T).
        target_lens: (B,) int, valid targets U_b (0 <= U_b <= U).

    Returns:
        loss: (B,) -log P per utterance (fp32 for half inputs, else the input dtype; inf when infeasible).
        alpha: (B, T, U+1) forward log-variables (-inf outside the utterance's lattice).
        beta: (B, T, U+1) backward log-variables, beta(t, u) including the emission at (t, u).
    """
    blank, label = _prepare(blank_logp, label_logp, logit_lens, target_lens)
    T = blank.shape[1]
    alpha = _alpha(blank, label)
    beta = _beta_ext(blank, label, logit_lens, target_lens)[:, :T]
    # cells at t >= T_b are -inf by construction except a virtual terminal lying inside the grid; drop it
    t_ok = torch.arange(T, device=blank.device).view(1, T, 1) < logit_lens.to(blank.device).view(-1, 1, 1)
    beta = beta.masked_fill(~t_ok, float("-inf"))
    return -beta[:, 0, 0], alpha, beta


@torch.no_grad()
def rnnt_lattice_posteriors(
    blank_logp: torch.Tensor, label_logp: torch.Tensor, logit_lens: torch.Tensor, target_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loss and transition posteriors (= minus the gradients of the loss w.r.t. the per-cell log-probs).

    Arguments as in :func:`rnnt_lattice_loss`.

    Returns:
        loss: (B,) -log P.
        blank_post: (B, T, U+1) P(the alignment takes the blank out of (t, u)) = -d loss / d blank_logp.
        label_post: (B, T, U+1) P(the alignment takes the label out of (t, u)) = -d loss / d label_logp.
        Their sum is the occupancy of cell (t, u). Both are zero outside the lattice and for infeasible
        utterances.
    """
    blank, label = _prepare(blank_logp, label_logp, logit_lens, target_lens)
    T = blank.shape[1]
    alpha = _alpha(blank, label)
    beta_ext = _beta_ext(blank, label, logit_lens, target_lens)  # (B, T+1, U1)
    log_p = beta_ext[:, 0, 0]  # (B,)
    ok = torch.isfinite(log_p).view(-1, 1, 1)
    lp = torch.where(ok, log_p.view(-1, 1, 1), torch.zeros_like(log_p).view(-1, 1, 1))
    blank_post = torch.exp(alpha + blank + beta_ext[:, 1:] - lp)
    beta_next_u = _shift_down(beta_ext[:, :T], float("-inf"))
    label_post = torch.exp(alpha + label + beta_next_u - lp)
    zero = torch.zeros((), dtype=blank.dtype, device=blank.device)
    blank_post = torch.where(ok, blank_post, zero)
    label_post = torch.where(ok, label_post, zero)
    return -log_p, blank_post, label_post


class _LatticeNLL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, blank_logp, label_logp, logit_lens, target_lens):
        loss, blank_post, label_post = rnnt_lattice_posteriors(blank_logp, label_logp, logit_lens, target_lens)
        ctx.save_for_backward(blank_post, label_post)
        ctx.in_dtypes = (blank_logp.dtype, label_logp.dtype)
        ctx.mark_non_differentiable(blank_post, label_post)
        return loss, blank_post, label_post

    @staticmethod
    def backward(ctx, grad_loss, _grad_blank_post, _grad_label_post):
        blank_post, label_post = ctx.saved_tensors
        g = grad_loss.to(blank_post.dtype).view(-1, 1, 1)
        return (-blank_post * g).to(ctx.in_dtypes[0]), (-label_post * g).to(ctx.in_dtypes[1]), None, None


def rnnt_lattice_nll(
    blank_logp: torch.Tensor,
    label_logp: torch.Tensor,
    logit_lens: torch.Tensor,
    target_lens: torch.Tensor,
    *,
    return_posteriors: bool = False,
):
    """Differentiable per-utterance RNN-T loss (B,) from per-cell log-probs (B, T, U+1).

    The backward pass returns the analytic gradients (minus the transition posteriors, scaled by the
    incoming gradient); the posteriors are computed in forward and kept (8 bytes per cell in fp32).
    Arguments as in :func:`rnnt_lattice_loss`; the loss is fp32 for half inputs, else the input dtype.
    With ``return_posteriors=True`` returns ``(loss, (blank_post, label_post))``, the posteriors being
    detached (B, T, U+1) tensors as in :func:`rnnt_lattice_posteriors`.
    """
    loss, blank_post, label_post = _LatticeNLL.apply(blank_logp, label_logp, logit_lens, target_lens)
    if return_posteriors:
        return loss, (blank_post, label_post)
    return loss


def extend_targets(targets: torch.Tensor, target_lens: torch.Tensor, blank: int) -> torch.Tensor:
    """(B, U) padded targets -> (B, U+1) int64 with ``blank`` at every u >= target_lens[b].

    Column u of the result is the label emitted *from* lattice row u (y_{u+1}); the padding makes every
    gather index valid whatever the padding value of ``targets`` was.
    """
    B, U = targets.shape
    ext = torch.cat([targets.long(), targets.new_full((B, 1), blank, dtype=torch.long)], dim=1)
    u = torch.arange(U + 1, device=targets.device).view(1, U + 1)
    return torch.where(u < target_lens.to(targets.device).view(B, 1), ext, torch.full_like(ext, blank))


def validate_targets(
    targets: torch.Tensor,
    logit_lens: torch.Tensor,
    target_lens: torch.Tensor,
    *,
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    blank: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the shared validator for losses that never hold the (B, T, U+1, V) logits.

    :func:`asrprec.losses.validate.validate_rnnt_inputs` reads only the shape, dtype and device of its
    ``logits`` argument, so it is handed a zero-storage stand-in of ``shape`` = (B, T, U+1, V).
    Returns ``(targets, logit_lens, target_lens)`` as int64 on ``device``; raises ValueError otherwise.
    """
    from asrprec.losses.validate import validate_rnnt_inputs

    if dtype not in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"inputs must be float64, float32, float16 or bfloat16, got {dtype}")
    stand_in = torch.empty((), dtype=dtype, device=device).expand(*shape)
    return validate_rnnt_inputs(stand_in, targets, logit_lens, target_lens, blank=blank)


def reduce_loss(loss: torch.Tensor, reduction: str) -> torch.Tensor:
    """'none' -> (B,), 'sum' -> scalar sum, 'mean' -> scalar mean over the batch (k2/torchaudio meaning)."""
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.mean()
    raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
