"""recipes/librispeech/prepare.py on the faults a real corpus folder throws: an empty --corpus-dir without network,
malformed transcript lines, a truncated FLAC, MUSAN recordings shorter than the noise windows, a tokenizer of
another size, a kill -9 during feature extraction. Each ends in one line naming the fix, or is named in the log and
left out while the preparation finishes."""

import logging
import math
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from asrprec.data.corpora import (
    CorpusError,
    PreparedData,
    download_librispeech,
    musan_noise_cuts,
    prepare_librispeech_manifests,
    prepare_musan_manifests,
)

from .conftest import needs_espeak, write_librispeech_layout, write_musan_layout

def _offline(request, timeout=None):
    """What urllib does without network: the name of the server cannot be resolved."""
    raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")


def test_no_network_gives_one_line_naming_corpus_dir_and_leaves_no_archive(tmp_path, monkeypatch, prepare):
    monkeypatch.setattr(urllib.request, "urlopen", _offline)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    with pytest.raises(CorpusError, match=r"could not download LibriSpeech train-clean-100 into .*\(https://www.openslr"
                                          r".org/resources/12/train-clean-100.tar.gz: URLError: \[Errno -3\] "
                                          r"Temporary failure in name resolution; nothing was received\).*Fix: .* pass "
                                          r"its folder as --corpus-dir"):
        download_librispeech(corpus, ["train-clean-100", "dev-clean"])
    assert list(corpus.rglob("*.tar.gz*")) == []
    # the whole script: one line (no traceback), nothing left that looks like an archive
    e = prepare("--subset", "100h", "--corpus-dir", corpus, "--data-dir", tmp_path / "data", "--stop-stage", "0")
    assert e.code == 2 and e.error.startswith("prepare.py: error: could not download LibriSpeech")
    assert "--corpus-dir" in e.error and "\n" not in e.error and list(corpus.rglob("*.tar.gz*")) == []


def test_an_empty_corpus_folder_is_named_in_one_line(tmp_path, prepare):
    corpus = tmp_path / "empty"
    corpus.mkdir()
    e = prepare("--subset", "100h", "--corpus-dir", corpus, "--data-dir", tmp_path / "data", "--stage", "1",
                "--stop-stage", "1")
    assert e.error.startswith("prepare.py: error: LibriSpeech parts ['train-clean-100', 'dev-clean', 'dev-other', "
                             f"'test-clean', 'test-other'] are not in {corpus / 'LibriSpeech'}")
    assert "point --corpus-dir at the folder that holds LibriSpeech/" in e.error


def test_malformed_transcript_lines_are_named_by_file_and_line(tmp_path):
    chapter = tmp_path / "LibriSpeech" / "dev-clean" / "19" / "198"
    chapter.mkdir(parents=True)
    trans = chapter / "19-198.trans.txt"
    trans.write_text("19-198-0000 HELLO WORLD\n19-198-0001\n\n20-1-0003 OTHER CHAPTER\n19-198-0004 FINE\n")
    with pytest.raises(CorpusError) as e:
        prepare_librispeech_manifests(tmp_path, ["dev-clean"], tmp_path / "manifests", max_bad_lines=2)
    assert (f"3 transcript line(s) in {tmp_path / 'LibriSpeech'} are not '<utterance-id> <text>': "
            f"{trans}:2: no text after '19-198-0001'; {trans}:3: empty line; "
            f"{trans}:4: utterance id '20-1-0003' is not of this chapter. Fix:") in str(e.value)
    assert "raise --max-bad-lines (now 2)" in str(e.value)
    assert not (tmp_path / "manifests" / "librispeech_recordings_dev-clean.jsonl.gz").exists()


def test_short_musan_recordings_name_the_flags_or_give_windows_with_them(tmp_path, caplog):
    seconds = 3.0
    write_musan_layout(tmp_path, seconds=seconds)
    manifests = tmp_path / "manifests"
    prepare_musan_manifests(tmp_path, manifests)
    with caplog.at_level(logging.WARNING), pytest.raises(
            CorpusError, match=r"no MUSAN recording .* is longer than 5 s \(the longest: 3.0 s, of 3\). Fix: lower "
                               r"--musan-min-s \(and --musan-window-s\)"):
        musan_noise_cuts(manifests)
    assert "MUSAN: 3 of 3 recordings are 5 s or shorter and give no noise window" in caplog.text
    caplog.clear()
    window, min_s = 2.0, 0.5
    with caplog.at_level(logging.WARNING):
        windows = musan_noise_cuts(manifests, window_s=window, min_s=min_s)
    # per recording: whole windows, and the remainder if it is longer than min_s
    per = math.floor(seconds / window) + (seconds % window > min_s)
    assert len(windows) == 3 * per and all(min_s < c.duration <= window for c in windows)
    assert "give no noise window" not in caplog.text


