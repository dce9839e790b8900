#!/usr/bin/env bash
# The test command of README.md. Without arguments: installs everything (the compile and export extras too) and
# runs the default, compile and export tiers in one pytest run spread over TEST_WORKERS processes (pytest-xdist;
# default 2, one torch thread each). With arguments: installs the base extras and hands the arguments to pytest
# instead (e.g. `-m slow` for the slow tier, `-m compile` for the compile tier alone).
#   compile tier: the numba-cuda kernels built for sm_80..sm_90 by NVVM and nvJitLink (wheels; no GPU or driver);
#                 numba-cuda takes over numba.cuda, and the simulator tests run the same with it installed.
#   export tier:  ONNX export checked with onnxruntime and the sherpa-onnx wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -gt 0 ]; then
  bash scripts/setup_env.sh
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
  exec .venv/bin/python -m pytest -q "$@"
fi
bash scripts/setup_env.sh compile export
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadscope -m "not slow and not gpu"
