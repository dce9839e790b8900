"""The numba CPU losses must not enlarge the process's thread counts beyond torch's.

numba sizes its pool once, at the first parallel call, so each case runs in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")

ROOT = Path(__file__).resolve().parents[2]

_CASE = """
import json, sys, torch
torch.set_num_threads(1)
import numba
from asrprec.losses import rnnt_loss, tdt_loss
g = torch.Generator().manual_seed(0)
B, T, U, V = 2, 4, 2, 6
x = torch.randn(B, T, U + 1, V + (2 if sys.argv[1] == "tdt" else 0), generator=g, requires_grad=True)
y = torch.randint(1, V, (B, U), generator=g)
tl, ul = torch.full((B,), T), torch.full((B,), U)
if sys.argv[1] == "tdt":
    tdt_loss(x, y, tl, ul, durations=[0, 1], backend="numba").backward()
else:
    rnnt_loss(x, y, tl, ul, backend="numba").backward()
print(json.dumps({"torch": torch.get_num_threads(), "pool": numba.config.NUMBA_NUM_THREADS,
                  "numba": numba.get_num_threads()}))
"""


def _run(loss: str, numba_threads: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS")}
    if numba_threads is not None:
        env["NUMBA_NUM_THREADS"] = numba_threads
    proc = subprocess.run([sys.executable, "-c", _CASE, loss], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="numba's default pool is already 1 thread")
@pytest.mark.parametrize("loss", ["rnnt", "tdt"])
def test_pool_capped_to_torch_threads(loss):
    assert _run(loss, None) == {"torch": 1, "pool": 1, "numba": 1}


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPUs for a pool larger than torch's")
def test_user_numba_num_threads_kept():
    assert _run("rnnt", "2")["pool"] == 2
