"""recipes/espeak/prepare.py end to end at toy size, and its idempotence."""

import os
import pathlib
import subprocess
import sys

from .conftest import needs_espeak

ROOT = pathlib.Path(__file__).resolve().parents[2]


@needs_espeak
def test_prepare_script_runs_and_is_idempotent(tmp_path):
    cmd = [
        sys.executable, str(ROOT / "recipes" / "espeak" / "prepare.py"), "--data-dir", str(tmp_path),
        "--num-train", "16", "--num-dev", "2", "--num-test", "2", "--num-test-fast", "2", "--num-test-names", "2",
        "--vocab-size", "40", "--num-workers", "1",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    for split in ("train", "dev", "test", "test-fast", "test-names"):
        assert (tmp_path / f"espeak_cuts_{split}_fbank.jsonl.gz").is_file()
    assert (tmp_path / "bpe.model").is_file()
    second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    log = second.stderr
    assert "corpus in" in log and "up to date" in log and "not retraining" in log and "synthesised" not in log

    from asrprec.data import load_fbank_cuts
    from asrprec.tokenizer import Tokenizer

    cuts = load_fbank_cuts(tmp_path)
    tok = Tokenizer(tmp_path / "bpe.model")
    texts = [c.supervisions[0].text for c in cuts["test"]]
    assert tok.decode_batch(tok.encode(texts)) == texts


def test_prepare_script_names_a_setting_it_cannot_meet_in_one_line(tmp_path):
    cmd = [sys.executable, str(ROOT / "recipes" / "espeak" / "prepare.py"), "--data-dir", str(tmp_path),
           "--num-train", "20", "--train-name-count", "500"]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("prepare.py: error: train_name_count=500 needs 3000")
    assert "fix:" in run.stderr
