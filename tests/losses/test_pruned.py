"""Lattice DP, smoothed ("simple") loss, prune ranges and the pruned loss, against float64 brute force.

The oracle enumerates every alignment of a small utterance (all orders of T_b-1 blanks and U_b labels,
then the final blank) and log-sums their scores; it shares no code with asrprec.losses.
"""

import itertools
import math

import pytest
import torch

from asrprec.losses.lattice import rnnt_lattice_loss, rnnt_lattice_nll, rnnt_lattice_posteriors
from asrprec.losses.pruned import (
    PRUNE_CRITERIA,
    do_rnnt_pruning,
    get_rnnt_prune_ranges,
    needed_prune_range,
    rnnt_loss_pruned,
    rnnt_loss_smoothed,
)

torch.set_num_threads(1)


def _alignment_scores(Tb, Ub, blank_lp, label_lp, allowed=None):
    """Scores of all alignments of one utterance; blank_lp(t, u), label_lp(t, u) are callables.

    ``allowed(t, u)`` (optional) says whether the alignment may visit cell (t, u).
    """
    scores = []
    for pos in itertools.combinations(range(Tb + Ub - 1), Ub):
        t = u = 0
        s = 0.0
        ok = allowed is None or allowed(0, 0)
        for k in range(Tb + Ub - 1):
            if k in pos:
                s += label_lp(t, u)
                u += 1
            else:
                s += blank_lp(t, u)
                t += 1
            ok = ok and (allowed is None or allowed(t, u))
        s += blank_lp(t, u)
        if ok:
            scores.append(s)
    return scores


def _logsumexp(xs):
    if not xs:
        return float("-inf")
    m = max(xs)
    if m == float("-inf"):
        return m
    return m + math.log(sum(math.exp(x - m) for x in xs))


def brute_force_loss(logp, targets, logit_lens, target_lens, blank=0, allowed=None):
    """-log P per utterance from full log-probs (B, T, U+1, V), float64, by enumerating alignments."""
    out = []
    for b in range(logp.shape[0]):
        Tb, Ub = int(logit_lens[b]), int(target_lens[b])
        lp = logp[b].double()
        y = [int(v) for v in targets[b, :Ub]]
        al = None if allowed is None else (lambda t, u, b=b: allowed(b, t, u))
        sc = _alignment_scores(Tb, Ub, lambda t, u: lp[t, u, blank].item(), lambda t, u: lp[t, u, y[u]].item(), al)
        out.append(-_logsumexp(sc))
    return torch.tensor(out, dtype=torch.float64)


