"""Audio of another sampling rate is resampled to 16 kHz for the features, with a counted message: an 8 kHz tone
gives the fbank of the same tone at 16 kHz, not that of a tone at twice its frequency."""

from __future__ import annotations

import logging

import numpy as np
import pytest

lhotse = pytest.importorskip("lhotse")
soundfile = pytest.importorskip("soundfile")


def _tone_cut(folder, name: str, rate: int, hz: float = 1000.0, seconds: float = 1.0):
    t = np.arange(int(rate * seconds)) / rate
    path = folder / f"{name}.wav"
    soundfile.write(str(path), 0.5 * np.sin(2 * np.pi * hz * t).astype(np.float32), rate)
    return lhotse.Recording.from_file(str(path), recording_id=name).to_cut()


def test_an_8khz_cut_is_resampled_and_counted(tmp_path, caplog):
    from asrprec.data.features import compute_fbank

    cuts = lhotse.CutSet.from_cuts([_tone_cut(tmp_path, "wide", 16000), _tone_cut(tmp_path, "narrow", 8000)])
    with caplog.at_level(logging.WARNING):
        out = compute_fbank(cuts, tmp_path / "feats", tmp_path / "cuts.jsonl.gz", num_jobs=1)
    assert "1 of 2 cuts are not 16000 Hz (8000 Hz, e.g. narrow): resampled to 16000 Hz" in caplog.text
    wide, narrow = (out[i].load_features() for i in ("wide", "narrow"))
    assert narrow.shape == wide.shape == (100, 80)  # 10 ms frames of 1 s
    # the tone's mel bin is the same (read as 16 kHz, the 8 kHz samples would put it at 2 kHz, ~9 bins higher)
    assert np.bincount(narrow.argmax(axis=1)).argmax() == np.bincount(wide.argmax(axis=1)).argmax()


def test_cuts_that_are_not_16khz_mono_are_counted_for_the_decoders_that_take_them_as_they_are(tmp_path, caplog):
    from asrprec.data.features import report_audio_formats

    cuts = [_tone_cut(tmp_path, "wide", 16000), _tone_cut(tmp_path, "narrow", 8000),
            _tone_cut(tmp_path, "cd", 44100)]
    with caplog.at_level(logging.WARNING):
        assert report_audio_formats(cuts) == 2
    assert "2 of 3 cuts are not 16000 Hz mono (8000 Hz x 1 channel(s), 44100 Hz x 1 channel(s); e.g. narrow)" \
        in caplog.text
