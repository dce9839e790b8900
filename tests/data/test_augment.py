"""Noise at an SNR, synthetic reverberation and the fbank-domain augmentations, checked against their definitions
and against lhotse's fbank of the signal they imitate."""

import numpy as np
import pytest

from asrprec.data.augment import add_noise, make_noise, reverberate, synthetic_rir


@pytest.mark.parametrize("snr_db", [0.0, 10.0, 25.0])
@pytest.mark.parametrize("color", ["white", "pink"])
def test_add_noise_hits_the_snr(snr_db, color):
    rng = np.random.default_rng(0)
    x = np.sin(2 * np.pi * 300 * np.arange(16000) / 16000)
    y = add_noise(x, snr_db, rng, color=color)
    measured = 10 * np.log10(np.mean(x**2) / np.mean((y - x) ** 2))
    assert abs(measured - snr_db) < 1e-6


def test_pink_noise_has_falling_spectrum():
    n = make_noise(1 << 16, np.random.default_rng(0), color="pink")
    p = np.abs(np.fft.rfft(n)) ** 2
    low, high = p[10:100].mean(), p[10000:20000].mean()
    assert low > 50 * high  # 1/f: ~ (15000 / 55) = 270x
    with pytest.raises(ValueError, match="color"):
        make_noise(10, np.random.default_rng(0), color="blue")


def test_rir_decays_by_60_db_over_rt60():
    rt60 = 0.4
    h = synthetic_rir(rt60, 16000, np.random.default_rng(0), direct_to_reverb_db=3.0)
    assert len(h) == round(rt60 * 16000) and h[0] == 1.0
    tail = h[1:]
    assert abs(10 * np.log10(1.0 / np.sum(tail**2)) - 3.0) < 1e-9
    # envelope: energy over a 20 ms window near the start vs near 0.3 s falls by 60 dB * 0.3 / 0.4 = 45 dB
    w = 320
    e0 = np.mean(h[1 : 1 + w] ** 2)
    e1 = np.mean(h[int(0.3 * 16000) : int(0.3 * 16000) + w] ** 2)
    assert 35 < 10 * np.log10(e0 / e1) < 55


def test_reverberate_keeps_length_and_power():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(8000)
    y = reverberate(x, synthetic_rir(0.3, 16000, rng))
    assert y.shape == x.shape and abs(np.mean(y**2) / np.mean(x**2) - 1) < 1e-9
    impulse = np.zeros(100)
    impulse[0] = 1.0
    h = np.array([1.0, 0.5, 0.25])
    out = reverberate(impulse, h)
    np.testing.assert_allclose(out[:3] / out[0], h, atol=1e-12)  # convolution with a delta gives the RIR


def test_change_tempo_resamples_frames_linearly():
    import torch

    from asrprec.data.augment import change_tempo

    # a frame index ramp: linear interpolation must give the ramp sampled at the new times, by hand
    x = torch.arange(10.0)[:, None].repeat(1, 3)  # (T=10, F=3)
    faster = change_tempo(x, 2.0)  # 5 frames at input times 0, 9/4, 9/2, 27/4, 9
    assert faster.shape == (5, 3) and torch.allclose(faster[:, 1], torch.tensor([0.0, 2.25, 4.5, 6.75, 9.0]))
    assert change_tempo(x, 0.5).shape == (20, 3) and change_tempo(x, 1.0) is x
    spectra = torch.randn(1, 80).repeat(50, 1)  # a steady spectrum stays that spectrum, only shorter
    assert torch.allclose(change_tempo(spectra, 1.3), spectra[: round(50 / 1.3)], atol=1e-6)
    with pytest.raises(ValueError, match="factor"):
        change_tempo(x, 0.0)


def test_tempo_factor_is_uniform_and_keeps_frames_for_every_token():
    import random

    from asrprec.data.augment import MIN_FRAMES_PER_TOKEN, tempo_factor

    rng = random.Random(0)
    draws = [tempo_factor(rng, 0.9, 1.6, 1000, 3) for _ in range(4000)]
    assert 0.9 <= min(draws) < 0.92 and 1.58 < max(draws) <= 1.6 and abs(np.mean(draws) - 1.25) < 0.02
    capped = [tempo_factor(rng, 1.0, 1.8, 60, 5) for _ in range(200)]  # cap 60 / (6 x 5) = 2: never binds
    assert max(capped) > 1.75
    capped = [tempo_factor(rng, 1.0, 1.8, 45, 5) for _ in range(200)]  # cap 45 / (6 x 5) = 1.5
    assert max(capped) == pytest.approx(45 / (MIN_FRAMES_PER_TOKEN * 5)) and min(capped) >= 1.0
    assert tempo_factor(rng, 1.5, 1.6, 40, 10) == 1.0  # already too short (40 < 6 x 10): left as it is