def _ragged(B=3, T=5, U=3, V=6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logit_lens = torch.tensor([T, T - 1, 2][:B])
    target_lens = torch.tensor([U, 1, 0][:B])
    targets = torch.randint(1, V, (B, U), generator=g)
    targets[1, 1:] = -1  # padding value must not matter
    return g, targets, logit_lens, target_lens


# ---------------------------------------------------------------------------------------------------- lattice


def test_lattice_loss_matches_brute_force_ragged():
    B, T, U, V = 3, 5, 3, 6
    g, targets, ll, tl = _ragged(B, T, U, V)
    logp = torch.randn(B, T, U + 1, V, generator=g, dtype=torch.float64).log_softmax(-1)
    tg = targets.clamp(min=0)
    blank_lp = logp[..., 0]
    label_lp = torch.cat([logp[:, :, :U].gather(3, tg.view(B, 1, U, 1).expand(B, T, U, 1)).squeeze(3),
                          torch.full((B, T, 1), 123.0, dtype=torch.float64)], 2)  # last column unused
    loss, alpha, beta = rnnt_lattice_loss(blank_lp, label_lp, ll, tl)
    ref = brute_force_loss(logp, tg, ll, tl)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    # alpha and beta meet at every cell of the first utterance: logsumexp_u(alpha+beta) over a frame's
    # cells is not log P, but alpha + blank + beta_next summed over the frame is (each path takes one
    # blank per frame); checked below through the posteriors.
    for b in range(B):
        Tb, Ub = int(ll[b]), int(tl[b])
        end = alpha[b, Tb - 1, Ub] + blank_lp[b, Tb - 1, Ub]
        torch.testing.assert_close(-end, ref[b], rtol=1e-12, atol=1e-12)


def test_lattice_posteriors_are_flows():
    B, T, U = 3, 6, 4
    g = torch.Generator().manual_seed(1)
    blank_lp = -torch.rand(B, T, U + 1, generator=g, dtype=torch.float64) * 3
    label_lp = -torch.rand(B, T, U + 1, generator=g, dtype=torch.float64) * 3
    ll, tl = torch.tensor([6, 4, 1]), torch.tensor([4, 2, 0])
    _, bp, lp = rnnt_lattice_posteriors(blank_lp, label_lp, ll, tl)
    for b in range(B):
        Tb, Ub = int(ll[b]), int(tl[b])
        # every alignment takes exactly one blank per frame and one label per row u < U_b
        torch.testing.assert_close(bp[b, :Tb].sum(1), torch.ones(Tb, dtype=torch.float64))
        torch.testing.assert_close(lp[b, :, :Ub].sum(0), torch.ones(Ub, dtype=torch.float64))
        assert bp[b, Tb:].abs().sum() == 0 and lp[b, :, Ub:].abs().sum() == 0 and bp[b, :, Ub + 1:].abs().sum() == 0


def test_lattice_gradcheck():
    B, T, U = 2, 4, 3
    g = torch.Generator().manual_seed(2)
    blank_lp = (-torch.rand(B, T, U + 1, generator=g, dtype=torch.float64) * 2).requires_grad_()
    label_lp = (-torch.rand(B, T, U + 1, generator=g, dtype=torch.float64) * 2).requires_grad_()
    ll, tl = torch.tensor([4, 3]), torch.tensor([3, 1])
    assert torch.autograd.gradcheck(lambda a, b: rnnt_lattice_nll(a, b, ll, tl), (blank_lp, label_lp))


def test_lattice_infeasible_is_inf_with_zero_grad():
    blank_lp = torch.zeros(1, 3, 3, dtype=torch.float64, requires_grad=True)
    label_lp = torch.full((1, 3, 3), float("-inf"), dtype=torch.float64, requires_grad=True)
    loss = rnnt_lattice_nll(blank_lp, label_lp, torch.tensor([3]), torch.tensor([2]))
    assert torch.isinf(loss).all()
    loss.sum().backward()
    assert torch.isfinite(blank_lp.grad).all() and blank_lp.grad.abs().sum() == 0


def test_lattice_bad_inputs():
    x = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="logit_lens"):
        rnnt_lattice_loss(x, x, torch.tensor([4, 3]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="target_lens"):
        rnnt_lattice_loss(x, x, torch.tensor([3, 3]), torch.tensor([4, 1]))
    with pytest.raises(ValueError, match="shape"):
        rnnt_lattice_loss(x, x[:, :2], torch.tensor([3, 3]), torch.tensor([1, 1]))


# ---------------------------------------------------------------------------------------------------- smoothed


def _naive_smoothed_logp(lm, am, target_lens, lm_s, am_s):
    """Interpolated per-cell log-probs (B, T, U+1, V), materialised, straight from the definition."""
    B, U1, V = lm.shape
    full = (am[:, :, None] + lm[:, None]).log_softmax(-1)
    lm_only = lm.log_softmax(-1)[:, None].expand_as(full)
    rows = [lm[b, u].softmax(-1) for b in range(B) for u in range(int(target_lens[b]) + 1)]
    log_uni = torch.stack(rows).mean(0).log()
    am_only = (am + log_uni).log_softmax(-1)[:, :, None].expand_as(full)
    return (1 - lm_s - am_s) * full + lm_s * lm_only + am_s * am_only


@pytest.mark.parametrize("scales", [(0.0, 0.0), (0.25, 0.0), (0.25, 0.1)])
def test_smoothed_matches_brute_force(scales):
    lm_s, am_s = scales
    B, T, U, V = 3, 5, 3, 6
    g, targets, ll, tl = _ragged(B, T, U, V, seed=3)
    lm = torch.randn(B, U + 1, V, generator=g, dtype=torch.float64)
    am = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    loss = rnnt_loss_smoothed(lm, am, targets, ll, tl, lm_only_scale=lm_s, am_only_scale=am_s, reduction="none")
    ref = brute_force_loss(_naive_smoothed_logp(lm, am, tl, lm_s, am_s), targets.clamp(min=0), ll, tl)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(
        rnnt_loss_smoothed(lm, am, targets, ll, tl, lm_only_scale=lm_s, am_only_scale=am_s), ref.mean())
    torch.testing.assert_close(
        rnnt_loss_smoothed(lm, am, targets, ll, tl, lm_only_scale=lm_s, am_only_scale=am_s, reduction="sum"),
        ref.sum())


def test_smoothed_gradcheck():
    B, T, U, V = 2, 4, 2, 5
    g = torch.Generator().manual_seed(4)
    lm = torch.randn(B, U + 1, V, generator=g, dtype=torch.float64, requires_grad=True)
    am = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([[1, 2], [3, 0]])
    ll, tl = torch.tensor([4, 3]), torch.tensor([2, 1])
    fn = lambda lm_, am_: rnnt_loss_smoothed(lm_, am_, targets, ll, tl, lm_only_scale=0.2, am_only_scale=0.1)
    assert torch.autograd.gradcheck(fn, (lm, am))


def test_smoothed_return_grad_posteriors():
    B, T, U, V = 3, 5, 3, 6
    g, targets, ll, tl = _ragged(B, T, U, V, seed=5)
    lm = torch.randn(B, U + 1, V, generator=g)
    am = torch.randn(B, T, V, generator=g)
    loss, (px_grad, py_grad) = rnnt_loss_smoothed(lm, am, targets, ll, tl, return_grad=True)
    assert loss.dtype == torch.float32 and px_grad.shape == py_grad.shape == (B, T, U + 1)
    for b in range(B):
        torch.testing.assert_close(py_grad[b, : int(ll[b])].sum(1), torch.ones(int(ll[b])))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_smoothed_half_inputs_promoted(dtype):
    B, T, U, V = 2, 6, 3, 8
    g, targets, ll, tl = _ragged(B, T, U, V, seed=6)
    lm = torch.randn(B, U + 1, V, generator=g).to(dtype).requires_grad_()
    am = torch.randn(B, T, V, generator=g).to(dtype).requires_grad_()
    loss = rnnt_loss_smoothed(lm, am, targets, ll, tl, reduction="none")
    ref = rnnt_loss_smoothed(lm.detach().double(), am.detach().double(), targets, ll, tl, reduction="none")
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    loss.sum().backward()
    assert am.grad.dtype == dtype and torch.isfinite(am.grad.float()).all()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = rnnt_loss_smoothed(lm.detach(), am.detach(), targets, ll, tl, reduction="none")
    assert auto.dtype == torch.float32
    torch.testing.assert_close(auto, loss.detach())


# ---------------------------------------------------------------------------------------------------- ranges


def _check_ranges(ranges, ll, tl, S):
    B, T, S_ = ranges.shape
    assert S_ == S and ranges.dtype == torch.int64
    start = ranges[:, :, 0]
    assert torch.equal(ranges, start.unsqueeze(2) + torch.arange(S))
    assert (start[:, 0] == 0).all()
    d = start[:, 1:] - start[:, :-1]
    assert (d >= 0).all() and (d <= S - 1).all()
    for b in range(B):
        hi = max(int(tl[b]) + 1 - S, 0)
        assert int(start[b].min()) >= 0 and int(start[b].max()) <= hi
        Tb, Ub = int(ll[b]), int(tl[b])
        if Ub <= (S - 1) * Tb:  # reachable: the last valid frame's window holds U_b
            assert int(start[b, Tb - 1]) <= Ub <= int(start[b, Tb - 1]) + S - 1


@pytest.mark.parametrize("criterion", PRUNE_CRITERIA)
@pytest.mark.parametrize("s_range", [1, 2, 3, 10])
def test_prune_ranges_valid_random_posteriors(s_range, criterion):
    B, T, U = 4, 9, 6
    g = torch.Generator().manual_seed(7)
    ll, tl = torch.tensor([9, 7, 3, 9]), torch.tensor([6, 2, 5, 0])
    px, py = torch.rand(B, T, U + 1, generator=g), torch.rand(B, T, U + 1, generator=g)
    ranges = get_rnnt_prune_ranges(px, py, ll, tl, s_range, criterion=criterion)
    # utterance 2 (5 tokens in 3 frames) needs windows of (5-1)//3 + 2 = 3 rows: narrower requests are widened
    _check_ranges(ranges, ll, tl, min(max(s_range, 3), U + 1))


def test_needed_prune_range_by_hand():
    # (U-1)//T + 2, and 1 for an empty transcript; 19 tokens in 2 frames need 11 (the width k2's warning quotes
    # in k2-fsa/k2 issue #1271)
    need = needed_prune_range(torch.tensor([2, 3, 4, 7, 5]), torch.tensor([19, 20, 4, 0, 1]))
    assert need.tolist() == [11, 8, 2, 1, 2]


def test_prune_ranges_widen_for_long_transcripts_by_hand(caplog):
    """5 tokens in 2 frames: a window of 2 rows climbs 1 row per frame and cannot reach row 5. The batch is
    widened to (5-1)//2 + 2 = 4 rows; frame 0 starts at row 0, the last frame at U+1-S = 2."""
    T, U = 2, 5
    px, py = torch.rand(2, T, U + 1), torch.rand(2, T, U + 1)
    ll, tl = torch.tensor([2, 2]), torch.tensor([5, 1])
    with caplog.at_level("INFO", logger="asrprec.losses.pruned"):
        ranges = get_rnnt_prune_ranges(px, py, ll, tl, s_range=2)
    assert ranges[0].tolist() == [[0, 1, 2, 3], [2, 3, 4, 5]]
    assert ranges[1, :, 0].tolist() == [0, 0]  # U=1: every start is 0
    assert "a window of 2 rows cannot reach the last token of 1 utterance(s)" in caplog.text
    assert "utterance 0: 5 tokens in 2 encoder frames needs (U-1)//T+2 = 4); widening the window to 4" in caplog.text
    # with the window k2 would have kept, no alignment survives; with the widened one the loss is finite and is
    # the brute-force sum over the alignments inside the windows
    V = 5
    targets = torch.tensor([[1, 2, 3, 4, 1], [2, -1, -1, -1, -1]])
    logits = torch.randn(2, T, U + 1, V, dtype=torch.float64)
    narrow = torch.tensor([[[0, 1], [1, 2]], [[0, 1], [0, 1]]])
    inf = rnnt_loss_pruned(logits.gather(2, narrow.unsqueeze(3).expand(2, T, 2, V)), targets, narrow, ll, tl,
                           reduction="none")
    assert math.isinf(inf[0].item())
    S = ranges.shape[2]
    loss = rnnt_loss_pruned(logits.gather(2, ranges.unsqueeze(3).expand(2, T, S, V)), targets, ranges, ll, tl,
                            reduction="none")
    allowed = lambda b, t, u: t >= int(ll[b]) or u in ranges[b, t].tolist()
    ref = brute_force_loss(logits.log_softmax(-1), targets.clamp(min=0), ll, tl, allowed=allowed)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)


