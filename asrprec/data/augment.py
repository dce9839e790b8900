"""Waveform augmentation for the synthetic corpus: additive noise at an SNR and simple reverberation; and, for
training, tempo and vocal-tract length perturbation of fbank frames, examples joined from several utterances with
pauses between them, and noise mixing of cuts.

The waveform functions are plain numpy on 1-D float signals, every random choice drawn from a caller-supplied
``numpy.random.Generator`` so a corpus stays deterministic for its seed. :func:`change_tempo`,
:func:`warp_frequency` and :class:`UtteranceJoiner` work on torch tensors of fbank frames,
:func:`noise_mix_transform` on lhotse cuts (lhotse's ``CutMix``); torch and lhotse are imported there only: the
corpus' synthesis workers import numpy alone. SpecAugment
lives in :mod:`asrprec.data.datamodule` and uses lhotse's.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Sequence

import numpy as np

from asrprec.data.frames import FRAME_SHIFT_S


def frequency_mask_width(num_bins: int, size: int | None = None) -> int:
    """The widest SpecAugment frequency mask for ``num_bins``-bin features: ``size`` when given, else icefall's 27
    bins of 80 scaled to the width (13 of 40), so that narrower features do not lose a larger share of their
    spectrum."""
    if size is not None:
        if size < 1:
            raise ValueError(f"features_mask_size must be >= 1 (or None: 27 of every 80 bins), got {size}")
        return int(size)
    return max(1, 27 * int(num_bins) // 80)


def _power(x: np.ndarray) -> float:
    return float(np.mean(np.square(x, dtype=np.float64)))


def make_noise(num_samples: int, rng: np.random.Generator, *, color: str = "white") -> np.ndarray:
    """Gaussian noise of unit power: ``color`` "white" (flat) or "pink" (power ∝ 1/f, shaped in the FFT domain)."""
    white = rng.standard_normal(num_samples)
    if color == "white":
        return white
    if color != "pink":
        raise ValueError(f"noise color must be 'white' or 'pink', got {color!r}")
    spec = np.fft.rfft(white)
    f = np.arange(len(spec), dtype=np.float64)
    f[0] = 1.0
    pink = np.fft.irfft(spec / np.sqrt(f), n=num_samples)
    return pink / np.sqrt(max(_power(pink), 1e-20))


def add_noise(x: np.ndarray, snr_db: float, rng: np.random.Generator, *, color: str = "white") -> np.ndarray:
    """Return ``x + n`` with ``10 log10(P(x) / P(n)) == snr_db`` (powers are means over the whole signal).

    ``x``: (N,) float. Returns (N,) float64.
    """
    x = np.asarray(x, dtype=np.float64)
    px = _power(x)
    if px == 0.0:
        return x.copy()
    noise = make_noise(len(x), rng, color=color)
    noise *= np.sqrt(px / (_power(noise) * 10.0 ** (snr_db / 10.0)))
    return x + noise


def synthetic_rir(rt60_s: float, sample_rate: int, rng: np.random.Generator, *, direct_to_reverb_db: float = 0.0) -> np.ndarray:
    """An exponentially decaying Gaussian-noise room impulse response with a direct-path spike.

    The tail's amplitude falls by 60 dB over ``rt60_s`` seconds (envelope ``exp(-6.9 t / rt60)``) and is
    ``rt60_s`` long; its energy relative to the direct path is set by ``direct_to_reverb_db``.
    Returns (L,) float64 with ``L = max(1, round(rt60_s * sample_rate))`` and ``rir[0] == 1``.
    """
    if rt60_s <= 0:
        raise ValueError(f"rt60_s must be > 0, got {rt60_s}")
    n = max(1, int(round(rt60_s * sample_rate)))
    t = np.arange(n) / sample_rate
    tail = rng.standard_normal(n) * np.exp(-6.9 * t / rt60_s)
    tail[0] = 0.0
    energy = float(np.sum(tail**2))
    if energy > 0:
        tail *= np.sqrt(10.0 ** (-direct_to_reverb_db / 10.0) / energy)
    tail[0] = 1.0
    return tail


def reverberate(x: np.ndarray, rir: np.ndarray) -> np.ndarray:
    """Convolve ``x`` with ``rir`` (FFT), keep the first ``len(x)`` samples and restore the dry signal's power.

    ``x``: (N,) float, ``rir``: (L,) float. Returns (N,) float64.
    """
    x = np.asarray(x, dtype=np.float64)
    n = len(x) + len(rir) - 1
    nfft = 1 << (n - 1).bit_length()
    y = np.fft.irfft(np.fft.rfft(x, nfft) * np.fft.rfft(rir, nfft), nfft)[: len(x)]
    py = _power(y)
    return y * np.sqrt(_power(x) / py) if py > 0 else y


#: the fewest fbank frames (10 ms) per token (or per word, when tokens are not counted) :func:`tempo_factor`
#: leaves: 60 ms, one and a half 40 ms encoder frames: room for a CTC head's blanks between repeated tokens
MIN_FRAMES_PER_TOKEN = 6


def change_tempo(features: Any, factor: float) -> Any:
    """Speech ``factor`` times faster, in the fbank domain: (T, F) frames -> (max(1, round(T / factor)), F).

    Each output frame is the linear interpolation of the input frames at its time (first and last frames kept):
    the frames keep their spectra, so pitch and formants stay, as with sox's ``tempo`` effect (WSOLA) on the
    audio; only their number changes. ``factor`` > 1 is faster, < 1 slower; 1 returns ``features`` unchanged.
    """
    import torch

    if factor <= 0:
        raise ValueError(f"factor must be > 0, got {factor}")
    n = features.shape[0]
    m = max(1, round(n / factor))
    if m == n:
        return features
    x = features.t().unsqueeze(0).float()  # (1, F, T)
    out = torch.nn.functional.interpolate(x, size=m, mode="linear", align_corners=True)
    return out[0].t().to(features.dtype)


def tempo_factor(rng: Any, low: float, high: float, num_frames: int, num_tokens: int) -> float:
    """A factor drawn uniformly from [``low``, ``high``] (``rng``: Python's ``random`` module or a
    ``random.Random``), lowered if needed (never below 1) so that at least :data:`MIN_FRAMES_PER_TOKEN` frames per
    token of the transcript remain: a CTC head needs a frame per token and one between repeats."""
    return cap_tempo(rng.uniform(low, high), num_frames, num_tokens)


def cap_tempo(factor: float, num_frames: int, num_tokens: int) -> float:
    """``factor`` lowered if needed (never below 1) to leave :data:`MIN_FRAMES_PER_TOKEN` frames per token."""
    if factor > 1.0:
        factor = min(factor, max(1.0, num_frames / (MIN_FRAMES_PER_TOKEN * max(1, num_tokens))))
    return factor


def rate_tempo_factor(rng: Any, low_wpm: float, high_wpm: float, num_frames: int, num_words: int) -> float:
    """The factor that brings an utterance of ``num_words`` words in ``num_frames`` fbank frames (10 ms) to a rate
    drawn uniformly from [``low_wpm``, ``high_wpm``] words per minute (pauses included, as the utterance's own rate
    is measured): > 1 speeds it up, < 1 slows it down. ``rng`` as in :func:`tempo_factor`; the caller caps it."""
    own_wpm = 60.0 * max(1, num_words) / (max(1, num_frames) * FRAME_SHIFT_S)
    return rng.uniform(low_wpm, high_wpm) / own_wpm


def count_words(text: str) -> int:
    """A transcript's words: :func:`change_batch_tempo`'s token count when no tokenizer is given."""
    return len(text.split())


def draw_tempo(rng: Any, num_frames: int, text: str, tempo_range: tuple[float, float] | None,
               count_tokens: Callable[[str], int] = count_words, *,
               fast: tuple[float, float, float] | None = None, shared: float | None = None) -> float:
    """One utterance's tempo factor (``rng``: Python's ``random`` module or a ``random.Random``): ``shared`` (a
    batch's one factor) capped by :func:`cap_tempo`, else as :func:`change_batch_tempo` describes ``tempo_range``
    and ``fast``. ``num_frames``: the utterance's fbank frames; ``text``: its transcript."""
    if fast is not None:  # one draw decides: a target rate, or the usual factor
        if rng.random() < fast[0]:
            return cap_tempo(rate_tempo_factor(rng, fast[1], fast[2], num_frames, count_words(text)), num_frames,
                             count_tokens(text))
        if tempo_range is None:
            return 1.0
    if shared is None:
        return tempo_factor(rng, *tempo_range, num_frames, count_tokens(text))
    return cap_tempo(shared, num_frames, count_tokens(text))


def utterance_tempo(seed: int, epoch: int, cut_id: str, num_frames: int, text: str,
                    tempo_range: tuple[float, float] | None, count_tokens: Callable[[str], int] = count_words, *,
                    fast: tuple[float, float, float] | None = None) -> float:
    """:func:`draw_tempo` for one utterance from its own generator, seeded by (``seed``, ``epoch``, ``cut_id``):
    the same factor wherever it is asked for, so a sampler can bucket an utterance by its duration after the tempo
    change before the dataset applies it (:func:`asrprec.data.buckets.tempo_bucketing_sampler`)."""
    from asrprec.rng import seed_from

    rng = random.Random(seed_from(seed, epoch, "tempo", cut_id))
    return draw_tempo(rng, num_frames, text, tempo_range, count_tokens, fast=fast)


def change_batch_tempo(features: Any, feature_lens: Any, texts: Sequence[str],
                       tempo_range: tuple[float, float] | None, count_tokens: Callable[[str], int] = count_words, *,
                       per_batch: bool = False, fast: tuple[float, float, float] | None = None,
                       factors: Sequence[float] | None = None) -> tuple[Any, Any]:
    """A padded batch, each row's valid frames through :func:`change_tempo` with its own :func:`tempo_factor`
    (drawn from Python's ``random``: seed it per batch), re-padded with zeros. ``per_batch``: one factor drawn for
    the whole batch (each row's still capped by :func:`cap_tempo`), so rows of similar lengths stay similar and the
    batch gains no padding. ``fast`` = (share, low_wpm, high_wpm): each row, with probability ``share``, is brought
    to a rate drawn from [low_wpm, high_wpm] words per minute instead (:func:`rate_tempo_factor`, capped); the other
    rows keep ``tempo_range`` (unchanged if it is None). Not with ``per_batch``. ``factors``: each row's factor,
    already drawn (:func:`utterance_tempo`); then nothing is drawn.

    features: (B, T, F); feature_lens: (B,) int; texts: each row's transcript. Returns (B, T', F) and (B,) lengths.
    """
    import torch

    if fast is not None and per_batch:
        raise ValueError("a target rate (fast) is drawn per utterance: it cannot be combined with per_batch")
    if factors is None:
        if fast is None and tempo_range is None:
            raise ValueError("change_batch_tempo needs tempo_range, fast or factors")
        shared = random.uniform(*tempo_range) if per_batch else None
        factors = [draw_tempo(random, n, text, tempo_range, count_tokens, fast=fast, shared=shared)
                   for n, text in zip(feature_lens.tolist(), texts)]
    elif len(factors) != len(texts):
        raise ValueError(f"factors has {len(factors)} entries for a batch of {len(texts)} rows")
    rows = [change_tempo(features[i, :n], f) for i, (n, f) in enumerate(zip(feature_lens.tolist(), factors))]
    lens = torch.tensor([r.shape[0] for r in rows], dtype=feature_lens.dtype)
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True), lens