@pytest.mark.parametrize("alpha", [0.88, 0.93, 1.07, 1.12])
def test_warp_frequency_matches_the_fbank_of_tones_moved_by_alpha(alpha):
    import torch

    from asrprec.data.augment import warp_frequency
    from asrprec.data.features import fbank_extractor

    # lhotse's fbank of tones at alpha x f is the independent reference for the warped fbank of the tones at f
    extractor, t = fbank_extractor(), np.arange(16000) / 16000

    def fbank(freqs):
        x = 0.1 * sum(np.sin(2 * np.pi * f * t) for f in freqs)
        return torch.from_numpy(extractor.extract(x.astype(np.float32), 16000)).mean(dim=0)

    for freqs in ([300.0], [700.0], [1500.0], [3000.0], [5000.0], [500.0, 1500.0, 2500.0]):
        warped = warp_frequency(fbank(freqs)[None, :], alpha)[0]
        reference = fbank([alpha * f for f in freqs])
        unwarped = fbank(freqs)
        assert abs(int(warped.argmax()) - int(reference.argmax())) <= 1, freqs  # a tone between two bins
        corr = float(torch.corrcoef(torch.stack([warped, reference]))[0, 1])
        assert corr > 0.97 and corr > float(torch.corrcoef(torch.stack([unwarped, reference]))[0, 1]), freqs
    x = torch.randn(7, 80)
    assert warp_frequency(x, 1.0) is x
    # on a ramp of bin indices: a monotone map of the band onto itself (the piecewise-linear warp keeps its top)
    ramp = warp_frequency(torch.arange(80.0)[None, :], alpha)[0]
    assert torch.all(ramp[1:] >= ramp[:-1]) and ramp[-1] > 78.0 and (ramp[40] - 40) * (1 - alpha) > 0
    with pytest.raises(ValueError, match="alpha"):
        warp_frequency(x, 0.0)


def test_batch_tempo_per_batch_draws_one_factor_and_caps_dense_rows():
    import random

    import torch

    from asrprec.data.augment import MIN_FRAMES_PER_TOKEN, change_batch_tempo

    lens = torch.tensor([300, 240, 200, 120])
    x = torch.randn(4, 300, 5)
    texts = ["a b", "a b c", "a", " ".join(["w"] * 15)]  # the last: 120 frames / (6 x 15) = 1.33 at most
    for seed in range(20):
        random.seed(seed)
        out, out_lens = change_batch_tempo(x, lens, texts, (1.4, 1.8), per_batch=True)
        factors = [n / m for n, m in zip(lens.tolist()[:3], out_lens.tolist()[:3])]
        assert max(factors) - min(factors) < 0.02 and 1.39 < factors[0] < 1.81  # one factor, up to rounding
        assert out_lens[3] == round(120 / (120 / (MIN_FRAMES_PER_TOKEN * 15)))  # capped at 1.33: 90 frames
        assert out.shape[1] == int(out_lens.max()) and torch.all(out[3, int(out_lens[3]):] == 0)
    random.seed(0)
    _, own = change_batch_tempo(x, lens, texts[:3] + ["a"], (1.4, 1.8))  # per row: the factors differ
    assert max(n / m for n, m in zip(lens.tolist(), own.tolist())) - min(n / m for n, m in zip(lens.tolist(),
                                                                                              own.tolist())) > 0.02


