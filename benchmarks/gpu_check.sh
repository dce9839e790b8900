#!/usr/bin/env bash
# One-shot GPU check: every GPU number the project still lacks, appended to benchmarks/RESULTS.md, in about
# 6 minutes on one H100/H200-class GPU (each step has a wall-clock cap; the caps add up to 595 s). From the repo root:
#   PYTHONPATH=. bash benchmarks/gpu_check.sh             # needs torch with CUDA, numba-cuda, torchaudio
#   PYTHONPATH=. bash benchmarks/gpu_check.sh --dry-run   # rehearsal on the CPU: every step at toy size,
#                                                         # numba-cuda in its simulator, tables to a temp file
# Steps:
#  1. numba-cuda loss vs the float64 reference: fp32/fp16/bf16, ragged, blank=V-1, clamp+FastEmit, U=2000
#     (beyond NeMo's U+1 <= 1024 limit), fp16 vs fp32 gradient storage (a failed case makes the exit non-zero);
#  1b. the TDT loss: numba-cuda vs the float64 reference (fp32/fp16/bf16, sigma, durations without 0, U=1500),
#     then TDT vs RNN-T numba-cuda fwd+bwd time and peak memory at B=8/32, T=200, U=100, V=1024;
#  2. loss kernels: numba-cuda and the torch reference, torchaudio CUDA as peer; time and peak memory,
#     fp32/fp16/bf16, a subset of the NeMo blog grid;
#  3. memory-lean loss vs full logits at B=32, T=200, U=200, V=1024, H=640 (fp32 and bf16 autocast);
#  4. Zipformer medium training step per precision policy (time, peak memory: bf16 vs amp-fp16);
#  4b. the same step's peak allocated and reserved memory against its fake-tensor projection
#      (benchmarks/memory_step.py; the projected numbers come from benchmarks/data/results.json);
#  5. ScaledAdam step, stacked vs per tensor;
#  5b. bf16 weight updates (master, kahan, stochastic, none): optimizer step time and state;
#  6. streaming Zipformer: streaming vs simulated streaming, then cost per chunk and RTFx;
#  7. decoding: RTFx of greedy (frame-looping), label-looping without and with CUDA graphs and modified beam
#     search, under fp32, autocast bf16/fp16 and whole-model bf16/fp16 casts (synthetic data, random weights);
#  7b. malsd_batch (batched beam search) eagerly and with its step captured as a CUDA graph and replayed: the same
#      tokens ("same as" column), RTFx against modified beam search (the dry run decodes eagerly on the CPU);
#  7c. the same for a TDT joiner (durations 0-4), whose malsd_batch step goes frame by frame;
#  8. torch.compile: Zipformer small training step compiled vs eager (fp32, amp-bf16), compile time
#     (benchmarks/compile.py; the dry run traces with the "eager" backend: no code generation on the CPU);
#  9. batches sized by memory: the stored --max-memory plan (Zipformer medium, amp-bf16, 80 GB; made on the CPU by
#     benchmarks/batch_plan.py plan) run on its 4 longest buckets: peak / budget, projected / measured, OOMs, padding.
set -euo pipefail
PY=${PYTHON:-python}
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") DRY=0 ;;
  *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac
if [ "$DRY" = 1 ]; then
  OUT=${GPU_CHECK_OUT:-$(mktemp)}
  FLAG=--dry-run; SIM="env NUMBA_ENABLE_CUDASIM=1"; CAPX=6  # a shared CPU is slow; the caps guard the GPU run
  GPU="dry run on the CPU"
else
  OUT=benchmarks/RESULTS.md
  FLAG=; SIM=env; CAPX=1
  GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
fi
failed=0
step() {  # step CAP TITLE COMMAND...: run COMMAND with a wall-clock cap; its table goes to $OUT under TITLE
  local cap=$1 title=$2
  shift 2
  printf '\n#### %s\n\n' "$title" | tee -a "$OUT"
  if ! timeout $((cap * CAPX)) "$@" 2>&1 | tee -a "$OUT"; then
    echo "(step failed or exceeded its $((cap * CAPX)) s cap)" | tee -a "$OUT"
    failed=$((failed + 1))
  fi
}
numba_cuda=$($PY -c 'import importlib.metadata as m; print(m.version("numba-cuda"))' 2>/dev/null || echo "not installed")
{
  echo
  echo "## GPU check ($GPU, $(date -u +%Y-%m-%d), torch $($PY -c 'import torch; print(torch.__version__)'), numba-cuda $numba_cuda)"
} | tee -a "$OUT"

# The GPU command lines; a dry run appends toy-size overrides (argparse keeps the last value), so it parses
# exactly the flags the GPU run uses.
LOSS_ARGS=(--device cuda --backends numba-cuda,torch --repeats 3 --peer-repeats 3
  --shapes "1,200,100,28;1,200,100,1024;8,200,100,1024;32,200,100,1024;8,400,200,1024")
