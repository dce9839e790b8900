"""Pruned RNN-T loss in plain PyTorch (no k2).

Semantics follow k2's ``rnnt_loss_smoothed``, ``get_rnnt_prune_ranges``, ``do_rnnt_pruning`` and
``rnnt_loss_pruned`` (k2-fsa/k2 ``k2/python/k2/rnnt_loss.py``; Kuang et al., "Pruned RNN-T for fast,
memory-efficient ASR training", 2022), written against our conventions: padded targets (B, U) plus
``target_lens``, ``logit_lens``, lattice tensors laid out (B, T, U+1) like the logits.

Training recipe (icefall): project encoder and decoder outputs to V ("am", "lm"), compute the smoothed
"simple" loss with ``return_grad=True``, turn its transition posteriors into per-frame windows of
``s_range`` label positions (:func:`get_rnnt_prune_ranges`), run the real joiner only on those windows
(:func:`do_rnnt_pruning`), and score them with :func:`rnnt_loss_pruned`.

Legend: B batch, T encoder frames, U target tokens (lattice rows u = 0..U), V vocabulary (blank
included), S = s_range window size, D feature dim.

Where this differs from k2 (topology, the window criterion, widening, the unigram, zero scales, the
cap on ``s_range``, reduction, fp32 inputs, the posterior layout), each deliberate, and why: ``docs/losses.md``.
"""

from __future__ import annotations

import logging

import torch

from asrprec.losses.lattice import extend_targets, reduce_loss, rnnt_lattice_nll, validate_targets
from asrprec.precision import fp32_island

__all__ = ["rnnt_loss_smoothed", "get_rnnt_prune_ranges", "needed_prune_range", "do_rnnt_pruning",
           "rnnt_loss_pruned", "PRUNE_CRITERIA"]

log = logging.getLogger(__name__)


def _smoothed_logprobs(lm, am, tgt_ext, target_lens, blank, lm_only_scale, am_only_scale):
    """Per-cell (blank, label) log-probs (B, T, U+1) of the interpolated additive-joiner model."""
    B, T, V = am.shape
    U1 = lm.shape[1]
    # exp(am - max) @ exp(lm - max)^T gives sum_v exp(am[t, v] + lm[u, v]) for every cell without ever
    # forming B x T x (U+1) x V (k2's trick). The maxima are constants for the gradient, so detach them.
    am_max = am.detach().amax(dim=2, keepdim=True)  # (B, T, 1)
    lm_max = lm.detach().amax(dim=2, keepdim=True)  # (B, U1, 1)
    am_e = (am - am_max).exp()
    lm_e = (lm - lm_max).exp()
    tiny = torch.finfo(am.dtype).tiny

    am_y = am.gather(2, tgt_ext.view(B, 1, U1).expand(B, T, U1))  # (B, T, U1): am[t, y_{u+1}]
    lm_y = lm.gather(2, tgt_ext.view(B, U1, 1)).view(B, 1, U1)  # lm[u, y_{u+1}]
    am_b = am[:, :, blank].view(B, T, 1)
    lm_b = lm[:, :, blank].view(B, 1, U1)

    combined_scale = 1.0 - lm_only_scale - am_only_scale
    blank_lp = torch.zeros((), dtype=am.dtype, device=am.device)
    label_lp = blank_lp
    if combined_scale != 0.0:
        norm = (torch.bmm(am_e, lm_e.transpose(1, 2)) + tiny).log() + am_max + lm_max.transpose(1, 2)  # (B,T,U1)
        blank_lp = blank_lp + combined_scale * (am_b + lm_b - norm)
        label_lp = label_lp + combined_scale * (am_y + lm_y - norm)
    if lm_only_scale != 0.0:
        lm_lse = lm.logsumexp(dim=2).view(B, 1, U1)
        blank_lp = blank_lp + lm_only_scale * (lm_b - lm_lse)
        label_lp = label_lp + lm_only_scale * (lm_y - lm_lse)
    if am_only_scale != 0.0:
        # "AM-only" model: the acoustic scores combined with a unigram LM = the LM softmax averaged over
        # all valid histories (rows u <= U_b of every utterance).
        valid = (torch.arange(U1, device=lm.device).view(1, U1) <= target_lens.view(B, 1)).to(lm.dtype)
        lm_sm = lm_e / lm_e.sum(dim=2, keepdim=True)
        unigram = (lm_sm * valid.unsqueeze(2)).sum(dim=(0, 1)) / valid.sum() + tiny  # (V,)
        log_uni = unigram.log()
        am_norm = (am_e @ unigram).log().unsqueeze(2) + am_max  # (B, T, 1)
        blank_lp = blank_lp + am_only_scale * (am_b + log_uni[blank] - am_norm)
        label_lp = label_lp + am_only_scale * (am_y + log_uni[tgt_ext].view(B, 1, U1) - am_norm)
    shape = (B, T, U1)
    return blank_lp.expand(shape), label_lp.expand(shape)