def test_batch_tempo_fast_share_reaches_its_target_rates():
    import random

    import torch

    from asrprec.data.augment import change_batch_tempo

    # 400 rows of 2 s; 4, 6 or 9 words: 120, 180 or 270 words per minute
    n_rows = 400
    lens = torch.full((n_rows,), 200)
    texts = [" ".join(["w"] * (4 + (i % 3) * 2 + (i % 3 == 2))) for i in range(n_rows)]
    x = torch.randn(n_rows, 200, 3)
    random.seed(0)
    _, out_lens = change_batch_tempo(x, lens, texts, (1.0, 1.0), fast=(0.3, 300.0, 500.0))
    wpm = torch.tensor([60.0 * len(t.split()) / (n * 0.01) for t, n in zip(texts, out_lens.tolist())])
    own = torch.tensor([60.0 * len(t.split()) / 2.0 for t in texts])
    moved = out_lens != 200
    # the rows not drawn keep tempo_range's factor (1 here); the drawn ones land in [300, 500] wpm, up to a frame
    assert torch.all(wpm[~moved] == own[~moved])
    assert torch.all((wpm[moved] > 300 * 0.99) & (wpm[moved] < 500 * 1.01))
    share = float(moved.float().mean())  # binomial(400, 0.3): sd 0.023
    assert abs(share - 0.3) < 0.08
    # uniform in rate: the drawn rates' mean is the range's middle (sd of the mean ~ 58 / sqrt(120) = 5 wpm)
    assert abs(float(wpm[moved].mean()) - 400.0) < 20.0
    # a target slower than the utterance slows it down; the token floor still caps a speed-up
    random.seed(1)
    _, slow = change_batch_tempo(x[:2], lens[:2], ["w " * 12, "w"], None, fast=(1.0, 60.0, 60.0))
    assert slow.tolist() == [1200, 100]  # 12 words at 60 wpm: 12 s; 1 word: 1 s (a factor of 2 from 2 s)
    random.seed(2)
    _, capped = change_batch_tempo(x[:1], lens[:1], [" ".join(["w"] * 25)], None, fast=(1.0, 3000.0, 3000.0))
    assert capped.tolist() == [150]  # 25 tokens: sped up 200 / (6 x 25) = 1.33x at most, not 3000 / 750 = 4x
    with pytest.raises(ValueError, match="per_batch"):
        change_batch_tempo(x, lens, texts, (1.0, 1.2), per_batch=True, fast=(0.5, 300.0, 400.0))


def test_tempo_fast_option_is_checked():
    from asrprec.data import DataConfig

    assert DataConfig(tempo_fast=[0.25, 300, 500]).tempo_fast == (0.25, 300, 500)
    for bad in [(1.5, 300, 500), (0.5, 500, 300), (0.5, 0, 300), (0.5, 300)]:
        with pytest.raises(ValueError, match="tempo_fast"):
            DataConfig(tempo_fast=bad)
    with pytest.raises(ValueError, match="tempo_per_batch"):
        DataConfig(tempo_fast=(0.5, 300, 500), tempo_per_batch=True)


def test_pause_frames_follow_the_noise_level_in_log_power():
    import math

    from asrprec.data.augment import pause_frames
    from asrprec.data.features import fbank_extractor

    extractor, rng = fbank_extractor(), np.random.default_rng(0)
    # above -60 dBFS: fainter noise meets the extractor's floor (log 1e-10) in the low bins, after pre-emphasis
    quiet, loud = pause_frames(0.5, -50.0, extractor, rng), pause_frames(0.5, -20.0, extractor, rng)
    assert quiet.shape == loud.shape == (50, 80)  # a frame every 10 ms (lhotse's Fbank does not snip the edges)
    # 30 dB more amplitude is 30 / 10 * ln(10) = 6.91 more log mel power in every bin (white noise: flat); one
    # bin's mean over 50 frames of a few FFT points' power scatters, the mean over all bins much less
    shift = (loud.mean(0) - quiet.mean(0)).numpy()
    assert abs(shift.mean() - 3 * math.log(10)) < 0.1 and np.allclose(shift, 3 * math.log(10), atol=1.0)
    assert pause_frames(0.001, -60.0, extractor, rng).shape[0] >= 1  # never empty: at least one 25 ms window


def _joined_rows(prob, max_utterances=3, seed=0, n=9):
    import random

    import torch

    from asrprec.data.augment import UtteranceJoiner

    # row i is frames of the constant i + 1 (positive; pauses are log powers of faint noise, all negative)
    lens = torch.tensor([5 + 3 * i for i in range(n)])
    x = torch.zeros(n, int(lens.max()), 4)
    for i, m in enumerate(lens.tolist()):
        x[i, :m] = i + 1
    random.seed(seed)
    joiner = UtteranceJoiner(prob, max_utterances, (0.2, 0.4), (-60.0, -50.0), num_mel_bins=4)
    texts = [f"w{i}" for i in range(n)]
    return lens, joiner(x, lens, texts, [str(i) for i in range(n)])


