"""Manifests too large to hold in memory: lazy reading, streaming writes, speed perturbation, shuffled combination.

LibriSpeech 960 h with 3x speed perturbation is 843k cuts; held as lhotse objects that is several GB per
process (and a dataloader worker or a DDP rank each holds its own copy). Everything here streams: cuts are read
from ``.jsonl.gz`` one at a time (``lhotse.load_manifest_lazy``) and written with lhotse's sequential writer.
Every output file is written atomically (:mod:`asrprec.atomic`), so a stage interrupted half-way never leaves a
file that a rerun would take for finished.
"""

from __future__ import annotations

import gzip
import logging
import random
from pathlib import Path
from typing import Any, Iterable, Sequence

from asrprec._optional import require
from asrprec.atomic import atomic_path
from asrprec.errors import AsrprecError

log = logging.getLogger(__name__)

# icefall's factors (k2-fsa/icefall egs/librispeech/ASR/local/compute_fbank_librispeech.py, --perturb-speed)
SPEED_FACTORS = (0.9, 1.1)


class ManifestError(AsrprecError, ValueError):
    """A manifest file that holds no cuts or cannot be read; the message names the file (and line) and the fix."""


def _open_lines(path: Path) -> Any:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def unreadable_line(path: Path | str, *, parse: bool = True) -> tuple[int, str] | None:
    """``(line number, why)`` of the first line of the JSON-lines manifest ``path`` that is not UTF-8 (or, with
    ``parse``, not a JSON object), or None when every line is."""
    import json

    path = Path(path)
    try:
        with _open_lines(path) as f:
            for i, raw in enumerate(f, 1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    return i, f"not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})"
                if parse and text.strip():
                    try:
                        json.loads(text)
                    except ValueError as e:
                        return i, f"not a JSON object ({e})"
    except (OSError, EOFError) as e:  # a truncated or corrupt gzip stream
        return i + 1 if "i" in locals() else 1, f"unreadable ({e})"
    return None


def load_cuts(path: Path | str, *, lazy: bool = True, hint: str = "run the data preparation first") -> Any:
    """The CutSet in ``path``: read lazily (one cut at a time, as iterated) or eagerly. A missing file is a
    FileNotFoundError naming it and ``hint`` (how to make it).

    Raises:
        ManifestError: an empty manifest, or a line that is not UTF-8 (checked before a lazy read, which would meet
            it only mid-epoch) or not JSON, naming ``path:line``.
    """
    lhotse = require("lhotse")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; fix: {hint}")
    bad = unreadable_line(path, parse=not lazy)
    if bad is None:
        try:
            cuts = lhotse.load_manifest_lazy(path) if lazy else lhotse.CutSet.from_file(path)
        except (ValueError, OSError, EOFError, KeyError, TypeError) as e:
            bad = unreadable_line(path) or (1, f"not a lhotse manifest ({type(e).__name__}: {e})")
    if bad is not None:
        raise ManifestError(f"{path}:{bad[0]}: {bad[1]}; fix: {hint} (or repair that line)")
    if cuts is None:  # lhotse reads an empty file as None
        raise ManifestError(f"{path} holds no cuts; fix: {hint} (check that the split is not empty)")
    return cuts if lazy else cuts.to_eager()


def write_cuts(cuts: Iterable[Any], path: Path | str) -> int:
    """Stream ``cuts`` into the manifest ``path`` (atomically, :mod:`asrprec.atomic`); return how many."""
    lhotse = require("lhotse")
    n = 0
    with atomic_path(path) as tmp, lhotse.CutSet.open_writer(tmp) as writer:
        for cut in cuts:
            writer.write(cut)
            n += 1
    return n


def speed_perturbed(cuts: Any, factors: Sequence[float] = SPEED_FACTORS) -> Any:
    """``cuts`` followed by a copy of them at each speed ``factor`` (lhotse ``perturb_speed``: the audio is
    resampled, so a cut of N samples becomes N / factor samples long and its pitch moves by ``factor``;
    ids get the suffix ``_sp<factor>``). Lazy when ``cuts`` is."""
    factors = tuple(float(f) for f in factors)
    if any(not f > 0 or f == 1.0 for f in factors):
        raise ValueError(f"speed factors must be positive and not 1.0 (the originals are kept anyway), got {factors}")
    if len(set(factors)) != len(factors):
        raise ValueError(f"speed factors must be distinct, got {factors}")
    out = cuts
    for f in factors:
        out = out + cuts.perturb_speed(f)
    return out


def shuffle_manifests(paths: Sequence[Path | str], out_path: Path | str, *, seed: int = 0) -> int:
    """Concatenate the ``.jsonl.gz`` manifests in ``paths`` in a seeded random order of their lines (icefall's
    ``cat ... | shuf`` for ``train-all-shuf``), so a lazy reader sees the parts and speeds mixed and a sampler's
    shuffle buffer does not have to. Holds the raw lines (not lhotse objects) in memory. Returns the count."""
    lines: list[bytes] = []
    for p in paths:
        if not Path(p).is_file():
            raise FileNotFoundError(f"{p} is missing; fix: run the stage that writes it first")
        with gzip.open(p, "rb") as f:
            lines.extend(line if line.endswith(b"\n") else line + b"\n" for line in f if line.strip())
    random.Random(seed).shuffle(lines)
    with atomic_path(out_path) as tmp, gzip.open(tmp, "wb") as f:
        f.writelines(lines)
    log.info("wrote %d shuffled cuts from %d manifests to %s", len(lines), len(paths), out_path)
    return len(lines)
