#!/usr/bin/env bash
# The test command of README.md: installs what it needs, then runs the default (fast, CPU) suite.
# Extra arguments go to pytest (e.g. `-m slow` for the end-to-end recipe test); without them the export tier
# (ONNX export against onnxruntime and the sherpa-onnx wheel, pip extra `export`) runs after the default suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
.venv/bin/python -m pytest -q
if ! .venv/bin/python -c "import onnx, onnxscript, onnxruntime, sherpa_onnx" 2>/dev/null; then
  .venv/bin/pip install --quiet --disable-pip-version-check -e ".[export]"
fi
.venv/bin/python -m pytest -q -m "export and not slow" tests/export