def test_musan_manifests_are_read_again_when_the_audio_changed(tmp_path, caplog):
    import lhotse

    write_musan_layout(tmp_path, seconds=3.0)
    manifests = tmp_path / "manifests"
    paths = prepare_musan_manifests(tmp_path, manifests)
    with caplog.at_level(logging.INFO):
        prepare_musan_manifests(tmp_path, manifests)
    assert "not re-reading the corpus" in caplog.text
    caplog.clear()
    write_musan_layout(tmp_path, seconds=12.0)  # longer files in place of the short ones
    with caplog.at_level(logging.INFO):
        prepare_musan_manifests(tmp_path, manifests)
    assert "3 recording(s) changed or missing" in caplog.text and "re-reading the corpus" in caplog.text
    durations = [r.duration for p in paths.values() for r in lhotse.RecordingSet.from_file(p)]
    assert durations == [12.0] * 3
    # the default windows of 12 s: one of 10 s each (the 2 s remainders are <= 5 s)
    assert [c.duration for c in musan_noise_cuts(manifests)] == [10.0] * 3


def test_a_vocabulary_too_large_for_the_transcripts_names_vocab_size(tmp_path, prepare):
    from lhotse import SupervisionSegment, SupervisionSet

    from asrprec.data.corpora import librispeech_manifest_paths

    path = librispeech_manifest_paths(tmp_path / "data" / "manifests", "train-clean-100")["supervisions"]
    path.parent.mkdir(parents=True)
    SupervisionSet.from_segments([SupervisionSegment(id=f"u{i}", recording_id=f"u{i}", start=0.0, duration=1.0,
                                                     text=text) for i, text in enumerate(["A CAT", "A DOG"])]).to_file(path)
    e = prepare("--subset", "100h", "--data-dir", tmp_path / "data", "--stage", "5", "--vocab-size", "500")
    assert e.error.startswith("prepare.py: error: stage 5: vocab_size=500 is too large for these texts")
    assert e.error.endswith("Fix: a smaller --vocab-size for prepare.py, and the same --vocab-size for train.py and "
                           "decode.py")


def test_the_tokenizer_path_follows_vocab_size(tmp_path):
    data = PreparedData(tmp_path)
    data.bpe_model(100).parent.mkdir(parents=True)
    data.bpe_model(100).write_bytes(b"x")
    assert data.tokenizer_model(100) == tmp_path / "lang_bpe_100" / "bpe.model"
    with pytest.raises(FileNotFoundError, match=rf"no tokenizer {tmp_path / 'lang_bpe_500' / 'bpe.model'}; "
                                                rf"{tmp_path} holds the tokenizer\(s\) of --vocab-size 100. Fix: pass "
                                                r"the --vocab-size prepare.py used"):
        data.tokenizer_model(500)


@needs_espeak
def test_prepare_finishes_on_a_librispeech_layout_with_faults(tiny_corpus, tmp_path, prepare, capsys):
    """A truncated FLAC in train-clean-100, a transcript line without text in dev-clean, MUSAN recordings of 3 s:
    every stage runs, the faults are named and left out, and nothing else is lost."""
    from asrprec.data import load_cuts

    _, cuts = tiny_corpus
    written = write_librispeech_layout(tmp_path, cuts)
    write_musan_layout(tmp_path, seconds=3.0)
    truncated_id, (_, flac) = sorted(written["train-clean-100"].items())[3]
    flac.write_bytes(flac.read_bytes()[:300])  # the header and a few frames
    dev_trans = next((tmp_path / "LibriSpeech" / "dev-clean").rglob("*.trans.txt"))
    dev_lines = dev_trans.read_text().splitlines()
    dev_trans.write_text("\n".join(dev_lines[:1] + ["1-2-3"] + dev_lines[1:]) + "\n")  # line 2: no text, no audio
    data_dir = tmp_path / "data"
    args = ("--subset", "100h", "--corpus-dir", tmp_path, "--data-dir", data_dir, "--num-jobs", 1, "--vocab-size",
            40, "--chunk-size", 16, "--musan-window-s", 2.0, "--musan-min-s", 0.5)
    assert prepare(*args) is None
    log = capsys.readouterr().err  # prepare.py's log handler writes to stderr
    assert f"leaving out the utterance of {dev_trans}:2: no text after '1-2-3'" in log
    # the truncated file's cut and its two speed-perturbed copies, each named with the file
    lost = [line for line in log.splitlines() if "its audio could not be read" in line]
    assert len(lost) == 3 and all(f"left out {truncated_id}" in line and str(flac) in line for line in lost), lost
    data = PreparedData(data_dir)

    def recordings(part):
        return {c.recording.id for c in load_cuts(data.cuts(part))}

    expected = {f"{u}{s}" for u in written["train-clean-100"] if u != truncated_id for s in ("", "_sp0.9", "_sp1.1")}
    assert recordings("train-clean-100") == expected
    assert recordings("dev-clean") == set(written["dev-clean"])
    assert len(load_cuts(data.musan_cuts)) == 3 * 2 and data.tokenizer_model(40).is_file()
    # a rerun finds every stage done and leaves the same outputs
    assert prepare(*args) is None
    assert recordings("train-clean-100") == expected and "its audio could not be read" not in capsys.readouterr().err


