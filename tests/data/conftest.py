"""A tiny synthetic corpus shared by the data tests (generated once per test run)."""

import pytest

from asrprec._optional import is_available

needs_espeak = pytest.mark.skipif(not is_available("espeakng_loader"), reason="needs espeakng-loader (asrprec[synth])")

TINY = dict(num_train=12, num_dev=4, num_test=4, seed=0, shard_size=4, snr_db=(10.0, 20.0), reverb_prob=0.5)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    if not is_available("espeakng_loader"):
        pytest.skip("needs espeakng-loader (asrprec[synth])")
    from asrprec.data import generate_corpus

    out = tmp_path_factory.mktemp("corpus")
    return out, generate_corpus(out, num_workers=2, **TINY)


@pytest.fixture(scope="session")
def tiny_fbank(tiny_corpus, tmp_path_factory):
    from asrprec.data import compute_corpus_fbank

    out, cuts = tiny_corpus
    return out, compute_corpus_fbank(cuts, out, num_jobs=1)


# LibriSpeech's on-disk layout (what openslr's archives unpack to), filled with the tiny corpus' audio:
# <root>/LibriSpeech/<part>/<speaker>/<chapter>/<speaker>-<chapter>-<utt>.flac and <speaker>-<chapter>.trans.txt.
# Train gets all 12 training utterances; each dev and test part two of the four dev / test ones.
LIBRISPEECH_FIXTURE_PARTS = {"train-clean-100": ("train", 0, 12), "dev-clean": ("dev", 0, 2),
                             "dev-other": ("dev", 2, 4), "test-clean": ("test", 0, 2), "test-other": ("test", 2, 4)}


def write_librispeech_layout(root, cuts_by_split):
    """Copy the tiny corpus into LibriSpeech's layout under ``root``; return ``{part: {utt_id: (text, flac path)}}``."""
    import shutil

    written = {}
    for p_idx, (part, (split, lo, hi)) in enumerate(LIBRISPEECH_FIXTURE_PARTS.items()):
        written[part] = {}
        for i, cut in enumerate(list(cuts_by_split[split])[lo:hi]):
            speaker, chapter = 100 + 10 * p_idx + i % 2, 1000 + p_idx  # two speakers, one chapter per part
            folder = root / "LibriSpeech" / part / str(speaker) / str(chapter)
            folder.mkdir(parents=True, exist_ok=True)
            utt = f"{speaker}-{chapter}-{i:04d}"
            shutil.copy(cut.recording.sources[0].source, folder / f"{utt}.flac")
            with open(folder / f"{speaker}-{chapter}.trans.txt", "a") as f:
                f.write(f"{utt} {cut.supervisions[0].text}\n")
            written[part][utt] = (cut.supervisions[0].text, folder / f"{utt}.flac")
    return written


def write_musan_layout(root, seconds=12.0, sample_rate=16000):
    """MUSAN's layout under ``root/musan``: one 16 kHz WAV per part (music with its ANNOTATIONS line), each
    ``seconds`` long: a chord (music), modulated pink noise (speech-like babble) and white noise (noise)."""
    import numpy as np
    import soundfile as sf

    from asrprec.data.augment import make_noise

    rng = np.random.default_rng(0)
    n = int(seconds * sample_rate)
    t = np.arange(n) / sample_rate
    signals = {
        ("music", "fma", "music-fma-0000"): sum(np.sin(2 * np.pi * f * t) for f in (220.0, 277.2, 329.6)) / 3,
        ("speech", "librivox", "speech-librivox-0000"): make_noise(n, rng, color="pink") * (1 + np.sin(6 * np.pi * t)) / 2,
        ("noise", "free-sound", "noise-free-sound-0000"): make_noise(n, rng),
    }
    paths = {}
    for (part, source, name), x in signals.items():
        folder = root / "musan" / part / source
        folder.mkdir(parents=True, exist_ok=True)
        x = (0.1 * x / np.max(np.abs(x))).astype(np.float32)
        sf.write(str(folder / f"{name}.wav"), x, sample_rate, subtype="PCM_16")
        paths[part] = folder / f"{name}.wav"
    (root / "musan" / "music" / "fma" / "ANNOTATIONS").write_text("music-fma-0000 classical N synthetic\n")
    return paths


@pytest.fixture(scope="session")
def corpus_layouts(tiny_corpus, tmp_path_factory):
    """``(root, written)``: LibriSpeech and MUSAN fixtures side by side in ``root`` (as lhotse's downloaders
    leave them)."""
    _, cuts = tiny_corpus
    root = tmp_path_factory.mktemp("corpora")
    written = write_librispeech_layout(root, cuts)
    write_musan_layout(root)
    return root, written
