"""Resumable, verified downloads against a local server in OpenSLR's layout (tests/data/conftest.py ``openslr``): a
dropped transfer keeps a ``.part`` that the next attempt resumes with a range request; the result is the served
bytes (compared byte for byte, MD5 computed here); a damaged download or archive is named, deleted, and never
unpacked; prepare.py's stage 0 ends such faults in one line and finishes when rerun."""

import os
import random

import pytest

from asrprec.data import download
from asrprec.data.corpora import CorpusError, download_librispeech, librispeech_parts, missing_librispeech_parts
from asrprec.data.download import ArchiveError, DownloadError, fetch, part_path

from .conftest import md5_hex, tar_gz

PATH = "/resources/12/dev-clean.tar.gz"


@pytest.fixture
def served(openslr, monkeypatch):
    """A dev-clean archive on the server (random audio bytes: gzip cannot shrink them) and its MD5."""
    monkeypatch.setattr(download, "RETRY_WAIT_S", 0.0)
    body = tar_gz({"LibriSpeech/dev-clean/1/2/1-2.trans.txt": b"1-2-0000 HELLO\n",
                   "LibriSpeech/dev-clean/1/2/1-2-0000.flac": os.urandom(100_000)})
    openslr.files[PATH] = body
    return body, md5_hex(body)


def test_a_dropped_download_keeps_its_part_and_the_next_attempt_resumes_it(openslr, served, tmp_path):
    body, md5 = served
    archive, cut = tmp_path / "dev-clean.tar.gz", len(body) * 2 // 5
    openslr.drops = [cut]
    with pytest.raises(DownloadError, match=rf"the transfer ended at {cut} of {len(body)} bytes; kept the partial "
                                            rf".*dev-clean.tar.gz.part \({cut} bytes\), which a rerun resumes"):
        fetch(openslr.url + "/12/dev-clean.tar.gz", archive, md5=md5, retries=0)
    assert not archive.exists() and part_path(archive).read_bytes() == body[:cut]
    assert fetch(openslr.url + "/12/dev-clean.tar.gz", archive, md5=md5, retries=0) == archive
    assert archive.read_bytes() == body and not part_path(archive).exists()
    assert openslr.requests == [(PATH, None), (PATH, f"bytes={cut}-")]
    # on disk and verified: no request
    fetch(openslr.url + "/12/dev-clean.tar.gz", archive, md5=md5)
    assert len(openslr.requests) == 2


def test_drops_that_make_progress_are_resumed_within_one_call(openslr, served, tmp_path):
    body, md5 = served
    openslr.drops = [20_000, 50_000]
    archive = fetch(openslr.url + "/12/dev-clean.tar.gz", tmp_path / "a.tar.gz", md5=md5, retries=2)
    assert archive.read_bytes() == body
    assert [r for _, r in openslr.requests] == [None, "bytes=20000-", "bytes=50000-"]


def test_a_server_that_ignores_the_range_gives_the_file_once(openslr, served, tmp_path):
    body, md5 = served
    archive = tmp_path / "dev-clean.tar.gz"
    part_path(archive).write_bytes(body[:1000])
    openslr.ignore_range = True
    fetch(openslr.url + "/12/dev-clean.tar.gz", archive, md5=md5)
    assert archive.read_bytes() == body  # not the 1000 bytes followed by the whole file


def test_a_complete_part_is_verified_without_a_second_transfer(openslr, served, tmp_path):
    """Killed after the last byte and before the checks: the server answers 416 for the range past the end."""
    body, md5 = served
    archive = tmp_path / "dev-clean.tar.gz"
    part_path(archive).write_bytes(body)
    fetch(openslr.url + "/12/dev-clean.tar.gz", archive, md5=md5)
    assert archive.read_bytes() == body and openslr.requests == [(PATH, f"bytes={len(body)}-")]


