"""benchmarks/timestamps.py and benchmarks/longform.py run end to end at toy size (a tiny corpus synthesised with
word times, a tokenizer trained on it, an untrained tiny Zipformer saved as epoch 1) and print their tables; their
numbers are not checked here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asrprec._optional import is_available

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not is_available("espeakng_loader"), reason="needs espeakng-loader (asrprec[synth])")]


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    import torch

    from asrprec.checkpoint.io import TrainingObjects, save_checkpoint
    from asrprec.data.synthetic import generate_corpus
    from asrprec.models import build_transducer
    from asrprec.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("toy")
    data, exp = root / "data", root / "exp"
    cuts = generate_corpus(data, num_train=0, num_dev=0, num_test=6, shard_size=6, num_workers=1)
    tok = Tokenizer.train([c.supervisions[0].text for c in cuts["test"]], data / "bpe", 40)
    spec = {"encoder": "zipformer", "size": "tiny", "vocab_size": tok.vocab_size, "blank_id": 0, "context_size": 2}
    torch.manual_seed(0)
    model = build_transducer(**spec)
    exp.mkdir()
    (exp / "model.json").write_text(json.dumps(spec))
    save_checkpoint(exp / "epoch-1.pt", TrainingObjects(model=model))
    return root, data, exp


def _run(script, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *map(str, args)], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_timestamps_benchmark_prints_a_row_per_search(toy_run):
    root, data, exp = toy_run
    out = _run("timestamps.py", "--exp-dir", exp, "--epoch", 1, "--avg", 1, "--data-dir", data, "--work-dir",
               root / "aligned", "--methods", "greedy_search,modified_beam_search,ctc_greedy_search", "--threads", 1)
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows == ["method", "greedy_search", "modified_beam_search"]
    assert "ctc_greedy_search: skipped" in out  # the model has no CTC head


def test_longform_benchmark_prints_a_row_per_length_and_mode(toy_run):
    root, data, exp = toy_run
    out = _run("longform.py", "--exp-dir", exp, "--epoch", 1, "--avg", 1, "--data-dir", data, "--work-dir",
               root / "long", "--minutes", 0.1, 0.25, "--one-pass-minutes", 0.1, "--chunk-seconds", 6,
               "--overlap-seconds", 2, "--threads", 1)
    rows = [[c.strip() for c in line.split("|")[1:3]] for line in out.splitlines() if line.startswith("| 0.")]
    assert rows == [["0.1", "chunked"], ["0.1", "one pass"], ["0.25", "chunked"]]
    out = _run("longform.py", "--exp-dir", exp, "--epoch", 1, "--avg", 1, "--data-dir", data, "--work-dir",
               root / "long", "--minutes", 0.1, "--one-pass-minutes", 0, "--pause-seconds", 0.3, "--threads", 1)
    assert "cut at pauses of 0.3 s" in out
    assert [line.split("|")[2].strip() for line in out.splitlines() if line.startswith("| 0.")] == ["chunked"]


def test_hotword_recall_benchmark_prints_a_row_per_search_and_score(toy_run):
    from asrprec.data import compute_corpus_fbank, load_corpus

    root, data, exp = toy_run
    if not (data / "espeak_cuts_test_fbank.jsonl.gz").is_file():
        compute_corpus_fbank({"test": load_corpus(data)["test"]}, data, num_jobs=1)
    out = _run("hotword_recall.py", "--exp-dir", exp, "--epoch", 1, "--avg", 1, "--data-dir", data, "--split", "test",
               "--words", "ONE", "TWO", "--score", 1, "--threads", 1)
    table = out[out.rindex("| method |"):]  # the final table (rows are also printed as they come)
    rows = [[c.strip() for c in line.split("|")[1:3]] for line in table.splitlines()
            if line.startswith("| ") and "---" not in line]
    assert rows == [["method", "hotword score"], ["greedy_search", "0"], ["greedy_search", "1"],
                    ["modified_beam_search", "0"], ["modified_beam_search", "1"]]


def test_the_benchmarks_decode_a_trained_model_in_eval_mode(toy_run):
    """lm_decode.py, hotword_recall.py and tdt_decode.py load through decode.py's load_trained: its model has no
    dropout left on, so one batch encodes the same twice."""
    import argparse
    import importlib.util

    import torch

    from asrprec.data import compute_corpus_fbank, load_corpus

    root, data, exp = toy_run
    if not (data / "espeak_cuts_test_fbank.jsonl.gz").is_file():
        compute_corpus_fbank({"test": load_corpus(data)["test"]}, data, num_jobs=1)
    spec = importlib.util.spec_from_file_location("bench_decode", ROOT / "benchmarks" / "decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = argparse.Namespace(exp_dir=exp, data_dir=data, epoch=1, avg=1, split="test", max_utts=0,
                              max_duration=300.0)
    model, batches, _ = bench.load_trained(args)
    assert not any(m.training for m in model.modules())
    with torch.no_grad():
        first, second = (model.encode(batches[0]["features"], batches[0]["feature_lens"])[0] for _ in range(2))
    assert torch.equal(first, second)
