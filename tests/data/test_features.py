"""Fbank features: frame count by Kaldi's rule, values against torchaudio's Kaldi fbank, fp32 island."""

import numpy as np
import pytest
import torch

from asrprec._optional import is_available
from asrprec.data.features import OnTheFlyFbank, compute_fbank, load_fbank_cuts
from asrprec.data.frames import num_frames

from .conftest import needs_espeak


def test_num_frames_rule():
    # snip_edges=False: one frame per 10 ms hop, rounded half up
    assert num_frames(16000) == 100
    assert num_frames(16079) == 100 and num_frames(16080) == 101
    assert num_frames(0) == 0


@needs_espeak
def test_precomputed_shapes_and_idempotence(tiny_fbank, caplog):
    out, cuts = tiny_fbank
    for split, split_cuts in cuts.items():
        for cut in split_cuts:
            feats = cut.load_features()
            expected_frames = (cut.recording.num_samples + 80) // 160  # independent of lhotse's own frame count
            assert feats.shape == (expected_frames, 80) and feats.dtype == np.float32
            assert np.isfinite(feats).all()
    loaded = load_fbank_cuts(out)
    assert [c.id for c in loaded["train"]] == [c.id for c in cuts["train"]]
    with caplog.at_level("INFO"):
        again = compute_fbank(
            cuts["dev"], out / "fbank" / "espeak_feats_dev", out / "espeak_cuts_dev_fbank.jsonl.gz", num_jobs=1
        )
    assert "up to date" in caplog.text and len(again) == len(cuts["dev"])


@needs_espeak
@pytest.mark.skipif(not is_available("torchaudio"), reason="torchaudio not installed")
def test_fbank_values_match_torchaudio_kaldi(tiny_fbank):
    import torchaudio.compliance.kaldi as kaldi

    _, cuts = tiny_fbank
    cut = next(iter(cuts["test"]))
    audio = torch.from_numpy(cut.load_audio()).float() * 32768  # Kaldi's int16 scale
    ref = kaldi.fbank(
        audio, num_mel_bins=80, sample_frequency=16000, dither=0.0, snip_edges=False, energy_floor=0.0,
        low_freq=20.0, high_freq=-400.0,
    ).numpy() - np.log(32768.0**2)  # lhotse works on [-1, 1] audio: log power shifts by log(32768^2)
    ours = cut.load_features()  # lilcom-compressed: ~3 significant digits
    n = min(len(ref), len(ours))
    assert abs(len(ref) - len(ours)) <= 1
    err = np.abs(ref[:n] - ours[:n])
    assert np.median(err) < 0.05 and np.quantile(err, 0.99) < 0.5


@needs_espeak
def test_on_the_fly_matches_precomputed_and_is_fp32_under_autocast(tiny_fbank):
    from lhotse.dataset.collation import collate_features

    _, cuts = tiny_fbank
    batch = cuts["dev"].sort_by_duration(ascending=False)
    otf = OnTheFlyFbank()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        feats, lens = otf(batch)
    assert feats.dtype == torch.float32 and lens.dtype == torch.int64
    stored, stored_lens = collate_features(batch)
    assert torch.equal(lens, stored_lens.long())
    for i, n in enumerate(lens.tolist()):
        # lilcom compression error only, except the last frames: on the fly, lhotse extracts from audio
        # zero-padded to the longest cut, where the stored features saw the cut's edge reflected
        err = (feats[i, : n - 2] - stored[i, : n - 2]).abs()
        assert err.median() < 0.05 and err.max() < 0.5, (err.median(), err.max())


@needs_espeak
def test_pad_with_silence_gives_the_features_of_the_padded_audio(tiny_fbank):
    from asrprec.data.features import fbank_extractor, pad_with_silence

    _, cuts = tiny_fbank
    cut = cuts["dev"][0]
    padded = list(pad_with_silence(cuts["dev"].subset(first=1), 0.66))[0]
    assert padded.id == cut.id and abs(padded.duration - (cut.duration + 0.66)) < 1e-6
    feats, lens = OnTheFlyFbank()([padded])
    audio = np.concatenate([cut.load_audio()[0], np.zeros(int(0.66 * 16000), np.float32)])
    want = fbank_extractor().extract(audio, 16000)
    assert int(lens[0]) == want.shape[0] == num_frames(len(audio))
    np.testing.assert_allclose(feats[0, : int(lens[0])].numpy(), want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=">= 0"):
        pad_with_silence(cuts["dev"], -1.0)
