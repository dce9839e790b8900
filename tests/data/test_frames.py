"""The one frame-count rule: what it predicts for a cut is what lhotse's fbank extractor then produces."""

import numpy as np
import pytest
import soundfile as sf

from asrprec.data.frames import cut_num_frames, num_frames


@pytest.mark.parametrize("num_samples", [1600, 16079, 16080, 16161, 24321])
def test_predicted_frames_are_the_extractors(tmp_path, num_samples):
    from lhotse import Fbank, FbankConfig, Recording

    path = tmp_path / f"a{num_samples}.wav"
    sf.write(path, np.random.default_rng(0).normal(0, 0.1, num_samples).astype(np.float32), 16000)
    cut = Recording.from_file(path).to_cut()
    frames = cut.compute_features(Fbank(FbankConfig(num_mel_bins=80))).shape[0]
    assert cut_num_frames(cut) == frames == num_frames(num_samples)
