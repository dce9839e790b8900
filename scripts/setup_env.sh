#!/usr/bin/env bash
# Create .venv (if needed) and install asrprec with everything the recipe and the tests use.
# Idempotent: a second run only checks that the install is complete.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import asrprec, torch, lhotse, numba, sentencepiece, espeakng_loader, scipy, matplotlib, pytest" 2>/dev/null; then
  .venv/bin/pip install --quiet --disable-pip-version-check -e ".[dev,synth,torchaudio]"
fi
