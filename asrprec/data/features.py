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
from asrprec.atomic import atomic_path
from asrprec.precision import fp32_island

log = logging.getLogger(__name__)

NUM_MEL_BINS = 80


def fbank_extractor(num_mel_bins: int = NUM_MEL_BINS) -> Any:
    """lhotse's Fbank extractor with ``num_mel_bins`` bins (other settings are lhotse's / Kaldi's defaults)."""
    from lhotse import Fbank, FbankConfig

    return Fbank(FbankConfig(num_mel_bins=num_mel_bins))


def _torch_one_thread() -> None:
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)


def _die_with(parent: int) -> None:
    """Linux: this process gets SIGKILL when ``parent`` (the process that started it) dies; a ``kill -9`` of the
    preparation would otherwise leave its pool's workers running, orphaned (prctl PR_SET_PDEATHSIG)."""
    import ctypes
    import os
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _worker_init(parent: int) -> None:
    _die_with(parent)
    _torch_one_thread()


def fbank_executor(num_jobs: int) -> ProcessPoolExecutor:
    """A spawn process pool whose workers run torch with one thread (see the module doc's pitfall) and end with
    the process that made the pool (:func:`_die_with`)."""
    import os

    return ProcessPoolExecutor(num_jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init,
                               initargs=(os.getpid(),))


@fp32_island
def compute_fbank(
    cuts: Any,
    storage_path: Path | str,
    manifest_path: Path | str,
    *,
    num_jobs: int = 2,
    num_mel_bins: int = NUM_MEL_BINS,
    executor: ProcessPoolExecutor | None = None,
    max_unreadable: int = 0,
) -> Any:
    """Extract and store fbank features of ``cuts`` (lilcom-compressed chunks), return the CutSet with features.

    Idempotent: when ``manifest_path`` already holds a CutSet with features for exactly these cut ids (but for at
    most ``max_unreadable`` left out), it is loaded instead. ``storage_path`` is a folder (``num_jobs > 1``) or
    file prefix for the arrays. ``executor``: an executor made by :func:`fbank_executor` to reuse across calls (one
    is made otherwise). Cuts whose audio cannot be read (lhotse leaves them out) are named in the log and left
    out, up to ``max_unreadable``; more raise :class:`~asrprec.data.corpora.CorpusError` naming them.
    """
    import torch

    lhotse = require("lhotse")
    from lhotse import LilcomChunkyWriter

    manifest_path = Path(manifest_path)
    if manifest_path.is_file():
        stored = lhotse.CutSet.from_file(manifest_path).to_eager()
        left_out = set(cuts.ids) - set(stored.ids)
        if (set(stored.ids) <= set(cuts.ids) and len(left_out) <= max_unreadable and all(c.has_features for c in stored)
                and all(Path(c.features.storage_path).exists() for c in stored)):
            stored_bins = stored[0].num_features if len(stored) else num_mel_bins
            if stored_bins == num_mel_bins:
                log.info("features in %s are up to date; not recomputing", manifest_path)
                return stored
        log.info("features in %s do not match the cuts; recomputing", manifest_path)
    Path(storage_path).parent.mkdir(parents=True, exist_ok=True)
    cuts = at_feature_rate(cuts)
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
    # lhotse's workers take every num_jobs-th cut, so the joined result's order would depend on num_jobs and, through
    # compute_fbank_lazy's chunks, on the chunk size: keep the order of ``cuts``
    position = {cid: i for i, cid in enumerate(cuts.ids)}
    with_feats = lhotse.CutSet.from_cuts(sorted(with_feats, key=lambda c: position[c.id]))
    if len(with_feats) != len(cuts):
        _report_unreadable([c for c in cuts if c.id not in set(with_feats.ids)], len(cuts), max_unreadable)
    with atomic_path(manifest_path) as tmp:
        with_feats.to_file(tmp)
    log.info("computed fbank for %d cuts in %.1f s -> %s", len(with_feats), time.perf_counter() - start, manifest_path)
    return with_feats


