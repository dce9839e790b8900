"""``tdt_loss``: the token-and-duration transducer (TDT) loss, over the backend registry of ``rnnt_loss``.

Legend: B batch, T encoder frames, U target tokens (the lattice has U+1 rows), V vocabulary (blank
included), D number of durations.

TDT (Xu et al., "Efficient Sequence Transduction by Jointly Predicting Tokens and Durations", ICML 2023,
arXiv 2304.06795) with NeMo's definition and logits layout (NVIDIA/NeMo
``nemo/collections/asr/losses/rnnt_pytorch.py`` ``TDTLossPytorch`` and the kernels in
``nemo/collections/asr/parts/numba/rnnt_loss/utils/cuda_utils/gpu_rnnt_kernel.py``):

* the joint's last dimension is V + D: V token logits (blank included), then D duration logits;
* token log-probs = log_softmax(token logits) - sigma (logit under-normalisation), duration log-probs =
  log_softmax(duration logits), each normalised on its own; every emission adds one of each;
* from lattice node (t, u) of utterance b: the token y_{u+1} with any listed duration d (0 allowed) goes
  to (t+d, u+1) and must land before T_b; the blank with a duration d > 0 goes to (t+d, u) and must land
  before T_b, except the final blank out of (T_b - d, U_b), which lands exactly on T_b;
* the cost is -log of the summed probability of all such paths.

Because every token needs a frame to itself when 0 is not a duration, an utterance with U_b ≥ T_b is then
infeasible: its cost is +inf and its gradient zero (all backends).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .api import resolve_backend
from .validate import check_logits, validate_rnnt_inputs


def validate_durations(durations: Sequence[int]) -> tuple[int, ...]:
    """Check a TDT duration set; returns it as a tuple of ints. Raises ValueError naming the fix."""
    if isinstance(durations, (str, bytes)) or not isinstance(durations, Sequence):
        raise ValueError(
            f"durations must be a sequence of ints such as (0, 1, 2, 3, 4), got {durations!r}."
        )
    out = tuple(durations)
    if not out:
        raise ValueError("durations is empty. Fix: pass the frame advances the joiner predicts, e.g. (0, 1, 2, 3, 4).")
    for d in out:
        if isinstance(d, bool) or not isinstance(d, int):
            raise ValueError(f"durations must be ints, got {d!r} in {durations!r}.")
        if d < 0:
            raise ValueError(f"durations must be ≥ 0, got {d} in {durations!r}.")
    if any(a >= b for a, b in zip(out, out[1:])):
        raise ValueError(
            f"durations must be strictly increasing, got {durations!r}. "
            f"Fix: sort them and drop repeats, e.g. {tuple(sorted(set(out)))}, and order the joiner's duration "
            "outputs the same way."
        )
    if 1 not in out:
        raise ValueError(
            f"durations {durations!r} do not contain 1: blanks could not advance frame by frame and most frame "
            "counts would have no alignment. Fix: include 1, e.g. (0, 1, 2, 3, 4)."
        )
    return out


def validate_tdt_inputs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    logit_lens: torch.Tensor,
    target_lens: torch.Tensor,
    *,
    durations: Sequence[int],
    blank: int = 0,
) -> tuple[tuple[int, ...], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check the inputs of :func:`tdt_loss`.

    Args:
        logits: (B, T, U+1, V+D) float tensor (fp64, fp32, fp16 or bf16).
        targets, logit_lens, target_lens, blank: as in :func:`asrprec.losses.validate_rnnt_inputs`, V being
            the number of token columns.
        durations: D strictly increasing ints ≥ 0 that include 1.

    Returns:
        ``(durations, targets, logit_lens, target_lens)``: a tuple of ints and contiguous int64 tensors on
        ``logits.device``.

    Raises:
        ValueError: naming the problem and the fix.
    """
    durs = validate_durations(durations)
    check_logits(logits, "(B, T, U+1, V+D)")
    B, T, U1, C = logits.shape
    D = len(durs)
    if C <= D:
        raise ValueError(
            f"logits' last dimension is {C}, but it must hold V ≥ 1 token logits (blank included) followed by "
            f"len(durations) = {D} duration logits. Fix: the TDT joiner outputs V + {D} columns."
        )
    # the shared validator reads only shape, dtype and device: hand it the token part's shape
    stand_in = torch.empty((), dtype=logits.dtype, device=logits.device).expand(B, T, U1, C - D)
    targets, logit_lens, target_lens = validate_rnnt_inputs(stand_in, targets, logit_lens, target_lens, blank=blank)
    return durs, targets, logit_lens, target_lens


