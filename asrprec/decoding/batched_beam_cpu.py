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
_kernel = None


def advance_kernel():
    """The compiled :func:`_advance` (numba imported and the kernel compiled, or read from its cache, on first use)."""
    global _kernel
    if _kernel is None:
        from numba import njit

        _kernel = njit(cache=True, nogil=True)(_advance)
    return _kernel


def _advance(best, choice, W, active, ints, tokens, stamps, durs, pair_label, pair_jump, pair_dur, lens, S, blank,
             V, drop, src_out, emit_out):  # pragma: no cover - compiled by numba
    """One step's state update for the first n = ``best.shape[0]`` utterances, in place.

    best, choice: (n, K) the candidates' scores (best first) and indices into each utterance's K · W.
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
    was_active = active[:n].copy()
    live = 0
    for b in range(n):
        T = lens[b]
        for k in range(K):
            c = choice[b, k]
            j = c // W
            p = c - j * W
            label = pair_label[p]
            alive = best[b, k] > -np.inf
            emit = label != blank and was_active[b, j] and alive
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
            jump = pair_jump[p]
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

