"""A tiny corpus for the reliability tests: random 80-bin "fbank" features (one .npy file per cut, so single files
can be deleted or corrupted), transcripts from a small vocabulary, a sentencepiece model; written under the names
``recipes/espeak`` reads (``espeak_cuts_<split>_fbank.jsonl.gz``, ``bpe.model``). Seconds to build, no espeak-ng.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

WORDS = ("ONE", "TWO", "THREE", "FOUR", "FIVE", "RED", "BLUE", "CAT", "DOG", "SEES")
# A Zipformer ``tiny`` at a fraction of its size: a training step takes milliseconds on a CPU.
TINY_OVERRIDES = {"encoder_dim": 32, "encoder_unmasked_dim": 32, "feedforward_dim": 48, "num_heads": 2,
                  "query_head_dim": 8, "value_head_dim": 4, "pos_head_dim": 2, "pos_dim": 8,
                  "frontend_channels": [4, 8, 8], "convnext_hidden_ratio": 0, "cnn_module_kernel": [3, 3, 3]}


def make_cut(cid: str, frames: int, text: str, feats_dir: Path, rng: np.random.Generator):
    from lhotse import Features, SupervisionSegment
    from lhotse.cut import MonoCut
    from lhotse.features.io import NumpyFilesWriter

    duration = frames / 100
    with NumpyFilesWriter(str(feats_dir)) as writer:
        key = writer.write(cid, rng.standard_normal((frames, 80)).astype(np.float32))
    features = Features(type="fbank", num_frames=frames, num_features=80, frame_shift=0.01, sampling_rate=16000,
                        start=0.0, duration=duration, storage_type="numpy_files", storage_path=str(feats_dir),
                        storage_key=key)
    sup = SupervisionSegment(id=cid, recording_id=cid, start=0.0, duration=duration, text=text)
    return MonoCut(id=cid, start=0.0, duration=duration, channel=0, supervisions=[sup], features=features)


def build(root: Path, *, num_train: int = 16, num_dev: int = 4, num_test: int = 4, seed: int = 0) -> Path:
    """Write the corpus into ``root`` and return it."""
    from lhotse import CutSet

    from asrprec.tokenizer import Tokenizer

    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    texts = []
    for split, n in (("train", num_train), ("dev", num_dev), ("test", num_test)):
        cuts = []
        for i in range(n):
            text = " ".join(rng.choice(WORDS, size=int(rng.integers(1, 4))))
            texts.append(text)
            cuts.append(make_cut(f"{split}-{i:03d}", int(rng.integers(60, 140)), text, root / "feats", rng))
        CutSet.from_cuts(cuts).to_file(root / f"espeak_cuts_{split}_fbank.jsonl.gz")
    Tokenizer.train(texts + list(WORDS), root / "bpe", vocab_size=24)
    return root


def load(root: Path) -> dict:
    from asrprec.data import load_fbank_cuts

    return load_fbank_cuts(root)


def save_split(root: Path, split: str, cuts) -> None:
    from lhotse import CutSet

    CutSet.from_cuts(cuts).to_file(root / f"espeak_cuts_{split}_fbank.jsonl.gz")
