"""Fixtures for decoding tests: ``kit`` (tiny models + reference decoders, from _kit.py) and one CPU thread."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("asrprec_tests_decoding_kit", Path(__file__).with_name("_kit.py"))
_kit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_kit)


@pytest.fixture
def kit():
    return _kit


@pytest.fixture(autouse=True)
def _one_thread(one_thread):  # tests/conftest.py
    yield
