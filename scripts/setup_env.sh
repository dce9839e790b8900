#!/usr/bin/env bash
# Create .venv (if needed) and install asrprec with everything the recipe and the tests use, plus the extras named
# as arguments (e.g. `compile export`), in one pip call. Idempotent: a second run only checks that the install is
# complete.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
extras=dev,synth,torchaudio
modules="asrprec, torch, lhotse, numba, sentencepiece, espeakng_loader, scipy, matplotlib, pytest, xdist"
for extra in "$@"; do
  case $extra in
    compile) modules+=", numba_cuda" ;;
    export) modules+=", onnx, onnxscript, onnxruntime, sherpa_onnx" ;;
    *) echo "setup_env.sh: unknown extra '$extra' (known: compile export)" >&2; exit 2 ;;
  esac
  extras+=",$extra"
done
if ! .venv/bin/python -c "import $modules" 2>/dev/null; then
  .venv/bin/pip install --quiet --disable-pip-version-check -e ".[$extras]"
fi
