"""Fault-injection tests: the tiny corpus of :mod:`corpus`, built once per test run."""

import shutil

import pytest

pytest.importorskip("lhotse")
pytest.importorskip("sentencepiece")


@pytest.fixture(scope="session")
def data_root(tmp_path_factory):
    from .corpus import build

    return build(tmp_path_factory.mktemp("reliability-corpus"))


@pytest.fixture
def corpus_copy(data_root, tmp_path):
    """A private copy of the corpus that a test may damage."""
    dst = tmp_path / "data"
    shutil.copytree(data_root, dst)
    # the manifests point at the original feature files: re-point them at the copy
    from lhotse import CutSet

    for path in dst.glob("espeak_cuts_*_fbank.jsonl.gz"):
        CutSet.from_cuts(_repoint(c, data_root, dst) for c in CutSet.from_file(path)).to_file(path)
    return dst


def _repoint(cut, old, new):
    from lhotse.utils import fastcopy

    return fastcopy(cut, features=fastcopy(cut.features,
                                           storage_path=cut.features.storage_path.replace(str(old), str(new))))


@pytest.fixture(autouse=True)
def _one_thread(one_thread):  # tests/conftest.py
    yield
