"""The sentencepiece wrapper: round trip, blank reserved at id 0, unk, idempotent training, errors."""

import numpy as np
import pytest

from asrprec.tokenizer import BLANK, Tokenizer


def _texts(n=600, seed=0):
    from asrprec.data.synthetic import CorpusConfig, random_text

    rng = np.random.default_rng(seed)
    return [random_text(rng, CorpusConfig()) for _ in range(n)]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return Tokenizer.train(_texts(), tmp_path_factory.mktemp("tok") / "bpe", 64)


def test_blank_is_id_zero_and_never_encoded(bpe):
    assert bpe.blank_id == 0 and bpe.id_to_piece(0) == BLANK
    assert bpe.unk_id == 1 and bpe.id_to_piece(1) == "<unk>"
    assert bpe.vocab_size == 64
    ids = bpe.encode(_texts(300, seed=1))
    assert all(row and min(row) >= 1 and max(row) < bpe.vocab_size for row in ids)
    assert all(0 not in row for row in ids)


def test_round_trip(bpe):
    texts = _texts(200, seed=2)
    ids = bpe.encode(texts)
    assert bpe.decode_batch(ids) == texts
    assert bpe.encode(texts[0]) == [ids[0]]  # a single string is a batch of one
    # decode drops blanks wherever they are (as greedy search output may contain them)
    with_blanks = [0] + [i for t in ids[0] for i in (t, 0)]
    assert bpe.decode(with_blanks) == texts[0]
    import torch

    assert bpe.decode(torch.tensor(ids[1])) == texts[1]


def test_unknown_characters_map_to_unk_and_blank_text_is_refused(bpe):
    assert bpe.unk_id in bpe.encode("THE DOG Ž")[0]
    with pytest.raises(ValueError, match="reserved blank"):
        bpe.encode([f"THE DOG {BLANK}"])


def test_unigram_and_text_file_and_reuse(tmp_path):
    path = tmp_path / "texts.txt"
    path.write_text("\n".join(_texts(400, seed=3)) + "\n")
    tok = Tokenizer.train(path, tmp_path / "uni", 40, model_type="unigram")
    assert tok.blank_id == 0 and tok.vocab_size == 40 and tok.id_to_piece(0) == BLANK
    texts = path.read_text().splitlines()
    assert tok.decode_batch(tok.encode(texts)) == texts
    model = tmp_path / "uni.model"
    mtime = model.stat().st_mtime_ns
    again = Tokenizer.train(path, tmp_path / "uni", 40, model_type="unigram")  # same settings: reused
    assert model.stat().st_mtime_ns == mtime and again.vocab_size == 40
    Tokenizer.train(path, tmp_path / "uni", 36, model_type="unigram")  # different settings: retrained
    assert Tokenizer(model).vocab_size == 36


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="too large"):
        Tokenizer.train(["ONE TWO", "THREE"], tmp_path / "big", 500)
    with pytest.raises(ValueError, match="model_type"):
        Tokenizer.train(["ONE"], tmp_path / "x", 10, model_type="word")
    with pytest.raises(ValueError, match="no non-empty texts"):
        Tokenizer.train(["", "  "], tmp_path / "x", 10)
    with pytest.raises(ValueError, match="reserved blank"):
        Tokenizer.train([f"ONE {BLANK}"], tmp_path / "x", 10)
    with pytest.raises(FileNotFoundError, match="Tokenizer.train"):
        Tokenizer(tmp_path / "missing.model")


def test_model_without_blank_is_rejected(tmp_path):
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_texts(200)), model_prefix=str(tmp_path / "plain"), vocab_size=40, minloglevel=2
    )
    with pytest.raises(ValueError, match="does not map"):
        Tokenizer(tmp_path / "plain.model")
