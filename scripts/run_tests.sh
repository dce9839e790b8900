#!/usr/bin/env bash
# The test command of README.md: installs what it needs, then runs the default (fast, CPU) suite and, when no
# arguments are given, the compile tier. Extra arguments go to pytest for the default suite only (e.g. `-m slow`
# for the end-to-end recipe test).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
.venv/bin/python -m pytest -q "$@"
[ $# -eq 0 ] || exit 0
# compile tier: the numba-cuda kernels built for sm_80..sm_90 by NVVM and nvJitLink (wheels; no GPU or driver).
# numba-cuda takes over numba.cuda; the simulator tests run the same with it installed.
if ! .venv/bin/python -c "import numba_cuda" 2>/dev/null; then
  .venv/bin/pip install --quiet --disable-pip-version-check -e ".[compile]"
fi
.venv/bin/python -m pytest -q -m compile
