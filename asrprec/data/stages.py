"""Stage records of a staged data preparation: a stage's outputs are trusted on a rerun only when the record it
writes last (``<output>.done.json``) says they were made from the same inputs and settings, and their content has
not changed since (:func:`outdated`); :func:`make_unless_done` redoes the stage otherwise."""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import zlib
from pathlib import Path
from typing import Any, Callable, Sequence

from asrprec.atomic import atomic_write_text

log = logging.getLogger(__name__)

#: a stage output's record of what it was made from: ``<name>.done.json`` beside ``<name>.jsonl.gz``
DONE_SUFFIX = ".done.json"
_digests: dict[tuple[str, int, int], str] = {}


def done_path(output: Path | str) -> Path:
    """Where :func:`record_done` keeps the record of ``output`` (a ``.jsonl.gz`` manifest)."""
    output = Path(output)
    return output.with_name(output.name.removesuffix(".jsonl.gz") + DONE_SUFFIX)


def content_digest(path: Path | str) -> str:
    """SHA-256 of a file's content; of a ``.gz`` file's uncompressed content (a gzip header holds the time of
    writing, so the same manifest written twice differs in bytes). Remembered per (path, size, mtime) in this
    process. A truncated or damaged gzip raises (EOFError, OSError, zlib.error)."""
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _digests:
        digest = hashlib.sha256()
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        _digests[key] = digest.hexdigest()
    return _digests[key]


def folder_fingerprint(folder: Path | str, suffixes: tuple[str, ...]) -> dict[str, Any]:
    """What a corpus folder holds, without reading its files (LibriSpeech 960 h has 290k): its path, and the count,
    total size and a digest of the (relative path, size, mtime) of the files whose names end with ``suffixes``. An
    unpacking keeps the archive's mtimes, so a part unpacked again has the same fingerprint."""
    folder = Path(folder)
    digest, count, size = hashlib.sha256(), 0, 0
    for parent, dirs, files in os.walk(folder):
        dirs.sort()
        rel = os.path.relpath(parent, folder)
        for name in sorted(f for f in files if f.endswith(suffixes)):
            st = os.stat(os.path.join(parent, name))
            digest.update(f"{rel}/{name}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
            count, size = count + 1, size + st.st_size
    return {"folder": str(folder.resolve()), "files": count, "bytes": size, "sha256": digest.hexdigest()}


def _plain(made_from: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(made_from, default=str))  # tuples -> lists, paths -> str: as a record reads back


def read_done(stamp: Path | str) -> dict[str, Any]:
    """The record :func:`record_done` wrote (``{}`` when it is missing or unreadable)."""
    try:
        done = json.loads(Path(stamp).read_text())
    except (OSError, ValueError):
        return {}
    return done if isinstance(done, dict) else {}


def outdated(stamp: Path | str, made_from: dict[str, Any], outputs: Sequence[Path]) -> str:
    """Why ``outputs`` cannot be trusted ("" when they can): one is missing; their record ``stamp`` (written last, by
    :func:`record_done`) is missing or unreadable; it says they were made from other inputs or settings than
    ``made_from``; or an output's content is not the one recorded (changed, truncated or damaged since)."""
    missing = [o.name for o in outputs if not o.is_file()]
    if missing:
        return f"{', '.join(missing)} missing"
    stamp = Path(stamp)
    done = read_done(stamp)
    if not isinstance(done.get("made_from"), dict) or not isinstance(done.get("outputs"), dict):
        return f"{'no' if not stamp.exists() else 'an unreadable'} record {stamp.name} of what they were made from"
    made_from, recorded = _plain(made_from), done["made_from"]
    changed = sorted(k for k in made_from.keys() | recorded.keys() if made_from.get(k) != recorded.get(k))
    if changed:
        return f"the {', '.join(changed)} they were made from changed"
    for o in outputs:
        try:
            digest = content_digest(o)
        except (OSError, EOFError, zlib.error) as e:
            return f"{o.name} is unreadable ({type(e).__name__}: {e})"
        if done["outputs"].get(o.name) != digest:
            return f"{o.name} changed since it was written"
    return ""


def record_done(stamp: Path | str, made_from: dict[str, Any], outputs: Sequence[Path], **facts: Any) -> None:
    """Record (atomically, after the outputs are complete) that ``outputs`` were made from ``made_from``: their
    content digests and any ``facts`` (e.g. counts) for a later completeness check."""
    record = {"made_from": _plain(made_from), "outputs": {o.name: content_digest(o) for o in outputs}, **facts}
    atomic_write_text(stamp, json.dumps(record, indent=1, sort_keys=True, default=str) + "\n")


def make_unless_done(outputs: Sequence[Path], made_from: dict[str, Any], make: Callable[[], Any]) -> bool:
    """``make()`` (which writes ``outputs``, each atomically) unless they are current for ``made_from``
    (:func:`outdated`); then record them (:func:`record_done`, in :func:`done_path` of the first). A dict ``make``
    returns is kept in the record as facts. Returns whether ``make`` ran."""
    stamp = done_path(outputs[0])
    why = outdated(stamp, made_from, outputs)
    names = ", ".join(str(o) for o in outputs)
    if not why:
        log.info("%s exists; skipping (made from the same inputs)", names)
        return False
    if any(o.exists() for o in outputs):
        log.warning("%s: %s; making it again", names, why)
    stamp.unlink(missing_ok=True)
    facts = make()
    record_done(stamp, made_from, outputs, **(facts if isinstance(facts, dict) else {}))
    return True
