"""The one frame-count rule of the features: 100 frames per second, counted as lhotse counts them.

lhotse's extractors run with ``snip_edges=False`` (Kaldi's option): a signal of ``n`` samples gives
``(n + hop // 2) // hop`` frames, ``hop = round(frame_shift · sample_rate)``. The precomputed features, the
on-the-fly extractor and the data checks must agree on it, so all of them count with lhotse's own
``compute_num_frames`` / ``compute_num_frames_from_samples`` (lhotse-speech/lhotse ``lhotse/utils.py``) rather
than a rounding of their own.
"""

from __future__ import annotations

from typing import Any

from asrprec._optional import require

__all__ = ["FRAME_SHIFT_S", "cut_num_frames", "num_frames"]

FRAME_SHIFT_S = 0.01  # 10 ms: the fbank's frame shift (lhotse's FbankConfig default)


def num_frames(num_samples: int, sample_rate: int = 16000, frame_shift_s: float = FRAME_SHIFT_S) -> int:
    """Frames of ``num_samples`` samples at ``sample_rate`` Hz."""
    utils = require("lhotse.utils")
    return int(utils.compute_num_frames_from_samples(num_samples, frame_shift_s, sample_rate))


def cut_num_frames(cut: Any, frame_shift_s: float = FRAME_SHIFT_S) -> int:
    """Frames of a lhotse cut: those of its features when it has them, else those its audio will give."""
    if cut.has_features:
        return int(cut.num_frames)
    utils = require("lhotse.utils")
    return int(utils.compute_num_frames(cut.duration, frame_shift_s, cut.sampling_rate))