def test_prune_ranges_criteria_by_hand():
    """T=6, U=4, S=3. Frame 1 has blank mass 0.5 on row 0 and label mass 0.9 out of row 3; frames 2-4 blank on
    row 4. Occupancy (label + blank in the window): starts 0, 1, 2 score 0.5, 0.9, 0.9 -> 1. k2 (blank in the
    window minus label mass entering its first row): 0.5, 0 - 0, 0 - 0 -> 0. Frames 2-4 favour start 2 under
    both, frame 0 (no mass) 0, the last frame must start at U+1-S = 2; these starts already satisfy the window
    constraints (non-decreasing, steps of at most S-1)."""
    T, U = 6, 4
    px, py = torch.zeros(1, T, U + 1), torch.zeros(1, T, U + 1)
    py[0, 1, 0] = 0.5
    px[0, 1, 3] = 0.9
    py[0, 2:5, 4] = 1.0
    ll, tl = torch.tensor([T]), torch.tensor([U])
    occ = get_rnnt_prune_ranges(px, py, ll, tl, 3, criterion="occupancy")[0, :, 0].tolist()
    k2 = get_rnnt_prune_ranges(px, py, ll, tl, 3, criterion="k2")[0, :, 0].tolist()
    assert occ == [0, 1, 2, 2, 2, 2] and k2 == [0, 0, 2, 2, 2, 2]
    assert get_rnnt_prune_ranges(px, py, ll, tl, 3)[0, :, 0].tolist() == occ  # the default
    with pytest.raises(ValueError, match="criterion"):
        get_rnnt_prune_ranges(px, py, ll, tl, 3, criterion="best")


