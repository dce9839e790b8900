"""``benchmarks/tdt_loss.py`` runs at toy size and prints one row per (shape, dtype); its numbers are not checked."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tdt_benchmark_prints_a_row_per_shape_and_dtype():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = [sys.executable, str(ROOT / "benchmarks" / "tdt_loss.py"), "--shapes", "2,6,3,10;1,4,2,8",
            "--dtypes", "bf16", "--repeats", "1", "--threads", "1", "--durations", "0,1,2"]
    p = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in p.stdout.splitlines() if line.startswith("| fp")
            or line.startswith("| bf")]
    assert [(r[0], r[1]) for r in rows] == [("bf16", "2,6,3,10"), ("bf16", "1,4,2,8")]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 and r[5] and r[6] for r in rows)  # times and both memories
