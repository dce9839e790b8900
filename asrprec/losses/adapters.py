"""Thin adapters that put torchaudio's and k2's RNN-T losses behind :func:`asrprec.losses.rnnt_loss`.

Legend: B batch, T frames, U target tokens (U+1 lattice rows), V vocabulary (blank included).
Inputs arrive validated (int64 targets and lengths on the logits' device). Both return (B,) costs.
"""

from __future__ import annotations

import torch

from .._optional import require
from ..precision.islands import fp32_island


def rnnt_loss_torchaudio(logits: torch.Tensor, targets: torch.Tensor, logit_lens: torch.Tensor,
                         target_lens: torch.Tensor, *, blank: int = 0, clamp: float | None = None,
                         fastemit_lambda: float = 0.0) -> torch.Tensor:
    """``torchaudio.functional.rnnt_loss`` (fused log-softmax), per-utterance costs as float32.

    torchaudio accepts fp32 and fp16 logits only (fp16 costs come back rounded to fp16), has no
    FastEmit, and clamps the gradient w.r.t. the logits to [-clamp, clamp] like asrprec's ``clamp``.
    It requires ``logits.size(1) == max(logit_lens)`` and ``targets.size(1) == max(target_lens)``,
    so the inputs are narrowed to those maxima first (a copy if that makes them non-contiguous).
    """
    if fastemit_lambda:
        raise ValueError("the torchaudio backend has no FastEmit. Fix: use backend='numba' or 'numba-cuda'.")
    if logits.dtype not in (torch.float32, torch.float16):
        raise ValueError(
            f"torchaudio's rnnt_loss accepts float32/float16 logits, not {logits.dtype}. "
            "Fix: use backend='auto' or 'numba'/'numba-cuda' (bf16-capable)."
        )
    ta_f = require("torchaudio").functional
    t_max = int(logit_lens.max())
    u_max = int(target_lens.max())
    x = logits[:, :t_max, : u_max + 1]
    y = targets[:, :u_max]
    # padding beyond U_b is never read, but torchaudio range-checks it
    y = torch.where(torch.arange(u_max, device=y.device)[None, :] < target_lens[:, None], y, 1 if blank == 0 else 0)
    costs = ta_f.rnnt_loss(
        x.contiguous(),
        y.to(torch.int32).contiguous(),
        logit_lens.to(torch.int32),
        target_lens.to(torch.int32),
        blank=blank,
        clamp=-1.0 if clamp is None else float(clamp),
        reduction="none",
        fused_log_softmax=True,
    )
    return costs.float()


@fp32_island
def _k2_costs(k2, logits, symbols, blank, boundary):
    return k2.rnnt_loss(logits=logits, symbols=symbols, termination_symbol=blank, boundary=boundary, reduction="none")


def rnnt_loss_k2(logits: torch.Tensor, targets: torch.Tensor, logit_lens: torch.Tensor, target_lens: torch.Tensor, *,
                 blank: int = 0, clamp: float | None = None, fastemit_lambda: float = 0.0) -> torch.Tensor:
    """``k2.rnnt_loss`` (k2 ``k2/python/k2/rnnt_loss.py``), per-utterance costs as float32 (fp64 for fp64).

    k2 computes in fp32/fp64 only, so fp16/bf16 logits are promoted inside an fp32 island (a
    logits-sized fp32 copy). ``boundary`` rows are [0, 0, U_b, T_b] (begin symbol, begin frame,
    end symbol, end frame). No ``clamp``, no FastEmit.
    """
    if clamp is not None or fastemit_lambda:
        raise ValueError("the k2 backend implements neither clamp nor FastEmit. Fix: use backend='numba'.")
    k2 = require("k2")
    boundary = torch.zeros(logits.shape[0], 4, dtype=torch.int64, device=logits.device)
    boundary[:, 2] = target_lens
    boundary[:, 3] = logit_lens
    symbols = targets.clamp(0, logits.shape[-1] - 1)  # padding beyond U_b is never read by k2
    if logits.dtype == torch.float64:
        return k2.rnnt_loss(logits=logits, symbols=symbols, termination_symbol=blank, boundary=boundary, reduction="none")
    return _k2_costs(k2, logits, symbols, blank, boundary).float()
