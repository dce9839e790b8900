"""Resumable, verified downloads of corpus archives, and their unpacking.

lhotse's downloaders (``lhotse/recipes/librispeech.py``, ``lhotse/recipes/musan.py``) fetch with
``lhotse.utils.resumable_download``, which resumes with an HTTP ``Range`` request but writes under the archive's
final name and verifies nothing: an interrupted or damaged download looks like a complete one, and a server that
answers the range request with the whole file (``200``) gets it appended to the bytes already there. Here:

* the bytes go to ``<archive>.part``; a rerun asks for the rest (``Range: bytes=<size>-``) and appends only a
  ``206`` answer that starts where the file ends (anything else starts over);
* a transfer that ends early keeps its ``.part`` (a rerun resumes it); one that ends must have the server's size
  (``Content-Range`` / ``Content-Length``) and the publisher's MD5 when one is known (:data:`OPENSLR_MD5`); only then
  is ``.part`` renamed to the archive (:func:`asrprec.atomic.publish`); an archive found under its final name is
  checked against the MD5 before it is used;
* an archive is unpacked with lhotse's ``safe_extract``, then marked with the file lhotse's downloaders check
  (``.completed``), so either side recognises the other's work.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

from asrprec.atomic import publish
from asrprec.errors import AsrprecError

log = logging.getLogger(__name__)

#: OpenSLR's resources (lhotse's ``base_url``); LibriSpeech is resource 12, MUSAN 17. Mirrors, e.g.
#: https://openslr.elda.org/resources and https://us.openslr.org/resources, have the same layout.
OPENSLR_URL = "https://www.openslr.org/resources"

#: MD5 of OpenSLR's archives, by path under :data:`OPENSLR_URL`: the sums OpenSLR publishes for LibriSpeech
#: (https://www.openslr.org/resources/12/md5sum.txt); all eight as pinned in PaddlePaddle/PaddleSpeech
#: ``dataset/librispeech/librispeech.py`` and ``dataset/musan/musan.py``.
OPENSLR_MD5 = {
    "12/dev-clean.tar.gz": "42e2234ba48799c1f50f24a7926300a1",
    "12/dev-other.tar.gz": "c8d0bcc9cca99d4f8b62fcc847357931",
    "12/test-clean.tar.gz": "32fa31d27d2e1cad72775fee3f4849a9",
    "12/test-other.tar.gz": "fb5a50374b501bb3bac4815ee91d3135",
    "12/train-clean-100.tar.gz": "2a93770f6d5c6c964bc36631d331a522",
    "12/train-clean-360.tar.gz": "c0e676e450a7ff2f54aeade5171606fa",
    "12/train-other-500.tar.gz": "d1a0fd59409feb2c614ce4d30c387708",
    "17/musan.tar.gz": "0c472d4fc0c5141eca47ad1ffeb2a7df",
}

PART_SUFFIX = ".part"
#: seconds between a dropped transfer and its resumption within one :func:`fetch`
RETRY_WAIT_S = 10.0
_BLOCK = 1 << 20


class DownloadError(AsrprecError, OSError):
    """The transfer failed (network, server); what was received is kept in the ``.part`` file, which a rerun resumes."""


class ArchiveError(AsrprecError, ValueError):
    """A complete download or an archive on disk is not what the publisher published, or cannot be unpacked."""


def part_path(archive: Path | str) -> Path:
    """Where a download of ``archive`` keeps its bytes until it is verified."""
    archive = Path(archive)
    return archive.with_name(archive.name + PART_SUFFIX)


def md5sum(path: Path | str) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def fetch(url: str, archive: Path | str, *, md5: str | None = None, timeout: float = 60.0, retries: int = 2) -> Path:
    """Download ``url`` to ``archive``, resuming the ``.part`` a previous attempt left; return ``archive``.

    An ``archive`` already there is kept when it matches ``md5`` (or no ``md5`` is known); one that does not is
    treated as a partial download (lhotse's downloader leaves those under the final name). ``timeout``: seconds a
    stalled connection is waited for; ``retries``: resumptions (:data:`RETRY_WAIT_S` apart) after a transfer that
    dropped having received something (one that receives nothing fails at once: no network, a refusing server).

    Raises:
        DownloadError: the transfer failed (the ``.part`` is kept; the message says how much it holds).
        ArchiveError: the download is complete (the server's size) but its MD5 is wrong (the ``.part`` is deleted).
    """
    archive = Path(archive)
    part = part_path(archive)
    if archive.is_file():
        if md5 is None or md5sum(archive) == md5:
            log.info("%s is on disk%s; not downloading", archive, " (MD5 verified)" if md5 else "")
            return archive
        log.warning("%s does not have the published MD5; treating it as a partial download", archive)
        if part.is_file():
            archive.unlink()
        else:
            archive.replace(part)
    archive.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(retries + 1):
        before = _size(part)
        try:
            total = _transfer(url, part, timeout)
            break
        except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
            if attempt == retries or _size(part) <= before:  # no byte came: no network, or the server refuses
                raise DownloadError(f"{url}: {_reason(e)}; {_kept(part)}") from None
            log.warning("%s: %s; resuming at byte %d in %g s", url, _reason(e), _size(part), RETRY_WAIT_S)
            time.sleep(RETRY_WAIT_S)
    size = _size(part)
    if md5 is not None and (got := md5sum(part)) != md5:
        part.unlink()
        raise ArchiveError(f"the download of {url} ({size} bytes) has MD5 {got}, not the published {md5}; deleted "
                           f"{part}")
    publish(part, archive)
    log.info("downloaded %s (%d bytes%s) -> %s", url, size, ", MD5 verified" if md5 else "", archive)
    return archive


def _transfer(url: str, part: Path, timeout: float) -> int | None:
    """Append the rest of ``url`` to ``part``; return the file's full size when the server says it."""
    offset = _size(part)
    headers = {"User-Agent": "asrprec"}  # some servers refuse urllib's default agent (lhotse sends a browser's)
    if offset:
        headers["Range"] = f"bytes={offset}-"
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
    except urllib.error.HTTPError as e:
        whole = re.fullmatch(r"bytes \*/(\d+)", e.headers.get("Content-Range") or "")
        if e.code == 416 and whole and int(whole[1]) == offset:
            return offset  # an earlier attempt received everything and stopped before the checks
        if e.code == 416 and offset:
            part.unlink()  # the part does not fit the file on the server: start over
            return _transfer(url, part, timeout)
        raise
    with response:
        span = re.fullmatch(r"bytes (\d+)-\d+/(\d+|\*)", response.headers.get("Content-Range") or "")
        if response.status == 206 and span is not None and int(span[1]) == offset:
            total, mode = (int(span[2]) if span[2] != "*" else None), "ab"
            log.info("resuming %s at %d of %s bytes", url, offset, total or "?")
        elif response.status == 200:  # the whole file: the server ignored the range, or none was asked
            length = response.headers.get("Content-Length")
            total, mode = (int(length) if length is not None else None), "wb"
            log.info("downloading %s (%s bytes) -> %s", url, total or "?", part)
        else:  # a range that is not the one asked for
            response.close()
            part.unlink()
            return _transfer(url, part, timeout)
        with open(part, mode) as f:
            _copy(response, f, total, url)
    if total is not None and _size(part) != total:
        raise DownloadError(f"the transfer ended at {_size(part)} of {total} bytes")
    return total


def _copy(response, f, total: int | None, url: str) -> None:
    """``response`` to the end of ``f``, logging every tenth of ``total`` (every GiB when it is unknown)."""
    step = max(total // 10, _BLOCK) if total else 1 << 30
    done = f.tell()
    mark = done + step
    while block := response.read(_BLOCK):
        f.write(block)
        done += len(block)
        if done >= mark:
            log.info("%s: %d of %s bytes", url, done, total or "?")
            mark = done + step


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def _reason(e: BaseException) -> str:
    return str(e) if isinstance(e, DownloadError) else f"{type(e).__name__}: {getattr(e, 'reason', None) or e}"


def _kept(part: Path) -> str:
    size = _size(part)
    if size == 0:
        part.unlink(missing_ok=True)
        return "nothing was received"
    return f"kept the partial {part} ({size} bytes), which a rerun resumes"


def unpack(archive: Path | str, target_dir: Path | str, marker: Path | str) -> None:
    """Unpack the tar archive into ``target_dir`` (lhotse's ``safe_extract``: no member outside it), then create
    ``marker``. An archive that cannot be read to its end is deleted and named (ArchiveError)."""
    import gzip
    import tarfile
    import zlib

    from lhotse.utils import safe_extract

    log.info("unpacking %s into %s", archive, target_dir)
    try:
        with tarfile.open(archive) as tar:
            safe_extract(tar, path=target_dir)
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:  # a full disk is not the archive's fault
        Path(archive).unlink()
        why = "; ".join(line.strip("- ") for line in str(e).splitlines() if line.strip())
        raise ArchiveError(f"{archive} cannot be unpacked ({type(e).__name__}: {why}); deleted it") from None
    Path(marker).parent.mkdir(parents=True, exist_ok=True)
    Path(marker).touch()
