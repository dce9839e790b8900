"""recipes/librispeech end to end on fixtures in LibriSpeech's and MUSAN's on-disk layouts: every preparation stage
through lhotse's recipe functions (download skipped: the corpus is on disk), a rerun that finds everything done, a
few training steps (tiny Zipformer, MUSAN mixing, time-warped SpecAugment, lazy manifest) and a greedy decode of
test-clean and test-other. The scripts run in this process (their ``__main__``), which
saves a torch import per script; the slow test runs them as commands, with on-the-fly features, streaming and
modified beam search."""

import json
import logging
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from asrprec.data import load_cuts
from asrprec.data.corpora import PreparedData

from .conftest import needs_espeak

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "librispeech"

pytestmark = needs_espeak


@pytest.fixture
def run_script(monkeypatch, capsys, caplog):
    """Run a recipe script's ``__main__`` here with ``args``; return what it printed and logged. The root logger's
    handlers (train.py replaces them) are restored afterwards."""
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


def run(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, f"{args[0]} failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p.stdout + p.stderr


def test_prepare_train_decode(corpus_layouts, tmp_path, run_script, recogs_wer):
    root, written = corpus_layouts
    data_dir, exp = tmp_path / "data", tmp_path / "exp"
    prepare = (RECIPE / "prepare.py", "--subset", "100h", "--corpus-dir", root, "--data-dir", data_dir,
               "--num-jobs", 1, "--vocab-size", 40, "--chunk-size", 16)
    log = run_script(*prepare)
    assert "are on disk" in log and "MUSAN is on disk" in log  # stage 0 downloads nothing
    data = PreparedData(data_dir)
    train = load_cuts(data.cuts(data.train_part("100h")))
    ids = [c.id for c in train]
    # 12 utterances at speeds 1, 0.9 and 1.1, shuffled together
    assert len(ids) == 36 and sum(i.endswith("_sp0.9") for i in ids) == sum(i.endswith("_sp1.1") for i in ids) == 12
    assert ids != sorted(ids, key=lambda i: ("_sp" in i, i.endswith("_sp1.1")))
    assert all(c.has_features and c.num_features == 80 for c in train)
    assert {c.supervisions[0].text for c in train} == {t for t, _ in written["train-clean-100"].values()}
    assert len(load_cuts(data.cuts("test-other"), lazy=False)) == 2 and data.musan_cuts.is_file()
    again = run_script(*prepare)
    assert "computed fbank" not in again and "not retraining" in again and again.count("exists; skipping") >= 6

    bpe = data.bpe_model(40)
    run_script(RECIPE / "train.py", "--subset", "100h", "--data-dir", data_dir, "--bpe-model", bpe, "--exp-dir", exp,
        "--size", "tiny", "--max-duration", 8, "--num-buckets", 2, "--num-workers", 0, "--num-epochs", 1,
        "--train.max_batches_per_epoch", 2, "--train.log_interval", 1, "--train.progress_bar", "false")
    log = (exp / "train.log").read_text()
    assert "epoch 1 batch 2: loss" in log and (exp / "epoch-1.pt").is_file()
    model = json.loads((exp / "model.json").read_text())
    assert (model["encoder"], model["size"], model["loss"]["loss"], model["vocab_size"]) == ("zipformer", "tiny",
                                                                                             "pruned", 40)
    out = run_script(RECIPE / "decode.py", "--data-dir", data_dir, "--bpe-model", bpe, "--exp-dir", exp, "--epoch", 1)
    assert "weights: average of epoch-1.pt" in out and "test-clean: WER" in out and "test-other: WER" in out
    summary = json.loads((exp / "wer-summary-greedy_search-epoch-1-avg-1-fp32.json").read_text())
    assert set(summary) == {"test-clean", "test-other"}
    for split, v in summary.items():
        assert v["wer"] == pytest.approx(recogs_wer(exp / f"recogs-{split}-greedy_search-epoch-1-avg-1-fp32.txt"))
    for split in ("test-clean", "test-other"):
        recogs = (exp / f"recogs-{split}-greedy_search-epoch-1-avg-1-fp32.txt").read_text()
        refs = {t for t, _ in written[split].values()}
        stored = {line.split("ref=")[1] for line in recogs.splitlines() if "ref=" in line}
        assert stored == {str(t.split()) for t in refs}

    # n-grams on the training transcripts in BPE pieces, then decoding with shallow fusion and LODR
    run_script(RECIPE / "prepare_lm.py", "--subset", "100h", "--data-dir", data_dir, "--vocab-size", 40)
    lm, lodr = bpe.parent / "lm_3gram.arpa", bpe.parent / "lm_2gram.arpa"
    assert "ngram 3=" in lm.read_text() and "ngram 2=" in lodr.read_text()
    out = run_script(RECIPE / "decode.py", "--data-dir", data_dir, "--bpe-model", bpe, "--exp-dir", exp, "--epoch", 1,
                     "--decoding-method", "malsd_batch", "--lm", lm, "--lm-scale", 0.3, "--lodr", lodr,
                     "--lodr-scale", 0.1)
    assert "test-clean: WER" in out and (exp / "wer-summary-malsd_batch-epoch-1-avg-1-fp32-beam-4-lm-0.3-lodr-0.1.json"
                                         ).is_file()


@pytest.mark.slow
def test_on_the_fly_features_and_streaming_as_commands(corpus_layouts, tmp_path):
    """Without the LibriSpeech fbank stage: on-the-fly features (speed-perturbed audio, MUSAN mixed as waveforms), a
    causal model, and decoding as live streams, which gives the recognitions of simulated streaming."""
    root, _ = corpus_layouts
    data_dir, exp = tmp_path / "data", tmp_path / "exp"
    common = ("--subset", "100h", "--corpus-dir", root, "--data-dir", data_dir, "--num-jobs", 1, "--vocab-size", 40)
    run(RECIPE / "prepare.py", *common, "--stop-stage", 2)
    run(RECIPE / "prepare.py", *common, "--stage", 4)
    data = PreparedData(data_dir)
    train_part = data.train_part("100h")
    assert not data.cuts(train_part).exists() and data.cuts(train_part, features=False).exists()
    bpe = data.bpe_model(40)
    run(RECIPE / "train.py", "--subset", "100h", "--data-dir", data_dir, "--bpe-model", bpe, "--exp-dir", exp,
        "--size", "tiny", "--causal", "--on-the-fly-feats", "--max-duration", 8, "--num-buckets", 2,
        "--num-workers", 2, "--num-epochs", 1, "--train.max_batches_per_epoch", 2, "--train.progress_bar", "false")
    assert (exp / "epoch-1.pt").is_file()
    decode = (RECIPE / "decode.py", "--data-dir", data_dir, "--bpe-model", bpe, "--exp-dir", exp, "--epoch", 1,
              "--on-the-fly-feats", "--chunk-size", 16, "--left-context-frames", 64)
    run(*decode, "--streaming")
    run(*decode)
    run(*decode, "--decoding-method", "modified_beam_search")
    assert (exp / "errs-test-other-modified_beam_search-epoch-1-avg-1-fp32-beam-4-chunk-16-left-64.txt").is_file()
    for split in ("test-clean", "test-other"):
        streamed = (exp / f"recogs-{split}-greedy_search-epoch-1-avg-1-fp32-streaming-chunk-16-left-64.txt").read_text()
        simulated = (exp / f"recogs-{split}-greedy_search-epoch-1-avg-1-fp32-chunk-16-left-64.txt").read_text()
        assert streamed == simulated and streamed.count("hyp=") == 2
