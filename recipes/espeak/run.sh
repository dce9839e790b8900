#!/usr/bin/env bash
# The embedded recipe end to end: install, synthesise speech, train the transducer + CR-CTC hybrid, decode both
# heads on every held-out split (unseen speakers; test-fast: faster than any training speaker) and print a WER
# table and the time each stage took.
#   bash recipes/espeak/run.sh                       # default precision
#   PRECISION=amp-bf16 bash recipes/espeak/run.sh    # any of fp32 amp-fp16 amp-bf16 bf16
#   bash recipes/espeak/run.sh --seed 1              # further arguments go to train.py
set -euo pipefail
cd "$(dirname "$0")/../.."
install_start=$EPOCHREALTIME
bash scripts/setup_env.sh
install_end=$EPOCHREALTIME
PY=.venv/bin/python
PRECISION=${PRECISION:-fp32}
EPOCHS=${EPOCHS:-8}  # train.py's default (configs/default.yaml)
AVG=${AVG:-2}
EXP=${EXP:-recipes/espeak/exp/$PRECISION}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
TIMES=()
stage() {  # stage NAME COMMAND...: run it and record its wall time
  local name=$1 t0=$EPOCHREALTIME
  shift
  "$@"
  TIMES+=("$name $t0 $EPOCHREALTIME")
}
start=$EPOCHREALTIME
stage prepare $PY recipes/espeak/prepare.py
stage lm $PY recipes/espeak/prepare_lm.py  # n-grams on the training transcripts, for decode.py --lm / --lodr
stage train $PY recipes/espeak/train.py --precision "$PRECISION" --exp-dir "$EXP" --num-epochs "$EPOCHS" "$@"
# both heads, each with its greedy and its beam search, the model loaded once; a WER table at the end. The weights:
# the running average over the last AVG epochs (sampled every 10 batches; icefall's --use-averaged-model), which
# beat the mean of the epoch end points on dev
stage decode $PY recipes/espeak/decode.py --exp-dir "$EXP" --epoch "$EPOCHS" --avg "$AVG" --use-averaged-model \
  --precision "$PRECISION" --decoding-method greedy_search modified_beam_search ctc_greedy_search \
  ctc_prefix_beam_search --beam-size 4 --splits test dev test-fast
echo "stage times (s):"
awk -v a="$install_start" -v b="$install_end" 'BEGIN { printf "  %-8s %6.1f (not in the total)\n", "install", b - a }'
for t in "${TIMES[@]}"; do
  read -r name t0 t1 <<< "$t"
  awk -v n="$name" -v a="$t0" -v b="$t1" 'BEGIN { printf "  %-8s %6.1f\n", n, b - a }'
done
awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "  %-8s %6.1f (after the install)\n", "total", b - a }'
echo "results in $EXP"
