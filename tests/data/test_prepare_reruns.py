"""Reruns of recipes/librispeech/prepare.py: an intact rerun skips every stage and says so; a corpus that changed, a
manifest truncated or damaged, a record that is unreadable, features whose storage is gone, or another flag makes the
stages that depend on them run again, and only those; the results then match the fixture on disk."""

import gzip
import shutil

import pytest

from asrprec.data import load_cuts
from asrprec.data.corpora import PreparedData, librispeech_manifest_paths
from asrprec.data.stages import done_path

from .conftest import LIBRISPEECH_FIXTURE_PARTS, needs_espeak, write_librispeech_layout

pytestmark = needs_espeak
PARTS = tuple(LIBRISPEECH_FIXTURE_PARTS)


@pytest.fixture
def prepared(tiny_corpus, tmp_path, prepare, capsys):
    """``(run, data, written)``: the LibriSpeech fixture prepared through stage 3 (no MUSAN); ``run(*extra)`` reruns
    prepare.py with the same flags and returns its log."""
    _, cuts = tiny_corpus
    written = write_librispeech_layout(tmp_path, cuts)
    base = ("--subset", "100h", "--corpus-dir", tmp_path, "--data-dir", tmp_path / "data", "--num-jobs", 1,
            "--chunk-size", 16, "--no-musan", "--stop-stage", 3)

    def run(*extra):
        capsys.readouterr()
        assert prepare(*base, *extra) is None
        return capsys.readouterr().err  # prepare.py's log handler writes to stderr

    run()
    return run, PreparedData(tmp_path / "data"), written


def _recordings(data, part, *, features=True):
    return sorted(c.recording.id for c in load_cuts(data.cuts(part, features=features)))


def _mtimes(folder):
    return {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def test_an_intact_rerun_skips_every_stage_and_says_so(prepared):
    run, data, written = prepared
    before = _mtimes(data.root)
    log = run()
    assert "match the corpus; not re-reading it" in log
    assert log.count("exists; skipping (made from the same inputs)") == len(PARTS) + 2  # stage 2 parts, 2 shuffles
    assert log.count("not recomputing (made from the same cuts, complete)") == len(PARTS)
    assert "WARNING" not in log and "computed fbank" not in log
    assert _mtimes(data.root) == before
    for part in PARTS:
        speeds = ("", "_sp0.9", "_sp1.1") if part == "train-clean-100" else ("",)
        assert _recordings(data, part) == sorted(u + s for u in written[part] for s in speeds)


def test_a_new_utterance_remakes_its_part_through_every_stage(prepared):
    run, data, written = prepared
    train_fbank = data.cuts("train-clean-100").stat().st_mtime_ns
    # a new recording and its transcript line in dev-clean's first chapter
    _, flac = next(iter(written["dev-clean"].values()))
    new_id = f"{flac.parent.parent.name}-{flac.parent.name}-0099"
    shutil.copy(flac, flac.parent / f"{new_id}.flac")
    with open(flac.parent / f"{flac.parent.parent.name}-{flac.parent.name}.trans.txt", "a") as f:
        f.write(f"{new_id} A NEW LINE\n")
    log = run()
    assert "LibriSpeech manifests of dev-clean in" in log and "the corpus they were made from changed" in log
    assert log.count("re-reading the corpus") == 1  # dev-clean only
    assert log.count("making it again") == 1 and log.count("cannot be reused") == 1
    assert _recordings(data, "dev-clean") == sorted([*written["dev-clean"], new_id])
    assert _recordings(data, "dev-clean", features=False) == sorted([*written["dev-clean"], new_id])
    texts = {c.supervisions[0].text for c in load_cuts(data.cuts("dev-clean"))}
    assert "A NEW LINE" in texts
    assert data.cuts("train-clean-100").stat().st_mtime_ns == train_fbank  # other parts untouched
    again = run()
    assert "re-reading the corpus" not in again and "computed fbank" not in again


def test_a_truncated_fbank_manifest_is_recomputed(prepared):
    run, data, written = prepared
    path = data.cuts("test-clean")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    log = run("--stage", 3)
    assert f"features in {path} cannot be reused: {path.name} is unreadable" in log
    assert _recordings(data, "test-clean") == sorted(written["test-clean"])
    assert all(c.load_features().shape[1] == 80 for c in load_cuts(path))


def test_fbank_whose_storage_is_gone_is_recomputed(prepared):
    run, data, written = prepared
    for archive in data.feature_storage("test-other").glob("*.lca"):
        archive.unlink()
    log = run("--stage", 3)
    assert "cannot be reused: 1 of its feature archives are gone" in log
    assert [c.load_features().shape[1] for c in load_cuts(data.cuts("test-other"))] == [80] * len(written["test-other"])


def test_an_unreadable_record_or_a_changed_manifest_remakes_only_that_output(prepared):
    run, data, written = prepared
    done_path(data.cuts("dev-other")).write_text("{not json")
    supervisions = librispeech_manifest_paths(data.manifest_dir, "test-clean")["supervisions"]
    supervisions.write_bytes(supervisions.read_bytes()[:-20])  # truncated: the gzip stream ends early
    log = run()
    assert "an unreadable record librispeech_cuts_dev-other.done.json" in log
    assert f"LibriSpeech manifests of test-clean in {data.manifest_dir}: {supervisions.name} is unreadable" in log
    assert log.count("re-reading the corpus") == 1 and log.count("cannot be reused") == 1
    # test-clean's manifests read again hold the same cuts: its later stages are kept
    assert f"{data.cuts('test-clean', features=False)} exists; skipping" in log
    with gzip.open(supervisions, "rt") as f:
        assert len(f.read().splitlines()) == len(written["test-clean"])
    assert _recordings(data, "dev-other") == sorted(written["dev-other"])


def test_another_speed_perturbation_remakes_the_training_cuts(prepared):
    run, data, written = prepared
    log = run("--speed-factors", "0.9")
    assert "the speed_factors they were made from changed" in log
    expected = sorted(u + s for u in written["train-clean-100"] for s in ("", "_sp0.9"))
    assert _recordings(data, "train-clean-100") == expected
    assert _recordings(data, data.train_part("100h")) == expected
    assert log.count("cannot be reused") == 1  # train-clean-100's fbank; the others are kept
