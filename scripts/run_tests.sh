#!/usr/bin/env bash
# The test command of README.md: installs what it needs, then runs the default (fast, CPU) tier and, when no
# arguments are given, the compile and export tiers (installing their extras). Extra arguments go to pytest
# instead (e.g. `-m slow` for the slow tier).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
.venv/bin/python -m pytest -q
# compile tier: the numba-cuda kernels built for sm_80..sm_90 by NVVM and nvJitLink (wheels; no GPU or driver).
# numba-cuda takes over numba.cuda; the simulator tests run the same with it installed.
# export tier: ONNX export checked with onnxruntime and the sherpa-onnx wheel.
if ! .venv/bin/python -c "import numba_cuda, onnx, onnxscript, onnxruntime, sherpa_onnx" 2>/dev/null; then
  .venv/bin/pip install --quiet --disable-pip-version-check -e ".[compile,export]"
fi
.venv/bin/python -m pytest -q -m compile
.venv/bin/python -m pytest -q -m "export and not slow" tests/export
