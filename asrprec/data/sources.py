"""A corpus of one's own as 16 kHz mono cuts: Kaldi data dirs, NeMo manifests and lhotse manifests.

A source (``SRC``) is one of:

* a Kaldi data dir: ``wav.scp`` (paths, or commands ending in ``|``), ``text``, optional ``segments`` and
  ``utt2spk``; what the files mean is lhotse's ``load_kaldi_data_dir`` (``segments`` honoured, an end of -1 is the
  end of the recording);
* a NeMo manifest (``.json``/``.jsonl``): a JSON object per line with ``audio_filepath``, ``duration``, ``text`` and
  optional ``offset``; a relative path is taken relative to the manifest's folder when the file is there (NeMo's
  ``nemo/collections/common/parts/preprocessing/manifest.py``, ``get_full_path``), else to the current folder;
* a lhotse manifest: a CutSet (``.jsonl``/``.jsonl.gz``), a ``RECORDINGS,SUPERVISIONS`` pair, or a folder holding
  one cuts manifest or one recordings and one supervisions manifest. A cut with several supervisions gives one cut
  per supervision.

:func:`detect_format` tells them apart; ``ImportOptions.format`` overrides it. Every cut is 16 kHz mono with one
supervision: a recording at another rate is resampled lazily (lhotse's ``Recording.resample``, applied when the
audio is read); a cut that uses several channels of a recording gets that recording mixed down (the mean of the
channels, resampled) into ``audio_dir/<recording id>.flac`` once, because lhotse's feature extractors read only
the first channel of a multi-channel cut.

Bad data is counted, named (file and line) and left out: lines that are empty, not UTF-8, malformed or without
text (``max_bad_lines`` per split), and audio that is missing or cannot be read (``max_bad_audio`` per split); more
is a :class:`~asrprec.data.corpora.CorpusError` naming them and the flag.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from asrprec.config import option

from .corpora import CorpusError
from .source_formats import (
    MANIFEST_SUFFIXES, READERS, SAMPLE_RATE, TEXT_NORMS, Builder, Problems, lhotse_folder, normalize_text, read_lines,
)

__all__ = ["SAMPLE_RATE", "SOURCE_FORMATS", "TEXT_NORMS", "ImportOptions", "Problems", "detect_format",
           "import_split", "normalize_text", "prepared_splits", "read_source", "source_files", "source_path",
           "split_name", "test_split_names", "write_splits"]

log = logging.getLogger(__name__)

SOURCE_FORMATS = ("kaldi", "nemo", "lhotse")


@dataclass(frozen=True)
class ImportOptions:
    """How :func:`import_split` reads a corpus's sources (the flags of ``recipes/custom/prepare.py``)."""

    format: str = option("auto", choices=("auto", *SOURCE_FORMATS),
                         help="what every SRC is: a Kaldi data dir, a NeMo manifest or a lhotse manifest (auto: "
                              "detected per SRC)")
    text_norm: str = option("none", choices=TEXT_NORMS,
                            help="transcripts as they are (none), or upper-case without punctuation but apostrophes "
                                 "(upper, as LibriSpeech's)")
    max_bad_lines: int = option(100, help="lines that are empty, not UTF-8, malformed or without text are named and "
                                          "left out, up to this many per split; more stop the preparation")
    max_bad_audio: int = option(100, help="audio files that are missing or cannot be read are named and their "
                                          "utterances left out, up to this many per split; more stop the preparation")

    def __post_init__(self) -> None:
        if self.format not in ("auto", *SOURCE_FORMATS):
            raise ValueError(f"format must be auto or one of {', '.join(SOURCE_FORMATS)}, got {self.format!r}")
        if self.text_norm not in TEXT_NORMS:
            raise ValueError(f"text_norm must be one of {', '.join(TEXT_NORMS)}, got {self.text_norm!r}")


def _named(src: str) -> tuple[str, str]:
    """``NAME=SRC`` -> (NAME, SRC); a plain SRC -> ("", SRC)."""
    name, sep, rest = src.partition("=")
    if sep and name and "/" not in name and "," not in name:
        return name, rest
    return "", src


def split_name(src: str) -> str:
    """A test split's name: ``NAME`` of ``NAME=SRC``, else the folder's or the manifest's name without its
    suffixes (``data/test_other`` -> ``test_other``, ``test-clean.jsonl`` -> ``test-clean``)."""
    name, src = _named(src)
    if name:
        return name
    path = Path(src.split(",")[0])
    base = path.name
    for suffix in MANIFEST_SUFFIXES:
        if base.endswith(suffix):
            return base[: -len(suffix)]
    return base


def source_path(src: str) -> str:
    """SRC without its ``NAME=``."""
    return _named(src)[1]


def detect_format(src: str) -> str:
    """``kaldi``, ``nemo`` or ``lhotse`` for a source (see the module doc); a CorpusError names a source that is
    neither, and ``--format``."""
    src = source_path(src)
    fix = "Fix: pass a Kaldi data dir (with wav.scp), a NeMo manifest (.json/.jsonl) or a lhotse manifest, or --format"
    if "," in src:
        return "lhotse"
    path = Path(src)
    if path.is_dir():
        if (path / "wav.scp").is_file():
            return "kaldi"
        if lhotse_folder(path):
            return "lhotse"
        raise CorpusError(f"{path} holds neither wav.scp (a Kaldi data dir) nor lhotse manifests. {fix}")
    if not path.is_file():
        raise CorpusError(f"no such file or folder: {path}. {fix}")
    if path.name.endswith(".gz"):
        return "lhotse"
    for _, line, _why in read_lines(path):
        if line is None or not line.strip():
            continue
        try:
            first = json.loads(line)
        except ValueError:
            break
        if isinstance(first, dict) and "audio_filepath" in first:
            return "nemo"
        if isinstance(first, (dict, list)):
            return "lhotse"
        break
    raise CorpusError(f"cannot tell what {path} is (its first line is neither a NeMo nor a lhotse manifest entry). {fix}")


