"""``benchmarks/gpu_check.sh --dry-run``: every step of the GPU check runs at toy size on the CPU (numba-cuda in its
simulator) and prints its table, so a GPU run cannot fail on a typo. In the compile tier, next to the other check
that stands in for a GPU (about a minute on two cores)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.compile

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["numba-cuda RNN-T loss vs the float64 reference", "numba-cuda TDT loss vs the float64 reference",
         "RNN-T loss backends", "Joint + loss",
         "Training step per precision policy", "Whole-step memory", "ScaledAdam step", "bf16 weight updates",
         "Streaming vs simulated streaming",
         "Streaming Zipformer", "Decoding: precision modes x methods", "Decoding: malsd_batch eagerly and replayed",
         "Decoding: TDT malsd_batch", "torch.compile: training step", "Batches sized by memory"]


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "results.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHON": sys.executable, "GPU_CHECK_OUT": str(out),
           "OMP_NUM_THREADS": "1"}
    p = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    text = out.read_text()
    titles = re.findall(r"^#### (.+)$", text, flags=re.M)
    assert len(titles) == len(STEPS) and all(t.startswith(s) for t, s in zip(titles, STEPS)), titles
    assert "failed cases: 0" in text and "failed TDT cases: 0" in text and "(step failed" not in text
    # each step printed a table with at least one data row
    for block in text.split("#### ")[1:]:
        rows = [line for line in block.splitlines() if line.startswith("| ") and not line.startswith("|---")]
        assert len(rows) >= 2, block[:500]
    # the decoding step ran label-looping and frame-looping greedy search and beam search under every mode
    decode = text.split("#### Decoding: precision")[1]
    for mode in ("fp32", "autocast-bf16", "autocast-fp16", "cast-bf16", "cast-fp16"):
        for method in ("greedy_search", "label_looping", "modified_beam_search"):
            assert f"| {mode} | {method} |" in decode
    # the malsd_batch step decoded with it and with modified beam search, and compared their search speed
    malsd = text.split("#### Decoding: malsd_batch")[1].split("#### ")[0]
    assert "| fp32 | malsd_batch |" in malsd and "| fp32 | modified_beam_search |" in malsd
    assert "fp32: malsd_batch's search RTFx (CPU) is" in malsd
    tdt = text.split("#### Decoding: TDT malsd_batch")[1].split("#### ")[0]
    assert "| fp32 | malsd_batch |" in tdt and "fp32: malsd_batch's search RTFx (CPU) is" in tdt
