"""A tiny synthetic corpus shared by the data tests (generated once per test session)."""

import pytest

from asrprec._optional import is_available

needs_espeak = pytest.mark.skipif(not is_available("espeakng_loader"), reason="needs espeakng-loader (asrprec[synth])")

TINY = dict(num_train=12, num_dev=4, num_test=4, seed=0, shard_size=4, snr_db=(10.0, 20.0), reverb_prob=0.5)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    if not is_available("espeakng_loader"):
        pytest.skip("needs espeakng-loader (asrprec[synth])")
    from asrprec.data import generate_corpus

    out = tmp_path_factory.mktemp("corpus")
    return out, generate_corpus(out, num_workers=2, **TINY)


@pytest.fixture(scope="session")
def tiny_fbank(tiny_corpus, tmp_path_factory):
    from asrprec.data import compute_corpus_fbank

    out, cuts = tiny_corpus
    return out, compute_corpus_fbank(cuts, out, num_jobs=1)