def report_audio_formats(cuts: Any) -> int:
    """Log how many ``cuts`` are not 16 kHz mono (their rates and channel counts, one example); return that count.
    For decoders that take each cut's audio at its own rate and mix it down (sherpa-onnx)."""
    from .source_formats import SAMPLE_RATE

    other = [c for c in cuts if c.sampling_rate != SAMPLE_RATE or c.num_channels != 1]
    if other:
        formats = sorted({(c.sampling_rate, c.num_channels) for c in other})
        log.warning("%d of %d cuts are not %d Hz mono (%s; e.g. %s): each is decoded at its own rate and mixed down",
                    len(other), len(cuts), SAMPLE_RATE, ", ".join(f"{r} Hz x {n} channel(s)" for r, n in formats),
                    other[0].id)
    return len(other)


def at_feature_rate(cuts: Any) -> Any:
    """``cuts`` with every cut of another sampling rate resampled to the fbank's 16 kHz (lazily, when its audio is
    loaded) and the count logged; fbank of 8 kHz audio read as 16 kHz would describe other frequencies."""
    lhotse = require("lhotse")
    from .source_formats import SAMPLE_RATE

    cuts = list(cuts)
    other = [c for c in cuts if c.sampling_rate != SAMPLE_RATE]
    if not other:
        return lhotse.CutSet.from_cuts(cuts)
    rates = sorted({c.sampling_rate for c in other})
    log.warning("%d of %d cuts are not %d Hz (%s Hz, e.g. %s): resampled to %d Hz for the features", len(other),
                len(cuts), SAMPLE_RATE, ", ".join(map(str, rates)), other[0].id, SAMPLE_RATE)
    return lhotse.CutSet.from_cuts(c.resample(SAMPLE_RATE) if c.sampling_rate != SAMPLE_RATE else c for c in cuts)


def _audio_file(cut: Any) -> str:
    sources = cut.recording.sources if cut.has_recording else []
    return str(sources[0].source) if sources else "no recording"


def _report_unreadable(lost: list[Any], total: int, max_unreadable: int) -> None:
    """Name the cuts feature extraction lost (lhotse leaves out a cut whose audio fails to load); raise beyond
    ``max_unreadable``."""
    from asrprec.data.corpora import CorpusError

    names = [f"{c.id} ({_audio_file(c)})" for c in lost]
    if len(lost) > max_unreadable:
        shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
        raise CorpusError(f"the audio of {len(lost)} of {total} cuts could not be read: {shown}. Fix: re-download or "
                          f"delete those files (and their transcript lines), or raise --max-bad-audio (now "
                          f"{max_unreadable}) to leave them out")
    for name in names:
        log.warning("left out %s: its audio could not be read", name)


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
    max_unreadable: int = 0,
    made_from: dict[str, Any] | None = None,
) -> Any:
    """:func:`compute_fbank` for a CutSet too large for memory (e.g. lazily read): ``chunk_size`` cuts at a time;
    at most ``max_unreadable`` cuts of all chunks together may be left out for unreadable audio.

    Chunk ``i``'s arrays go to ``storage_dir/chunk-<i>`` and its manifest to ``storage_dir/chunk-<i>.jsonl.gz``; a
    rerun after an interruption reuses the chunks already done (the chunking follows the order of ``cuts``, so the
    input must be the same). At the end the chunk manifests are joined into ``manifest_path`` (written
    atomically), and a record of it is written last (:func:`asrprec.data.stages.record_done`). ``made_from``
    describes ``cuts`` (e.g. the digest of the manifest they are read from): an existing ``manifest_path`` is
    reused only when its record has the same ``made_from`` and ``num_mel_bins`` and it is complete
    (:func:`incomplete_fbank`); otherwise it is computed again. Returns the result opened lazily.
    """
    import itertools

    lhotse = require("lhotse")
    from asrprec.data.stages import done_path, outdated, read_done, record_done
    from asrprec.data.manifests import write_cuts

    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    manifest_path, storage_dir = Path(manifest_path), Path(storage_dir)
    made_from = {**(made_from or {}), "num_mel_bins": num_mel_bins}
    stamp = done_path(manifest_path)
    why = outdated(stamp, made_from, [manifest_path]) or incomplete_fbank(manifest_path, read_done(stamp))
    if not why:
        log.info("features in %s exist; not recomputing (made from the same cuts, complete)", manifest_path)
        return lhotse.load_manifest_lazy(manifest_path)
    if manifest_path.exists():
        log.warning("features in %s cannot be reused: %s; recomputing", manifest_path, why)
    stamp.unlink(missing_ok=True)
    manifest_path.unlink(missing_ok=True)
    _start_chunks(storage_dir, made_from)
    chunk_manifests, left_out, n_in = [], [], 0
    executor = fbank_executor(num_jobs) if num_jobs > 1 else None
    try:
        it = iter(cuts)
        for i in itertools.count():
            chunk = list(itertools.islice(it, chunk_size))
            if not chunk:
                break
            path = storage_dir / f"chunk-{i:05d}.jsonl.gz"
            done = compute_fbank(lhotse.CutSet.from_cuts(chunk), storage_dir / f"chunk-{i:05d}", path,
                                 num_jobs=num_jobs, num_mel_bins=num_mel_bins, executor=executor,
                                 max_unreadable=max_unreadable - len(left_out))
            kept = set(done.ids)
            left_out += [c.id for c in chunk if c.id not in kept]
            n_in += len(chunk)
            chunk_manifests.append(path)
    finally:
        if executor is not None:
            executor.shutdown()
    n = write_cuts((c for p in chunk_manifests for c in lhotse.load_manifest_lazy(p)), manifest_path)
    record_done(stamp, made_from, [manifest_path], cuts_in=n_in, left_out=left_out)
    for p in chunk_manifests:
        p.unlink()
    log.info("fbank of %d cuts in %d chunks -> %s", n, len(chunk_manifests), manifest_path)
    return lhotse.load_manifest_lazy(manifest_path)


