"""LibriSpeech and MUSAN through lhotse's own recipes: download (skipped when on disk), manifests, noise cuts.

What LibriSpeech and MUSAN look like on disk is lhotse's knowledge (``lhotse.recipes.librispeech`` and
``lhotse.recipes.musan``); this module adds what a staged, idempotent preparation needs around it:

* a corpus already on disk is never downloaded again (lhotse's downloader only trusts its own ``.completed``
  markers, so a copy unpacked by hand would be fetched a second time); downloads resume and are verified
  (:mod:`asrprec.data.download`);
* a stage's outputs are trusted on a rerun only when the record it writes last (``<output>.done.json``,
  :func:`outdated`) says they were made from the same inputs and settings and they have not changed since; otherwise
  the stage is done again. Every output is published atomically (:mod:`asrprec.atomic`): lhotse writes manifests
  into a temporary folder, from which each is published, so an interrupted preparation leaves nothing that a rerun
  would take for complete;
* a part that produced nothing is an error naming the folder;
* the MUSAN noise cuts icefall mixes into training batches: every recording of music, speech and noise cut
  into 10 s windows, windows of 5 s or less dropped (k2-fsa/icefall
  ``egs/librispeech/ASR/local/compute_fbank_musan.py``).

Layout of ``corpus_dir`` (what lhotse's downloaders write): ``corpus_dir/LibriSpeech/<part>/<speaker>/<chapter>/``
with ``<speaker>-<chapter>-<utt>.flac`` and ``<speaker>-<chapter>.trans.txt``, and ``corpus_dir/musan/{music,
speech,noise}/<source>/*.wav``. ``corpus_dir`` may also be the ``LibriSpeech`` folder itself.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from asrprec._optional import require
from asrprec.atomic import TEMPORARY_GLOB, atomic_path, publish
from asrprec.errors import AsrprecError

from .stages import DONE_SUFFIX, folder_fingerprint, outdated, record_done

log = logging.getLogger(__name__)


class CorpusError(AsrprecError, ValueError):
    """The corpus on disk (or its download) cannot be prepared as asked; the message names the folder and the
    fix (a recipe's ``run_main`` prints it as one line)."""


def _download(what: str, target: Path, fetch: Callable[[], Any]) -> Any:
    """``fetch()`` (:func:`asrprec.data.download.fetch` or ``unpack``); its failures become a CorpusError naming the
    fix: ``--corpus-dir`` when the network fails, a new download when the archive is wrong."""
    from asrprec.data.download import ArchiveError, DownloadError

    try:
        return fetch()
    except ArchiveError as e:
        raise CorpusError(f"{what}: {e}. Fix: rerun to download it again (if it fails the same way, pass another "
                          f"mirror as --openslr-url), or put the unpacked corpus in {target} and pass that folder as "
                          f"--corpus-dir") from None
    except DownloadError as e:
        raise CorpusError(f"could not download {what} ({e}). Fix: check the network and rerun (a partial download "
                          f"resumes), or put the corpus on disk and pass its folder as --corpus-dir (it must hold "
                          f"LibriSpeech/<part>/ and musan/)") from None


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


def download_librispeech(corpus_dir: Path | str, parts: Sequence[str], *, base_url: str | None = None) -> Path:
    """Download (resumably, verified: :func:`asrprec.data.download.fetch`) and unpack the LibriSpeech ``parts`` not
    yet on disk, from OpenSLR's resource 12 at ``base_url`` (:data:`~asrprec.data.download.OPENSLR_URL` by default).

    Returns :func:`librispeech_root`. Parts already unpacked under it are skipped, whoever unpacked them; the
    archives are kept next to ``LibriSpeech/`` as lhotse's downloader keeps them (delete them once unpacked).
    """
    from asrprec.data.download import OPENSLR_MD5, OPENSLR_URL, fetch

    unknown = sorted(set(parts) - set(_ALL_LIBRISPEECH_PARTS))
    if unknown:
        raise ValueError(f"unknown LibriSpeech parts {unknown}; known: {', '.join(_ALL_LIBRISPEECH_PARTS)}")
    missing = missing_librispeech_parts(corpus_dir, parts)
    root = librispeech_root(corpus_dir)
    if not missing:
        log.info("LibriSpeech parts %s are on disk in %s; not downloading", ", ".join(parts), root)
        return root
    base_url = (base_url or OPENSLR_URL).rstrip("/")
    log.info("downloading LibriSpeech %s into %s", ", ".join(missing), root.parent)
    for part in missing:
        name = f"12/{part}.tar.gz"
        archive = root.parent / f"{part}.tar.gz"
        what = f"LibriSpeech {part} into {root.parent}"
        _download(what, root.parent, lambda: fetch(f"{base_url}/{name}", archive, md5=OPENSLR_MD5.get(name)))
        _unpack(what, archive, root.parent, root / part / ".completed", [root / part])
    return root


def _unpack(what: str, archive: Path, target: Path, marker: Path, folders: Sequence[Path]) -> None:
    """Unpack ``archive`` into ``target`` after removing the ``folders`` it fills (what an interrupted unpacking
    left, as lhotse's downloader does); when it cannot be unpacked, its partial contents are removed again: with the
    archive deleted, they would pass for a corpus on disk."""
    from asrprec.data.download import unpack

    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    try:
        _download(what, target, lambda: unpack(archive, target, marker))
    except CorpusError:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        raise


def musan_root(corpus_dir: Path | str) -> Path:
    """``corpus_dir/musan``, or ``corpus_dir`` itself when it already is that folder."""
    corpus_dir = Path(corpus_dir)
    return corpus_dir if corpus_dir.name == "musan" or (corpus_dir / "noise").is_dir() else corpus_dir / "musan"


def _musan_on_disk(root: Path) -> bool:
    """Music, speech and noise hold audio, and it is not an interrupted unpacking of lhotse's (as above)."""
    if (root.parent / "musan.tar.gz").is_file() and not (root.parent / ".musan_completed").is_file():
        return False
    return all((root / p).is_dir() and next((root / p).rglob("*.wav"), None) is not None for p in MUSAN_PARTS)


def download_musan(corpus_dir: Path | str, *, base_url: str | None = None) -> Path:
    """Download (resumably, verified) and unpack MUSAN, OpenSLR's resource 17 at ``base_url``, unless its music,
    speech and noise folders hold audio."""
    from asrprec.data.download import OPENSLR_MD5, OPENSLR_URL, fetch

    root = musan_root(corpus_dir)
    if _musan_on_disk(root):
        log.info("MUSAN is on disk in %s; not downloading", root)
        return root
    base_url = (base_url or OPENSLR_URL).rstrip("/")
    name, archive, what = "17/musan.tar.gz", root.parent / "musan.tar.gz", f"MUSAN into {root.parent}"
    log.info("downloading %s", what)
    _download(what, root.parent, lambda: fetch(f"{base_url}/{name}", archive, md5=OPENSLR_MD5[name]))
    _unpack(what, archive, root.parent, root.parent / ".musan_completed", [root / p for p in MUSAN_PARTS])
    return root


def librispeech_manifest_paths(manifest_dir: Path | str, part: str) -> dict[str, Path]:
    """Where lhotse's ``prepare_librispeech`` writes a part's recordings and supervisions."""
    manifest_dir = Path(manifest_dir)
    return {k: manifest_dir / f"librispeech_{k}_{part}.jsonl.gz" for k in ("recordings", "supervisions")}


def prepare_librispeech_manifests(
    corpus_dir: Path | str, parts: Sequence[str], manifest_dir: Path | str, *, num_jobs: int = 1,
    max_bad_lines: int = 0, max_bad_audio: int = 0,
) -> dict[str, dict[str, Path]]:
    """lhotse's ``prepare_librispeech`` for the ``parts`` whose manifests in ``manifest_dir`` are not current: a
    part's manifests are reused when its record (``librispeech_<part>.done.json``) holds the same
    :func:`folder_fingerprint` of the part's audio and transcripts and the manifests are unchanged (:func:`outdated`).

    Transcript lines that are not ``<utterance-id> <text>`` (:func:`malformed_transcript_lines`) are named in the
    log and their utterances left out, up to ``max_bad_lines`` in all; a part holding some is read line by line
    through lhotse's own ``parse_utterance``, which lhotse's recipe would stop on with a bare ValueError. A part whose
    audio lhotse cannot open (a corrupt FLAC header) is read the same way, and each such file is named and its
    utterance left out, up to ``max_bad_audio`` per part.

    Returns ``{part: {"recordings": path, "supervisions": path}}``. Raises FileNotFoundError naming the folder
    when a part is not on disk, CorpusError for more than ``max_bad_lines`` malformed lines (naming them by file and
    line), and ValueError when a part holds no utterance with audio.
    """
    root = librispeech_root(corpus_dir)
    missing = missing_librispeech_parts(root, parts)
    if missing:
        raise FileNotFoundError(
            f"LibriSpeech parts {missing} are not in {root} (no <part>/<speaker>/<chapter>/*.trans.txt); fix: run "
            f"the download stage, or point --corpus-dir at the folder that holds LibriSpeech/"
        )
    paths = {p: librispeech_manifest_paths(manifest_dir, p) for p in parts}
    stamps = {p: Path(manifest_dir) / f"librispeech_{p}{DONE_SUFFIX}" for p in parts}
    made_from = {p: {"corpus": folder_fingerprint(root / p, (".flac", ".txt"))} for p in parts}
    stale = {p: outdated(stamps[p], made_from[p], list(paths[p].values())) for p in parts}
    todo = [p for p in parts if stale[p]]
    if not todo:
        log.info("LibriSpeech manifests for %s are in %s and match the corpus; not re-reading it", ", ".join(parts),
                 manifest_dir)
        return paths
    for p in todo:
        if any(f.is_file() for f in paths[p].values()):
            log.warning("LibriSpeech manifests of %s in %s: %s; re-reading the corpus", p, manifest_dir, stale[p])
        stamps[p].unlink(missing_ok=True)
    bad = {p: malformed_transcript_lines(root / p) for p in todo}
    named = [f"{path}:{i}: {why}" for p in todo for path, i, why in bad[p]]
    if len(named) > max_bad_lines:
        shown = "; ".join(named[:10]) + (f"; ... ({len(named)} in all)" if len(named) > 10 else "")
        raise CorpusError(f"{len(named)} transcript line(s) in {root} are not '<utterance-id> <text>': {shown}. Fix: "
                          "repair them from the original archive (re-download the part), or raise --max-bad-lines "
                          f"(now {max_bad_lines}) to leave those utterances out")
    for line in named:
        log.warning("leaving out the utterance of %s", line)
    from lhotse.recipes import prepare_librispeech

    clean = [p for p in todo if not bad[p]]
    manifests: dict[str, Any] = {}
    if clean:
        try:
            manifests = _prepare_atomically(manifest_dir, lambda out: prepare_librispeech(
                root, dataset_parts=clean, output_dir=out, num_jobs=num_jobs))
        except Exception as e:  # lhotse stops on the first file it cannot open, without naming it
            log.warning("lhotse's LibriSpeech recipe stopped (%s: %s); reading %s line by line to name the audio it "
                        "cannot open", type(e).__name__, str(e)[:200], ", ".join(clean))
    for p in todo:
        if p not in manifests:
            skip = {(path, i) for path, i, _ in bad[p]}
            manifests[p] = _prepare_atomically(
                manifest_dir, lambda out: _part_manifests(root / p, p, skip, out, max_bad_audio))
    for p in todo:
        if p not in manifests or len(manifests[p]["recordings"]) == 0:
            raise ValueError(f"LibriSpeech part {p} in {root / p} gave no utterances with audio (each line of a "
                             f".trans.txt needs its <utterance-id>.flac next to it); fix: re-download the part")
        log.info("LibriSpeech %s: %d utterances", p, len(manifests[p]["recordings"]))
        record_done(stamps[p], made_from[p], list(paths[p].values()), utterances=len(manifests[p]["recordings"]),
                    left_out=[f"{path}:{i}: {w}" for path, i, w in bad[p]])
    return paths


def malformed_transcript_lines(part_dir: Path) -> list[tuple[Path, int, str]]:
    """``(file, line number, why)`` for each line of the part's ``*.trans.txt`` that is not ``<utterance-id> <text>``
    with an id of the file's chapter."""
    out = []
    for trans in sorted(Path(part_dir).rglob("*.trans.txt")):
        for i, raw in enumerate(trans.read_bytes().splitlines(), 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                out.append((trans, i, f"not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})"))
                continue
            fields = line.split(maxsplit=1)
            if not fields:
                why = "empty line"
            elif len(fields) < 2:
                why = f"no text after {fields[0]!r}"
            elif not fields[0].startswith(trans.name.removesuffix(".trans.txt") + "-"):
                why = f"utterance id {fields[0]!r} is not of this chapter"
            else:
                continue
            out.append((trans, i, why))
    return out


def _part_manifests(part_dir: Path, part: str, skip: set[tuple[Path, int]], out: Path,
                    max_bad_audio: int = 0) -> dict[str, Any]:
    """A part's recordings and supervisions as lhotse's recipe makes them (its ``parse_utterance`` on each line,
    lhotse/recipes/librispeech.py), leaving out the lines in ``skip``; written into ``out`` under lhotse's names."""
    from lhotse import RecordingSet, SupervisionSet
    from lhotse.qa import fix_manifests, validate_recordings_and_supervisions
    from lhotse.recipes.librispeech import parse_utterance

    recordings, supervisions, unreadable = [], [], []
    for trans in sorted(part_dir.rglob("*.trans.txt")):
        for i, line in enumerate(trans.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if (trans, i) in skip:
                continue
            try:
                parsed = parse_utterance(part_dir, line, {})
            except Exception as e:  # soundfile / audioread on a file that is not audio
                unreadable.append(f"{trans.parent / line.split()[0]}.flac ({type(e).__name__}: {str(e)[:120]})")
                continue
            if parsed is not None:
                recordings.append(parsed[0])
                supervisions.append(parsed[1])
    if len(unreadable) > max_bad_audio:
        shown = "; ".join(unreadable[:10]) + (f"; ... ({len(unreadable)} in all)" if len(unreadable) > 10 else "")
        raise CorpusError(f"LibriSpeech {part}: {len(unreadable)} audio file(s) cannot be read: {shown}. Fix: "
                          "re-download the part, or raise --max-bad-audio (now "
                          f"{max_bad_audio}) to leave those utterances out")
    for name in unreadable:
        log.warning("left out %s: its audio could not be read", name)
    recs, sups = fix_manifests(RecordingSet.from_recordings(recordings), SupervisionSet.from_segments(supervisions))
    validate_recordings_and_supervisions(recs, sups)
    paths = librispeech_manifest_paths(out, part)
    for manifest, path in ((recs, paths["recordings"]), (sups, paths["supervisions"])):
        with atomic_path(path) as tmp:
            manifest.to_file(tmp)
    return {"recordings": recs, "supervisions": sups}


def musan_manifest_paths(manifest_dir: Path | str) -> dict[str, Path]:
    """Where lhotse's ``prepare_musan`` writes each part's recordings."""
    return {p: Path(manifest_dir) / f"musan_recordings_{p}.jsonl.gz" for p in MUSAN_PARTS}


def prepare_musan_manifests(corpus_dir: Path | str, manifest_dir: Path | str) -> dict[str, Path]:
    """lhotse's ``prepare_musan`` (music with vocals included, as icefall), unless its recordings manifests exist."""
    paths = musan_manifest_paths(manifest_dir)
    root = musan_root(corpus_dir)
    if all(p.is_file() for p in paths.values()):
        stale = _stale_musan_manifests(paths, root)
        if not stale:
            log.info("MUSAN manifests are in %s; not re-reading the corpus", manifest_dir)
            return paths
        log.warning("MUSAN manifests in %s do not match %s (%s); re-reading the corpus", manifest_dir, root, stale)
    if not _musan_on_disk(root):
        raise FileNotFoundError(f"MUSAN is not in {root} (need music/, speech/ and noise/ with .wav files); fix: run "
                                f"the download stage, or point --corpus-dir at the folder that holds musan/")
    from lhotse.recipes import prepare_musan

    _prepare_atomically(manifest_dir, lambda out: prepare_musan(root, output_dir=out, parts=MUSAN_PARTS))
    return paths


def _stale_musan_manifests(paths: dict[str, Path], root: Path) -> str:
    """Why the MUSAN manifests no longer describe the audio in ``root`` ("" when they do): a recording whose file
    is gone or has another length, or audio files they do not list. MUSAN's ~2,000 headers are read in seconds."""
    import soundfile

    lhotse = require("lhotse")
    listed, changed = set(), []
    for path in paths.values():
        for rec in lhotse.RecordingSet.from_file(path):
            source = Path(rec.sources[0].source)
            listed.add(source.resolve())
            try:
                if soundfile.info(str(source)).frames != rec.num_samples:
                    changed.append(rec.id)
            except (OSError, RuntimeError):
                changed.append(rec.id)
    unlisted = [w for w in root.rglob("*.wav") if w.resolve() not in listed]
    why = [f"{len(changed)} recording(s) changed or missing, e.g. {changed[0]}" if changed else "",
           f"{len(unlisted)} new file(s), e.g. {unlisted[0].name}" if unlisted else ""]
    return "; ".join(w for w in why if w)


def _prepare_atomically(manifest_dir: Path | str, prepare: Callable[[Path], Any]) -> Any:
    """``prepare(folder)`` (a lhotse recipe writing its manifests into ``folder``) on a temporary folder inside
    ``manifest_dir``; then each manifest it wrote is published into ``manifest_dir``. Returns what it returned."""
    manifest_dir = Path(manifest_dir)
    manifest_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=TEMPORARY_GLOB[:-1], dir=manifest_dir))
    try:
        out = prepare(tmp)
        for written in sorted(tmp.glob("*.jsonl.gz")):
            publish(written, manifest_dir / written.name)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
    dropped (icefall's noise cuts), and a count of the recordings that gave none is logged. An eager CutSet without
    supervisions.

    Raises:
        CorpusError: no recording is longer than ``min_s`` (the message gives the longest and the flags to lower).
    """
    lhotse = require("lhotse")
    if not 0 < min_s < window_s:
        raise CorpusError(f"MUSAN noise windows need 0 < --musan-min-s < --musan-window-s, got --musan-min-s {min_s:g} "
                          f"and --musan-window-s {window_s:g}; fix: a --musan-min-s below --musan-window-s")
    recordings = []
    for part, path in musan_manifest_paths(manifest_dir).items():
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; fix: run the manifests stage first")
        recordings.extend(lhotse.RecordingSet.from_file(path))
    cuts = lhotse.CutSet.from_manifests(recordings=lhotse.RecordingSet.from_recordings(recordings))
    windows = lhotse.CutSet.from_cuts(c for c in cuts.cut_into_windows(window_s) if c.duration > min_s)
    short = [r for r in recordings if r.duration <= min_s]
    if short:
        log.warning("MUSAN: %d of %d recordings are %g s or shorter and give no noise window (e.g. %s); lower "
                    "--musan-min-s to use them", len(short), len(recordings), min_s,
                    ", ".join(f"{r.id} ({r.duration:.1f} s)" for r in short[:3]))
    if len(windows) == 0:
        longest = max((r.duration for r in recordings), default=0.0)
        raise CorpusError(f"no MUSAN recording in {manifest_dir} is longer than {min_s:g} s (the longest: "
                          f"{longest:.1f} s, of {len(recordings)}). Fix: lower --musan-min-s (and --musan-window-s), "
                          "or re-download MUSAN")
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
    * ``lang_bpe_<vocab>/bpe.model``: the tokenizer;
    * beside each manifest a stage made, ``<name>.done.json``: what it was made from (:func:`outdated`); in each
      features folder, ``made_from.json``: the inputs of the chunks computed so far.

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

    def tokenizer_model(self, vocab_size: int) -> Path:
        """:meth:`bpe_model`, which must exist; FileNotFoundError names the sizes prepared instead."""
        path = self.bpe_model(vocab_size)
        if not path.is_file():
            made = sorted(int(p.parent.name.removeprefix("lang_bpe_")) for p in Path(self.root).glob("lang_bpe_*/bpe.model")
                          if p.parent.name.removeprefix("lang_bpe_").isdigit())
            also = (f"; {self.root} holds the tokenizer(s) of --vocab-size {', '.join(map(str, made))}" if made
                    else "")
            raise FileNotFoundError(f"no tokenizer {path}{also}. Fix: pass the --vocab-size prepare.py used, or run "
                                    f"prepare.py --stage 5 --vocab-size {vocab_size}")
        return path