@pytest.mark.parametrize("S", [1, 2, 4, 7])
def test_window_criteria_match_formulas_in_k2_layout(S):
    """The per-frame window scores (before the constraints) against the formulas written in k2's layout
    (px (B, U, T), py (B, U+1, T)), by explicit sums over rows:
    occupancy: sum_{k<S} (px + py)[s+k]; k2: sum_{k<S} py[s+k] - px[s-1] (nothing enters row 0)."""
    from asrprec.losses.pruned import _window_starts

    B, T, U = 3, 11, 6
    g = torch.Generator().manual_seed(3)
    px, py = torch.rand(B, T, U + 1, generator=g), torch.rand(B, T, U + 1, generator=g)
    px[:, :, U] = 0  # no label out of the last row
    px_k2, py_k2 = px[:, :, :U].transpose(1, 2), py.transpose(1, 2)
    occ, k2 = [], []
    for s in range(U + 2 - S):
        rows = range(s, s + S)
        occ.append(sum(py_k2[:, r] + (px_k2[:, r] if r < U else 0) for r in rows))
        k2.append(sum(py_k2[:, r] for r in rows) - (px_k2[:, s - 1] if s > 0 else 0))
    assert torch.equal(_window_starts(px, py, S, "occupancy"), torch.stack(occ, 1).argmax(1))
    assert torch.equal(_window_starts(px, py, S, "k2"), torch.stack(k2, 1).argmax(1))


