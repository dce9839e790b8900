"""Polyphase resampling in numpy (espeak speaks at 22,050 Hz; the corpus is 16 kHz).

A rational-ratio resampler ``up / down`` with a Kaiser-windowed sinc low-pass, the same design as
scipy's ``signal.resample_poly`` (scipy/scipy ``scipy/signal/_signaltools.py``: cutoff at
``1 / max(up, down)`` of the upsampled Nyquist, ``half_len = 10 * max(up, down)``, Kaiser β = 5,
gain ``up``, delay compensated so that output sample ``m`` sits at input time ``m * down / up``).
It is written here so that neither scipy nor torchaudio is a dependency. Only the needed output
samples are computed: output ``n = q * up + r`` is the dot product of the filter's phase ``r``
(``K ≈ 2 * half_len / up`` taps) with ``K`` consecutive input samples starting at
``q * down + first[r]`` — one gather from a strided window view and one einsum (~2 ms for 3 s of audio).
"""

from __future__ import annotations

from functools import lru_cache
from math import gcd

import numpy as np


@lru_cache(maxsize=8)
def _design(up: int, down: int, half_width: int, beta: float) -> tuple[np.ndarray, np.ndarray]:
    """The low-pass filter split into its ``up`` phases.

    Returns ``taps`` (up, K): row ``r`` holds the filter taps of output phase ``r`` (output sample
    ``n = q * up + r``) in the order of consecutive input samples, and ``first`` (up,): the input
    index of tap 0 for ``q = 0`` (input index for general ``q``: ``q * down + first[r]``).
    """
    max_rate = max(up, down)
    half_len = half_width * max_rate
    n = np.arange(-half_len, half_len + 1, dtype=np.float64)
    cutoff = 1.0 / max_rate  # as a fraction of the upsampled signal's Nyquist frequency
    h = cutoff * np.sinc(cutoff * n) * np.kaiser(2 * half_len + 1, beta)
    h *= up / h.sum()  # unit DC gain after zero-stuffing by `up`
    # y[n] = sum_j x[j] * h[n*down - j*up + half_len] over the j with the tap index inside the filter
    k = -(-(2 * half_len + 1) // up) + 1
    i = np.arange(up, dtype=np.int64) * down
    first = -((half_len - i) // up)  # ceil((i - half_len) / up)
    tap = i[:, None] - (first[:, None] + np.arange(k)[None, :]) * up + half_len
    taps = np.where((tap >= 0) & (tap <= 2 * half_len), h[np.clip(tap, 0, 2 * half_len)], 0.0)
    return taps, first


def resample_poly(x: np.ndarray, orig_sr: int, new_sr: int, *, half_width: int = 10, beta: float = 5.0) -> np.ndarray:
    """Resample a 1-D signal from ``orig_sr`` to ``new_sr`` Hz.

    ``x``: (N,) float array. Returns (ceil(N * new_sr / orig_sr),) float64.
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"resample_poly expects a 1-D signal, got shape {x.shape}; resample each channel separately")
    if orig_sr <= 0 or new_sr <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_sr} -> {new_sr}")
    g = gcd(int(orig_sr), int(new_sr))
    up, down = int(new_sr) // g, int(orig_sr) // g
    if up == down:
        return x.copy()
    taps, first = _design(up, down, half_width, float(beta))
    k = taps.shape[1]
    n_out = -(-len(x) * up // down)
    periods = -(-n_out // up)
    left = int(max(0, -first.min()))
    right = int(max(0, (periods - 1) * down + first.max() + k - len(x)))
    xp = np.concatenate([np.zeros(left), x, np.zeros(right)])  # zeros outside the signal
    windows = np.lib.stride_tricks.sliding_window_view(xp, k)  # (len(xp) - k + 1, K), no copy
    start = np.arange(periods)[:, None] * down + first[None, :] + left  # (periods, up)
    y = np.einsum("qrk,rk->qr", windows[start], taps)  # one gather of the windows, then a dot per phase
    return y.reshape(-1)[:n_out]
