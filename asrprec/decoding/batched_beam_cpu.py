"""The bookkeeping half of a ``malsd_batch`` step on the CPU, compiled by numba: one call instead of some sixty small
tensor operations (each a few microseconds of dispatch on (B, K) tensors, more than the arithmetic itself).

Given each utterance's K best candidates (from one ``topk``), :func:`advance` reorders the survivors' state, appends
the emitted labels, moves the frame pointers and merges hypotheses with equal state rows, with the rules of
:mod:`asrprec.decoding.batched_beam`, whose tensor form (``static_shapes=True``, what a CUDA graph replays) is its
twin: the tests decode with both and compare.

Legend: n utterances computed, K beam, L label columns, W candidates per hypothesis (V labels, or V · D (label,
duration) pairs).
"""

from __future__ import annotations

import math

import numpy as np

_HASH_MUL = 1_000_003  # as asrprec.decoding.batched_beam
_kernels: dict = {}


def _compiled(fn):
    """``fn`` compiled by numba (once; kept by name)."""
    if fn.__name__ not in _kernels:
        from numba import njit

        _kernels[fn.__name__] = njit(cache=True, nogil=True)(fn)
    return _kernels[fn.__name__]


def advance_kernel():
    """The compiled :func:`_advance` (numba imported and the kernel compiled, or read from its cache, on first use)."""
    return _compiled(_advance)


def tdt_select_kernel():
    """The compiled :func:`_tdt_select` (its helper :func:`_insert` compiled first: the kernel calls it)."""
    global _insert
    _insert = _compiled(_insert)
    return _compiled(_tdt_select)


def _insert(vals, ids, v, i):  # pragma: no cover - compiled by numba
    """Put (v, i) into the descending list ``vals`` / ``ids`` when it beats the last entry (strictly)."""
    k = vals.shape[0] - 1
    if not v > vals[k]:
        return
    while k > 0 and v > vals[k - 1]:
        vals[k] = vals[k - 1]
        ids[k] = ids[k - 1]
        k -= 1
    vals[k] = v
    ids[k] = i


def _tdt_select(lp, lpd, e_rows, e_score, score, on_it, W, D, blank, best, choice, expand):
    # pragma: no cover - compiled by numba
    """A TDT step's candidates on the CPU (the tensor form: ``MalsdBeamSearch._tdt_candidates``): for each of the
    first n utterances, the ``E`` best (label, duration) pairs of its expanding hypotheses, then the K best of those
    and the hypotheses that wait or have finished (each proposing itself as a blank), best first.

    lp: (n, E, V) and lpd: (n, E, D) float64 log-probabilities of the expanding rows ``e_rows`` (n, E), whose scores
    are ``e_score`` (-inf: no row). score: (n, K); on_it: (n, K) bool, hypotheses on the earliest frame (they leave
    unless they expand). Writes best, choice (n, K) as a ``topk`` gives them (choice = source · W + pair), and
    expand (n, K) bool.
    """
    n, E, V = lp.shape
    K = score.shape[1]
    El, Ed = min(E, V), min(E, D)
    for b in range(n):
        new_v = np.full(E, -np.inf)
        new_c = np.zeros(E, dtype=np.int64)
        for k in range(K):
            expand[b, k] = False
        for e in range(E):
            base = e_score[b, e]
            if base == -np.inf:
                continue
            expand[b, e_rows[b, e]] = True
            lab_v = np.full(El, -np.inf)
            lab_i = np.zeros(El, dtype=np.int64)
            for v in range(V):
                _insert(lab_v, lab_i, lp[b, e, v], v)
            dur_v = np.full(Ed, -np.inf)
            dur_i = np.zeros(Ed, dtype=np.int64)
            for d in range(D):
                _insert(dur_v, dur_i, lpd[b, e, d], d)
            for i in range(El):
                for j in range(Ed):
                    _insert(new_v, new_c, base + lab_v[i] + dur_v[j], e_rows[b, e] * W + lab_i[i] * D + dur_i[j])
        for k in range(K):
            best[b, k] = -np.inf
            choice[b, k] = 0
        for e in range(E):
            _insert(best[b], choice[b], new_v[e], new_c[e])
        for k in range(K):
            if not on_it[b, k] and score[b, k] > -np.inf:
                _insert(best[b], choice[b], score[b, k], k * W + blank * D)


