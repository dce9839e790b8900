"""Memory-lean exact joint + RNN-T loss: the logits are never materialised for the whole lattice.

The plain path runs the joiner on the full (B, T, U+1) grid, keeping the hidden activation
(B·T·(U+1)·J) and the logits, their log-softmax and their gradient (B·T·(U+1)·V each) alive at the
peak. Here the joint is evaluated one tile of cells at a time, twice:

1. forward, under no_grad: for each tile, the logits z, their fp32 log-normaliser L = logsumexp_v z,
   and the blank and label logits -> per-cell log-probs lb = z_blank - L, ly = z_{y_{u+1}} - L;
   then the exact lattice recursion (:mod:`asrprec.losses.lattice`) gives the loss and the transition
   posteriors (blank_post, label_post), which are all that is kept: 8 bytes per cell;
2. backward: for each tile, recompute z with autograd enabled, form the exact fused-log-softmax
   gradient  dz = (blank_post + label_post)·softmax(z) - blank_post·1[blank] - label_post·1[y_{u+1}]
   (scaled by the incoming gradient; clamped first when ``clamp`` is given, like the reference),
   and push it through the joiner with ``torch.autograd.grad`` w.r.t. the tile's encoder rows, the
   decoder rows and the joiner's parameters, accumulating in fp32.

Nothing of size B·T·(U+1)·V or B·T·(U+1)·J is ever held; the cost is one extra joint forward
(4 joint GEMMs instead of 3). Autocast is honoured: the state seen in forward is re-entered for the
backward recompute (as torch.utils.checkpoint does), so tiles run in the autocast dtype exactly like the
plain path, while every log-softmax statistic is fp32. A whole-model bf16 joiner works too.

Legend: B batch, T encoder frames, U target tokens (U+1 lattice rows), V vocabulary (blank included),
J joiner hidden size.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from asrprec.losses.lattice import extend_targets, reduce_loss, rnnt_lattice_posteriors, validate_targets
from asrprec.precision import fp32_island
from asrprec.precision.islands import AUTOCAST_DEVICES

__all__ = ["rnnt_loss_lean", "lean_tile_shape"]

# Default tile budget in (cells x (J + V)) elements: 2**21 elements = 8 MB per fp32 copy. A tile holds
# about six such copies at its peak (hidden pre/post tanh, logits, fp32 softmax, gradient, hidden grad).
_TILE_ELEMS = 2**21


def lean_tile_shape(B: int, T: int, U1: int, J: int, V: int, tile_elems: int = _TILE_ELEMS) -> tuple[int, int]:
    """(tile_t, tile_u) so that B·tile_t·tile_u·(J+V) <= tile_elems (at least one frame x one row)."""
    per_frame = B * U1 * (J + V)
    if per_frame <= tile_elems:
        return max(1, min(T, tile_elems // per_frame)), U1
    return 1, max(1, min(U1, tile_elems // (B * (J + V))))


def _capture_autocast() -> list[tuple[str, bool, torch.dtype]]:
    out = []
    for dev in AUTOCAST_DEVICES:
        if dev == "cuda" and not torch.cuda.is_available():
            continue
        out.append((dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)))
    return out


@contextlib.contextmanager
def _autocast_as(state: list[tuple[str, bool, torch.dtype]]):
    with contextlib.ExitStack() as stack:
        for dev, enabled, dtype in state:
            stack.enter_context(torch.autocast(device_type=dev, dtype=dtype, enabled=enabled))
        yield


def _tiles(T: int, U1: int, tile_t: int, tile_u: int):
    for t0 in range(0, T, tile_t):
        for u0 in range(0, U1, tile_u):
            yield t0, min(T, t0 + tile_t), u0, min(U1, u0 + tile_u)


def _stat_dtype(z: torch.Tensor) -> torch.dtype:
    return torch.float64 if z.dtype == torch.float64 else torch.float32


class _LeanJointLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, joiner, cfg, enc, dec, tgt_ext, logit_lens, target_lens, *params):
        blank, tile_t, tile_u, clamp, autocast_state = cfg
        B, T, _ = enc.shape
        U1 = dec.shape[1]
        stats = None
        for t0, t1, u0, u1 in _tiles(T, U1, tile_t, tile_u):
            z = joiner(enc[:, t0:t1].unsqueeze(2), dec[:, u0:u1].unsqueeze(1), project_input=False)
            with fp32_island():
                zf = z.to(_stat_dtype(z))
                if stats is None:
                    stats = torch.empty((3, B, T, U1), dtype=zf.dtype, device=zf.device)
                lse = zf.logsumexp(dim=3)
                stats[0, :, t0:t1, u0:u1] = zf[..., blank] - lse
                idx = tgt_ext[:, u0:u1].view(B, 1, u1 - u0, 1).expand(B, t1 - t0, u1 - u0, 1)
                stats[1, :, t0:t1, u0:u1] = zf.gather(3, idx).squeeze(3) - lse
            del z, zf, lse
        loss, blank_post, label_post = rnnt_lattice_posteriors(stats[0], stats[1], logit_lens, target_lens)
        del stats
        ctx.joiner = joiner
        ctx.cfg = cfg
        ctx.n_params = len(params)
        ctx.save_for_backward(enc, dec, tgt_ext, blank_post, label_post)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        enc, dec, tgt_ext, blank_post, label_post = ctx.saved_tensors
        blank, tile_t, tile_u, clamp, autocast_state = ctx.cfg
        joiner = ctx.joiner
        params = [p for p in joiner.parameters()]
        need = ctx.needs_input_grad
        need_enc, need_dec = need[2], need[3]
        need_p = [bool(n) and p.requires_grad for n, p in zip(need[7:], params)]
        B, T, _ = enc.shape
        U1 = dec.shape[1]
        acc = blank_post.dtype
        g = grad_loss.to(acc).view(B, 1, 1, 1)
        grad_enc = torch.zeros(enc.shape, dtype=acc, device=enc.device) if need_enc else None
        grad_dec = torch.zeros(dec.shape, dtype=acc, device=dec.device) if need_dec else None
        grad_p = [torch.zeros(p.shape, dtype=acc, device=p.device) if n else None for p, n in zip(params, need_p)]
        used = [False] * len(params)  # parameters the joint never touches (e.g. the projections) get None
        for t0, t1, u0, u1 in _tiles(T, U1, tile_t, tile_u):
            e = enc[:, t0:t1].detach().requires_grad_(need_enc)
            d = dec[:, u0:u1].detach().requires_grad_(need_dec)
            with torch.enable_grad(), _autocast_as(autocast_state):
                z = joiner(e.unsqueeze(2), d.unsqueeze(1), project_input=False)
            with torch.no_grad(), fp32_island():
                bp = blank_post[:, t0:t1, u0:u1]
                lp = label_post[:, t0:t1, u0:u1]
                dz = torch.softmax(z.to(acc), dim=3).mul_((bp + lp).unsqueeze(3))
                dz[..., blank] -= bp
                idx = tgt_ext[:, u0:u1].view(B, 1, u1 - u0, 1).expand(B, t1 - t0, u1 - u0, 1)
                dz.scatter_add_(3, idx, -lp.unsqueeze(3))
                if clamp is not None:
                    dz.clamp_(-clamp, clamp)
                dz = dz.mul_(g).to(z.dtype)
            inputs, slots = [], []
            if need_enc:
                inputs.append(e)
                slots.append(("enc", None))
            if need_dec:
                inputs.append(d)
                slots.append(("dec", None))
            for i, (p, n) in enumerate(zip(params, need_p)):
                if n:
                    inputs.append(p)
                    slots.append(("p", i))
            if not inputs:
                break
            grads = torch.autograd.grad(z, inputs, grad_outputs=dz, allow_unused=True)
            del z, dz
            for (kind, i), gr in zip(slots, grads):
                if gr is None:
                    continue
                if kind == "enc":
                    grad_enc[:, t0:t1] += gr
                elif kind == "dec":
                    grad_dec[:, u0:u1] += gr
                else:
                    grad_p[i] += gr
                    used[i] = True
        out_enc = grad_enc.to(enc.dtype) if grad_enc is not None else None
        out_dec = grad_dec.to(dec.dtype) if grad_dec is not None else None
        out_p = [gp.to(p.dtype) if u else None for gp, p, u in zip(grad_p, params, used)]
        return (None, None, out_enc, out_dec, None, None, None, *out_p)


def rnnt_loss_lean(
    joiner: nn.Module,
    encoder_proj_out: torch.Tensor,
    decoder_proj_out: torch.Tensor,
    targets: torch.Tensor,
    logit_lens: torch.Tensor,
    target_lens: torch.Tensor,
    *,
    blank: int = 0,
    reduction: str = "mean",
    tile_t: int | None = None,
    tile_u: int | None = None,
    clamp: float | None = None,
) -> torch.Tensor:
    """Exact RNN-T loss of ``joiner`` on the full lattice, holding only per-cell state plus one tile.

    Equal in value and gradients (w.r.t. both projected inputs and every joiner parameter) to::

        logits = joiner(encoder_proj_out[:, :, None], decoder_proj_out[:, None], project_input=False)
        rnnt_loss(logits, targets, logit_lens, target_lens, blank=blank, reduction=reduction, clamp=clamp)

    Args:
        joiner: module called as ``joiner(enc (B, t, 1, J), dec (B, 1, u, J), project_input=False)``
            returning (B, t, u, V) logits (e.g. :class:`asrprec.models.joiner.Joiner`).
        encoder_proj_out: (B, T, J) encoder output already through ``joiner.encoder_proj``.
        decoder_proj_out: (B, U+1, J) decoder output already through ``joiner.decoder_proj``.
        targets: (B, U) int padded labels. logit_lens: (B,) int T_b. target_lens: (B,) int U_b.
        blank: blank id. reduction: "mean" (over the batch, the default) | "sum" | "none".
        tile_t, tile_u: frames / lattice rows per tile; default: :func:`lean_tile_shape` with a budget
            of 2**21 cells x (J+V) elements (about 8 MB per fp32 copy of the tile).
        clamp: clamp each utterance's gradient w.r.t. the logits to [-clamp, clamp] (as the reference).

    Returns:
        scalar loss, or (B,) with reduction="none"; fp32 (fp64 when the joiner computes in fp64).

    Not supported (yet): FastEmit; the loss must be backpropagated at most once per forward (the
    per-cell posteriors are saved, the joiner's activations are not).
    """
    if encoder_proj_out.dim() != 3 or decoder_proj_out.dim() != 3 or \
            encoder_proj_out.shape[0] != decoder_proj_out.shape[0] or \
            encoder_proj_out.shape[2] != decoder_proj_out.shape[2]:
        raise ValueError(f"encoder_proj_out must be (B, T, J) and decoder_proj_out (B, U+1, J) with equal B and "
                         f"J, got {tuple(encoder_proj_out.shape)} and {tuple(decoder_proj_out.shape)}. Fix: pass "
                         "the outputs of joiner.encoder_proj / joiner.decoder_proj")
    if clamp is not None and clamp <= 0:
        raise ValueError(f"clamp must be positive or None, got {clamp}")
    B, T, J = encoder_proj_out.shape
    U1 = decoder_proj_out.shape[1]
    V = getattr(joiner, "vocab_size", None)
    if V is None:
        with torch.no_grad():
            V = joiner(encoder_proj_out[:1, :1].unsqueeze(2), decoder_proj_out[:1, :1].unsqueeze(1),
                       project_input=False).shape[-1]
    targets, logit_lens, target_lens = validate_targets(
        targets, logit_lens, target_lens, shape=(B, T, U1, int(V)), dtype=encoder_proj_out.dtype,
        device=encoder_proj_out.device, blank=blank)
    auto_t, auto_u = lean_tile_shape(B, T, U1, J, int(V))
    tile_t = auto_t if tile_t is None else int(tile_t)
    tile_u = auto_u if tile_u is None else int(tile_u)
    if tile_t < 1 or tile_u < 1:
        raise ValueError(f"tile_t and tile_u must be >= 1, got {tile_t}, {tile_u}")
    cfg = (blank, tile_t, tile_u, None if clamp is None else float(clamp), _capture_autocast())
    tgt_ext = extend_targets(targets, target_lens, blank)
    params = tuple(joiner.parameters())
    loss = _LeanJointLoss.apply(joiner, cfg, encoder_proj_out, decoder_proj_out, tgt_ext, logit_lens,
                                target_lens, *params)
    return reduce_loss(loss, reduction)
