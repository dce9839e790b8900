#!/usr/bin/env bash
# Create .venv (if needed) and install asrprec with everything the recipe and the tests use, then the extras named
# as arguments (e.g. `compile export`). Two pip calls on purpose: resolved together with torch, numba-cuda[cu13]'s
# CUDA wheels can pull pip to an older, CPU-only torch; installed after it, they fit the torch already there.
# Idempotent: a second run only checks that the install is complete.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
base="asrprec, torch, lhotse, numba, sentencepiece, espeakng_loader, scipy, matplotlib, pytest, xdist"
extras=""
modules=""
for extra in "$@"; do
  case $extra in
    compile) modules+=", numba_cuda" ;;
    export) modules+=", onnx, onnxscript, onnxruntime, sherpa_onnx" ;;
    *) echo "setup_env.sh: unknown extra '$extra' (known: compile export)" >&2; exit 2 ;;
  esac
  extras+="${extras:+,}$extra"
done
pip_install() { .venv/bin/pip install --quiet --disable-pip-version-check "$@"; }
if ! .venv/bin/python -c "import $base" 2>/dev/null; then
  pip_install -e ".[dev,synth,torchaudio]"
fi
if [ -n "$extras" ] && ! .venv/bin/python -c "import ${modules#, }" 2>/dev/null; then
  pip_install -e ".[$extras]"
fi