def test_a_damaged_download_is_named_and_deleted(openslr, served, tmp_path):
    body, md5 = served
    damaged = bytearray(body)
    damaged[len(body) // 2] ^= 0xFF
    openslr.files[PATH] = bytes(damaged)
    archive = tmp_path / "dev-clean.tar.gz"
    with pytest.raises(ArchiveError, match=rf"the download of .*/12/dev-clean.tar.gz \({len(body)} bytes\) has MD5 "
                                           rf"{md5_hex(bytes(damaged))}, not the published {md5}; deleted "):
        fetch(openslr.url + "/12/dev-clean.tar.gz", archive, md5=md5)
    assert list(tmp_path.iterdir()) == []


def test_an_archive_on_disk_without_the_published_md5_is_completed_or_rejected(openslr, served, tmp_path):
    """Under the final name without the published MD5 (e.g. cut short by lhotse's downloader, which writes there):
    a prefix of the file is resumed; a damaged whole file is named and deleted."""
    body, md5 = served
    archive = tmp_path / "dev-clean.tar.gz"
    archive.write_bytes(body[:30_000])
    fetch(openslr.url + "/12/dev-clean.tar.gz", archive, md5=md5)
    assert archive.read_bytes() == body and openslr.requests[-1] == (PATH, "bytes=30000-")
    archive.write_bytes(body[:-1] + bytes([body[-1] ^ 1]))
    with pytest.raises(ArchiveError, match="not the published"):
        fetch(openslr.url + "/12/dev-clean.tar.gz", archive, md5=md5)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("damage", ["truncated", "noise"])
def test_an_archive_that_cannot_be_unpacked_is_named_with_the_fix(openslr, served, tmp_path, monkeypatch, damage):
    """Without a published MD5 only the size is checked; the unpacking then names a damaged archive, and deletes it
    with what it had unpacked (a transcript without the archive next to it would pass for a part on disk)."""
    body, _ = served
    # noise: gzip's magic, then a compression method gzip does not have (8 is deflate) and seeded random bytes, so
    # the archive is never a valid gzip stream that merely ends early
    noise = b"\x1f\x8b\x00" + random.Random(0).randbytes(5000)
    openslr.files[PATH] = body[: len(body) * 3 // 5] if damage == "truncated" else noise
    monkeypatch.delitem(download.OPENSLR_MD5, "12/dev-clean.tar.gz")
    error = "EOFError" if damage == "truncated" else "ReadError"
    with pytest.raises(CorpusError, match=rf"LibriSpeech dev-clean into .*: .*dev-clean.tar.gz cannot be unpacked "
                                          rf"\({error}: .*\); deleted it. Fix: rerun to download it again") as e:
        download_librispeech(tmp_path, ["dev-clean"], base_url=openslr.url)
    assert "\n" not in str(e.value) and not (tmp_path / "dev-clean.tar.gz").exists()
    assert not (tmp_path / "LibriSpeech" / "dev-clean").exists()
    assert missing_librispeech_parts(tmp_path, ["dev-clean"]) == ["dev-clean"]


def test_prepare_downloads_resume_across_runs_and_unpack_verified_archives(openslr, tmp_path, monkeypatch, prepare):
    """Stage 0 from a mirror (--openslr-url): a download that keeps dropping ends the run in one line naming its
    .part and --corpus-dir; the rerun resumes it; every part and MUSAN are unpacked from archives whose bytes are
    the served ones."""
    monkeypatch.setattr(download, "RETRY_WAIT_S", 0.0)
    members = {}
    for i, part in enumerate(librispeech_parts("100h")):
        trans = f"LibriSpeech/{part}/{i}/7/{i}-7.trans.txt"
        members[f"12/{part}.tar.gz"] = {trans: f"{i}-7-0000 PART {part.upper()}\n".encode(),
                                        trans.replace(".trans.txt", "-0000.flac"): os.urandom(40_000)}
    members["17/musan.tar.gz"] = {f"musan/{p}/x/{p}-0000.wav": os.urandom(20_000) for p in ("music", "speech", "noise")}
    archives = {name: tar_gz(m) for name, m in members.items()}
    for name, body in archives.items():
        openslr.files[f"/resources/{name}"] = body
        monkeypatch.setitem(download.OPENSLR_MD5, name, md5_hex(body))
    first = "/resources/12/train-clean-100.tar.gz"
    openslr.drops = [10_000, 20_000, 30_000]  # three drops: more than the two resumptions of one run
    corpus = tmp_path / "corpus"
    args = ("--subset", "100h", "--corpus-dir", corpus, "--data-dir", tmp_path / "data", "--stop-stage", 0,
            "--openslr-url", openslr.url)
    e = prepare(*args)
    assert e.code == 2 and "\n" not in e.error
    assert e.error.startswith(f"prepare.py: error: could not download LibriSpeech train-clean-100 into {corpus} (")
    assert f"kept the partial {corpus / 'train-clean-100.tar.gz.part'} (30000 bytes), which a rerun resumes" in e.error
    assert "--corpus-dir" in e.error and not (corpus / "train-clean-100.tar.gz").exists()
    assert prepare(*args) is None
    assert openslr.requests[:4] == [(first, None), (first, "bytes=10000-"), (first, "bytes=20000-"),
                                    (first, "bytes=30000-")]
    for name, m in members.items():
        assert (corpus / name.split("/")[1]).read_bytes() == archives[name]
        assert all((corpus / member).read_bytes() == data for member, data in m.items())
    assert missing_librispeech_parts(corpus, librispeech_parts("100h")) == []
    assert (corpus / ".musan_completed").is_file() and not list(corpus.glob("*.part"))
    served = len(openslr.requests)
    assert prepare(*args) is None and len(openslr.requests) == served  # all on disk: nothing fetched


def test_prepare_names_a_damaged_download_with_the_fix(openslr, served, tmp_path, monkeypatch, prepare):
    body, md5 = served
    openslr.files[PATH] = body[:-10] + bytes(10)
    monkeypatch.setitem(download.OPENSLR_MD5, "12/dev-clean.tar.gz", md5)
    part_dir = tmp_path / "LibriSpeech" / "train-clean-100" / "1" / "2"  # on disk: dev-clean is the first download
    part_dir.mkdir(parents=True)
    (part_dir / "1-2.trans.txt").write_text("1-2-0000 A\n")
    e = prepare("--subset", "100h", "--corpus-dir", tmp_path, "--data-dir", tmp_path / "data", "--stop-stage", 0,
                "--openslr-url", openslr.url, "--no-musan")
    assert e.error.startswith(f"prepare.py: error: LibriSpeech dev-clean into {tmp_path}: the download of "
                             f"{openslr.url}/12/dev-clean.tar.gz ({len(body)} bytes) has MD5 ")
    assert f"not the published {md5}; deleted {tmp_path / 'dev-clean.tar.gz.part'}. Fix: rerun to download" in e.error
    assert not list(tmp_path.glob("dev-clean.tar.gz*")) and not (tmp_path / "LibriSpeech" / "dev-clean").exists()
