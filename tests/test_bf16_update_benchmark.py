"""benchmarks/bf16_update.py: the measured bytes per parameter of a real model equal the documented ones, and the
projection multiplies them by the parameter count."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> list[list[str]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bf16_update.py"), *args], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    return [[c.strip() for c in line.split("|")[1:-1]] for line in p.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("|---")]


@pytest.mark.slow
def test_bytes_measured_on_zipformer_tiny_match_the_documented_formula():
    rows = _run("bytes", "--sizes", "tiny", "--optimizers", "adamw")[1:]  # the header first
    assert [r[1] for r in rows][:6] == ["fp32", "amp-bf16", "bf16 master", "bf16 kahan", "bf16 stochastic", "bf16 none"]
    for r in rows:  # Zipformer tiny keeps no module in fp32: every parameter follows the formula
        assert float(r[5]) == pytest.approx(float(r[6]), abs=0.01), r


@pytest.mark.slow
def test_projection_scales_the_bytes_per_parameter(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("asrprec_bench_bf16", ROOT / "benchmarks" / "bf16_update.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.run_project(argparse.Namespace(models=["zipformer-medium"], whole_step=False))
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and not line.startswith("|---")]
    body = {r[0]: r for r in rows[1:]}
    n = bench.count_parameters(bench._build("zipformer-medium", "meta"))
    for label, per in (("bf16 master", 20), ("bf16 kahan", 14), ("bf16 stochastic", 12), ("amp-bf16", 16)):
        assert body[label][1] == str(per)
        assert float(body[label][2].split()[0]) == pytest.approx(per * n / 2**30, abs=0.006)


def test_whole_step_configs_name_policy_update_and_moments():
    import importlib.util

    spec = importlib.util.spec_from_file_location("asrprec_bench_bf16_cfg", ROOT / "benchmarks" / "bf16_update.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench._step_config("bf16:stochastic:moments") == ("bf16", "stochastic", True)
    assert bench._step_config("amp-bf16") == ("amp-bf16", "master", False)
    for bad in ("bf16:sometimes", "bf16:kahan:fp8", "fp32:none", "bf16:none:moments:x"):
        with pytest.raises(argparse.ArgumentTypeError, match="known are"):
            bench._step_config(bad)
