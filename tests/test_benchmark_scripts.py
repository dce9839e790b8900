"""The benchmark scripts run (at toy size) and print their tables; their numbers are not checked here."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_encoder_benchmark_projects_gpu_memory_on_fake_tensors():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = [sys.executable, str(ROOT / "benchmarks" / "encoder.py"), "--project-gpu", "--sizes", "tiny",
            "--policies", "fp32,bf16", "--batch", "2", "--frames", "200", "--threads", "1"]
    p = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in p.stdout.splitlines() if line.startswith("| tiny")]
    assert [r[1].strip() for r in rows] == ["fp32", "bf16"]
    fp32_peak, bf16_peak = float(rows[0][3]), float(rows[1][3])
    # everything bf16 is 2 bytes instead of 4: between half and (fixed overheads) most of fp32's peak
    assert 0.45 * fp32_peak < bf16_peak < 0.85 * fp32_peak


def test_streaming_benchmark_prints_a_row_per_setting():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = [sys.executable, str(ROOT / "benchmarks" / "streaming.py"), "--policies", "fp32,bf16", "--streams", "1,2",
            "--chunks", "16", "--seconds", "1", "--runs", "1", "--threads", "1"]
    p = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in p.stdout.splitlines() if line.startswith("| tiny")]
    assert [(r[1], r[2]) for r in rows] == [("fp32", "1"), ("fp32", "2"), ("bf16", "1"), ("bf16", "2")]
    # every cache is held in the policy's dtype: bf16 state is half of fp32's (the frame counter aside)
    fp32_kib, bf16_kib = float(rows[0][4].split()[0]), float(rows[2][4].split()[0])
    assert abs(bf16_kib - fp32_kib / 2) <= 1


def test_plots_render_every_figure_the_readme_shows(tmp_path):
    """benchmarks/plots.py draws each figure from benchmarks/data/results.json; benchmarks/RESULTS.md shows each one
    (README.md some of them), and the committed PNGs in docs/ are the ones it draws."""
    import importlib.util
    import re

    assert importlib.util.find_spec("matplotlib") is not None, "matplotlib is part of the dev extra"
    spec = importlib.util.spec_from_file_location("asrprec_bench_plots", ROOT / "benchmarks" / "plots.py")
    plots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plots)
    paths = plots.render_all(ROOT / "benchmarks" / "data" / "results.json", tmp_path)
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    assert {p.name for p in paths} == set(re.findall(r"\(\.\./docs/([\w-]+\.png)\)", results))
    assert set(re.findall(r"\(docs/([\w-]+\.png)\)", (ROOT / "README.md").read_text())) <= {p.name for p in paths}
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000
        assert (ROOT / "docs" / p.name).is_file(), f"docs/{p.name} is not committed; run python benchmarks/plots.py"


@pytest.mark.slow  # the synthetic model's two blank calibrations decode the batch 28 times
def test_decode_benchmark_times_the_ctc_head_beside_the_transducer():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = [sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--synthetic", "--modes", "fp32", "--methods",
            "greedy_search,ctc_greedy_search,ctc_prefix_beam_search", "--utts", "2", "--seconds", "1", "--vocab", "20",
            "--runs", "1", "--threads", "1"]
    p = subprocess.run(args + ["--ctc"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [line.split("|")[2].strip() for line in p.stdout.splitlines() if line.startswith("| fp32")]
    assert rows == ["greedy_search", "ctc_greedy_search", "ctc_prefix_beam_search"]
    p = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)  # no CTC head without --ctc
    assert p.returncode != 0 and "--use-ctc" in p.stderr


def test_compile_benchmark_prices_padding_t_against_symbolic_shapes(tmp_path):
    from lhotse import CutSet
    from lhotse.testing.dummies import dummy_cut

    # 24 one-second cuts (100 frames each): padding T to a multiple of N runs ceil(100 / N) * N frames per cut
    manifest = tmp_path / "cuts.jsonl.gz"
    CutSet.from_cuts(dummy_cut(i, duration=1.0) for i in range(24)).to_file(manifest)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = [sys.executable, str(ROOT / "benchmarks" / "compile.py"), "--padding", str(manifest), "--max-duration",
            "4", "--num-buckets", "2", "--pad-multiples", "50,64,30"]
    p = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r[0]: r[1:] for r in ([c.strip() for c in line.split("|")[1:-1]] for line in p.stdout.splitlines())
            if r and r[0][:1] in "-0123456789"}
    assert rows["- (symbolic B, T)"][0] == "2400"
    assert rows["50"][:2] == ["2400", "+0.0%"]
    assert rows["64"][:3] == [str(24 * 128), "+28.0%", "1"]
    assert rows["30"][:3] == [str(24 * 120), "+20.0%", "1"]
