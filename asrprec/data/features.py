"""80-dim log-mel filterbank features with lhotse's own extractor, precomputed or on the fly.

The extractor is lhotse's ``Fbank(FbankConfig(num_mel_bins=80))`` (16 kHz, 25 ms windows every
10 ms, povey window, no dither, ``snip_edges=False``), as icefall's
``egs/librispeech/ASR/local/compute_fbank_librispeech.py`` uses it. Feature extraction is an fp32
island: it runs with autocast disabled whatever precision policy is active.

Pitfall: with several extraction jobs each process must run torch with one
thread, or extraction gets ~6× slower; :func:`compute_fbank` gives lhotse an executor whose workers
set that up.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from asrprec._optional import require
from asrprec.precision import fp32_island

log = logging.getLogger(__name__)

NUM_MEL_BINS = 80
FRAME_SHIFT_S = 0.01


def fbank_extractor(num_mel_bins: int = NUM_MEL_BINS) -> Any:
    """lhotse's Fbank extractor with ``num_mel_bins`` bins (other settings are lhotse's / Kaldi's defaults)."""
    from lhotse import Fbank, FbankConfig

    return Fbank(FbankConfig(num_mel_bins=num_mel_bins))


def num_frames(num_samples: int, sample_rate: int = 16000, frame_shift_s: float = FRAME_SHIFT_S) -> int:
    """Frames of a ``snip_edges=False`` extractor: ``(num_samples + hop // 2) // hop`` (Kaldi's rule)."""
    hop = int(round(frame_shift_s * sample_rate))
    return (num_samples + hop // 2) // hop


def _torch_one_thread() -> None:
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)


def fbank_executor(num_jobs: int) -> ProcessPoolExecutor:
    """A spawn process pool whose workers run torch with one thread (see the module doc's pitfall)."""
    return ProcessPoolExecutor(num_jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_torch_one_thread)


@fp32_island
def compute_fbank(
    cuts: Any,
    storage_path: Path | str,
    manifest_path: Path | str,
    *,
    num_jobs: int = 2,
    num_mel_bins: int = NUM_MEL_BINS,
    executor: ProcessPoolExecutor | None = None,
) -> Any:
    """Extract and store fbank features of ``cuts`` (lilcom-compressed chunks), return the CutSet with features.

    Idempotent: when ``manifest_path`` already holds a CutSet with features for exactly these cut ids,
    it is loaded instead. ``storage_path`` is a folder (``num_jobs > 1``) or file prefix for the arrays.
    ``executor``: an executor made by :func:`fbank_executor` to reuse across calls (one is made otherwise).
    """
    import torch

    lhotse = require("lhotse")
    from lhotse import LilcomChunkyWriter

    manifest_path = Path(manifest_path)
    if manifest_path.is_file():
        stored = lhotse.CutSet.from_file(manifest_path).to_eager()
        if sorted(stored.ids) == sorted(cuts.ids) and all(c.has_features for c in stored):
            stored_bins = stored[0].num_features if len(stored) else num_mel_bins
            if stored_bins == num_mel_bins:
                log.info("features in %s are up to date; not recomputing", manifest_path)
                return stored
        log.info("features in %s do not match the cuts; recomputing", manifest_path)
    Path(storage_path).parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    own_executor = executor is None and num_jobs > 1
    if own_executor:
        executor = fbank_executor(num_jobs)
    parent_threads = torch.get_num_threads()
    if num_jobs > 1:
        torch.set_num_threads(1)  # the parent only waits; this also quiets lhotse's threads warning
    try:
        with_feats = cuts.compute_and_store_features(
            extractor=fbank_extractor(num_mel_bins),
            storage_path=str(storage_path),
            num_jobs=num_jobs,
            storage_type=LilcomChunkyWriter,
            executor=executor,
            progress_bar=False,
        )
    finally:
        torch.set_num_threads(parent_threads)
        if own_executor:
            executor.shutdown()
    with_feats = with_feats.to_eager()
    if len(with_feats) != len(cuts):
        raise RuntimeError(
            f"feature extraction returned {len(with_feats)} of {len(cuts)} cuts (lhotse drops cuts whose audio fails to load); "
            f"run asrprec.data.validate_cuts(cuts) to find the broken ones"
        )
    manifest_path.parent.mkdir(parents=True, exist_ok=True)
    with_feats.to_file(manifest_path)
    log.info("computed fbank for %d cuts in %.1f s -> %s", len(with_feats), time.perf_counter() - start, manifest_path)
    return with_feats