@fp32_island
def rnnt_loss_smoothed(
    lm: torch.Tensor,
    am: torch.Tensor,
    targets: torch.Tensor,
    logit_lens: torch.Tensor,
    target_lens: torch.Tensor,
    *,
    blank: int = 0,
    lm_only_scale: float = 0.25,
    am_only_scale: float = 0.0,
    reduction: str = "mean",
    return_grad: bool = False,
):
    """The "simple" RNN-T loss of an additive joiner, smoothed with LM-only and AM-only terms.

    Per cell, log p = (1-l-a)·log softmax(am[t] + lm[u]) + l·log softmax(lm[u]) + a·log(softmax-over-v of
    am[t] + log unigram), l = ``lm_only_scale``, a = ``am_only_scale``, evaluated only at the blank and at
    y_{u+1}; the normalisers come from one batched matmul, never a (B, T, U+1, V) tensor. With
    l = a = 0 this is exactly the RNN-T loss of logits ``am[:, :, None] + lm[:, None]``.

    Args:
        lm: (B, U+1, V) float, decoder ("language model") part of the logits; row u sees y_1..y_u.
        am: (B, T, V) float, encoder ("acoustic model") part of the logits.
        targets: (B, U) int, padded label ids (values past ``target_lens`` are ignored).
        logit_lens: (B,) int, valid frames T_b.
        target_lens: (B,) int, valid labels U_b.
        blank: blank id. reduction: "mean" (over the batch, the default of every asrprec loss, as in k2 and
            torchaudio) | "sum" | "none".
        return_grad: also return the transition posteriors used to prune.

    Returns:
        loss: scalar, or (B,) with reduction="none"; fp32 (fp64 for fp64 inputs).
        With ``return_grad``: ``(loss, (px_grad, py_grad))``: px_grad (B, T, U+1) = posterior of the
        label transition out of (t, u), py_grad (B, T, U+1) = posterior of the blank transition, i.e.
        minus the gradients of the unreduced loss w.r.t. the label / blank log-probs (k2's "px/py grads",
        transposed to our (B, T, U+1) layout). Detached; zero outside each lattice.
    """
    if lm.dim() != 3 or am.dim() != 3 or lm.shape[0] != am.shape[0] or lm.shape[2] != am.shape[2]:
        raise ValueError(f"lm must be (B, U+1, V) and am (B, T, V) with equal B and V, got lm "
                         f"{tuple(lm.shape)} and am {tuple(am.shape)}")
    B, T, V = am.shape
    U = lm.shape[1] - 1
    targets, logit_lens, target_lens = validate_targets(
        targets, logit_lens, target_lens, shape=(B, T, U + 1, V), dtype=am.dtype, device=am.device, blank=blank)
    tgt_ext = extend_targets(targets, target_lens, blank)
    blank_lp, label_lp = _smoothed_logprobs(lm, am, tgt_ext, target_lens.to(am.device), blank,
                                            float(lm_only_scale), float(am_only_scale))
    loss, (blank_post, label_post) = rnnt_lattice_nll(blank_lp, label_lp, logit_lens, target_lens,
                                                      return_posteriors=True)
    loss = reduce_loss(loss, reduction)
    if return_grad:
        return loss, (label_post, blank_post)
    return loss