def test_prune_ranges_follow_a_sharp_alignment():
    # posteriors concentrated on the diagonal path u = t//2: each window must contain it
    B, T, U = 1, 10, 4
    py = torch.zeros(B, T, U + 1)
    px = torch.zeros(B, T, U + 1)
    for t in range(T):
        py[0, t, min(t // 2, U)] = 1.0
    ranges = get_rnnt_prune_ranges(px, py, torch.tensor([T]), torch.tensor([U]), 2)
    _check_ranges(ranges, torch.tensor([T]), torch.tensor([U]), 2)
    for t in range(T):
        assert min(t // 2, U) in ranges[0, t].tolist()


# ---------------------------------------------------------------------------------------------------- pruned


def test_do_rnnt_pruning_gathers_rows():
    B, T, U, D, S = 2, 4, 3, 5, 2
    am = torch.randn(B, T, D, requires_grad=True)
    lm = torch.randn(B, U + 1, D, requires_grad=True)
    ranges = torch.tensor([[0, 0, 1, 2], [0, 1, 1, 2]]).unsqueeze(2) + torch.arange(S)
    am_p, lm_p = do_rnnt_pruning(am, lm, ranges)
    assert am_p.shape == lm_p.shape == (B, T, S, D)
    for b in range(B):
        for t in range(T):
            for k in range(S):
                assert torch.equal(lm_p[b, t, k], lm[b, ranges[b, t, k]])
                assert torch.equal(am_p[b, t, k], am[b, t])
    (am_p + lm_p).sum().backward()
    assert torch.equal(am.grad, torch.full_like(am, S))
    assert am.grad is not None and float(lm.grad.sum()) == B * T * S * D


def test_pruned_equals_full_loss_when_window_covers_lattice():
    B, T, U, V = 3, 5, 3, 6
    g, targets, ll, tl = _ragged(B, T, U, V, seed=8)
    logits = torch.randn(B, T, U + 1, V, generator=g, dtype=torch.float64, requires_grad=True)
    px, py = torch.rand(B, T, U + 1, generator=g), torch.rand(B, T, U + 1, generator=g)
    ranges = get_rnnt_prune_ranges(px, py, ll, tl, s_range=U + 3)  # capped at U+1
    assert ranges.shape == (B, T, U + 1)
    pruned_logits = logits.gather(2, ranges.unsqueeze(3).expand(B, T, U + 1, V))
    loss = rnnt_loss_pruned(pruned_logits, targets, ranges, ll, tl, reduction="none")
    ref = brute_force_loss(logits.detach().log_softmax(-1), targets.clamp(min=0), ll, tl)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)


def test_pruned_equals_brute_force_restricted_to_windows():
    B, T, U, V, S = 3, 6, 4, 7, 2
    g = torch.Generator().manual_seed(9)
    ll, tl = torch.tensor([6, 5, 4]), torch.tensor([4, 2, 3])
    targets = torch.randint(1, V, (B, U), generator=g)
    logits = torch.randn(B, T, U + 1, V, generator=g, dtype=torch.float64)
    px, py = torch.rand(B, T, U + 1, generator=g), torch.rand(B, T, U + 1, generator=g)
    ranges = get_rnnt_prune_ranges(px, py, ll, tl, s_range=S)
    pruned_logits = logits.gather(2, ranges.unsqueeze(3).expand(B, T, S, V)).requires_grad_()
    loss = rnnt_loss_pruned(pruned_logits, targets, ranges, ll, tl, reduction="none")
    allowed = lambda b, t, u: t >= int(ll[b]) or u in ranges[b, t].tolist()
    ref = brute_force_loss(logits.log_softmax(-1), targets, ll, tl, allowed=allowed)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda x: rnnt_loss_pruned(x, targets, ranges, ll, tl), (pruned_logits,))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pruned_half_logits_promoted(dtype):
    B, T, U, V, S = 2, 5, 3, 6, 2
    g, targets, ll, tl = _ragged(B, T, U, V, seed=10)
    ranges = get_rnnt_prune_ranges(torch.rand(B, T, U + 1, generator=g), torch.rand(B, T, U + 1, generator=g),
                                   ll, tl, S)
    logits = torch.randn(B, T, S, V, generator=g).to(dtype).requires_grad_()
    loss = rnnt_loss_pruned(logits, targets, ranges, ll, tl)
    ref = rnnt_loss_pruned(logits.detach().double(), targets, ranges, ll, tl)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    loss.backward()
    assert logits.grad.dtype == dtype


def test_pruned_pipeline_end_to_end_gradients():
    """smoothed -> ranges -> pruning -> additive joiner -> pruned loss; gradients reach both inputs."""
    B, T, U, V, S = 2, 8, 4, 9, 3
    g, targets, ll, tl = _ragged(B, T, U, V, seed=11)
    am = torch.randn(B, T, V, generator=g, requires_grad=True)
    lm = torch.randn(B, U + 1, V, generator=g, requires_grad=True)
    simple, (px, py) = rnnt_loss_smoothed(lm, am, targets, ll, tl, return_grad=True)
    assert px.requires_grad is False
    ranges = get_rnnt_prune_ranges(px, py, ll, tl, S)
    _check_ranges(ranges, ll, tl, S)
    am_p, lm_p = do_rnnt_pruning(am, lm, ranges)
    pruned = rnnt_loss_pruned(am_p + lm_p, targets, ranges, ll, tl)
    # pruning can only remove alignments: the pruned loss is >= the full loss of the same logits
    full = rnnt_loss_smoothed(lm, am, targets, ll, tl, lm_only_scale=0.0)
    assert pruned.item() >= full.item() - 1e-4
    (simple + pruned).backward()
    assert torch.isfinite(am.grad).all() and am.grad.abs().sum() > 0 and lm.grad.abs().sum() > 0


def test_pruned_bad_inputs():
    logits = torch.randn(1, 3, 2, 5)
    targets = torch.tensor([[1, 2]])
    ranges = torch.zeros(1, 3, 2, dtype=torch.long) + torch.arange(2)
    with pytest.raises(ValueError, match="ranges"):
        rnnt_loss_pruned(logits, targets, ranges + 5, torch.tensor([3]), torch.tensor([2]))
    with pytest.raises(ValueError, match="blank"):
        rnnt_loss_pruned(logits, torch.tensor([[0, 2]]), ranges, torch.tensor([3]), torch.tensor([2]))
    with pytest.raises(ValueError, match="reduction"):
        rnnt_loss_pruned(logits, targets, ranges, torch.tensor([3]), torch.tensor([2]), reduction="avg")
