"""LibriSpeech and MUSAN through lhotse's own recipes: download (skipped when on disk), manifests, noise cuts.

What LibriSpeech and MUSAN look like on disk is lhotse's knowledge (``lhotse.recipes.librispeech`` and
``lhotse.recipes.musan``); this module adds what a staged, idempotent preparation needs around it:

* a corpus already on disk is never downloaded again (lhotse's downloader only trusts its own ``.completed``
  markers, so a copy unpacked by hand would be fetched a second time);
* manifests that exist are reused, and a part that produced nothing is an error naming the folder;
* the MUSAN noise cuts icefall mixes into training batches: every recording of music, speech and noise cut
  into 10 s windows, windows of 5 s or less dropped (k2-fsa/icefall
  ``egs/librispeech/ASR/local/compute_fbank_musan.py``).

Layout of ``corpus_dir`` (what lhotse's downloaders write): ``corpus_dir/LibriSpeech/<part>/<speaker>/<chapter>/``
with ``<speaker>-<chapter>-<utt>.flac`` and ``<speaker>-<chapter>.trans.txt``, and ``corpus_dir/musan/{music,
speech,noise}/<source>/*.wav``. ``corpus_dir`` may also be the ``LibriSpeech`` folder itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from asrprec._optional import require

log = logging.getLogger(__name__)

# The published training subsets (icefall: --full-libri False / True), the dev parts icefall validates on, and
# the test parts it reports.
LIBRISPEECH_TRAIN_PARTS = {
    "100h": ("train-clean-100",),
    "960h": ("train-clean-100", "train-clean-360", "train-other-500"),
}
LIBRISPEECH_DEV_PARTS = ("dev-clean", "dev-other")
LIBRISPEECH_TEST_PARTS = ("test-clean", "test-other")
MUSAN_PARTS = ("music", "speech", "noise")
_ALL_LIBRISPEECH_PARTS = LIBRISPEECH_TRAIN_PARTS["960h"] + LIBRISPEECH_DEV_PARTS + LIBRISPEECH_TEST_PARTS


def librispeech_parts(subset: str) -> tuple[str, ...]:
    """Every LibriSpeech part a ``subset`` ("100h" or "960h") needs: its training parts, then dev and test."""
    if subset not in LIBRISPEECH_TRAIN_PARTS:
        raise ValueError(f"unknown LibriSpeech subset {subset!r}; choose one of {', '.join(LIBRISPEECH_TRAIN_PARTS)}")
    return LIBRISPEECH_TRAIN_PARTS[subset] + LIBRISPEECH_DEV_PARTS + LIBRISPEECH_TEST_PARTS


def librispeech_root(corpus_dir: Path | str) -> Path:
    """The folder holding the LibriSpeech parts: ``corpus_dir/LibriSpeech``, or ``corpus_dir`` itself when it
    already is that folder (it holds part folders such as ``dev-clean``)."""
    corpus_dir = Path(corpus_dir)
    if corpus_dir.name == "LibriSpeech" or any((corpus_dir / p).is_dir() for p in _ALL_LIBRISPEECH_PARTS):
        return corpus_dir
    return corpus_dir / "LibriSpeech"


def _part_on_disk(part_dir: Path) -> bool:
    """A part holds transcripts, and is not an unpacking of lhotse's that was interrupted (its archive is still
    next to LibriSpeech/ without the ``.completed`` marker lhotse writes when unpacking ends)."""
    if not part_dir.is_dir() or next(part_dir.rglob("*.trans.txt"), None) is None:
        return False
    archive = part_dir.parent.parent / f"{part_dir.name}.tar.gz"
    return not archive.is_file() or (part_dir / ".completed").is_file()


def missing_librispeech_parts(corpus_dir: Path | str, parts: Sequence[str]) -> list[str]:
    """The ``parts`` with no folder holding transcripts (``*.trans.txt``) under :func:`librispeech_root`."""
    root = librispeech_root(corpus_dir)
    return [p for p in parts if not _part_on_disk(root / p)]


def download_librispeech(corpus_dir: Path | str, parts: Sequence[str]) -> Path:
    """Download and unpack the LibriSpeech ``parts`` not yet on disk (lhotse's downloader, from openslr.org).

    Returns :func:`librispeech_root`. Parts already unpacked under it are skipped, whoever unpacked them.
    """
    unknown = sorted(set(parts) - set(_ALL_LIBRISPEECH_PARTS))
    if unknown:
        raise ValueError(f"unknown LibriSpeech parts {unknown}; known: {', '.join(_ALL_LIBRISPEECH_PARTS)}")
    missing = missing_librispeech_parts(corpus_dir, parts)
    root = librispeech_root(corpus_dir)
    if not missing:
        log.info("LibriSpeech parts %s are on disk in %s; not downloading", ", ".join(parts), root)
        return root
    from lhotse.recipes import download_librispeech as lhotse_download

    log.info("downloading LibriSpeech %s into %s", ", ".join(missing), root.parent)
    lhotse_download(target_dir=root.parent, dataset_parts=list(missing))
    return root


def musan_root(corpus_dir: Path | str) -> Path:
    """``corpus_dir/musan``, or ``corpus_dir`` itself when it already is that folder."""
    corpus_dir = Path(corpus_dir)
    return corpus_dir if corpus_dir.name == "musan" or (corpus_dir / "noise").is_dir() else corpus_dir / "musan"


def _musan_on_disk(root: Path) -> bool:
    """Music, speech and noise hold audio, and it is not an interrupted unpacking of lhotse's (as above)."""
    if (root.parent / "musan.tar.gz").is_file() and not (root.parent / ".musan_completed").is_file():
        return False
    return all((root / p).is_dir() and next((root / p).rglob("*.wav"), None) is not None for p in MUSAN_PARTS)


def download_musan(corpus_dir: Path | str) -> Path:
    """Download and unpack MUSAN (lhotse's downloader) unless its music, speech and noise folders hold audio."""
    root = musan_root(corpus_dir)
    if _musan_on_disk(root):
        log.info("MUSAN is on disk in %s; not downloading", root)
        return root
    from lhotse.recipes import download_musan as lhotse_download

    log.info("downloading MUSAN into %s", root.parent)
    lhotse_download(target_dir=root.parent)
    return root


def librispeech_manifest_paths(manifest_dir: Path | str, part: str) -> dict[str, Path]:
    """Where lhotse's ``prepare_librispeech`` writes a part's recordings and supervisions."""
    manifest_dir = Path(manifest_dir)
    return {k: manifest_dir / f"librispeech_{k}_{part}.jsonl.gz" for k in ("recordings", "supervisions")}


def prepare_librispeech_manifests(
    corpus_dir: Path | str, parts: Sequence[str], manifest_dir: Path | str, *, num_jobs: int = 1
) -> dict[str, dict[str, Path]]:
    """lhotse's ``prepare_librispeech`` for ``parts`` (it reuses manifests already in ``manifest_dir``).

    Returns ``{part: {"recordings": path, "supervisions": path}}``. Raises FileNotFoundError naming the folder
    when a part is not on disk, and ValueError when a part holds no utterance with audio.
    """
    root = librispeech_root(corpus_dir)
    missing = missing_librispeech_parts(root, parts)
    if missing:
        raise FileNotFoundError(
            f"LibriSpeech parts {missing} are not in {root} (no <part>/<speaker>/<chapter>/*.trans.txt); fix: run "
            f"the download stage, or point --corpus-dir at the folder that holds LibriSpeech/"
        )
    paths = {p: librispeech_manifest_paths(manifest_dir, p) for p in parts}
    todo = [p for p in parts if not all(f.is_file() for f in paths[p].values())]
    if not todo:
        log.info("LibriSpeech manifests for %s are in %s; not re-reading the corpus", ", ".join(parts), manifest_dir)
        return paths
    from lhotse.recipes import prepare_librispeech

    Path(manifest_dir).mkdir(parents=True, exist_ok=True)
    manifests = prepare_librispeech(root, dataset_parts=list(todo), output_dir=manifest_dir, num_jobs=num_jobs)
    for p in todo:
        if p not in manifests or len(manifests[p]["recordings"]) == 0:
            raise ValueError(f"LibriSpeech part {p} in {root / p} gave no utterances with audio (each line of a "
                             f".trans.txt needs its <utterance-id>.flac next to it); fix: re-download the part")
        log.info("LibriSpeech %s: %d utterances", p, len(manifests[p]["recordings"]))
    return paths


def musan_manifest_paths(manifest_dir: Path | str) -> dict[str, Path]:
    """Where lhotse's ``prepare_musan`` writes each part's recordings."""
    return {p: Path(manifest_dir) / f"musan_recordings_{p}.jsonl.gz" for p in MUSAN_PARTS}


def prepare_musan_manifests(corpus_dir: Path | str, manifest_dir: Path | str) -> dict[str, Path]:
    """lhotse's ``prepare_musan`` (music with vocals included, as icefall), unless its recordings manifests exist."""
    paths = musan_manifest_paths(manifest_dir)
    if all(p.is_file() for p in paths.values()):
        log.info("MUSAN manifests are in %s; not re-reading the corpus", manifest_dir)
        return paths
    root = musan_root(corpus_dir)
    if not _musan_on_disk(root):
        raise FileNotFoundError(f"MUSAN is not in {root} (need music/, speech/ and noise/ with .wav files); fix: run "
                                f"the download stage, or point --corpus-dir at the folder that holds musan/")
    from lhotse.recipes import prepare_musan

    prepare_musan(root, output_dir=manifest_dir, parts=MUSAN_PARTS)
    return paths


def librispeech_cuts(manifest_dir: Path | str, part: str) -> Any:
    """One cut per utterance of ``part`` (eager CutSet) from its lhotse manifests."""
    lhotse = require("lhotse")
    paths = librispeech_manifest_paths(manifest_dir, part)
    for p in paths.values():
        if not p.is_file():
            raise FileNotFoundError(f"{p} is missing; fix: run the manifests stage first")
    return lhotse.CutSet.from_manifests(
        recordings=lhotse.RecordingSet.from_file(paths["recordings"]),
        supervisions=lhotse.SupervisionSet.from_file(paths["supervisions"]),
    )


def musan_noise_cuts(manifest_dir: Path | str, *, window_s: float = 10.0, min_s: float = 5.0) -> Any:
    """Every MUSAN recording (music, speech, noise) cut into ``window_s`` windows; windows of ``min_s`` or less are
    dropped (icefall's noise cuts). An eager CutSet without supervisions."""
    lhotse = require("lhotse")
    recordings = []
    for part, path in musan_manifest_paths(manifest_dir).items():
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; fix: run the manifests stage first")
        recordings.extend(lhotse.RecordingSet.from_file(path))
    cuts = lhotse.CutSet.from_manifests(recordings=lhotse.RecordingSet.from_recordings(recordings))
    windows = lhotse.CutSet.from_cuts(c for c in cuts.cut_into_windows(window_s) if c.duration > min_s)
    if len(windows) == 0:
        raise ValueError(f"no MUSAN recording in {manifest_dir} is longer than {min_s} s; fix: re-download MUSAN")
    return windows


def librispeech_transcripts(manifest_dir: Path | str, parts: Sequence[str]) -> list[str]:
    """The transcripts of ``parts`` from their supervision manifests (read lazily), e.g. to train the tokenizer."""
    lhotse = require("lhotse")
    texts = []
    for part in parts:
        path = librispeech_manifest_paths(manifest_dir, part)["supervisions"]
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; fix: run the manifests stage first")
        texts.extend(s.text for s in lhotse.SupervisionSet.from_jsonl_lazy(path))
    return texts


@dataclass(frozen=True)
class PreparedData:
    """Where the preparation of a corpus puts its outputs under one data folder (icefall's ``data/`` layout):

    * ``manifests/``: lhotse's recordings and supervisions, and ``<prefix>_cuts_<part>.jsonl.gz`` (cuts with
      audio only: speed-perturbed for training parts; what on-the-fly features read);
    * ``fbank/``: ``<prefix>_cuts_<part>.jsonl.gz`` with precomputed features, their arrays in
      ``<prefix>_feats_<part>/``, and ``musan_cuts.jsonl.gz`` (noise cuts with features and audio);
    * ``lang_bpe_<vocab>/bpe.model``: the tokenizer.

    The training cuts of a subset are the part ``train-<subset>-shuf`` (all its training parts, shuffled).
    """

    root: Path
    prefix: str = "librispeech"

    @property
    def manifest_dir(self) -> Path:
        return Path(self.root) / "manifests"

    @property
    def fbank_dir(self) -> Path:
        return Path(self.root) / "fbank"

    def cuts(self, part: str, *, features: bool = True) -> Path:
        return (self.fbank_dir if features else self.manifest_dir) / f"{self.prefix}_cuts_{part}.jsonl.gz"

    def feature_storage(self, part: str) -> Path:
        return self.fbank_dir / f"{self.prefix}_feats_{part}"

    @staticmethod
    def train_part(subset: str) -> str:
        return f"train-{subset}-shuf"

    @property
    def musan_cuts(self) -> Path:
        return self.fbank_dir / "musan_cuts.jsonl.gz"

    def bpe_model(self, vocab_size: int) -> Path:
        return Path(self.root) / f"lang_bpe_{vocab_size}" / "bpe.model"
