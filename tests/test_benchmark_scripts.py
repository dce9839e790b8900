"""The benchmark scripts run (at toy size) and print their tables; their numbers are not checked here."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_train_step_benchmark_prints_a_row_per_variant():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = [sys.executable, str(ROOT / "benchmarks" / "train_step.py"), 'conformer:{"num_layers": 1}',
            'conformer:{"num_layers": 1, "ff_dim": 144}', "--batches", "1", "--threads", "1", "--swish-reference"]
    p = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [line for line in p.stdout.splitlines() if line.startswith("| conformer")]
    assert len(rows) == 4  # 2 variants x {saved-derivative, reference} DoubleSwish
    assert rows[0].endswith("| 1.000 |")  # the first variant against itself
    assert "reference DoubleSwish" in rows[1] and "saved-derivative DoubleSwish" in rows[2]