def _nan_where_logits_are(costs: torch.Tensor, logits: torch.Tensor, logit_lens: torch.Tensor,
                          target_lens: torch.Tensor) -> torch.Tensor:
    """``costs`` (B,) with NaN for each utterance whose valid logits (its first T_b frames, U_b+1 rows) hold a NaN.
    The backends' max-shifted log-sum-exp turns a NaN logit into an infinite cost, which reads as "no alignment";
    a NaN cost says what happened, as :func:`asrprec.losses.rnnt_loss` does. One summing pass over the logits
    (a NaN survives a sum; no (B, T, U+1, V+D) mask is made)."""
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    sums = torch.stack([logits.detach()[b, :t, : u + 1].sum(dtype=acc)
                        for b, (t, u) in enumerate(zip(logit_lens.tolist(), target_lens.tolist()))])
    return torch.where(torch.isnan(sums), torch.full_like(costs, float("nan")), costs)


def tdt_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    logit_lens: torch.Tensor,
    target_lens: torch.Tensor,
    *,
    durations: Sequence[int] = (0, 1, 2, 3, 4),
    blank: int = 0,
    sigma: float = 0.0,
    omega: float = 0.0,
    reduction: str = "mean",
    backend: str = "auto",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Token-and-duration transducer loss with both log-softmaxes fused in (the lattice: module docstring).

    Legend: B batch, T encoder frames, U target tokens (U+1 lattice rows), V vocabulary (blank included),
    D = len(durations).

    Args:
        logits: (B, T, U+1, V+D) raw joint output, fp32, fp16 or bf16 (fp64 with ``torch``/``numba``):
            V token logits then D duration logits. Never cast: backends compute in fp32 or better.
        targets: (B, U) integer, padded; entries beyond ``target_lens[b]`` are ignored.
        logit_lens: (B,) integer frames per utterance, 1 ≤ T_b ≤ T.
        target_lens: (B,) integer tokens per utterance, 0 ≤ U_b ≤ U.
        durations: the frame advances the D duration logits stand for, strictly increasing, including 1
            (0 lets a token keep the frame; blanks never take 0).
        blank: blank id in [0, V).
        sigma: logit under-normalisation ≥ 0, subtracted from every token log-prob (NeMo recommends 0.05).
        omega: in [0, 1]. With probability ``omega`` (one draw per call, ``torch.rand`` on ``generator`` or
            torch's default CPU generator) the call returns the plain RNN-T loss of the token logits instead
            (log-softmax over V, no sigma) and the duration logits get a zero gradient: NeMo's rule,
            ``GPUTDT.compute_cost_and_score`` in NVIDIA/NeMo
            ``nemo/collections/asr/parts/numba/rnnt_loss/utils/cuda_utils/gpu_rnnt.py``.
        reduction: ``"mean"`` (over the batch, not divided by target lengths), ``"sum"`` or ``"none"``
            (the (B,) costs -log P), as :func:`asrprec.losses.rnnt_loss`.
        backend: ``"auto"`` (CPU: numba; CUDA: numba-cuda, else torch) or ``torch``, ``numba``, ``numba-cuda``.
        generator: the random source of ``omega``'s draw.

    Returns:
        float32 loss (float64 for fp64 logits): a scalar, or (B,) for ``reduction="none"``. +inf for an
        utterance with no alignment (possible only when 0 is not a duration and U_b ≥ T_b); NaN for one whose
        valid logits hold a NaN.

    Raises:
        ValueError: bad inputs (see :func:`validate_tdt_inputs`), sigma, omega or reduction out of range,
            or a backend that cannot handle the device or dtype.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}.")
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not (math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"sigma must be a finite number ≥ 0, got {sigma!r}. Fix: 0.0 (off) or e.g. 0.05.")
    if isinstance(omega, bool) or not isinstance(omega, (int, float)) or not 0.0 <= omega <= 1.0:
        raise ValueError(f"omega must be a probability in [0, 1], got {omega!r}. Fix: 0.0 (pure TDT) or e.g. 0.1.")
    durs, targets, logit_lens, target_lens = validate_tdt_inputs(
        logits, targets, logit_lens, target_lens, durations=durations, blank=blank
    )
    spec = resolve_backend(backend, logits.device.type, logits.dtype, loss="tdt")
    if omega > 0.0 and float(torch.rand((), generator=generator)) < omega:
        # the backend's own RNN-T loss on the token logits; the duration columns get no gradient
        costs = spec.fn(
            logits[..., : logits.shape[-1] - len(durs)], targets, logit_lens, target_lens,
            blank=blank, clamp=None, fastemit_lambda=0.0,
        )
    else:
        costs = spec.tdt_fn(logits, targets, logit_lens, target_lens, durations=durs, blank=blank, sigma=float(sigma))
    costs = _nan_where_logits_are(costs, logits, logit_lens, target_lens)
    if reduction == "mean":
        return costs.mean()
    if reduction == "sum":
        return costs.sum()
    return costs