def source_files(src: str, fmt: str) -> list[Path]:
    """The files a source is read from (what a stage record digests)."""
    src = source_path(src)
    if fmt == "kaldi":
        return [Path(src) / n for n in ("wav.scp", "text", "segments", "utt2spk") if (Path(src) / n).is_file()]
    if fmt == "lhotse":
        if "," in src:
            return [Path(p) for p in src.split(",")]
        if Path(src).is_dir():
            return list(lhotse_folder(Path(src)).values())
    return [Path(src)]



def read_source(src: str, options: ImportOptions, audio_dir: Path | str) -> tuple[list[Any], Problems]:
    """The 16 kHz mono cuts of one source and what was left out (nothing raised for bad data; see
    :func:`import_split`)."""
    fmt = detect_format(src) if options.format == "auto" else options.format
    path = source_path(src)
    if fmt == "kaldi" and not (Path(path) / "wav.scp").is_file():
        raise CorpusError(f"{path} is not a Kaldi data dir (no wav.scp). Fix: check the path, or --format")
    b = Builder(options.text_norm, Path(audio_dir))
    cuts = READERS[fmt](path, b)
    log.info("%s (%s): %d utterances, %d line(s) and %d audio file(s) left out", path, fmt, len(cuts),
             len(b.problems.lines), len(b.problems.audio))
    return cuts, b.problems


def import_split(srcs: Sequence[str], options: ImportOptions, out: Path | str, audio_dir: Path | str) -> dict:
    """Read ``srcs`` (:func:`read_source`) into one manifest ``out`` (written atomically) of 16 kHz mono cuts;
    mixed-down recordings go to ``audio_dir/<k>-<name of the k-th source>/``.

    Returns the facts for the stage record: ``cuts`` and ``left_out`` (every problem, named). Raises CorpusError
    for more than ``max_bad_lines`` bad lines or ``max_bad_audio`` bad audio files in all ``srcs`` (naming them and
    the flag), for an utterance id two sources share, and when nothing is left.
    """
    from .manifests import write_cuts

    cuts, problems, seen = [], Problems(), {}
    for k, src in enumerate(srcs):
        got, p = read_source(src, options, Path(audio_dir) / f"{k}-{split_name(src)}")
        problems.lines += p.lines
        problems.audio += p.audio
        for c in got:
            if c.id in seen:
                raise CorpusError(f"utterance {c.id!r} is in both {seen[c.id]} and {source_path(src)}. Fix: give the "
                                  "sources distinct utterance ids (or prepare them as separate splits)")
            seen[c.id] = source_path(src)
        cuts += got
    for kind, found, limit, flag in (("line", problems.lines, options.max_bad_lines, "--max-bad-lines"),
                                     ("audio file", problems.audio, options.max_bad_audio, "--max-bad-audio")):
        if len(found) > limit:
            shown = "; ".join(found[:10]) + (f"; ... ({len(found)} in all)" if len(found) > 10 else "")
            raise CorpusError(f"{len(found)} bad {kind}(s) in {', '.join(source_path(s) for s in srcs)}: {shown}. "
                              f"Fix: repair them, or raise {flag} (now {limit}) to leave their utterances out")
        for named in found:
            log.warning("left out: %s", named)
    if not cuts:
        raise CorpusError(f"no usable utterance in {', '.join(source_path(s) for s in srcs)}. Fix: check the paths, "
                          "the format (--format) and the log's reasons")
    n = write_cuts(cuts, out)
    return {"cuts": n, "left_out": problems.lines + problems.audio, "bad_lines": len(problems.lines),
            "bad_audio": len(problems.audio)}



# -- the splits of a prepared corpus -------------------------------------------------------------------------------

SPLITS_FILE = "splits.json"


def test_split_names(tests: Sequence[str]) -> list[str]:
    """The names of the test splits (:func:`split_name`); a CorpusError when two are the same or one is taken."""
    names = [split_name(t) for t in tests]
    clash = sorted({n for n in names if names.count(n) > 1 or n in ("train", "dev") or n.startswith("train-")})
    if clash:
        raise CorpusError(f"test split name(s) {', '.join(clash)} are taken (twice, or train/dev). Fix: name each "
                          "test source, e.g. --test other=path/to/test_other")
    return names


def write_splits(root: Path | str, splits: dict[str, list[str]]) -> None:
    """Record which sources each prepared split was read from (``root/splits.json``), for decoding to list them."""
    from asrprec.atomic import atomic_write_text

    atomic_write_text(Path(root) / SPLITS_FILE, json.dumps(splits, indent=1) + "\n")


def prepared_splits(root: Path | str) -> dict[str, list[str]]:
    """``{split: [sources]}`` as :func:`write_splits` recorded it; FileNotFoundError names prepare.py."""
    path = Path(root) / SPLITS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; fix: run python recipes/custom/prepare.py with this --data-dir")
    return json.loads(path.read_text())
