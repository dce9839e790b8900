"""The one atomic file writer: a file holds either its old contents or the whole new ones, never a part.

New contents go to a temporary file beside the destination (``.tmp-<random>-<name>``: the same folder, so the
rename cannot cross file systems, and the destination's suffixes kept, since lhotse picks the format from them).
When the write is complete the file is flushed to disk (``fsync``), made readable (``0644``), renamed onto the
destination (``os.replace``, atomic on POSIX), and the folder is synced so that the rename itself survives a
power cut. A failure at any point deletes the temporary file and leaves the destination as it was; a process
killed mid-write leaves only a ``.tmp-*`` file, which :data:`TEMPORARY_GLOB` finds. A failure of the file system
(a full disk, a file-size limit, a read-only folder) becomes one :class:`OutputWriteError` naming the path, the
errno and the free space, also where a writer such as ``torch.save`` buries the ``OSError`` under its own error.
"""

from __future__ import annotations

import contextlib
import errno as errno_names
import os
import shutil
import tempfile
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from asrprec.errors import AsrprecError

__all__ = ["TEMPORARY_GLOB", "OutputWriteError", "atomic_path", "atomic_write", "atomic_write_text", "publish",
           "write_error"]

#: the names of this module's temporary files (a killed write's leftovers)
TEMPORARY_GLOB = ".tmp-*"


class OutputWriteError(AsrprecError, OSError):
    """A file could not be written (nothing was left under its name); the message names the path, the errno and
    the free space of its file system."""


def _os_error(e: BaseException) -> OSError | None:
    """The ``OSError`` behind ``e``: itself, or one in its ``__cause__`` / ``__context__`` chain (``torch.save``
    reports a full disk as ``RuntimeError: [enforce fail at inline_container.cc]`` with the ``OSError`` as its
    context)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError) and e.errno is not None:
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _free_space(path: Path) -> str:
    folder = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return "free space unknown"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if free >= size:
            return f"{free / size:.1f} {unit} free there"
    return f"{free} bytes free there"


def write_error(path: Path, e: BaseException) -> OutputWriteError | None:
    """The one-line :class:`OutputWriteError` for a write of ``path`` that failed with ``e``, or None when ``e``
    is not a file-system error (a bug in the writer stays a traceback)."""
    if isinstance(e, OutputWriteError):
        return e
    os_error = _os_error(e)
    if os_error is None:
        return None
    name = errno_names.errorcode.get(os_error.errno, str(os_error.errno))
    fix = {errno_names.ENOSPC: "free space there or write elsewhere",
           errno_names.EDQUOT: "free space within your quota or write elsewhere",
           errno_names.EFBIG: "raise the file-size limit (ulimit -f) or write elsewhere",
           errno_names.EROFS: "write to a writable folder",
           errno_names.EACCES: "write to a folder you may write to"}.get(os_error.errno, "check the folder")
    err = OutputWriteError(f"could not write {path}: {os_error.strerror or os_error} ({name}); "
                           f"{_free_space(path.parent)}; nothing was left under that name; fix: {fix}")
    err.errno = os_error.errno
    return err


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
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _temporary(path)
    except OSError as e:
        raise write_error(path, e) or e from None
    try:
        yield tmp
        publish(tmp, path)
    except Exception as e:
        err = write_error(path, e)
        if err is None or err is e:
            raise
        raise err from e
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
