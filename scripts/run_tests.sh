#!/usr/bin/env bash
# The test command of README.md: installs what it needs, then runs the default (fast, CPU) suite.
# Extra arguments go to pytest (e.g. `-m slow` for the end-to-end recipe test).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
exec .venv/bin/python -m pytest -q "$@"