#: window criteria of :func:`get_rnnt_prune_ranges` (see there)
PRUNE_CRITERIA = ("occupancy", "k2")
_widths_warned: set[tuple[int, int]] = set()


def needed_prune_range(logit_lens: torch.Tensor, target_lens: torch.Tensor) -> torch.Tensor:
    """(B,) the narrowest window that can reach the final cell (T_b-1, U_b): ``(U_b-1)//T_b + 2`` (1 when U_b = 0).

    Windows of S rows advance by at most S-1 rows per frame from row 0, so after T_b frames they reach row
    (S-1)·T_b at most, and the final cell is inside the last window iff (S-1)·T_b >= U_b.
    """
    u, t = target_lens.long(), logit_lens.long().clamp(min=1)
    return torch.where(u > 0, torch.div(u - 1, t, rounding_mode="floor") + 2, torch.ones_like(u))


@torch.no_grad()
def get_rnnt_prune_ranges(
    px_grad: torch.Tensor,
    py_grad: torch.Tensor,
    logit_lens: torch.Tensor,
    target_lens: torch.Tensor,
    s_range: int,
    *,
    criterion: str = "occupancy",
) -> torch.Tensor:
    """Per-frame windows of S consecutive lattice rows to keep, S = ``s_range`` (capped at U+1), widened for the
    batch when an utterance needs more.

    Widening: an utterance with more tokens than its windows can climb (``(U_b-1)//T_b + 2 > S``, see
    :func:`needed_prune_range`) would have no path through the windows, an infinite pruned loss, and its batch
    would be lost; S is raised to the largest such need in the batch, with a log line (a warning the first
    time a width is needed, then at INFO), as k2 does since k2-fsa/k2 PR #1245.

    Window start per frame, ``criterion`` (the module docstring says why the default is "occupancy"):

    * ``"occupancy"`` (k2's criterion before k2-fsa/k2 PR #1009, kept there as
      ``get_rnnt_prune_ranges_deprecated``): maximise the total (label + blank) posterior inside the window;
    * ``"k2"`` (k2's current criterion, PR #1009; Kuang et al. 2022, §3.2): maximise the blank posterior summed
      over the window's rows minus the label posterior entering its first row from the row below, i.e. keep the
      rows where alignments leave the frame, and do not cut alignments that enter the window at this frame from
      below it.

    Then the starts are made valid for every utterance b (k2's ``_adjust_pruning_lower_bound``, our code):

    * frames t >= T_b - 1 start at max(U_b + 1 - S, 0), so the final cell (T_b-1, U_b) is inside;
    * non-decreasing in t (a backward running minimum);
    * s[t+1] - s[t] <= S - 1 (no row is skipped between frames) and s[0] = 0 (a running minimum of
      (S-1)·t - s, clamped at 0).

    Hence 0 <= start <= max(U_b + 1 - S, 0), and after widening every utterance has a path through its windows.

    Args:
        px_grad: (B, T, U+1) label-transition posteriors from :func:`rnnt_loss_smoothed`.
        py_grad: (B, T, U+1) blank-transition posteriors.
        logit_lens: (B,) int, T_b. target_lens: (B,) int, U_b.
        s_range: window size requested (>= 1).
        criterion: "occupancy" or "k2" (above).

    Returns:
        ranges: (B, T, S) int64, ranges[b, t, k] = start[b, t] + k.
    """
    if px_grad.dim() != 3 or px_grad.shape != py_grad.shape:
        raise ValueError(f"px_grad and py_grad must both be (B, T, U+1), got {tuple(px_grad.shape)} and "
                         f"{tuple(py_grad.shape)}")
    if s_range < 1:
        raise ValueError(f"s_range must be >= 1, got {s_range}")
    if criterion not in PRUNE_CRITERIA:
        raise ValueError(f"criterion must be one of {PRUNE_CRITERIA}, got {criterion!r}")
    B, T, U1 = px_grad.shape
    dev = px_grad.device
    logit_lens, target_lens = logit_lens.to(dev), target_lens.to(dev)
    S = _widened(min(int(s_range), U1), logit_lens, target_lens, U1)
    start = _window_starts(px_grad, py_grad, S, criterion)  # (B, T) in [0, U1 - S]

    t = torch.arange(T, device=dev).view(1, T)
    last = (target_lens.view(B, 1) + 1 - S).clamp(min=0)
    start = torch.where(t >= logit_lens.view(B, 1) - 1, last.expand(B, T), start)
    start = start.flip(1).cummin(dim=1).values.flip(1)  # non-decreasing
    v = (S - 1) * t - start
    v = v.flip(1).cummin(dim=1).values.flip(1).clamp(min=0)  # v non-decreasing and >= 0
    start = (S - 1) * t - v
    return start.unsqueeze(2) + torch.arange(S, device=dev).view(1, 1, S)


