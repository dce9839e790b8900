#!/usr/bin/env bash
# The test command of README.md. Without arguments: installs everything (the compile, export and docs extras too),
# builds the docs (`mkdocs build --strict`: a warning fails the run), then runs the default, compile and export
# tiers in one pytest run spread over TEST_WORKERS processes (pytest-xdist; default 2, one torch thread each).
# With arguments: installs the base extras and hands the arguments to pytest instead (e.g. `-m slow` for the slow
# tier, `-m compile` for the compile tier alone).
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
# the docs first: the API reference from the docstrings and the guides, any mkdocs warning an error
if ! .venv/bin/python -c "import mkdocs, mkdocstrings, mkdocstrings_handlers.python" 2>/dev/null; then
  .venv/bin/pip install --quiet --disable-pip-version-check -e ".[docs]"
fi
site=$(mktemp -d)
.venv/bin/mkdocs build --strict --site-dir "$site"
rm -rf "$site"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadscope -m "not slow and not gpu"