@pytest.mark.slow  # two spawned workers import torch: ~45 s on a busy 2-core machine
def test_feature_workers_end_with_a_killed_preparation(tmp_path):
    """kill -9 of the process that runs the fbank pool: its spawned workers end too instead of staying orphaned."""
    import os
    import signal
    import subprocess
    import time

    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    code = ("import time\n"
            "from asrprec.data.features import fbank_executor\n"
            "ex = fbank_executor(2)\n"
            "busy = [ex.submit(time.sleep, 3) for _ in range(2)]\n"  # two tasks at once: two workers
            "[f.result() for f in busy]\n"
            "print('ready', flush=True)\n"
            "time.sleep(600)\n")
    root = Path(__file__).resolve().parents[2]
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})
    assert p.stdout.readline().strip() == "ready"
    children = [int(c) for t in Path(f"/proc/{p.pid}/task").iterdir() for c in (t / "children").read_text().split()]
    workers = [c for c in children if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]
    assert len(workers) == 2 and all(_alive(pid) for pid in workers), children
    pids = children  # the workers and multiprocessing's resource tracker
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    deadline = time.time() + 20
    while any(_alive(pid) for pid in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), pids


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting for its (new) parent to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@needs_espeak
@pytest.mark.slow  # a pool of two spawned workers
def test_fbank_order_follows_the_cuts_not_the_chunks_or_jobs(tiny_corpus, tmp_path):
    from asrprec.data.features import compute_fbank_lazy

    _, cuts = tiny_corpus
    train = cuts["train"]
    out = compute_fbank_lazy(train, tmp_path / "feats", tmp_path / "cuts.jsonl.gz", chunk_size=5, num_jobs=2)
    assert [c.id for c in out] == list(train.ids)


def test_transcript_lines_that_are_not_utf8_are_named_by_file_and_line(tmp_path):
    chapter = tmp_path / "LibriSpeech" / "dev-clean" / "19" / "198"
    chapter.mkdir(parents=True)
    trans = chapter / "19-198.trans.txt"
    trans.write_bytes(b"19-198-0000 HELLO WORLD\n19-198-0001 CAF\xe9 AU LAIT\n")  # Latin-1, not UTF-8
    with pytest.raises(CorpusError) as e:
        prepare_librispeech_manifests(tmp_path, ["dev-clean"], tmp_path / "manifests", max_bad_lines=0)
    assert f"{trans}:2: not UTF-8 text (byte 0xe9 at column 16)" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("window_s, min_s", [(2.0, 2.0), (2.0, 3.0), (2.0, 0.0)])
def test_musan_window_flags_out_of_order_give_one_line_naming_both(tmp_path, window_s, min_s):
    with pytest.raises(CorpusError, match=r"0 < --musan-min-s < --musan-window-s, got --musan-min-s .* fix: "):
        musan_noise_cuts(tmp_path, window_s=window_s, min_s=min_s)


def _tone_part(root: Path, n: int = 3) -> list[Path]:
    import numpy as np
    import soundfile as sf

    chapter = root / "LibriSpeech" / "dev-clean" / "19" / "198"
    chapter.mkdir(parents=True)
    flacs = []
    for i in range(n):
        flac = chapter / f"19-198-{i:04d}.flac"
        sf.write(str(flac), 0.1 * np.sin(np.arange(16000) * (i + 1) / 10).astype(np.float32), 16000)
        flacs.append(flac)
    (chapter / "19-198.trans.txt").write_text("".join(f"19-198-{i:04d} WORD {i}\n" for i in range(n)))
    return flacs


def test_audio_stage_1_cannot_open_is_named_and_left_out_under_max_bad_audio(tmp_path, caplog):
    import lhotse

    flacs = _tone_part(tmp_path)
    flacs[1].write_bytes(b"this is not a FLAC file" * 10)
    with pytest.raises(CorpusError, match=rf"dev-clean: 1 audio file\(s\) cannot be read: {flacs[1]} .*"
                                          r"raise --max-bad-audio \(now 0\)"):
        prepare_librispeech_manifests(tmp_path, ["dev-clean"], tmp_path / "m0")
    with caplog.at_level(logging.WARNING):
        paths = prepare_librispeech_manifests(tmp_path, ["dev-clean"], tmp_path / "m1", max_bad_audio=1)
    assert f"left out {flacs[1]}" in caplog.text
    assert sorted(r.id for r in lhotse.RecordingSet.from_file(paths["dev-clean"]["recordings"])) == [
        "19-198-0000", "19-198-0002"]
