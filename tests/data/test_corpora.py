"""LibriSpeech / MUSAN preparation through lhotse's recipe functions on fixtures in their on-disk layouts, speed
perturbation against the resampling arithmetic, chunked (lazy) fbank, and shuffled manifests."""

import gzip
import json

import numpy as np
import pytest
import soundfile as sf

from asrprec.data import (
    OnTheFlyFbank, compute_fbank_lazy, fbank_extractor, load_cuts, shuffle_manifests, speed_perturbed, write_cuts,
)
from asrprec.data.frames import num_frames
from asrprec.data import corpora
from asrprec.data.corpora import PreparedData

from .conftest import LIBRISPEECH_FIXTURE_PARTS, needs_espeak

PARTS = tuple(LIBRISPEECH_FIXTURE_PARTS)


@pytest.fixture(scope="module")
def manifests(corpus_layouts, tmp_path_factory):
    root, _ = corpus_layouts
    out = tmp_path_factory.mktemp("manifests")
    return out, corpora.prepare_librispeech_manifests(root, PARTS, out), corpora.prepare_musan_manifests(root, out)


@needs_espeak
def test_librispeech_manifests_match_the_files_on_disk(corpus_layouts, manifests):
    """lhotse's prepare_librispeech finds every utterance we wrote, with its transcript, audio and speaker."""
    _, written = corpus_layouts
    out, _, _ = manifests
    for part in PARTS:
        cuts = corpora.librispeech_cuts(out, part)
        assert len(cuts) == len(written[part])
        for cut in cuts:
            text, flac = written[part][cut.recording.id]
            assert cut.supervisions[0].text == text
            assert cut.supervisions[0].speaker == cut.recording.id.split("-")[0]
            info = sf.info(str(flac))
            assert (cut.recording.num_samples, cut.sampling_rate) == (info.frames, info.samplerate)
    expected_texts = [t for t, _ in written["train-clean-100"].values()]
    assert sorted(corpora.librispeech_transcripts(out, ["train-clean-100"])) == sorted(expected_texts)


@needs_espeak
def test_manifests_are_reused_and_missing_parts_are_named(corpus_layouts, manifests, monkeypatch, tmp_path):
    import lhotse.recipes

    root, _ = corpus_layouts
    out, _, _ = manifests

    def must_not_run(*a, **k):
        raise AssertionError("the corpus was read again although its manifests exist")

    monkeypatch.setattr(lhotse.recipes, "prepare_librispeech", must_not_run)
    monkeypatch.setattr(lhotse.recipes, "prepare_musan", must_not_run)
    corpora.prepare_librispeech_manifests(root, PARTS, out)
    corpora.prepare_musan_manifests(root, out)
    with pytest.raises(FileNotFoundError, match=r"\['train-other-500'\].*--corpus-dir"):
        corpora.prepare_librispeech_manifests(root, ["train-other-500"], tmp_path)
    with pytest.raises(FileNotFoundError, match="MUSAN is not in"):
        corpora.prepare_musan_manifests(tmp_path, tmp_path)


@needs_espeak
def test_download_skips_what_is_on_disk(corpus_layouts, monkeypatch):
    """Only parts without transcripts on disk are fetched, into the folder above LibriSpeech/, and unpacked there."""
    from asrprec.data import download

    root, _ = corpus_layouts
    calls = []
    monkeypatch.setattr(download, "fetch", lambda url, archive, md5: calls.append(("fetch", url, archive, md5)))
    monkeypatch.setattr(download, "unpack", lambda *a: calls.append(("unpack", *a)))
    assert corpora.download_librispeech(root, PARTS) == root / "LibriSpeech"
    assert corpora.download_librispeech(root / "LibriSpeech", PARTS) == root / "LibriSpeech"  # the folder itself
    assert corpora.download_musan(root) == root / "musan"
    assert calls == []
    corpora.download_librispeech(root, PARTS + ("train-clean-360",))
    archive = root / "train-clean-360.tar.gz"
    assert calls == [  # the MD5 OpenSLR publishes in resources/12/md5sum.txt
        ("fetch", "https://www.openslr.org/resources/12/train-clean-360.tar.gz", archive,
         "c0e676e450a7ff2f54aeade5171606fa"),
        ("unpack", archive, root, root / "LibriSpeech" / "train-clean-360" / ".completed")]
    assert corpora.missing_librispeech_parts(root, corpora.librispeech_parts("960h")) == ["train-clean-360",
                                                                                          "train-other-500"]
    # lhotse's own unpacking, interrupted: its archive without its .completed marker -> fetched again
    (root / "dev-other.tar.gz").write_bytes(b"")
    try:
        assert corpora.missing_librispeech_parts(root, PARTS) == ["dev-other"]
        (root / "LibriSpeech" / "dev-other" / ".completed").touch()
        assert corpora.missing_librispeech_parts(root, PARTS) == []
    finally:
        (root / "dev-other.tar.gz").unlink()
        (root / "LibriSpeech" / "dev-other" / ".completed").unlink()
    with pytest.raises(ValueError, match="unknown LibriSpeech parts"):
        corpora.download_librispeech(root, ["train-clean-1000"])
    with pytest.raises(ValueError, match="subset"):
        corpora.librispeech_parts("1000h")


