"""The one atomic writer: the destination holds the old or the whole new contents, a failed write leaves nothing,
a killed one leaves only a file the stale-temporary sweep finds."""

from __future__ import annotations

import gzip
import os
import stat
import subprocess
import sys
import textwrap

import pytest

from asrprec.atomic import TEMPORARY_GLOB, atomic_path, atomic_write, atomic_write_text
from asrprec.checkpoint import remove_stale_temporaries


def test_write_replaces_whole_file_readable_by_all(tmp_path):
    path = tmp_path / "sub" / "a.json"
    atomic_write_text(path, "old")
    atomic_write_text(path, "new text")
    assert path.read_text() == "new text"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert sorted(os.listdir(path.parent)) == ["a.json"]


def test_failed_write_keeps_old_contents_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "a.bin"
    atomic_write(path, lambda f: f.write(b"old"))

    def half_then_fail(f):
        f.write(b"partial")
        f.flush()
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, half_then_fail)
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["a.bin"]


def test_temporary_keeps_the_suffixes_format_detection_needs(tmp_path):
    path = tmp_path / "cuts.jsonl.gz"
    with atomic_path(path) as tmp:
        assert tmp.parent == tmp_path and tmp.name.endswith(".jsonl.gz") and tmp.match(TEMPORARY_GLOB)
        with gzip.open(tmp, "wt") as f:
            f.write('{"id": "a"}\n')
    assert gzip.open(path, "rt").read() == '{"id": "a"}\n'


def test_killed_write_leaves_only_a_temporary_the_sweep_removes(tmp_path):
    path = tmp_path / "epoch-1.pt"
    path.write_bytes(b"complete")
    code = textwrap.dedent(f"""
        import os
        from asrprec.atomic import atomic_write

        def die(f):
            f.write(b"half")
            f.flush()
            os._exit(9)  # no cleanup runs, as under SIGKILL

        atomic_write({str(path)!r}, die)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert out.returncode == 9, out.stderr.decode()
    assert path.read_bytes() == b"complete"
    left = sorted(p.name for p in tmp_path.iterdir() if p != path)
    assert len(left) == 1 and (tmp_path / left[0]).match(TEMPORARY_GLOB), left
    assert [p.name for p in remove_stale_temporaries(tmp_path)] == left
    assert os.listdir(tmp_path) == ["epoch-1.pt"]
