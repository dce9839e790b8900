"""A tiny corpus written in the three formats recipes/custom reads (Kaldi data dir, NeMo manifest, lhotse CutSet),
with the faults it must survive: an 8 kHz stereo file, a 22.05 kHz file, a missing audio file, an empty transcript
and a transcript that is not UTF-8."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import soundfile as sf

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()
# utterance -> (sample rate, channels, seconds); u3's file is never written
AUDIO = {"u0": (16000, 1, 1.4), "u1": (8000, 2, 1.5), "u2": (22050, 1, 1.3), "u3": (16000, 1, 1.2),
         "u4": (16000, 1, 1.2), "u5": (16000, 1, 1.2), "u6": (16000, 1, 1.6), "u7": (16000, 1, 1.5)}
MISSING, EMPTY_TEXT, NOT_UTF8 = "u3", "u4", "u5"
KEPT = ("u0", "u1", "u2", "u6", "u7")
NEMO_OFFSET = ("u6", 0.25)  # the NeMo manifest takes u6 from 0.25 s to its end
# u1 is L = a + b, R = a - b: its mixdown is the 300 Hz tone a alone; the first channel alone would hold b too
TONE_A_HZ, TONE_B_HZ = 300.0, 1000.0


def text_of(utt: str) -> str:
    i = int(utt[1:])
    return " ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(3 + i % 3))


def write_audio(folder: Path) -> dict[str, Path]:
    """One file per utterance (not u3's); returns every utterance's path."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = {}
    for utt, (sr, channels, seconds) in AUDIO.items():
        path = folder / f"{utt}.wav"
        paths[utt] = path
        if utt == MISSING:
            continue
        t = np.arange(int(sr * seconds)) / sr
        if channels == 2:
            a, b = 0.3 * np.sin(2 * np.pi * TONE_A_HZ * t), 0.3 * np.sin(2 * np.pi * TONE_B_HZ * t)
            sf.write(path, np.stack([a + b, a - b], axis=1), sr, subtype="FLOAT")
        else:
            sf.write(path, 0.1 * rng.standard_normal(len(t)) * np.sin(2 * np.pi * 3 * t), sr, subtype="FLOAT")
    return paths


def _text_line(utt: str, prefix: bytes) -> bytes:
    if utt == EMPTY_TEXT:
        return prefix.rstrip()
    if utt == NOT_UTF8:
        return prefix + "café au lait".encode("latin-1")
    return prefix + text_of(utt).encode()


def write_kaldi(folder: Path, audio: dict[str, Path]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "wav.scp").write_text("".join(f"{u} {p}\n" for u, p in audio.items()))
    (folder / "text").write_bytes(b"".join(_text_line(u, f"{u} ".encode()) + b"\n" for u in audio))
    (folder / "utt2spk").write_text("".join(f"{u} spk{int(u[1:]) % 2}\n" for u in audio))
    return folder


def kaldi_line(utt: str) -> int:
    return list(AUDIO).index(utt) + 1


def write_nemo(path: Path, audio: dict[str, Path]) -> Path:
    lines = []
    for u, p in audio.items():
        offset = NEMO_OFFSET[1] if u == NEMO_OFFSET[0] else 0.0
        entry = {"audio_filepath": str(p), "duration": AUDIO[u][2] - offset, "text": "" if u == EMPTY_TEXT else
                 "TEXT", **({"offset": offset} if offset else {})}
        line = json.dumps(entry).encode()
        lines.append(line.replace(b'"TEXT"', b'"' + _text_line(u, b"") + b'"'))
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def write_lhotse(path: Path, audio: dict[str, Path]) -> Path:
    """A CutSet manifest (.jsonl.gz): u1 a MultiCut of both channels, u3 a recording whose file is missing."""
    from lhotse import Recording, SupervisionSegment
    from lhotse.audio import AudioSource

    lines = []
    for u, p in audio.items():
        if u == MISSING:
            sr, _, seconds = AUDIO[u]
            rec = Recording(id=u, sources=[AudioSource("file", [0], str(p))], sampling_rate=sr,
                            num_samples=int(sr * seconds), duration=seconds)
        else:
            rec = Recording.from_file(p, recording_id=u)
        cut = rec.to_cut()
        channel = 0 if rec.num_channels == 1 else list(range(rec.num_channels))
        cut.supervisions = [SupervisionSegment(id=u, recording_id=u, start=0.0, duration=rec.duration,
                                               channel=channel, text="" if u == EMPTY_TEXT else "TEXT")]
        line = json.dumps(cut.to_dict()).encode()
        lines.append(line.replace(b'"TEXT"', b'"' + _text_line(u, b"") + b'"'))
    with gzip.open(path, "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    return path


def write_all(root: Path) -> dict[str, Path]:
    """The corpus in each format under ``root``: ``{"kaldi": dir, "nemo": manifest, "lhotse": manifest}``."""
    audio = write_audio(root / "audio")
    return {"kaldi": write_kaldi(root / "kaldi", audio), "nemo": write_nemo(root / "corpus.jsonl", audio),
            "lhotse": write_lhotse(root / "cuts.jsonl.gz", audio)}