def _widened(S: int, logit_lens: torch.Tensor, target_lens: torch.Tensor, U1: int) -> int:
    """S, or the batch's largest :func:`needed_prune_range` when that is wider (never above U+1)."""
    if logit_lens.numel() == 0:
        return S
    need = needed_prune_range(logit_lens, target_lens)
    widest = min(int(need.max()), U1)
    if widest <= S:
        return S
    short = (need > S).nonzero().flatten().tolist()
    b = short[int(torch.argmax(need[short]))]
    key = (S, widest)
    level = logging.INFO if key in _widths_warned else logging.WARNING
    _widths_warned.add(key)
    log.log(level, "pruned RNN-T: a window of %d rows cannot reach the last token of %d utterance(s) in this batch "
            "(e.g. utterance %d: %d tokens in %d encoder frames needs (U-1)//T+2 = %d); widening the window to %d "
            "for this batch (k2 does the same). Many such utterances mean the encoder's frame rate is too low for "
            "the tokens: check the data or raise --prune-range",
            S, len(short), b, int(target_lens[b]), int(logit_lens[b]), int(need[b]), widest)
    return widest


def _window_starts(px_grad: torch.Tensor, py_grad: torch.Tensor, S: int, criterion: str) -> torch.Tensor:
    """(B, T) the window start maximising ``criterion`` at every frame (first maximum on ties, as k2's argmax)."""
    B, T, U1 = px_grad.shape
    # float64 cumulative sums: window sums stay exact enough to rank
    if criterion == "occupancy":
        occ = (px_grad + py_grad).to(torch.float64)
        cs = torch.cat([occ.new_zeros(B, T, 1), occ.cumsum(dim=2)], dim=2)  # (B, T, U1+1)
        return (cs[:, :, S:] - cs[:, :, :-S]).argmax(dim=2)
    blank = py_grad.to(torch.float64)
    cs = torch.cat([blank.new_zeros(B, T, 1), blank.cumsum(dim=2)], dim=2)
    blank_in_window = cs[:, :, S:] - cs[:, :, :-S]  # (B, T, U1-S+1): rows s..s+S-1
    # label posterior entering row s at this frame from row s-1 (none into row 0)
    entering = torch.cat([px_grad.new_zeros(B, T, 1), px_grad[:, :, : U1 - S]], dim=2).to(torch.float64)
    return (blank_in_window - entering).argmax(dim=2)


