"""The readers of :mod:`asrprec.data.sources`: Kaldi data dirs, NeMo manifests and lhotse manifests as 16 kHz mono
cuts with one supervision each, what they leave out named in a :class:`Problems` (the module doc of
:mod:`asrprec.data.sources` says what each format may hold and how audio is resampled and mixed down)."""

from __future__ import annotations

import gzip
import io
import json
import logging
import shutil
import subprocess
import tempfile
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from asrprec._optional import require
from asrprec.atomic import TEMPORARY_GLOB, atomic_path

from .corpora import CorpusError

log = logging.getLogger(__name__)

TEXT_NORMS = ("none", "upper")
SAMPLE_RATE = 16000
MANIFEST_SUFFIXES = (".jsonl.gz", ".json.gz", ".jsonl", ".json")
_NEMO_KEYS = ("audio_filepath", "duration", "text")


@dataclass
class Problems:
    """What a source's reading left out: ``lines`` and ``audio``, each ``"<file>:<line>: <why>"``."""

    lines: list[str] = field(default_factory=list)
    audio: list[str] = field(default_factory=list)


def normalize_text(text: str, mode: str) -> str:
    """``text`` with its whitespace collapsed; under ``upper`` also upper-cased, every character that is no letter,
    digit or apostrophe made a space (LibriSpeech's transcripts: ``"Don't, he said."`` -> ``"DON'T HE SAID"``)."""
    if mode == "upper":
        text = "".join(c if c.isalnum() or c == "'" or unicodedata.category(c) == "Mn" else " " for c in text.upper())
    elif mode != "none":
        raise ValueError(f"text normalisation must be one of {', '.join(TEXT_NORMS)}, got {mode!r}")
    return " ".join(text.split())


def lhotse_folder(path: Path) -> dict[str, Path]:
    """The manifests of a lhotse folder: ``{"cuts": p}`` or ``{"recordings": p, "supervisions": p}`` ({} if none)."""
    found: dict[str, list[Path]] = {k: [] for k in ("cuts", "recordings", "supervisions")}
    for p in sorted(path.iterdir()):
        if p.is_file() and p.name.endswith(MANIFEST_SUFFIXES):
            for kind in found:
                if kind in p.name:
                    found[kind].append(p)
    if len(found["cuts"]) == 1:
        return {"cuts": found["cuts"][0]}
    if len(found["recordings"]) == 1 and len(found["supervisions"]) == 1:
        return {"recordings": found["recordings"][0], "supervisions": found["supervisions"][0]}
    return {}