def _advance(best, choice, W, expand, active, ints, tokens, stamps, durs, pair_label, pair_jump, pair_dur, lens, S,
             blank, V, drop, src_out, emit_out):  # pragma: no cover - compiled by numba
    """One step's state update for the first n = ``best.shape[0]`` utterances, in place.

    best, choice: (n, K) the candidates' scores (best first) and indices into each utterance's K · W.
    expand: (n, K) bool, the hypotheses expanded this step (the others, finished or waiting for their frame, proposed
    themselves: they keep their state).
    active: (B, K) bool, before the step; updated. ints: (B, K, 6) int64 [frame, labels on it, label count, last
    label, hash, context]; updated. tokens, stamps, durs: (B, K, L) int64 (stamps / durs with L = 1: not kept).
    pair_label, pair_jump, pair_dur: (W,) each candidate's label, frame jump and duration (RNN-T: D = 1, a blank
    jumps 1, a label 0). lens: (B,). drop: V^(C-1), a context keeps its last C - 1 tokens modulo it.
    src_out, emit_out: (n, K) int64 / bool outputs: each survivor's source hypothesis, whether it took a label.
    The scores of merged-away or empty hypotheses become -inf (``best`` is rewritten: the new scores).
    Returns the number of utterances up to the last one with an active hypothesis.
    """
    n, K = best.shape
    L, F = tokens.shape[2], ints.shape[2]
    keep_times, keep_durs = stamps.shape[2] > 1, durs.shape[2] > 1
    old = ints[:n].copy()
    old_tokens = tokens[:n].copy()
    old_stamps = stamps[:n].copy()
    old_durs = durs[:n].copy()
    live = 0
    for b in range(n):
        T = lens[b]
        for k in range(K):
            c = choice[b, k]
            j = c // W
            p = c - j * W
            label = pair_label[p]
            alive = best[b, k] > -np.inf
            moving = expand[b, j] and alive
            emit = label != blank and moving
            t, sym, length, last, h, ctx = old[b, j, 0], old[b, j, 1], old[b, j, 2], old[b, j, 3], old[b, j, 4], \
                old[b, j, 5]
            for i in range(length):
                tokens[b, k, i] = old_tokens[b, j, i]
            if keep_times:
                for i in range(length):
                    stamps[b, k, i] = old_stamps[b, j, i]
            if keep_durs:
                for i in range(length):
                    durs[b, k, i] = old_durs[b, j, i]
            jump = pair_jump[p] if moving else 0
            if emit:
                pos = min(length, L - 1)
                tokens[b, k, pos] = label
                if keep_times:
                    stamps[b, k, pos] = t
                if keep_durs:
                    durs[b, k, pos] = pair_dur[p]
                h = h * _HASH_MUL + label + 1
                last = label
                length += 1
                ctx = ctx % drop * V + label
            sym = sym + 1 if emit and jump == 0 else 0
            if sym >= S:  # the S-th label on a frame moves one frame on
                jump += 1
                sym = 0
            t = min(t + jump, T)
            if t >= T:
                sym = 0
            ints[b, k, 0] = t
            ints[b, k, 1] = sym
            ints[b, k, 2] = length
            ints[b, k, 3] = last
            ints[b, k, 4] = h
            ints[b, k, 5] = ctx
            src_out[b, k] = j
            emit_out[b, k] = emit
        # merge equal rows: the first (best) of each group takes the log-sum of the group's scores
        for k in range(K):
            if best[b, k] == -np.inf:
                continue
            leader = True
            total = 0.0
            for j in range(K):
                if best[b, j] == -np.inf:
                    continue
                same = True
                for f in range(F):
                    if ints[b, j, f] != ints[b, k, f]:
                        same = False
                        break
                if same and j < k:  # an earlier (better) hypothesis of the group leads it
                    leader = False
                    break
                if same:
                    total += math.exp(best[b, j] - best[b, k])
            best[b, k] = best[b, k] + math.log(total) if leader else -np.inf
        for k in range(K):
            a = ints[b, k, 0] < T and best[b, k] > -np.inf
            active[b, k] = a
            if a:
                live = b + 1
    return live