def do_rnnt_pruning(am: torch.Tensor, lm: torch.Tensor, ranges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather the joiner inputs of the kept cells.

    Args:
        am: (B, T, D) encoder-side joiner input (e.g. the projected encoder output).
        lm: (B, U+1, D) decoder-side joiner input.
        ranges: (B, T, S) int64 from :func:`get_rnnt_prune_ranges`.

    Returns:
        am_pruned: (B, T, S, D), an expanded view of ``am``.
        lm_pruned: (B, T, S, D), lm_pruned[b, t, k] = lm[b, ranges[b, t, k]].
    """
    if am.dim() != 3 or lm.dim() != 3 or ranges.dim() != 3:
        raise ValueError(f"am (B, T, D), lm (B, U+1, D), ranges (B, T, S) expected, got {tuple(am.shape)}, "
                         f"{tuple(lm.shape)}, {tuple(ranges.shape)}")
    B, T, S = ranges.shape
    if am.shape[:2] != (B, T) or lm.shape[0] != B or am.shape[2] != lm.shape[2]:
        raise ValueError(f"shapes disagree: am {tuple(am.shape)}, lm {tuple(lm.shape)}, ranges {tuple(ranges.shape)}")
    am_pruned = am.unsqueeze(2).expand(B, T, S, am.shape[2])
    lm_pruned = lm[torch.arange(B, device=lm.device).view(B, 1, 1), ranges]
    return am_pruned, lm_pruned


@fp32_island
def rnnt_loss_pruned(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ranges: torch.Tensor,
    logit_lens: torch.Tensor,
    target_lens: torch.Tensor,
    *,
    blank: int = 0,
    reduction: str = "mean",
) -> torch.Tensor:
    """RNN-T loss on the pruned joiner output: every cell outside the windows has probability 0.

    Args:
        logits: (B, T, S, V) float (any precision; log-softmax runs in fp32), the joiner on
            ``do_rnnt_pruning`` outputs.
        targets: (B, U) int padded labels. ranges: (B, T, S) int64 rows kept per frame.
        logit_lens: (B,) int T_b. target_lens: (B,) int U_b.
        blank: blank id. reduction: "mean" (over the batch, the default) | "sum" | "none".

    Returns:
        scalar loss, or (B,) with reduction="none"; fp32 (fp64 for fp64 logits). Equals the full RNN-T
        loss when S = U+1.
    """
    if logits.dim() != 4:
        raise ValueError(f"logits must be (B, T, S, V), got {tuple(logits.shape)}")
    B, T, S, V = logits.shape
    if targets.dim() != 2:
        raise ValueError(f"targets must be (B, U), got shape {tuple(targets.shape)}")
    U = targets.shape[1]
    targets, logit_lens, target_lens = validate_targets(
        targets, logit_lens, target_lens, shape=(B, T, U + 1, V), dtype=logits.dtype, device=logits.device,
        blank=blank)
    if not isinstance(ranges, torch.Tensor) or ranges.shape != (B, T, S) or ranges.dtype.is_floating_point:
        raise ValueError(f"ranges must be an integer (B, T, S)=({B}, {T}, {S}) tensor, got "
                         f"{tuple(ranges.shape)} {ranges.dtype}")
    if S > U + 1 or int(ranges.min()) < 0 or int(ranges.max()) > U:
        raise ValueError(f"ranges must index rows 0..U={U} with S <= U+1, got S={S}, "
                         f"values [{int(ranges.min())}, {int(ranges.max())}]")
    ranges = ranges.long()
    tgt_ext = extend_targets(targets, target_lens, blank)  # (B, U+1)
    sym = tgt_ext.gather(1, ranges.view(B, T * S)).view(B, T, S, 1)
    lse = logits.logsumexp(dim=3)  # (B, T, S)
    blank_p = logits[..., blank] - lse
    label_p = logits.gather(3, sym).squeeze(3) - lse
    full = torch.full((B, T, U + 1), float("-inf"), dtype=logits.dtype, device=logits.device)
    blank_full = full.scatter(2, ranges, blank_p)
    label_full = full.scatter(2, ranges, label_p)
    return reduce_loss(rnnt_lattice_nll(blank_full, label_full, logit_lens, target_lens), reduction)