def _kaldi_mel(hz: Any) -> Any:
    import torch

    return 1127.0 * torch.log1p(hz / 700.0)


def _kaldi_mel_inverse(mel: Any) -> Any:
    import torch

    return 700.0 * torch.expm1(mel / 1127.0)


def warp_frequency(features: Any, alpha: float, *, low_hz: float = 20.0, high_hz: float = 7600.0) -> Any:
    """Vocal-tract length perturbation (VTLP; Jaitly & Hinton, ICML 2013 workshop) in the log-mel domain: (T, F) ->
    (T, F), the frames of a speaker whose vocal tract is ``1 / alpha`` times as long, every formant moved from f to
    ``alpha``·f.

    Each output bin, at centre frequency f, takes the (linearly interpolated) value the input has at the source
    frequency f / ``alpha``; above a knee at 0.85·``high_hz``·min(1, ``alpha``) the source frequency runs linearly to
    ``high_hz``, so the band edge maps to itself (the piecewise-linear warp of Kaldi's VTLN). ``low_hz`` /
    ``high_hz``: the mel filterbank's band (lhotse's ``FbankConfig`` at 16 kHz: 20 and 8000 - 400 Hz); bins are
    taken as equally spaced in Kaldi's mel scale between them. ``alpha`` 1 returns ``features`` unchanged.
    """
    import torch

    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if alpha == 1.0:
        return features
    num_bins = features.shape[-1]
    lo, hi = (_kaldi_mel(torch.tensor(f, dtype=torch.float64)) for f in (low_hz, high_hz))
    step = (hi - lo) / (num_bins + 1)
    centre = _kaldi_mel_inverse(lo + step * torch.arange(1, num_bins + 1, dtype=torch.float64))
    knee = 0.85 * high_hz * min(1.0, alpha)
    source = torch.where(centre <= knee, centre / alpha,
                         knee / alpha + (centre - knee) * (high_hz - knee / alpha) / (high_hz - knee))
    pos = ((_kaldi_mel(source) - lo) / step - 1.0).clamp(0.0, num_bins - 1.0)  # fractional input bin
    left = pos.floor().long().clamp(max=num_bins - 2)
    frac = (pos - left).to(torch.float32)
    x = features.float()
    out = x[..., left] * (1.0 - frac) + x[..., left + 1] * frac
    return out.to(features.dtype)


