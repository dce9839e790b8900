"""recipes/custom end to end on the tiny corpus of custom_corpus.py, one format per split (NeMo for training, Kaldi
for validation, lhotse and Kaldi for two test splits): prepare, train a tiny Zipformer for one epoch, decode every
test split, and (export tier) export to sherpa-onnx's files. The scripts run in this process (their ``__main__``)."""

import json
from pathlib import Path

import pytest

from . import custom_corpus as cc
from .test_sources import run_script  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "custom"
VOCAB = 24


@pytest.fixture
def trained(tmp_path, run_script):  # noqa: F811
    src = cc.write_all(tmp_path / "src")
    data, exp = tmp_path / "data", tmp_path / "exp"
    run_script(RECIPE / "prepare.py", "--train", src["nemo"], "--dev", src["kaldi"], "--test", src["lhotse"],
               "--test", f"other={src['kaldi']}", "--data-dir", data, "--vocab-size", VOCAB, "--bpe-model-type",
               "bpe", "--num-jobs", 1)
    run_script(RECIPE / "train.py", "--data-dir", data, "--vocab-size", VOCAB, "--exp-dir", exp, "--size", "tiny",
               "--num-epochs", 1, "--max-duration", 4, "--num-buckets", 2, "--num-workers", 0,
               "--train.progress_bar", "false")
    return data, exp


def test_prepare_train_decode(trained, run_script, recogs_wer):  # noqa: F811
    data, exp = trained
    log = (exp / "train.log").read_text()
    assert "epoch 1 done" in log and (exp / "epoch-1.pt").is_file()
    out = run_script(RECIPE / "decode.py", "--data-dir", data, "--vocab-size", VOCAB, "--exp-dir", exp, "--epoch", 1)
    assert "cuts: WER" in out and "other: WER" in out
    tag = "greedy_search-epoch-1-avg-1-fp32"
    summary = json.loads((exp / f"wer-summary-{tag}.json").read_text())
    assert set(summary) == {"cuts", "other"}
    for split, v in summary.items():
        recogs = exp / f"recogs-{split}-{tag}.txt"
        assert v["wer"] == pytest.approx(recogs_wer(recogs))
        refs = {line.split("ref=")[1] for line in recogs.read_text().splitlines() if "ref=" in line}
        assert refs == {str(cc.text_of(u).split()) for u in cc.KEPT}


@pytest.mark.export
def test_export(trained, run_script):  # noqa: F811
    import sentencepiece as spm

    data, exp = trained
    run_script(RECIPE / "export.py", "--data-dir", data, "--vocab-size", VOCAB, "--exp-dir", exp, "--epoch", 1)
    out = exp / "onnx-epoch-1-avg-1"
    assert all((out / f).is_file() for f in ("encoder.onnx", "decoder.onnx", "joiner.onnx"))
    sp = spm.SentencePieceProcessor(model_file=str(data / f"lang_bpe_{VOCAB}" / "bpe.model"))
    tokens = [line.rsplit(" ", 1) for line in (out / "tokens.txt").read_text().splitlines()]
    assert [int(i) for _, i in tokens] == list(range(VOCAB))
    assert [p for p, _ in tokens][2:] == [sp.id_to_piece(i) for i in range(2, VOCAB)]