def _start_chunks(storage_dir: Path, made_from: dict[str, Any]) -> None:
    """Chunk manifests in ``storage_dir`` left by an interrupted run are reused only when that run had the same
    ``made_from`` (kept in ``storage_dir/made_from.json``); others are deleted."""
    import json

    from asrprec.atomic import atomic_write_text
    from asrprec.data.stages import read_done

    record = storage_dir / "made_from.json"
    wanted = json.loads(json.dumps(made_from, default=str))
    if read_done(record) != wanted:
        for old in storage_dir.glob("chunk-*.jsonl.gz"):
            old.unlink()
    atomic_write_text(record, json.dumps(wanted, sort_keys=True) + "\n")


def incomplete_fbank(manifest_path: Path | str, done: dict[str, Any]) -> str:
    """Why the fbank manifest is not complete ("" when it is): a cut without features, features whose storage is
    gone, or another count of cuts than the ``done`` record's ``cuts_in`` less its ``left_out``. Reads the manifest
    as JSON lines (no lhotse objects: 450k cuts of a 960 h part take seconds)."""
    import gzip
    import json
    import zlib

    if not isinstance(done.get("cuts_in"), int) or not isinstance(done.get("left_out"), list):
        return "its record holds no count of cuts"
    count, storage = 0, set()
    try:
        with gzip.open(manifest_path, "rt", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                cut = json.loads(line)
                if not cut.get("features"):
                    return f"cut {cut.get('id')} has no features"
                storage.add(cut["features"]["storage_path"])
                count += 1
    except (OSError, EOFError, zlib.error, ValueError, KeyError, TypeError) as e:
        return f"it is unreadable ({type(e).__name__}: {e})"
    gone = sorted(s for s in storage if not Path(s).exists())
    if gone:
        return f"{len(gone)} of its feature archives are gone, e.g. {gone[0]}"
    expected = done["cuts_in"] - len(done["left_out"])
    if count != expected:
        return f"it holds {count} cuts, not {expected} ({done['cuts_in']} less {len(done['left_out'])} left out)"
    return ""


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
    from .manifests import load_cuts

    hint = "run the data preparation first (e.g. python recipes/espeak/prepare.py)"
    return {split: load_cuts(Path(data_dir) / f"{prefix}_cuts_{split}_fbank.jsonl.gz", lazy=False, hint=hint)
            for split in splits}


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
