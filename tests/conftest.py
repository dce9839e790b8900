"""Shared test fixtures: one torch thread, and the word error rate of a recogs file recomputed by a plain Levenshtein distance,
independently of asrprec.metrics (tests compare the WER a recipe reports with it)."""

import ast
from pathlib import Path

import pytest
import torch


def edit_distance(ref: list[str], hyp: list[str]) -> int:
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1]


def wer_of_recogs(path: Path) -> float:
    """Percent WER of a ``recogs-*.txt`` file (``<cut>:\tref=[...]`` and ``<cut>:\thyp=[...]`` lines)."""
    refs, hyps = {}, {}
    for line in Path(path).read_text().splitlines():
        cut, _, rest = line.partition(":\t")
        kind, _, words = rest.partition("=")
        (refs if kind == "ref" else hyps)[cut] = ast.literal_eval(words)
    assert refs.keys() == hyps.keys() and refs
    errors = sum(edit_distance(refs[c], hyps[c]) for c in refs)
    return 100.0 * errors / max(sum(len(r) for r in refs.values()), 1)


@pytest.fixture
def recogs_wer():
    """``recogs_wer(path)``: the percent WER of a recogs file, recomputed here."""
    return wer_of_recogs


@pytest.fixture
def one_thread():
    """torch on one thread for the test (results that must be bitwise reproducible, small ops)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