@needs_espeak
def test_musan_noise_cuts_are_10s_windows_longer_than_5s(manifests):
    out, _, _ = manifests
    cuts = corpora.musan_noise_cuts(out)
    # three 12 s recordings: each gives a 10 s window and a 2 s remainder, which is dropped
    assert sorted(c.duration for c in cuts) == [10.0, 10.0, 10.0]
    assert {c.recording.id.split("-")[0] for c in cuts} == {"music", "speech", "noise"}
    assert all(not c.supervisions for c in cuts)


def _tone(path, freq, seconds, sr=16000):
    t = np.arange(int(round(seconds * sr))) / sr
    sf.write(str(path), 0.3 * np.sin(2 * np.pi * freq * t), sr, format="FLAC", subtype="PCM_16")


def _peak_hz(x, sr=16000):
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x)), n=8 * len(x)))  # zero-padded: 0.25 Hz bins for 0.5 s
    return np.fft.rfftfreq(8 * len(x), 1 / sr)[spectrum.argmax()]


def test_speed_perturbation_resamples_by_the_factor(tmp_path):
    """A cut of N samples at factor f lasts N / f samples (to within one sample), its audio has that many samples,
    and a 440 Hz tone in it moves to 440 f Hz; lazily read cuts perturb the same way."""
    import lhotse

    durations = (1.37, 2.0)
    for i, seconds in enumerate(durations):
        _tone(tmp_path / f"tone{i}.flac", 440.0, seconds)
    recordings = lhotse.RecordingSet.from_recordings(lhotse.Recording.from_file(tmp_path / f"tone{i}.flac")
                                                     for i in range(len(durations)))
    cuts = lhotse.CutSet.from_manifests(recordings=recordings)
    write_cuts(cuts, tmp_path / "cuts.jsonl.gz")
    for source in (cuts, load_cuts(tmp_path / "cuts.jsonl.gz")):
        out = list(speed_perturbed(source, (0.9, 1.1)))
        assert len(out) == 3 * len(durations)
        originals = {c.id: c for c in out[: len(durations)]}
        for cut in out[len(durations):]:
            base, factor = cut.id.rsplit("_sp", 1)
            factor = float(factor)
            n = originals[base].num_samples
            assert abs(cut.num_samples - n / factor) <= 1.0
            assert cut.duration == pytest.approx(cut.num_samples / 16000)
            audio = cut.load_audio()[0]
            assert audio.shape == (cut.num_samples,)
            assert _peak_hz(audio[: 8000]) == pytest.approx(440.0 * factor, abs=1.0)
        # on-the-fly features of the perturbed audio: Kaldi's frame count for its length (snip_edges=False)
        feats, feat_lens = OnTheFlyFbank()(lhotse.CutSet.from_cuts(out))
        assert feat_lens.tolist() == [num_frames(c.num_samples) for c in out] and feats.shape[2] == 80
    with pytest.raises(ValueError, match="not 1.0"):
        speed_perturbed(cuts, (1.0,))
    with pytest.raises(ValueError, match="distinct"):
        speed_perturbed(cuts, (0.9, 0.9))


