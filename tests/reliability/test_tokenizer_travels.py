"""The tokenizer travels with the model: training copies it into the experiment folder and records its sha256 in
model.json; a resume or a decode with another tokenizer (a data folder whose ``bpe.model`` was re-made with other
pieces) is refused in one line naming both digests; decode and export use the folder's copy; folders from before
the copy keep working with the tokenizer given."""

import hashlib
import json
import shutil

import pytest

from asrprec.experiment import TOKENIZER_NAME, experiment_tokenizer, read_model_config
from asrprec.tokenizer import Tokenizer

from .corpus import WORDS
from .test_bad_args import recipe


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def retrain_tokenizer(data):
    """Re-make ``data/bpe.model`` as a rerun of prepare on other text would: the same size, other pieces."""
    texts = [" ".join(w[::-1] for w in (a, b)) for a in WORDS for b in WORDS]
    (data / "bpe.model").unlink(missing_ok=True)
    Tokenizer.train(texts, data / "bpe", vocab_size=24, overwrite=True)
    assert Tokenizer(data / "bpe.model").vocab_size == 24
    return data / "bpe.model"


@pytest.fixture
def run(corpus_copy, tmp_path):
    """A one-epoch run on a private copy of the corpus."""
    exp = tmp_path / "exp"
    out = recipe("train.py", "--data-dir", corpus_copy, "--exp-dir", exp, "--num-epochs", 1,
                 "--train.max_batches_per_epoch", 2)
    assert out.code is None, out.text
    return corpus_copy, exp


def files(exp):
    skip = ("train.log", "run.lock")  # a refused command logs its refusal; run.lock names the last run to take it
    return {p.name: p.read_bytes() for p in sorted(exp.iterdir()) if p.is_file() and p.name not in skip}


def test_training_keeps_a_copy_of_the_tokenizer_and_its_digest(run):
    data, exp = run
    assert (exp / TOKENIZER_NAME).read_bytes() == (data / "bpe.model").read_bytes()
    record = json.loads((exp / "model.json").read_text())["tokenizer"]
    assert record == {"file": "bpe.model", "sha256": sha(data / "bpe.model")}
    assert "tokenizer" not in read_model_config(exp)  # no builder argument


def test_a_resume_with_a_remade_tokenizer_is_refused_naming_both_digests(run):
    data, exp = run
    trained = sha(exp / TOKENIZER_NAME)
    new = retrain_tokenizer(data)
    assert sha(new) != trained
    assert Tokenizer(new).encode("RED CAT") != Tokenizer(exp / TOKENIZER_NAME).encode("RED CAT")
    before = files(exp)
    out = recipe("train.py", "--data-dir", data, "--exp-dir", exp, "--num-epochs", 2, "--resume", "auto")
    assert out.code == 2 and "\n" not in out.error
    assert f"the tokenizer {new} (sha256 {sha(new)[:16]}...) is not the one the model in {exp} was trained with " \
           f"({exp / TOKENIZER_NAME}, sha256 {trained[:16]}...)" in out.error
    assert "Fix: resume with the tokenizer the run was trained with" in out.error and "another --exp-dir" in out.error
    assert files(exp) == before  # no checkpoint, history or model.json changed


def test_decode_refuses_another_tokenizer_and_uses_the_folders_copy(run):
    data, exp = run
    trained = sha(exp / TOKENIZER_NAME)
    saved = (data / "bpe.model").read_bytes()
    new = retrain_tokenizer(data)
    out = recipe("decode.py", "--data-dir", data, "--exp-dir", exp, "--epoch", 1, "--splits", "dev")
    assert out.code == 2 and "\n" not in out.error
    assert f"(sha256 {sha(new)[:16]}...)" in out.error and f"sha256 {trained[:16]}..." in out.error
    assert f"Fix: restore {new} from the folder's copy" in out.error
    assert not list(exp.glob("recogs-*")) and not list(exp.glob("wer-summary-*"))
    new.unlink()  # without the data folder's tokenizer, the folder's copy decodes
    out = recipe("decode.py", "--data-dir", data, "--exp-dir", exp, "--epoch", 1, "--splits", "dev")
    assert out.code is None, out.text
    recogs = {p.name: p.read_text() for p in exp.glob("recogs-*.txt")}
    assert recogs
    (data / "bpe.model").write_bytes(saved)  # the same file as the copy: accepted, and decodes the same
    for p in exp.glob("recogs-*.txt"):
        p.unlink()
    out = recipe("decode.py", "--data-dir", data, "--exp-dir", exp, "--epoch", 1, "--splits", "dev")
    assert out.code is None, out.text
    assert {p.name: p.read_text() for p in exp.glob("recogs-*.txt")} == recogs


def test_a_folder_without_a_copy_uses_the_tokenizer_given(run, caplog):
    data, exp = run
    (exp / TOKENIZER_NAME).unlink()
    model = json.loads((exp / "model.json").read_text())
    del model["tokenizer"]
    (exp / "model.json").write_text(json.dumps(model))
    caplog.set_level("INFO", logger="asrprec.experiment")
    assert experiment_tokenizer(exp, data / "bpe.model") == data / "bpe.model"
    assert "holds no copy of its tokenizer" in caplog.text
    out = recipe("decode.py", "--data-dir", data, "--exp-dir", exp, "--epoch", 1, "--splits", "dev")
    assert out.code is None, out.text
    out = recipe("train.py", "--data-dir", data, "--exp-dir", exp, "--num-epochs", 2, "--resume", "auto",
                 "--train.max_batches_per_epoch", 2)
    assert out.code is None, out.text
    assert (exp / "epoch-2.pt").is_file() and not (exp / TOKENIZER_NAME).exists()


def test_export_uses_the_folders_copy(run):
    from asrprec.export.cli import _experiment_tokenizer

    data, exp = run
    shutil.move(data / "bpe.model", data / "elsewhere.model")
    tok = _experiment_tokenizer(exp, lambda: Tokenizer(data / "bpe.model"))  # the data folder's is gone
    assert tok.model_path == exp / TOKENIZER_NAME
    retrain_tokenizer(data)
    from asrprec.experiment import TokenizerMismatchError

    with pytest.raises(TokenizerMismatchError, match="is not the one the model in"):
        _experiment_tokenizer(exp, lambda: Tokenizer(data / "bpe.model"))
