"""The one input validator shared by every RNN-T loss backend.

Every check raises a :class:`ValueError` that names the problem and the fix, so a backend never
sees (and never has to diagnose) malformed input. Legend: B batch, T encoder frames, U target
tokens (the lattice has U+1 rows), V vocabulary size (blank included).

Checking the *values* of the lengths and targets costs one small device-to-host copy per call on
CUDA (the tensors are O(B·U)); that is negligible next to a B·T·(U+1)·V loss.
"""

from __future__ import annotations

import torch

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _check_int_tensor(name: str, x: object, ndim: int, hint: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}. Fix: pass torch.tensor(...).")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise ValueError(
            f"{name} must be an integer tensor, got dtype {x.dtype}. Fix: convert it with {name}.long()."
        )
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s) {hint}, got shape {tuple(x.shape)}.")
    return x


def check_logits(logits: object, layout: str, fix: str = "", *, name: str = "logits", ndim: int = 4) -> None:
    """The checks of a loss's logits: a float tensor (fp64, fp32, fp16 or bf16) of the ``ndim`` dimensions
    ``layout`` names; ``fix`` ends the message of a wrong number of dimensions; ``name``: the argument's name in the
    messages."""
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(logits).__name__}.")
    if logits.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"{name} must be float64, float32, float16 or bfloat16, got {logits.dtype}. "
            "Fix: pass the network's float output."
        )
    if logits.dim() != ndim:
        raise ValueError(
            f"{name} must have shape {layout}, got {logits.dim()} dimension(s) {tuple(logits.shape)}.{fix}"
        )


def validate_rnnt_inputs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    logit_lens: torch.Tensor,
    target_lens: torch.Tensor,
    *,
    blank: int = 0,
    logits_name: str = "logits",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check the inputs of :func:`asrprec.losses.rnnt_loss` and normalise the integer tensors.

    Args:
        logits: (B, T, U+1, V) float tensor (fp64, fp32, fp16 or bf16), unnormalised joint output.
        targets: (B, U) integer tensor, padded; only the first ``target_lens[b]`` entries of row b
            are read (they must lie in [0, V) and differ from ``blank``).
        logit_lens: (B,) integer tensor, 1 ≤ logit_lens[b] ≤ T.
        target_lens: (B,) integer tensor, 0 ≤ target_lens[b] ≤ U.
        blank: the blank id, 0 ≤ blank < V.
        logits_name: what the messages call ``logits`` (a caller validating a stand-in of another argument's
            shape and dtype, e.g. CTC's (B, T, V) ``log_probs``, names that argument).

    Returns:
        ``(targets, logit_lens, target_lens)`` as contiguous int64 tensors on ``logits.device``.

    Raises:
        ValueError: naming the problem and the fix.
    """
    check_logits(
        logits, "(B, T, U+1, V)",
        " Fix: the joiner must combine encoder (B, T, D) and predictor (B, U+1, D) outputs into (B, T, U+1, V).",
        name=logits_name,
    )
    B, T, U1, V = logits.shape
    targets = _check_int_tensor("targets", targets, 2, "(B, U)")
    logit_lens = _check_int_tensor("logit_lens", logit_lens, 1, "(B,)")
    target_lens = _check_int_tensor("target_lens", target_lens, 1, "(B,)")
    if B == 0:
        raise ValueError(f"{logits_name} has batch size 0. Fix: skip empty batches before calling the loss.")
    if T == 0:
        raise ValueError(f"{logits_name} has T == 0 frames. Fix: every utterance needs at least one encoder frame.")
    if V == 0:
        raise ValueError(f"{logits_name} has V == 0 classes. Fix: the vocabulary must include the blank.")
    if targets.shape[0] != B or logit_lens.shape[0] != B or target_lens.shape[0] != B:
        raise ValueError(
            f"batch sizes disagree: {logits_name} {B}, targets {targets.shape[0]}, logit_lens {logit_lens.shape[0]}, "
            f"target_lens {target_lens.shape[0]}. Fix: pass tensors of the same batch."
        )
    U = targets.shape[1]
    if U1 != U + 1:
        raise ValueError(
            f"logits has U+1 = {U1} label positions but targets has U = {U} columns (need U+1 = {U + 1}). "
            "Fix: feed the predictor the blank-prefixed targets (B, U+1) and pad targets to U columns."
        )
    if not isinstance(blank, int) or isinstance(blank, bool):
        raise ValueError(f"blank must be an int, got {blank!r}.")
    if not 0 <= blank < V:
        raise ValueError(f"blank = {blank} is out of range for V = {V} classes. Fix: use 0 ≤ blank < V.")

    dev = logits.device
    targets = targets.to(device=dev, dtype=torch.int64).contiguous()
    logit_lens = logit_lens.to(device=dev, dtype=torch.int64).contiguous()
    target_lens = target_lens.to(device=dev, dtype=torch.int64).contiguous()

    # One host copy of the (small) integer data for all value checks.
    tl, ul = logit_lens.cpu(), target_lens.cpu()
    if (tl < 1).any():
        b = int((tl < 1).nonzero()[0])
        raise ValueError(
            f"logit_lens[{b}] = {int(tl[b])}: every utterance needs at least one frame. "
            "Fix: drop utterances with no encoder frames."
        )
    if (tl > T).any():
        b = int((tl > T).nonzero()[0])
        raise ValueError(f"logit_lens[{b}] = {int(tl[b])} exceeds T = {T}. Fix: lengths must not exceed logits.size(1).")
    if (ul < 0).any():
        b = int((ul < 0).nonzero()[0])
        raise ValueError(f"target_lens[{b}] = {int(ul[b])} is negative. Fix: lengths must be ≥ 0.")
    if (ul > U).any():
        b = int((ul > U).nonzero()[0])
        raise ValueError(
            f"target_lens[{b}] = {int(ul[b])} exceeds U = {U}. Fix: lengths must not exceed targets.size(1)."
        )
    if U > 0:
        tg = targets.cpu()
        inside = torch.arange(U)[None, :] < ul[:, None]
        if (inside & (tg == blank)).any():
            b, u = (inside & (tg == blank)).nonzero()[0].tolist()
            raise ValueError(
                f"targets[{b}, {u}] is the blank id {blank}. Fix: targets must not contain the blank "
                "(check the tokenizer's blank/pad mapping or the `blank` argument)."
            )
        bad = inside & ((tg < 0) | (tg >= V))
        if bad.any():
            b, u = bad.nonzero()[0].tolist()
            raise ValueError(
                f"targets[{b}, {u}] = {int(tg[b, u])} is outside [0, V = {V}). "
                "Fix: the joiner's output size must cover the whole vocabulary; padding must lie beyond target_lens."
            )
    return targets, logit_lens, target_lens