@pytest.mark.parametrize("seed", range(5))
def test_joined_examples_hold_their_utterances_in_order_with_pauses(seed):
    lens, (y, y_lens, texts, ids) = _joined_rows(prob=0.7, seed=seed)
    seen = []
    for row, (m, text, ident) in enumerate(zip(y_lens.tolist(), texts, ids)):
        assert (y[row, m:] == 0).all()  # zero padding after the row's frames
        frames = y[row, :m, 0].tolist()
        # read the row back: runs of a positive constant are utterances, negative runs are pauses
        runs, k = [], 0
        while k < m:
            j = k
            while j < m and (frames[j] > 0) == (frames[k] > 0) and (frames[k] < 0 or frames[j] == frames[k]):
                j += 1
            runs.append((frames[k], j - k))
            k = j
        utts = [(int(v) - 1, r) for v, r in runs if v > 0]
        pauses = [r for v, r in runs if v < 0]
        assert [u for u, _ in utts] == [int(i) for i in ident.split("+")]
        assert text == " ".join(f"w{u}" for u, _ in utts)
        assert all(r == int(lens[u]) for u, r in utts)  # every frame of each utterance, none lost
        assert len(pauses) == len(utts) - 1 and all(20 <= r <= 40 for r in pauses)  # 0.2-0.4 s of 10 ms frames
        assert len(utts) <= 3
        seen += [u for u, _ in utts]
    assert sorted(seen) == list(range(len(lens)))  # each utterance exactly once


def test_joining_nothing_or_everything():
    lens, (y, y_lens, texts, ids) = _joined_rows(prob=0.0)
    assert ids == [str(i) for i in range(9)] and y_lens.tolist() == lens.tolist()
    lens, (_, _, texts, ids) = _joined_rows(prob=1.0, max_utterances=2)
    assert sum("+" in i for i in ids) == 4 and len(ids) == 5  # four pairs and the odd one out


def test_utterance_tempo_is_one_draw_per_cut_and_epoch_within_the_range_and_cap():
    from asrprec.data.augment import MIN_FRAMES_PER_TOKEN, utterance_tempo

    draws = {(e, i): utterance_tempo(7, e, f"cut-{i}", 1000, "a b c", (0.9, 1.8)) for e in (1, 2) for i in range(2000)}
    assert all(0.9 <= f <= 1.8 for f in draws.values())
    first = [draws[1, i] for i in range(2000)]
    assert abs(np.mean(first) - 1.35) < 0.02 and np.std(first) == pytest.approx(0.9 / 12 ** 0.5, rel=0.05)
    # the same cut and epoch: the same factor, in any order of asking; another epoch or seed: a new draw
    assert utterance_tempo(7, 1, "cut-5", 1000, "a b c", (0.9, 1.8)) == draws[1, 5]
    assert sum(draws[1, i] != draws[2, i] for i in range(2000)) == 2000
    assert utterance_tempo(8, 1, "cut-5", 1000, "a b c", (0.9, 1.8)) != draws[1, 5]
    # capped as tempo_factor is: 45 frames of 5 words keep 6 frames a word (<= 1.5x)
    capped = [utterance_tempo(0, 1, f"c{i}", 45, "w w w w w", (1.0, 1.8)) for i in range(300)]
    assert max(capped) == pytest.approx(45 / (MIN_FRAMES_PER_TOKEN * 5)) and min(capped) >= 1.0
    # a target rate: 20 words in 4 s (300 wpm) brought to 600 wpm is twice as fast
    assert utterance_tempo(0, 1, "c", 400, " ".join(["w"] * 20), None, lambda t: 1,
                           fast=(1.0, 600.0, 600.0)) == pytest.approx(2.0)


def test_change_batch_tempo_applies_given_factors():
    import torch

    from asrprec.data.augment import change_batch_tempo

    x = torch.randn(3, 40, 4)
    out, lens = change_batch_tempo(x, torch.tensor([40, 30, 9]), ["a", "b", "c"], None, factors=[2.0, 1.0, 0.5])
    assert lens.tolist() == [20, 30, 18] and out.shape == (3, 30, 4)
    assert torch.equal(out[1, :30], x[1, :30]) and torch.all(out[0, 20:] == 0)
    with pytest.raises(ValueError, match="2 entries for a batch of 3"):
        change_batch_tempo(x, torch.tensor([40, 30, 9]), ["a", "b", "c"], None, factors=[2.0, 1.0])
