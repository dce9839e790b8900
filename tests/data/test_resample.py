"""Resampling (scipy's polyphase filter) against closed-form sines, a textbook brute force and torchaudio."""

import numpy as np
import pytest

from asrprec._optional import is_available
from asrprec.data.resample import resample_poly


def _sine(freq, sr, seconds=1.0, phase=0.3):
    t = np.arange(int(round(sr * seconds))) / sr
    return np.sin(2 * np.pi * freq * t + phase)


@pytest.mark.parametrize("freq", [100.0, 1000.0, 4321.0, 6500.0])
def test_sine_matches_closed_form_at_new_rate(freq):
    y = resample_poly(_sine(freq, 22050), 22050, 16000)
    assert len(y) == int(np.ceil(22050 * 16000 / 22050))
    expected = _sine(freq, 16000)[: len(y)]
    inner = slice(400, -400)  # away from the zero-padded edges
    assert np.max(np.abs(y[inner] - expected[inner])) < 5e-3
    spectrum = np.abs(np.fft.rfft(y * np.hanning(len(y))))
    assert abs(np.argmax(spectrum) * 16000 / len(y) - freq) <= 1.0


def test_sweep_matches_the_closed_form_in_the_pass_band():
    # A linear chirp 50 Hz -> 7 kHz over 3 s, evaluated in closed form at the 16 kHz sample times: below 6 kHz
    # (where the low-pass passes everything) the resampled signal equals it to 2e-3.
    def chirp(t):
        return np.sin(2 * np.pi * (50.0 * t + 0.5 * (6950.0 / 3.0) * t * t) + 0.3)

    y = resample_poly(chirp(np.arange(3 * 22050) / 22050), 22050, 16000)
    t = np.arange(len(y)) / 16000
    freq = 50.0 + 6950.0 / 3.0 * t
    inside = (np.arange(len(y)) >= 400) & (freq <= 6000.0)
    assert np.max(np.abs(y - chirp(t))[inside]) < 2.5e-3


def test_aliasing_is_suppressed():
    # 10 kHz is above the 8 kHz Nyquist of the output: the low-pass must remove it (> 40 dB).
    y = resample_poly(_sine(10000.0, 22050), 22050, 16000)
    assert np.sqrt(np.mean(y[400:-400] ** 2)) < 0.01 * np.sqrt(0.5)


def test_upsampling_and_identity():
    x = _sine(440.0, 16000)
    y = resample_poly(x, 16000, 22050)
    assert len(y) == 22050
    expected = _sine(440.0, 22050)
    assert np.max(np.abs(y[400:-400] - expected[400:-400])) < 5e-3
    z = resample_poly(x, 16000, 16000)
    assert np.array_equal(z, x) and z is not x


def test_bad_input():
    with pytest.raises(ValueError, match="1-D"):
        resample_poly(np.zeros((2, 10)), 22050, 16000)
    with pytest.raises(ValueError, match="positive"):
        resample_poly(np.zeros(10), 0, 16000)


@pytest.mark.skipif(not is_available("torchaudio"), reason="torchaudio not installed")
def test_agrees_with_torchaudio_on_band_limited_signal():
    import torch
    import torchaudio.functional as F

    rng = np.random.default_rng(0)
    t = np.arange(22050) / 22050
    x = sum(rng.uniform(0.1, 0.5) * np.sin(2 * np.pi * f * t + rng.uniform(0, 6)) for f in rng.uniform(50, 6000, 12))
    ours = resample_poly(x, 22050, 16000)
    theirs = F.resample(torch.tensor(x), 22050, 16000, lowpass_filter_width=64, rolloff=0.99).numpy()
    n = min(len(ours), len(theirs))
    err = ours[300 : n - 300] - theirs[300 : n - 300]
    assert np.sqrt(np.mean(err**2)) < 5e-3 * np.sqrt(np.mean(x**2))


@pytest.mark.parametrize("orig_sr,new_sr,n", [(22050, 16000, 157), (16000, 24000, 301), (24000, 16000, 300), (16000, 22050, 64)])
def test_matches_the_documented_filter_by_brute_force(orig_sr, new_sr, n):
    # Textbook definition: zero-stuff by `up`, convolve with the centred Kaiser-windowed sinc, keep every `down`-th.
    from math import gcd

    g = gcd(orig_sr, new_sr)
    up, down = new_sr // g, orig_sr // g
    half_len = 10 * max(up, down)
    m = np.arange(-half_len, half_len + 1)
    h = np.sinc(m / max(up, down)) * np.kaiser(2 * half_len + 1, 5.0)
    h *= up / h.sum()
    x = np.random.default_rng(n).standard_normal(n)
    stuffed = np.zeros(n * up)
    stuffed[::up] = x
    full = np.convolve(stuffed, h)[half_len:]  # centre the filter: output i sees input time i
    expected = full[::down][: -(-n * up // down)]
    np.testing.assert_allclose(resample_poly(x, orig_sr, new_sr), expected, atol=1e-12)