def read_lines(path: Path) -> Iterator[tuple[int, str | None, str]]:
    """``(line number, text, "")`` for each line of ``path`` (gzip when it ends in .gz), or ``(n, None, why)`` for a
    line that is not UTF-8."""
    with (gzip.open if path.name.endswith(".gz") else open)(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            try:
                yield i, raw.decode("utf-8").rstrip("\r\n"), ""
            except UnicodeDecodeError as e:
                yield i, None, f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"


# -- audio ---------------------------------------------------------------------------------------------------------


def _probe(rec_id: str, source: str) -> Any:
    """The Recording of a wav.scp entry or an audio file: its real rate, channels and length (a command ending in
    ``|`` is run once). Raises FileNotFoundError or another exception when it cannot be read."""
    lhotse = require("lhotse")
    if source.endswith("|"):
        import soundfile

        cmd = source[:-1].strip()
        out = subprocess.run(cmd, shell=True, capture_output=True, check=True).stdout
        info = soundfile.info(io.BytesIO(out))
        return lhotse.Recording(id=rec_id, sources=[lhotse.audio.AudioSource("command", list(range(info.channels)), cmd)],
                                sampling_rate=info.samplerate, num_samples=info.frames,
                                duration=info.frames / info.samplerate)
    if not Path(source).is_file():
        raise FileNotFoundError("no such file")
    return lhotse.Recording.from_file(source, recording_id=rec_id)


def _mixed_down(rec: Any, audio_dir: Path) -> Any:
    """``rec`` at 16 kHz and one channel: mixed down (channel mean) into ``audio_dir/<id>.flac`` when it has several
    channels, else resampled lazily when its rate is not 16 kHz."""
    lhotse = require("lhotse")
    if rec.num_channels > 1:
        import soundfile

        out = audio_dir / f"{rec.id.replace('/', '_')}.flac"
        samples = (rec.resample(SAMPLE_RATE) if rec.sampling_rate != SAMPLE_RATE else rec).load_audio().mean(axis=0)
        with atomic_path(out) as tmp:
            soundfile.write(str(tmp), samples, SAMPLE_RATE, format="FLAC", subtype="PCM_24")
        log.info("%s: %d channels at %d Hz mixed down to %s", rec.id, rec.num_channels, rec.sampling_rate, out)
        return lhotse.Recording.from_file(out, recording_id=rec.id)
    return rec.resample(SAMPLE_RATE) if rec.sampling_rate != SAMPLE_RATE else rec


class Builder:
    """Makes the cuts of one source: recordings probed and mixed down once each, problems collected."""

    def __init__(self, text_norm: str, audio_dir: Path) -> None:
        self.text_norm, self.audio_dir, self.problems = text_norm, audio_dir, Problems()
        self.recordings: dict[str, Any] = {}
        self._mono: dict[str, Any] = {}

    def recording(self, key: str, rec_id: str, source: str, where: str) -> Any | None:
        """The probed recording of ``source`` (cached by ``key``), or None after naming the problem at ``where``."""
        if key not in self.recordings:
            try:
                self.recordings[key] = _probe(rec_id, source)
            except FileNotFoundError:
                self.problems.audio.append(f"{where}: {source}: no such file")
                self.recordings[key] = None
            except Exception as e:  # soundfile, lhotse's backends and a failing command raise many kinds
                self.problems.audio.append(f"{where}: {source}: cannot be read ({type(e).__name__}: {e})")
                self.recordings[key] = None
        return self.recordings[key]

    def text(self, text: Any, where: str) -> str | None:
        if not isinstance(text, str):
            self.problems.lines.append(f"{where}: the text is not a string")
            return None
        norm = normalize_text(text, self.text_norm)
        if not norm:
            self.problems.lines.append(f"{where}: empty text" + (" after normalisation" if text.strip() else ""))
            return None
        return norm

    def cut(self, cut_id: str, rec: Any, start: float, duration: float, text: str, where: str, *,
            channel: int | None = None, speaker: str | None = None) -> Any | None:
        """A 16 kHz mono cut with one supervision: ``channel`` of ``rec``, or all its channels mixed down (None)."""
        lhotse = require("lhotse")
        if duration <= 0 or start < 0 or start + duration > rec.duration + 0.02:
            self.problems.lines.append(f"{where}: the segment {start:g} s + {duration:g} s does not lie within the "
                                       f"{rec.duration:g} s of {rec.id}")
            return None
        duration = min(duration, rec.duration - start)
        if channel is None or rec.num_channels == 1:
            if rec.id not in self._mono:
                self._mono[rec.id] = _mixed_down(rec, self.audio_dir)
            rec = self._mono[rec.id]
            channel = rec.channel_ids[0]
        elif rec.sampling_rate != SAMPLE_RATE:
            rec = rec.resample(SAMPLE_RATE)
        sup = lhotse.SupervisionSegment(id=cut_id, recording_id=rec.id, start=0.0, duration=duration, channel=channel,
                                        text=text, speaker=speaker)
        return lhotse.MonoCut(id=cut_id, start=start, duration=duration, channel=channel, recording=rec,
                              supervisions=[sup])


# -- Kaldi -----------------------------------------------------------------------------------------------------------


def _kaldi_table(path: Path, problems: Problems, named: set[str], *,
                 fields: int | None = None) -> dict[str, tuple[int, str]]:
    """``{id: (line number, rest of the line)}`` of a Kaldi table; bad lines named in ``problems``, their ids (as
    far as they can be read) added to ``named`` so that a fault is counted once."""
    table: dict[str, tuple[int, str]] = {}
    if not path.is_file():
        return table
    with open(path, "rb") as f:
        raw_ids = [(raw.split(maxsplit=1) or [b""])[0].decode("utf-8", errors="replace") for raw in f]
    for i, line, why in read_lines(path):
        where = f"{path}:{i}"
        if line is None:
            problems.lines.append(f"{where}: {why}")
            named.add(raw_ids[i - 1])
            continue
        parts = line.split(maxsplit=1)
        if not parts:
            problems.lines.append(f"{where}: empty line")
        elif len(parts) < 2:
            problems.lines.append(f"{where}: no {'text' if path.name == 'text' else 'value'} after {parts[0]!r}")
            named.add(parts[0])
        elif fields is not None and len(line.split()) != fields:
            problems.lines.append(f"{where}: {len(line.split())} fields, not {fields}")
            named.add(parts[0])
        elif parts[0] in table:
            problems.lines.append(f"{where}: {parts[0]!r} again (first on line {table[parts[0]][0]})")
        else:
            table[parts[0]] = (i, parts[1].strip())
    return table


def _read_kaldi(folder: Path, b: Builder) -> list[Any]:
    """The cuts of a Kaldi data dir. Its clean lines are written into a temporary copy (with ``reco2dur`` from the
    probed audio, and ``utt2spk`` when it has none) that lhotse's ``load_kaldi_data_dir`` reads for the supervisions;
    the recordings are the probed ones (lhotse's take every file to be at the rate it is given)."""
    from lhotse.kaldi import load_kaldi_data_dir

    p, named = b.problems, set()
    wav = _kaldi_table(folder / "wav.scp", p, named)
    text = _kaldi_table(folder / "text", p, named)
    utt2spk = _kaldi_table(folder / "utt2spk", p, named, fields=2)
    segments = _kaldi_table(folder / "segments", p, named, fields=4)
    has_segments = (folder / "segments").is_file()
    for seg, (i, rest) in list(segments.items()):
        rec_id, start, end = rest.split()
        try:
            ok = float(start) >= 0 and (end == "-1" or float(end) > float(start))
        except ValueError:
            ok = False
        if not ok or rec_id not in wav:
            why = f"recording {rec_id!r} is not in wav.scp" if ok else f"bad times {start} {end}"
            p.lines.append(f"{folder / 'segments'}:{i}: {why}")
            del segments[seg]
    recs = {}
    for rec_id, (i, source) in wav.items():
        rec = b.recording(rec_id, rec_id, source, f"{folder / 'wav.scp'}:{i}")
        if rec is not None:
            recs[rec_id] = rec
    utts = {u: r.split()[0] for u, (_, r) in segments.items()} if has_segments else {r: r for r in wav}
    where = {u: (f"{folder / 'segments'}:{segments[u][0]}" if has_segments else f"{folder / 'wav.scp'}:{wav[u][0]}")
             for u in utts}
    keep = {}
    for u, rec_id in utts.items():
        if u not in text:
            if u not in named:
                p.lines.append(f"{where[u]}: no line for {u!r} in {folder / 'text'}")
        elif rec_id in recs and (norm := b.text(text[u][1], f"{folder / 'text'}:{text[u][0]}")) is not None:
            keep[u] = norm
    if not keep:
        return []
    tmp = Path(tempfile.mkdtemp(prefix=TEMPORARY_GLOB[:-1]))
    try:
        used = {utts[u] for u in keep}
        tables = {"wav.scp": {r: wav[r][1] for r in used}, "reco2dur": {r: f"{recs[r].duration}" for r in used},
                  "text": keep, "utt2spk": {u: utt2spk[u][1] if u in utt2spk else u for u in keep}}
        if has_segments:
            tables["segments"] = {u: segments[u][1] for u in keep}
        for name, rows in tables.items():
            (tmp / name).write_text("".join(f"{k} {v}\n" for k, v in rows.items()), encoding="utf-8")
        _, sups, _ = load_kaldi_data_dir(tmp, sampling_rate=SAMPLE_RATE, use_reco2dur=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cuts = []
    for s in sups:
        cut = b.cut(s.id, recs[s.recording_id], s.start, s.duration, s.text, where[s.id], speaker=s.speaker)
        if cut is not None:
            cuts.append(cut)
    return cuts


# -- NeMo ------------------------------------------------------------------------------------------------------------


def _read_nemo(path: Path, b: Builder) -> list[Any]:
    """The cuts of a NeMo manifest: one per line, ``offset`` (default 0) and ``duration`` into ``audio_filepath``;
    a cut's id is its file's name, with ``-<line>`` when the file gives several cuts."""
    entries = []
    for i, line, why in read_lines(path):
        where = f"{path}:{i}"
        if line is None or not line.strip():
            b.problems.lines.append(f"{where}: {why or 'empty line'}")
            continue
        try:
            d = json.loads(line)
        except ValueError as e:
            b.problems.lines.append(f"{where}: not JSON ({e})")
            continue
        missing = [k for k in _NEMO_KEYS if not isinstance(d, dict) or k not in d]
        if missing:
            b.problems.lines.append(f"{where}: no {', '.join(repr(k) for k in missing)}")
            continue
        try:
            start, duration = float(d.get("offset") or 0.0), float(d["duration"])
        except (TypeError, ValueError):
            b.problems.lines.append(f"{where}: offset or duration is not a number")
            continue
        text = b.text(d["text"], where)
        if text is None:
            continue
        audio = Path(str(d["audio_filepath"])).expanduser()
        if not audio.is_absolute() and (path.parent / audio).exists():
            audio = path.parent / audio
        entries.append((i, where, audio, start, duration, text))
    per_file: dict[Path, int] = {}
    for _, _, audio, *_ in entries:
        per_file[audio] = per_file.get(audio, 0) + 1
    ids: dict[str, Path] = {}
    cuts = []
    for i, where, audio, start, duration, text in entries:
        rec_id = _unique(audio.name.split(".")[0], audio, ids)
        rec = b.recording(str(audio), rec_id, str(audio), where)
        if rec is not None:
            cut_id = rec_id if per_file[audio] == 1 else f"{rec_id}-{i}"
            cut = b.cut(cut_id, rec, start, duration, text, where)
            if cut is not None:
                cuts.append(cut)
    return cuts


def _unique(name: str, audio: Path, ids: dict[str, Path]) -> str:
    """A recording id for ``audio``: its name, numbered when another file already has it."""
    candidate, n = name, 1
    while ids.setdefault(candidate, audio) != audio:
        n += 1
        candidate = f"{name}-{n}"
    return candidate


# -- lhotse ----------------------------------------------------------------------------------------------------------


def _manifest_items(path: Path, b: Builder) -> Iterator[tuple[str, Any]]:
    """``(where, item)`` for each cut, recording or supervision of a lhotse manifest (JSON lines, maybe gzipped,
    one item read at a time; a ``.json`` array at once)."""
    lhotse = require("lhotse")
    from lhotse.serialization import deserialize_item

    if path.name.endswith((".json", ".json.gz")):
        try:
            manifest = lhotse.load_manifest(path)
        except Exception as e:  # lhotse raises what json and its deserialisers raise
            b.problems.lines.append(f"{path}: not a lhotse manifest ({type(e).__name__}: {e})")
            return
        for n, item in enumerate(manifest, 1):
            yield f"{path} item {n}", item
        return
    for i, line, why in read_lines(path):
        where = f"{path}:{i}"
        if line is None or not line.strip():
            b.problems.lines.append(f"{where}: {why or 'empty line'}")
            continue
        try:
            yield where, deserialize_item(json.loads(line))
        except Exception as e:  # a JSON error, or a lhotse deserialiser's KeyError/TypeError/ValueError
            b.problems.lines.append(f"{where}: not a lhotse manifest entry ({type(e).__name__}: {e})")


def _files_missing(rec: Any) -> list[str]:
    return [s.source for s in rec.sources if s.type == "file" and not Path(s.source).is_file()]


def _read_lhotse(src: str, b: Builder) -> list[Any]:
    """The cuts of a lhotse CutSet, or of a recordings + supervisions pair (a cut per supervision)."""
    paths = ({"recordings": Path(src.split(",")[0]), "supervisions": Path(src.split(",")[1])} if "," in src
             else lhotse_folder(Path(src)) if Path(src).is_dir() else {"cuts": Path(src)})
    if not paths:
        raise CorpusError(f"{src} holds no lhotse cuts manifest, nor one recordings and one supervisions manifest. "
                          "Fix: pass the manifest file, or RECORDINGS,SUPERVISIONS")
    for p in paths.values():
        if not p.is_file():
            raise CorpusError(f"no such lhotse manifest: {p}. Fix: pass an existing file")
    pieces = []  # (where, recording, start, duration, supervision, channel or None for all)
    if "cuts" in paths:
        for where, cut in _manifest_items(paths["cuts"], b):
            if not hasattr(cut, "supervisions") or not getattr(cut, "has_recording", False):
                b.problems.lines.append(f"{where}: not a cut with a recording")
                continue
            if not cut.supervisions:
                b.problems.lines.append(f"{where}: cut {cut.id} has no supervision")
            channel = cut.channel if isinstance(cut.channel, int) and type(cut).__name__ == "MonoCut" else None
            for s in cut.supervisions:
                pieces.append((where, cut.recording, cut.start + s.start, s.duration, s, channel))
    else:
        recs = {}
        for where, rec in _manifest_items(paths["recordings"], b):
            recs[rec.id] = rec
        for where, s in _manifest_items(paths["supervisions"], b):
            if s.recording_id not in recs:
                b.problems.lines.append(f"{where}: recording {s.recording_id!r} is not in {paths['recordings']}")
                continue
            channel = s.channel if isinstance(s.channel, int) and recs[s.recording_id].num_channels > 1 else None
            pieces.append((where, recs[s.recording_id], s.start, s.duration, s, channel))
    cuts, reported = [], set()
    for where, rec, start, duration, s, channel in pieces:
        missing = _files_missing(rec)
        if missing:
            if rec.id not in reported:
                b.problems.audio.append(f"{where}: {missing[0]}: no such file")
                reported.add(rec.id)
            continue
        text = b.text(s.text, where)
        if text is not None:
            cut = b.cut(s.id, rec, start, duration, text, where, channel=channel, speaker=s.speaker)
            if cut is not None:
                cuts.append(cut)
    return cuts


READERS = {"kaldi": lambda src, b: _read_kaldi(Path(src), b), "nemo": lambda src, b: _read_nemo(Path(src), b),
            "lhotse": _read_lhotse}