def change_batch_warp(features: Any, feature_lens: Any, warp_range: tuple[float, float]) -> Any:
    """A padded batch, each row through :func:`warp_frequency` with its own factor drawn uniformly from
    ``warp_range`` (Python's ``random``: seed it per batch); padded frames stay zero. features: (B, T, F)."""
    import random

    out = features.clone()
    for i, n in enumerate(feature_lens.tolist()):
        out[i, :n] = warp_frequency(features[i, :n], random.uniform(*warp_range))
    return out


def pause_frames(seconds: float, level_db: float, extractor: Any, rng: np.random.Generator) -> Any:
    """The fbank frames of a pause: ``seconds`` of 16 kHz white noise at ``level_db`` dBFS RMS, through
    ``extractor`` (:func:`asrprec.data.features.fbank_extractor`). Returns (T, F) float32, T >= 1."""
    import torch

    num_samples = max(400, int(round(seconds * 16000)))  # at least one 25 ms window
    noise = (10.0 ** (level_db / 20.0) * rng.standard_normal(num_samples)).astype(np.float32)
    return torch.as_tensor(extractor.extract(noise, 16000)).float()


class UtteranceJoiner:
    """Training examples that hold several utterances, as a long recording's chunks do: a share ``prob`` of a
    batch's rows is taken, in random groups of 2 to ``max_utterances``, and each group becomes one row, its
    utterances' fbank frames in a row with a pause between each two (:func:`pause_frames`: ``pause_s`` seconds,
    ``pause_db`` dBFS, each drawn uniformly) and their transcripts joined by a space. The pauses are made as audio
    would make them: lhotse's padding of precomputed features (``Cut.pad``, log 1e-10) is a level no recording has.

    Draws come from Python's ``random`` (seed it per batch). features: (B, T, F); feature_lens: (B,); texts and
    ids: per row. Returns them for the new rows (joined rows last, their ids joined by ``+``), zero-padded.
    """

    def __init__(self, prob: float, max_utterances: int, pause_s: tuple[float, float],
                 pause_db: tuple[float, float], num_mel_bins: int = 80) -> None:
        self.prob, self.max_utterances = prob, max_utterances
        self.pause_s, self.pause_db = pause_s, pause_db
        self.num_mel_bins = num_mel_bins
        self._extractor = None

    def __call__(self, features: Any, feature_lens: Any, texts: Sequence[str],
                 ids: Sequence[str]) -> tuple[Any, Any, list[str], list[str]]:
        import random

        import torch

        chosen = [i for i in range(len(texts)) if random.random() < self.prob]
        random.shuffle(chosen)
        groups = []
        while len(chosen) >= 2:
            size = min(len(chosen), random.randint(2, self.max_utterances))
            groups.append(chosen[:size])
            chosen = chosen[size:]
        if not groups:
            return features, feature_lens, list(texts), list(ids)
        if self._extractor is None:
            from asrprec.data.features import fbank_extractor

            self._extractor = fbank_extractor(self.num_mel_bins)
        rng = np.random.default_rng(random.getrandbits(63))
        joined = {i for g in groups for i in g}
        keep = [i for i in range(len(texts)) if i not in joined]
        rows = [features[i, :n] for i, n in zip(keep, feature_lens[keep].tolist())]
        new_texts, new_ids = [texts[i] for i in keep], [ids[i] for i in keep]
        for g in groups:
            parts = []
            for k, i in enumerate(g):
                if k:
                    parts.append(pause_frames(random.uniform(*self.pause_s), random.uniform(*self.pause_db),
                                              self._extractor, rng).to(features.dtype))
                parts.append(features[i, : int(feature_lens[i])])
            rows.append(torch.cat(parts))
            new_texts.append(" ".join(texts[i] for i in g))
            new_ids.append("+".join(ids[i] for i in g))
        lens = torch.tensor([r.shape[0] for r in rows], dtype=feature_lens.dtype)
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True), lens, new_texts, new_ids


