#!/usr/bin/env bash
# The embedded recipe end to end: install, synthesise speech, train, decode (greedy and modified beam search).
#   bash recipes/espeak/run.sh                       # default precision
#   PRECISION=amp-bf16 bash recipes/espeak/run.sh    # any of fp32 amp-fp16 amp-bf16 bf16
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup_env.sh
PY=.venv/bin/python
PRECISION=${PRECISION:-fp32}
EPOCHS=${EPOCHS:-10}
AVG=${AVG:-3}
EXP=${EXP:-recipes/espeak/exp/$PRECISION}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
start=$(date +%s)
$PY recipes/espeak/prepare.py
$PY recipes/espeak/prepare_lm.py  # n-grams on the training transcripts, for decode.py --lm / --lodr
$PY recipes/espeak/train.py --precision "$PRECISION" --exp-dir "$EXP" --num-epochs "$EPOCHS" "$@"
$PY recipes/espeak/decode.py --exp-dir "$EXP" --epoch "$EPOCHS" --avg "$AVG" --precision "$PRECISION" \
  --decoding-method greedy_search
$PY recipes/espeak/decode.py --exp-dir "$EXP" --epoch "$EPOCHS" --avg "$AVG" --precision "$PRECISION" \
  --decoding-method modified_beam_search --beam-size 4 --splits test
# the running average of the weights over the last AVG epochs (sampled every 10 batches; icefall's
# --use-averaged-model) instead of the mean of their AVG end points
$PY recipes/espeak/decode.py --exp-dir "$EXP" --epoch "$EPOCHS" --avg "$AVG" --precision "$PRECISION" \
  --decoding-method greedy_search --use-averaged-model
echo "recipe finished in $(( $(date +%s) - start )) s (after install); results in $EXP"
