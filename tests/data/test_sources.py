"""Corpus import (asrprec.data.sources) and recipes/custom/prepare.py on a tiny corpus in each format: the faults
(a missing file, an empty transcript, a transcript that is not UTF-8) are named by file and line, counted and left
out; every cut is 16 kHz mono, an 8 kHz stereo file mixed down (checked on its spectrum), and the features have the
frame count Kaldi's fbank gives (snip_edges=False: (samples + hop / 2) // hop)."""

import json
import logging
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest

from asrprec.data import load_cuts
from asrprec.data.corpora import CorpusError, PreparedData
from asrprec.data.sources import ImportOptions, detect_format, import_split, normalize_text, read_source
from asrprec.data.stages import read_done

from . import custom_corpus as cc

ROOT = Path(__file__).resolve().parents[2]
PREPARE = ROOT / "recipes" / "custom" / "prepare.py"


@pytest.fixture
def run_script(monkeypatch, capsys, caplog):
    """Run a recipe script's ``__main__`` here with ``args``; return what it printed and logged (the root logger's
    handlers, which a recipe replaces, are restored afterwards)."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level

    def run(script, *args):
        monkeypatch.setattr(sys, "argv", [str(script), *map(str, args)])
        caplog.clear()
        with caplog.at_level(logging.INFO):
            runpy.run_path(str(script), run_name="__main__")
        out = capsys.readouterr()
        return out.out + out.err + caplog.text

    yield run
    for h in root.handlers[:]:
        if h not in saved[0]:
            root.removeHandler(h)
            h.close()
    for h in saved[0]:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(saved[1])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return cc.write_all(tmp_path_factory.mktemp("custom"))


def expected_faults(fmt, src):
    """The three faults as (file, line, words the reason holds)."""
    if fmt == "kaldi":
        return [(src / "wav.scp", cc.kaldi_line(cc.MISSING), "no such file"),
                (src / "text", cc.kaldi_line(cc.EMPTY_TEXT), f"no text after '{cc.EMPTY_TEXT}'"),
                (src / "text", cc.kaldi_line(cc.NOT_UTF8), "not UTF-8")]
    line = {u: i + 1 for i, u in enumerate(cc.AUDIO)}
    return [(src, line[cc.MISSING], "no such file"), (src, line[cc.EMPTY_TEXT], "empty text"),
            (src, line[cc.NOT_UTF8], "not UTF-8")]


def test_each_format_is_detected_and_format_overrides(corpus, tmp_path):
    assert {f: detect_format(str(p)) for f, p in corpus.items()} == {"kaldi": "kaldi", "nemo": "nemo",
                                                                     "lhotse": "lhotse"}
    with pytest.raises(CorpusError, match=r"holds neither wav.scp .* or --format"):
        detect_format(str(tmp_path))
    # a NeMo manifest whose first line is damaged cannot be told apart; --format nemo reads it, naming that line
    damaged = tmp_path / "damaged.jsonl"
    damaged.write_bytes(b"{not json\n" + corpus["nemo"].read_bytes())
    with pytest.raises(CorpusError, match=r"cannot tell what .*damaged.jsonl is.*--format"):
        detect_format(str(damaged))
    cuts, problems = read_source(str(damaged), ImportOptions(format="nemo"), tmp_path / "audio")
    assert sorted(c.id for c in cuts) == list(cc.KEPT) and problems.lines[0].startswith(f"{damaged}:1: not JSON")
    with pytest.raises(CorpusError, match=r"is not a Kaldi data dir \(no wav.scp\).*--format"):
        read_source(str(corpus["nemo"]), ImportOptions(format="kaldi"), tmp_path / "audio")


def test_text_normalisation():
    assert normalize_text("  Don't, he said -- well-known!\tÉtude ", "upper") == "DON'T HE SAID WELL KNOWN ÉTUDE"
    assert normalize_text("  keep, THIS\n as is ", "none") == "keep, THIS as is"


def test_limits_name_the_faults_and_the_flag(corpus, tmp_path):
    src = corpus["nemo"]
    with pytest.raises(CorpusError, match=rf"2 bad line\(s\) in {src}: {src}:5: empty text; {src}:6: not UTF-8.*"
                                          r"raise --max-bad-lines \(now 1\)"):
        import_split([str(src)], ImportOptions(max_bad_lines=1), tmp_path / "a.jsonl.gz", tmp_path / "audio")
    with pytest.raises(CorpusError, match=rf"1 bad audio file\(s\) .*{src}:4: .*u3.wav: no such file.*"
                                          r"--max-bad-audio \(now 0\)"):
        import_split([str(src)], ImportOptions(max_bad_audio=0), tmp_path / "a.jsonl.gz", tmp_path / "audio")
    assert not (tmp_path / "a.jsonl.gz").exists()


def num_frames(seconds):
    samples = round(seconds * 16000)
    return (samples + 80) // 160  # Kaldi fbank, 10 ms hop, snip_edges=False


@pytest.mark.parametrize("fmt", ["kaldi", "nemo", "lhotse"])
def test_prepare_names_counts_and_leaves_out_faults(fmt, corpus, tmp_path, run_script):
    src = corpus[fmt]
    args = ("--train", src, "--dev", src, "--test", f"eval={src}", "--data-dir", tmp_path, "--vocab-size", 24,
            "--bpe-model-type", "bpe", "--num-jobs", 1, "--speed-factors")
    log = run_script(PREPARE, *args)
    for path, line, why in expected_faults(fmt, src):
        named = [x for x in log.splitlines() if f"left out: {path}:{line}: " in x]
        assert len(named) == 3 and why in named[0], (path, line, why, log[-3000:])  # once per split
    data = PreparedData(tmp_path, prefix="custom")
    for split in ("train", "dev", "eval"):
        record = read_done(data.manifest_dir / f"custom_imported_{split}.done.json")
        assert (record["cuts"], record["bad_lines"], record["bad_audio"]) == (5, 2, 1)
    assert json.loads((tmp_path / "splits.json").read_text()) == {"train": [str(src)], "dev": [str(src)],
                                                                   "eval": [f"eval={src}"]}
    cuts = {c.id: c for c in load_cuts(data.cuts("eval"))}
    assert sorted(cuts) == list(cc.KEPT)
    offset = cc.NEMO_OFFSET[1] if fmt == "nemo" else 0.0
    for utt, cut in cuts.items():
        seconds = cc.AUDIO[utt][2] - (offset if utt == cc.NEMO_OFFSET[0] else 0.0)
        assert cut.duration == pytest.approx(seconds, abs=1e-6) and cut.supervisions[0].text == cc.text_of(utt)
        audio = cut.load_audio()
        assert cut.sampling_rate == 16000 and audio.shape == (1, round(seconds * 16000))
        assert cut.num_frames == num_frames(seconds) and cut.load_features().shape == (num_frames(seconds), 80)
    # u1 was L = a + b, R = a - b at 8 kHz: the mixdown holds tone a (300 Hz) and not tone b (1 kHz)
    spectrum = np.abs(np.fft.rfft(cuts["u1"].load_audio()[0]))
    hz = np.fft.rfftfreq(cuts["u1"].load_audio().shape[1], 1 / 16000)
    at = {f: spectrum[np.argmin(np.abs(hz - f))] for f in (cc.TONE_A_HZ, cc.TONE_B_HZ)}
    assert at[cc.TONE_B_HZ] < 1e-3 * at[cc.TONE_A_HZ]
    assert data.tokenizer_model(24).is_file() and len(load_cuts(data.cuts("train-all-shuf"), lazy=False)) == 5
    if fmt == "kaldi":  # a rerun finds every stage done
        again = run_script(PREPARE, *args)
        assert "left out" not in again and "computed fbank" not in again and "not retraining" in again
        assert again.count("exists; skipping") >= 6


def test_kaldi_segments_and_a_lhotse_pair(corpus, tmp_path):
    from lhotse import CutSet

    kaldi = tmp_path / "kaldi"
    kaldi.mkdir()
    wav = Path(corpus["kaldi"] / "wav.scp").read_text().splitlines()[6]  # u6, 1.6 s
    (kaldi / "wav.scp").write_text(wav + "\n")
    (kaldi / "segments").write_text("s1 u6 0.10 0.70\ns2 u6 0.80 -1\n")
    (kaldi / "text").write_text("s1 alpha bravo\ns2 charlie\n")
    cuts, problems = read_source(str(kaldi), ImportOptions(), tmp_path / "audio")
    assert not problems.lines and not problems.audio
    assert [(c.id, c.start, round(c.duration, 6), c.supervisions[0].text) for c in cuts] == [
        ("s1", 0.10, 0.6, "alpha bravo"), ("s2", 0.80, 0.8, "charlie")]
    # recordings + supervisions: the same cuts through lhotse's own manifests, as a pair and as a folder
    pair = CutSet.from_cuts(cuts)
    folder = tmp_path / "pair"
    folder.mkdir()
    pair.decompose(output_dir=folder)
    recs, sups = sorted(folder.glob("recordings*")), sorted(folder.glob("supervisions*"))
    assert len(recs) == len(sups) == 1
    for src in (f"{recs[0]},{sups[0]}", str(folder)):
        assert detect_format(src) == "lhotse"
        again, problems = read_source(src, ImportOptions(text_norm="upper"), tmp_path / "audio")
        assert [(c.id, c.start, round(c.duration, 6), c.supervisions[0].text) for c in again] == [
            ("s1", 0.10, 0.6, "ALPHA BRAVO"), ("s2", 0.80, 0.8, "CHARLIE")]


def test_kaldi_commands_are_run_for_their_audio(corpus, tmp_path):
    """A wav.scp entry ending in ``|`` is a command whose output is the audio (Kaldi's extended filename), here the
    8 kHz stereo file through cat: probed for its real rate and channels, and mixed down as a file would be."""
    kaldi = tmp_path / "kaldi"
    kaldi.mkdir()
    stereo = corpus["kaldi"].parent / "audio" / "u1.wav"
    (kaldi / "wav.scp").write_text(f"u1 cat {stereo} |\nu9 false |\n")
    (kaldi / "text").write_text("u1 delta echo\nu9 nothing\n")
    cuts, problems = read_source(str(kaldi), ImportOptions(), tmp_path / "audio")
    assert [c.id for c in cuts] == ["u1"] and cuts[0].load_audio().shape == (1, round(cc.AUDIO["u1"][2] * 16000))
    assert problems.audio == [f"{kaldi / 'wav.scp'}:2: false |: cannot be read (CalledProcessError: Command 'false' "
                              "returned non-zero exit status 1.)"]


def test_test_splits_are_named_after_their_source_or_by_name():
    from asrprec.data.sources import test_split_names

    assert test_split_names(["data/test_clean", "x/test-other.jsonl", "noisy=a/b.jsonl.gz", "p/r.jsonl.gz,p/s.jsonl.gz"]) \
        == ["test_clean", "test-other", "noisy", "r"]
    with pytest.raises(CorpusError, match=r"test split name\(s\) test are taken.*--test other=path/to/test_other"):
        test_split_names(["a/test", "b/test.jsonl"])
    with pytest.raises(CorpusError, match=r"name\(s\) dev are taken"):
        test_split_names(["dev=a/x.jsonl"])
