"""A full disk (here the file-size limit, ``ulimit -f``, which fails a write with EFBIG as a full disk fails it with
ENOSPC) leaves nothing half-written under a final name and gives one line naming the path, the errno and the free
space, for each kind of output: checkpoints, json records, manifests, recogs / errs files, ONNX files, tokens.txt.

Each writer runs in a child process whose file-size limit is set low; SIGXFSZ is ignored there so the write fails
with an OSError, as it does on a full disk."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 64 * 1024  # bytes: above every log line and record the child writes, below each output under test

PRELUDE = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
out = sys.argv[1]
"""


def _run_limited(body: str, out: Path, *, prog: bool = False) -> subprocess.CompletedProcess:
    code = PRELUDE.format(limit=LIMIT) + textwrap.dedent(body)
    if prog:  # through a program's entry point: one line on stderr, exit code 2, the line in the log
        code = code.replace("def main():", "from asrprec.cli import run_main, setup_logging\ndef main():")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, env=env,
                          timeout=300)


def _assert_one_line_and_nothing_left(res: subprocess.CompletedProcess, folder: Path, final: str) -> str:
    line = res.stderr.strip().splitlines()[-1]
    assert "could not write" in line and final in line and "EFBIG" in line and "free there" in line, res.stderr
    assert "nothing was left" in line and "fix:" in line
    assert not (folder / final).exists() or (folder / final).read_bytes() == b"old", f"{final} was half-written"
    assert not list(folder.glob(".tmp-*")), "a temporary file was left behind"
    return line


WRITERS = {
    # name: (final file name, the write; ``out`` is the folder)
    "checkpoint": ("epoch-1.pt", """
        import torch
        from asrprec.checkpoint import atomic_torch_save
        atomic_torch_save({"model": {"w": torch.zeros(100_000)}}, f"{out}/epoch-1.pt")
    """),
    "json record": ("history.json", """
        import json
        from asrprec.atomic import atomic_write_text
        atomic_write_text(f"{out}/history.json", json.dumps([{"epoch": i, "loss": 0.5} for i in range(10_000)]))
    """),
    "manifest": ("cuts.jsonl.gz", """
        from lhotse import CutSet
        from lhotse.testing.dummies import dummy_cut
        from asrprec.data.manifests import write_cuts
        import os
        cuts = [dummy_cut(i, recording=None).with_id(os.urandom(64).hex()) for i in range(3000)]
        write_cuts(cuts, f"{out}/cuts.jsonl.gz")
    """),
    "recogs": ("recogs-test.txt", """
        from asrprec.metrics import write_recogs
        write_recogs(f"{out}/recogs-test.txt", [(f"cut-{i}", "a b c d e f", "a b c d e g") for i in range(5000)])
    """),
    "errs": ("errs-test.txt", """
        from asrprec.metrics import write_error_stats
        write_error_stats(f"{out}/errs-test.txt", [(f"cut-{i}", "a b c d e f", "a x c d e") for i in range(5000)])
    """),
    "tokens.txt": ("tokens.txt", """
        from asrprec.export.exporter import write_tokens
        class Pieces:
            vocab_size = 20_000
            def id_to_piece(self, i):
                return "<blk>" if i == 0 else f"piece{i:08d}"
        write_tokens(Pieces(), f"{out}/tokens.txt")
    """),
}


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_a_full_disk_leaves_nothing_half_written_and_names_path_errno_and_free_space(tmp_path, name):
    final, body = WRITERS[name]
    (tmp_path / final).write_bytes(b"old")  # an earlier version must survive the failed write
    res = _run_limited(body, tmp_path)
    assert res.returncode != 0
    assert "OutputWriteError" in res.stderr, res.stderr
    _assert_one_line_and_nothing_left(res, tmp_path, final)


def test_an_onnx_file_is_never_left_half_written(tmp_path):
    onnx = pytest.importorskip("onnx")
    _write_small_onnx(tmp_path / "encoder.onnx")
    res = _run_limited("""
        from asrprec.export.exporter import add_metadata
        add_metadata(f"{out}/encoder.onnx", {"model_type": "zipformer2"})
    """, tmp_path)
    assert res.returncode != 0
    line = res.stderr.strip().splitlines()[-1]
    assert "could not write" in line and "encoder.onnx" in line and "EFBIG" in line, res.stderr
    assert list(onnx.load(str(tmp_path / "encoder.onnx")).metadata_props) == [], "the file under its name changed"
    assert not list(tmp_path.glob(".tmp-*")), "a temporary file was left behind"


def _write_small_onnx(path: Path) -> None:
    """A valid ONNX file of 160 KB, above the limit (written here, without one)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.zeros((200, 200), np.float32), "w")  # 160 KB
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 200])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 200])], [w])
    onnx.save(helper.make_model(graph), str(path))


def test_a_program_ends_in_one_line_exit_2_and_its_log_records_it(tmp_path):
    res = _run_limited("""
        def main():
            setup_logging(f"{out}/train.log", rank=0)
            from asrprec.metrics import write_recogs
            write_recogs(f"{out}/recogs-test.txt", [(f"cut-{i}", "a b c", "a b d") for i in range(10_000)])
        run_main(main, "decode.py")
    """, tmp_path, prog=True)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in res.stderr, res.stderr  # the log's line and the program's line
    assert lines[-1].startswith("decode.py: error: could not write ") and "recogs-test.txt" in lines[-1]
    assert "could not write" in (tmp_path / "train.log").read_text()
    assert not (tmp_path / "recogs-test.txt").exists() and not list(tmp_path.glob(".tmp-*"))
