"""The one atomic file writer: a file holds either its old contents or the whole new ones, never a part.

New contents go to a temporary file beside the destination (``.tmp-<random>-<name>``: the same folder, so the
rename cannot cross file systems, and the destination's suffixes kept, since lhotse picks the format from them).
When the write is complete the file is flushed to disk (``fsync``), made readable (``0644``), renamed onto the
destination (``os.replace``, atomic on POSIX), and the folder is synced so that the rename itself survives a
power cut. A failure at any point deletes the temporary file and leaves the destination as it was; a process
killed mid-write leaves only a ``.tmp-*`` file, which :data:`TEMPORARY_GLOB` finds.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Callable, Iterator

__all__ = ["TEMPORARY_GLOB", "atomic_path", "atomic_write", "atomic_write_text", "publish"]

#: the names of this module's temporary files (a killed write's leftovers)
TEMPORARY_GLOB = ".tmp-*"


def _fsync_dir(directory: Path) -> None:
    # makes a rename durable; not every platform or file system allows opening a folder (best effort)
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _temporary(path: Path) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=TEMPORARY_GLOB[:-1], suffix=f"-{path.name}", dir=path.parent)
    os.close(fd)
    return Path(tmp)


def publish(written: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Make the complete file ``written`` durable and rename it onto ``path`` (same file system)."""
    written, path = Path(written), Path(path)
    fd = os.open(written, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(written, 0o644)  # mkstemp creates 0600; outputs are ordinary readable files
    os.replace(written, path)
    _fsync_dir(path.parent)
    return path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` for a writer that wants a file name (lhotse's ``to_file``,
    ``open_writer``); :func:`publish` it onto ``path`` when the block ends without an exception, delete it
    otherwise. The parent folders are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(path)
    try:
        yield tmp
        publish(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> Path:
    """Call ``write(f)`` on a binary file object and put what it wrote at ``path`` atomically."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        write(f)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` so that ``path`` holds either the old or the whole new text."""
    return atomic_write(path, lambda f: f.write(text.encode("utf-8")))
