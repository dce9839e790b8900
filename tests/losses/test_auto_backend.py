"""backend="auto" says which loss it chose, and warns with the pip extra when a CUDA run falls back because the
numba-cuda kernels are not installed."""

import dataclasses
import logging

import torch

from asrprec.losses import api


def _without_numba_cuda(monkeypatch):
    spec = api._REGISTRY["numba-cuda"]
    monkeypatch.setitem(api._REGISTRY, "numba-cuda", dataclasses.replace(
        spec, devices=("cuda",), probe=lambda: (False, "No module named 'numba.cuda'")))
    monkeypatch.setattr(api, "_AUTO_REPORTED", set())


def test_cuda_fallback_names_the_choice_and_the_extra(monkeypatch, caplog):
    _without_numba_cuda(monkeypatch)
    with caplog.at_level(logging.INFO, logger="asrprec.losses.api"):
        spec = api.resolve_backend("auto", "cuda", torch.float32)
        api.resolve_backend("auto", "cuda", torch.float32)  # reported once, not every step
    assert spec.name in ("torchaudio", "torch")
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert infos == [f"RNN-T loss backend='auto' chose {spec.name} for float32 logits on cuda"]
    assert len(warnings) == 1 and "pip install 'asrprec[cuda]'" in warnings[0]
    assert "numba-cuda: it is unavailable: No module named 'numba.cuda'" in warnings[0]


def test_no_warning_when_the_fastest_backend_runs_or_the_dtype_rules_it_out(monkeypatch, caplog):
    monkeypatch.setattr(api, "_AUTO_REPORTED", set())
    with caplog.at_level(logging.INFO, logger="asrprec.losses.api"):
        assert api.resolve_backend("auto", "cpu", torch.float32).name == "numba"
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    _without_numba_cuda(monkeypatch)
    monkeypatch.setitem(api._REGISTRY, "numba-cuda", dataclasses.replace(api._REGISTRY["numba-cuda"],
                                                                         probe=lambda: (True, "")))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="asrprec.losses.api"):
        api.resolve_backend("auto", "cuda", torch.float64)  # numba-cuda takes no float64: not an install problem
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
