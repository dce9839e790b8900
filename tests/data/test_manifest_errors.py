"""A manifest that is empty, not UTF-8 or not JSON is one error naming the file and line, not a traceback from
inside lhotse (``'NoneType' object has no attribute 'to_eager'``) or a failure mid-epoch."""

from __future__ import annotations

import gzip
import json

import pytest

from asrprec.data import ManifestError, load_cuts

lhotse = pytest.importorskip("lhotse")


def _cut_line(i: int, text: str = "HELLO") -> bytes:
    cut = lhotse.MonoCut(id=f"c{i}", start=0.0, duration=1.0, channel=0,
                         supervisions=[lhotse.SupervisionSegment(id=f"s{i}", recording_id="r", start=0.0,
                                                                 duration=1.0, text=text)])
    return (json.dumps(cut.to_dict()) + "\n").encode()


@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl"])
def test_an_empty_manifest_is_named_with_the_fix(tmp_path, lazy, suffix):
    path = tmp_path / f"cuts_test{suffix}"
    (gzip.open if suffix.endswith(".gz") else open)(path, "wb").close()
    with pytest.raises(ManifestError, match=rf"{path} holds no cuts; fix: run the data preparation first"):
        load_cuts(path, lazy=lazy)


@pytest.mark.parametrize("lazy", [True, False])
def test_a_line_that_is_not_utf8_is_named_by_file_and_line_before_any_cut_is_read(tmp_path, lazy):
    path = tmp_path / "cuts_train.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(_cut_line(0) + _cut_line(1, "CAFE").replace(b"CAFE", b"CAF\xe9") + _cut_line(2))
    with pytest.raises(ManifestError, match=rf"{path}:2: not UTF-8 text \(byte 0xe9 at column \d+\)"):
        load_cuts(path, lazy=lazy)


def test_a_line_that_is_not_json_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "cuts_dev.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(_cut_line(0) + _cut_line(1)[:40] + b"\n" + _cut_line(2))
    with pytest.raises(ManifestError, match=rf"{path}:2: not a JSON object"):
        load_cuts(path, lazy=False)


def test_a_good_manifest_loads_every_cut(tmp_path):
    path = tmp_path / "cuts_dev.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(b"".join(_cut_line(i) for i in range(3)))
    assert [c.id for c in load_cuts(path)] == ["c0", "c1", "c2"]
    assert [c.supervisions[0].text for c in load_cuts(path, lazy=False)] == ["HELLO"] * 3


def test_an_empty_split_of_a_prepared_folder_is_named(tmp_path):
    from asrprec.data import load_fbank_cuts

    for split in ("dev", "test"):
        with gzip.open(tmp_path / f"espeak_cuts_{split}_fbank.jsonl.gz", "wb") as f:
            f.write(_cut_line(0) if split == "dev" else b"")
    assert [c.id for c in load_fbank_cuts(tmp_path, splits=("dev",))["dev"]] == ["c0"]
    with pytest.raises(ManifestError, match=r"espeak_cuts_test_fbank.jsonl.gz holds no cuts; fix: run the data "):
        load_fbank_cuts(tmp_path, splits=("dev", "test"))