def compute_corpus_fbank(cuts_by_split: dict[str, Any], out_dir: Path | str, *, num_jobs: int = 2, prefix: str = "espeak") -> dict:
    """:func:`compute_fbank` for each split: features under ``out_dir/fbank``, manifests ``<prefix>_cuts_<split>_fbank.jsonl.gz``."""
    out_dir = Path(out_dir)
    executor = fbank_executor(num_jobs) if num_jobs > 1 else None  # one pool for all splits: workers start once
    try:
        return {
            split: compute_fbank(
                cuts,
                out_dir / "fbank" / f"{prefix}_feats_{split}",
                out_dir / f"{prefix}_cuts_{split}_fbank.jsonl.gz",
                num_jobs=num_jobs,
                executor=executor,
            )
            for split, cuts in cuts_by_split.items()
        }
    finally:
        if executor is not None:
            executor.shutdown()


def compute_fbank_lazy(
    cuts: Any,
    storage_dir: Path | str,
    manifest_path: Path | str,
    *,
    chunk_size: int = 20000,
    num_jobs: int = 2,
    num_mel_bins: int = NUM_MEL_BINS,
) -> Any:
    """:func:`compute_fbank` for a CutSet too large for memory (e.g. lazily read): ``chunk_size`` cuts at a time.

    Chunk ``i``'s arrays go to ``storage_dir/chunk-<i>`` and its manifest to ``storage_dir/chunk-<i>.jsonl.gz``; a
    rerun after an interruption reuses the chunks already done (the chunking follows the order of ``cuts``, so the
    input must be the same). At the end the chunk manifests are joined into ``manifest_path`` (written
    atomically). When ``manifest_path`` exists nothing is computed. Returns the result opened lazily.
    """
    import itertools

    lhotse = require("lhotse")
    from asrprec.data.manifests import write_cuts

    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    manifest_path, storage_dir = Path(manifest_path), Path(storage_dir)
    if manifest_path.is_file():
        log.info("features in %s exist; not recomputing (delete the file to recompute)", manifest_path)
        return lhotse.load_manifest_lazy(manifest_path)
    storage_dir.mkdir(parents=True, exist_ok=True)
    chunk_manifests = []
    executor = fbank_executor(num_jobs) if num_jobs > 1 else None
    try:
        it = iter(cuts)
        for i in itertools.count():
            chunk = list(itertools.islice(it, chunk_size))
            if not chunk:
                break
            path = storage_dir / f"chunk-{i:05d}.jsonl.gz"
            compute_fbank(lhotse.CutSet.from_cuts(chunk), storage_dir / f"chunk-{i:05d}", path, num_jobs=num_jobs,
                          num_mel_bins=num_mel_bins, executor=executor)
            chunk_manifests.append(path)
    finally:
        if executor is not None:
            executor.shutdown()
    n = write_cuts((c for p in chunk_manifests for c in lhotse.load_manifest_lazy(p)), manifest_path)
    for p in chunk_manifests:
        p.unlink()
    log.info("fbank of %d cuts in %d chunks -> %s", n, len(chunk_manifests), manifest_path)
    return lhotse.load_manifest_lazy(manifest_path)


class OnTheFlyFbank:
    """Callable ``cuts -> (features (B, T, F) float32, feature_lens (B,) int64)`` computed from audio, as an fp32 island.

    Wraps lhotse's ``OnTheFlyFeatures(Fbank)``; rows follow the order of ``cuts`` and are zero-padded to the longest.
    """

    def __init__(self, num_mel_bins: int = NUM_MEL_BINS) -> None:
        from lhotse.dataset import OnTheFlyFeatures

        self._otf = OnTheFlyFeatures(fbank_extractor(num_mel_bins))

    @fp32_island
    def __call__(self, cuts: Any):
        feats, feat_lens = self._otf(cuts)
        return feats.float(), feat_lens.long()


def load_fbank_cuts(data_dir: Path | str, *, prefix: str = "espeak", splits: tuple[str, ...] = ("train", "dev", "test")) -> dict:
    """The CutSets with features written by :func:`compute_corpus_fbank`: ``{split: CutSet}`` (eager)."""
    lhotse = require("lhotse")
    out = {}
    for split in splits:
        path = Path(data_dir) / f"{prefix}_cuts_{split}_fbank.jsonl.gz"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; fix: run the data preparation first (e.g. python recipes/espeak/prepare.py)")
        out[split] = lhotse.CutSet.from_file(path).to_eager()
    return out


def _pad_cut(cut: Any, seconds: float) -> Any:
    return cut.pad(duration=cut.duration + seconds, direction="right").with_id(cut.id)


def pad_with_silence(cuts: Any, seconds: float) -> Any:
    """Every cut followed by ``seconds`` of digital silence (zero samples), under its own id: the audio a streaming
    client sends when it ends a stream (sherpa-onnx's examples append 0.66 s so its last frames get decoded). Compute
    the features on the fly (``DataConfig(on_the_fly_feats=True)``): stored features end with the original audio."""
    from functools import partial

    if seconds < 0:
        raise ValueError(f"seconds must be >= 0, got {seconds}")
    return cuts.map(partial(_pad_cut, seconds=float(seconds)))