@needs_espeak
def test_chunked_fbank_matches_lhotse_and_resumes_after_interruption(manifests, tmp_path, monkeypatch):
    """compute_fbank_lazy over a lazy manifest in chunks: every cut gets lhotse Fbank's features of its audio, and
    after a failure in the second chunk a rerun recomputes only the chunks not yet done."""
    from asrprec.data import features

    out, _, _ = manifests
    write_cuts(corpora.librispeech_cuts(out, "train-clean-100"), tmp_path / "raw.jsonl.gz")
    lazy = load_cuts(tmp_path / "raw.jsonl.gz")
    real = features.compute_fbank
    calls = []

    def failing_second_chunk(cuts, storage_path, manifest_path, **kw):
        calls.append(manifest_path.name)
        if len(calls) == 2:
            raise RuntimeError("interrupted")
        return real(cuts, storage_path, manifest_path, **kw)

    monkeypatch.setattr(features, "compute_fbank", failing_second_chunk)
    target = tmp_path / "fbank.jsonl.gz"
    with pytest.raises(RuntimeError, match="interrupted"):
        compute_fbank_lazy(lazy, tmp_path / "feats", target, chunk_size=5, num_jobs=1)
    assert not target.exists()
    first_chunk = next((tmp_path / "feats").glob("chunk-00000*.lca"))
    done_at = first_chunk.stat().st_mtime_ns
    monkeypatch.setattr(features, "compute_fbank", real)
    result = compute_fbank_lazy(lazy, tmp_path / "feats", target, chunk_size=5, num_jobs=1)
    assert first_chunk.stat().st_mtime_ns == done_at  # reused, not recomputed
    assert sorted(p.name for p in (tmp_path / "feats").glob("*.lca")) == [f"chunk-0000{i}.lca" for i in range(3)]
    assert result.is_lazy and [c.id for c in result] == [c.id for c in lazy]
    extractor = fbank_extractor()
    for cut in list(result)[::4]:
        expected = extractor.extract(cut.load_audio(), cut.sampling_rate)
        np.testing.assert_allclose(cut.load_features(), expected, atol=0.05)  # lilcom's quantisation
    monkeypatch.setattr(features, "compute_fbank", failing_second_chunk)
    calls.clear()
    compute_fbank_lazy(lazy, tmp_path / "feats", target, chunk_size=5, num_jobs=1)  # done: nothing to compute
    assert calls == []


def test_shuffled_manifest_keeps_every_line_once(tmp_path):
    paths = []
    for k in range(3):
        paths.append(tmp_path / f"part{k}.jsonl.gz")
        with gzip.open(paths[-1], "wt") as f:
            f.writelines(json.dumps({"id": f"{k}-{i}"}) + "\n" for i in range(50))
    assert shuffle_manifests(paths, tmp_path / "all.jsonl.gz", seed=3) == 150
    with gzip.open(tmp_path / "all.jsonl.gz", "rt") as f:
        ids = [json.loads(line)["id"] for line in f]
    in_order = [f"{k}-{i}" for k in range(3) for i in range(50)]
    assert sorted(ids) == sorted(in_order) and ids != in_order
    assert ids[:50] != in_order[:50] and {i.split("-")[0] for i in ids[:30]} == {"0", "1", "2"}
    shuffle_manifests(paths, tmp_path / "again.jsonl.gz", seed=3)
    assert gzip.open(tmp_path / "again.jsonl.gz").read() == gzip.open(tmp_path / "all.jsonl.gz").read()


def test_atomic_writes_leave_nothing_on_failure(tmp_path):
    def cuts():
        yield from ()
        raise RuntimeError("broken input")

    with pytest.raises(RuntimeError):
        write_cuts(cuts(), tmp_path / "out.jsonl.gz")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError, match="fix: run stage 2"):
        load_cuts(tmp_path / "missing.jsonl.gz", hint="run stage 2")


def test_prepared_data_layout(tmp_path):
    data = PreparedData(tmp_path)
    assert data.cuts("dev-clean") == tmp_path / "fbank" / "librispeech_cuts_dev-clean.jsonl.gz"
    assert data.cuts("dev-clean", features=False) == tmp_path / "manifests" / "librispeech_cuts_dev-clean.jsonl.gz"
    assert data.cuts(data.train_part("960h")).name == "librispeech_cuts_train-960h-shuf.jsonl.gz"
    assert data.bpe_model(500) == tmp_path / "lang_bpe_500" / "bpe.model"