STREAM_ARGS=(--device cuda --sizes small --policies fp32,bf16 --streams 1,16 --chunks 32 --left 128 --seconds 10 --runs 3)
DECODE_ARGS=(--synthetic --size medium --vocab 500 --utts 32 --seconds 10 --runs 2 --device cuda)
MALSD_ARGS=(--synthetic --size medium --vocab 500 --utts 32 --seconds 10 --runs 2 --device cuda
  --modes fp32,autocast-bf16 --methods modified_beam_search,malsd_batch,malsd_batch_graphs --beam 4)
MALSD_TDT_ARGS=("${MALSD_ARGS[@]}" --tdt-durations 0,1,2,3,4 --modes fp32)
COMPILE_ARGS=(--device cuda --models zipformer:small --precisions fp32,amp-bf16 --batches 8 --warmup 3
  --batch-size 16,32 --frames 500,1500)
PLAN_ARGS=(device-run --plans benchmarks/data/batch_plan_gpu.json --policy amp-bf16 --device cuda --steps 2 --buckets 4)
if [ "$DRY" = 1 ]; then
  PLAN_ARGS+=(--plans benchmarks/data/batch_plan_dry.json --policy fp32 --device cpu --steps 1 --buckets 1)
  LOSS_ARGS+=(--device cpu --shapes "1,2,1,4" --repeats 1 --peer-repeats 1 --no-mem --threads 1)
  STREAM_ARGS+=(--device cpu --sizes tiny --streams 1 --chunks 16 --left 64 --seconds 1 --runs 1 --threads 1)
  DECODE_ARGS+=(--device cpu --size tiny --vocab 64 --utts 2 --seconds 1 --runs 1 --threads 1)
  MALSD_ARGS+=(--device cpu --size tiny --vocab 64 --utts 2 --seconds 1 --runs 1 --threads 1 --modes fp32)
  MALSD_TDT_ARGS+=(--device cpu --size tiny --vocab 64 --utts 2 --seconds 1 --runs 1 --threads 1)
  COMPILE_ARGS+=(--device cpu --models zipformer:tiny --precisions fp32 --batches 1 --warmup 1 --batch-size 2,2
    --frames 40,40 --threads 1 --backend eager)
fi

step 45 "numba-cuda RNN-T loss vs the float64 reference" $SIM $PY benchmarks/gpu_check.py loss-check $FLAG
step 60 "numba-cuda TDT loss vs the float64 reference; TDT vs RNN-T kernels" $SIM $PY benchmarks/gpu_check.py tdt-check $FLAG
step 60 "RNN-T loss backends: fwd+bwd time and peak memory beyond the inputs (NeMo blog grid subset)" \
  $SIM $PY benchmarks/rnnt_loss.py "${LOSS_ARGS[@]}"
step 25 "Joint + loss: full logits vs the memory-lean loss" $PY benchmarks/gpu_check.py lean $FLAG
step 50 "Training step per precision policy (peak = max_memory_allocated)" $PY benchmarks/gpu_check.py train-step $FLAG
step 40 "Whole-step memory: projected (fake tensors) vs max_memory_allocated and memory_reserved" \
  $PY benchmarks/gpu_check.py step-memory $FLAG
step 15 "ScaledAdam step" $PY benchmarks/gpu_check.py optimizer $FLAG
step 20 "bf16 weight updates: optimizer step time and state per --bf16-update" $PY benchmarks/gpu_check.py bf16-update $FLAG
step 15 "Streaming vs simulated streaming" $PY benchmarks/gpu_check.py streaming-check $FLAG
step 25 "Streaming Zipformer: cost per chunk and RTFx (benchmarks/streaming.py)" $PY benchmarks/streaming.py "${STREAM_ARGS[@]}"
step 50 "Decoding: precision modes x methods, label-looping with and without CUDA graphs (benchmarks/decode.py)" \
  $PY benchmarks/decode.py "${DECODE_ARGS[@]}"
step 40 "Decoding: malsd_batch eagerly and replayed as a CUDA graph (benchmarks/decode.py)" \
  $PY benchmarks/decode.py "${MALSD_ARGS[@]}"
step 30 "Decoding: TDT malsd_batch (frame by frame) eagerly and replayed as a CUDA graph (benchmarks/decode.py)" \
  $PY benchmarks/decode.py "${MALSD_TDT_ARGS[@]}"
step 60 "torch.compile: training step compiled vs eager (benchmarks/compile.py)" \
  $PY benchmarks/compile.py "${COMPILE_ARGS[@]}"
step 60 "Batches sized by memory: a --max-memory plan run per bucket (benchmarks/batch_plan.py)" \
  $PY benchmarks/batch_plan.py "${PLAN_ARGS[@]}"
if [ "$failed" -ne 0 ]; then
  echo "gpu_check: $failed step(s) failed; tables so far in $OUT" >&2
  exit 1
fi
echo "gpu_check: all steps passed; tables appended to $OUT"
