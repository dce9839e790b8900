"""Rational-ratio resampling of a 1-D signal (espeak speaks at 22,050 Hz; the corpus is 16 kHz).

``scipy.signal.resample_poly`` does the work (scipy/scipy ``scipy/signal/_signaltools.py``): a Kaiser-windowed
(β = 5) sinc low-pass with its cutoff at the lower Nyquist frequency and ``10 * max(up, down)`` taps on each side,
applied polyphase, delay compensated so that output sample ``m`` sits at input time ``m * down / up``. scipy is
imported lazily (the ``synth`` extra), so only corpus synthesis needs it.
"""

from __future__ import annotations

from math import gcd

import numpy as np

from asrprec._optional import require


def resample_poly(x: np.ndarray, orig_sr: int, new_sr: int) -> np.ndarray:
    """Resample a 1-D signal from ``orig_sr`` to ``new_sr`` Hz.

    ``x``: (N,) float array. Returns (ceil(N * new_sr / orig_sr),) float64 (a copy of ``x`` for equal rates).
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
    return require("scipy.signal").resample_poly(x, up, down)