def noise_mix_transform(config: Any, *, on_the_fly_feats: bool) -> "ReseedableCutTransform":
    """lhotse ``CutMix`` over the noise cuts of ``config`` (a :class:`asrprec.data.datamodule.NoiseMixConfig`; read
    eagerly: MUSAN's 109 h make ~40k windows of 10 s).

    Each mixed cut keeps its id and its duration (``pad_to_longest=False``): icefall's CutMix pads every cut of a
    batch with noise to the longest, but then passes the supervision's own frame count as the encoder length
    (k2-fsa/icefall egs/librispeech/ASR/zipformer/train.py, ``supervisions["num_frames"]``), so the padding is
    never seen; our batches take lengths from the cuts, and this keeps them the same. The noise choices and SNR
    draws come from a generator that :class:`AsrDataset` re-seeds for every batch (from the run's seed, the epoch
    and the batch's cut ids), so a batch gets the same noise in any worker and after a resume, and different
    batches get different noise.
    """
    from lhotse.dataset import CutMix

    from asrprec.data.manifests import load_cuts

    noise = load_cuts(config.cuts_path, lazy=False, hint="prepare the noise cuts (e.g. the recipe's MUSAN stage)")
    if len(noise) == 0:
        raise ValueError(f"{config.cuts_path} holds no noise cuts; fix: re-run the noise preparation")
    first = noise[0]
    if on_the_fly_feats and not first.has_recording:
        raise ValueError(f"noise cut {first.id!r} in {config.cuts_path} has no audio, which on-the-fly features need "
                         f"to mix waveforms; fix: use noise cuts made from recordings")
    if not on_the_fly_feats and not first.has_features:
        raise ValueError(f"noise cut {first.id!r} in {config.cuts_path} has no features, which precomputed-feature "
                         f"training mixes; fix: compute its fbank (asrprec.data.compute_fbank) or use on_the_fly_feats")
    # lhotse's CutMix takes a random.Random as its seed and draws from that very object
    return ReseedableCutTransform(lambda rng: CutMix(cuts=noise, p=config.p, snr=config.snr_db, pad_to_longest=False,
                                                     preserve_id=True, seed=rng))


class ReseedableCutTransform:
    """A lhotse cut transform built on a generator of its own, which :class:`AsrDataset` re-seeds per batch."""

    def __init__(self, build: Callable[[random.Random], Callable[[Any], Any]]) -> None:
        self._rng = random.Random(0)
        self._transform = build(self._rng)

    def reseed(self, seed: int) -> None:
        self._rng.seed(seed)

    def __call__(self, cuts: Any) -> Any:
        return self._transform(cuts)
