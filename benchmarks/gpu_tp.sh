#!/usr/bin/env bash
# Tensor parallelism on a two-GPU box (nvidia-h100-x2), unattended, bounded by LIMIT seconds:
#   tests       tests/gpu/test_tensor_parallel_gpu.py: TP 2 with CUDA graphs == TP 1 (float32),
#               P TP 2 -> D TP 1 and P TP 1 -> D TP 2 over CUDA IPC == colocated TP 1
#   parity      Llama-3.1-8B config, dummy weights: greedy TP 2 vs TP 1 on a fixed prompt set,
#               float32 (token for token) and bf16 (agreement rate)
#   step        Llama-3.1-8B bf16: decode step at batch 1 and 64, TP 1 vs TP 2, NCCL share
#   serve       Llama-3.1-8B bf16: 1,000 ShareGPT-like requests, one colocated worker at TP 1
#               (GPU 0) and at TP 2 (GPUs 0, 1)
#   pool32      Qwen2.5-32B-shaped bf16: the KV pool at TP 1 (small: ~47k tokens on 80 GB) and per rank at TP 2
#   serve32     Qwen2.5-32B-shaped bf16 at TP 2: the 1,000-request workload
# Usage: OUT=/tmp/out LIMIT=560 bash benchmarks/gpu_tp.sh [part ...]   (default: all parts)
# Each part's output is in $OUT/r/<part>.txt (tables at the end), JSON beside it; a summary with
# each part's exit code and seconds in $OUT/summary.txt.
set -uo pipefail
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
source "$(dirname "$0")/gpu_env.sh"
PARTS=${*:-tests parity step serve pool32 serve32}

for part in $PARTS; do
  case $part in
    tests) step tests python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=150 -m gpu tests/gpu/test_tensor_parallel_gpu.py ;;
    parity) step parity python3 benchmarks/engine/tensor_parallel.py parity --model $B8 --out "$R/parity.json" ;;
    step) step step python3 benchmarks/engine/tensor_parallel.py step --model $B8 --batch 1 64 --context 1024 --out "$R/step.json" ;;
    serve)
      step serve_tp1 $SERVE --model $B8 --label tp1 --log-dir "$R/logs_serve_tp1" --out "$R/serve_tp1.json"
      step serve_tp2 $SERVE --model $B8 --label tp2 --log-dir "$R/logs_serve_tp2" --out "$R/serve_tp2.json" -- --tensor-parallel-size 2 ;;
    pool32) step pool32 python3 benchmarks/engine/tensor_parallel.py pool --model $Q32 --max-model-len 4096 --out "$R/pool32.json" ;;
    serve32) step serve32_tp2 $SERVE --model $Q32 --label qwen32-tp2 --log-dir "$R/logs_serve32" --out "$R/serve32_tp2.json" -- --tensor-parallel-size 2 ;;
    *) echo "unknown part $part" >> "$OUT/summary.txt" ;;
  esac
done
tar czf "$OUT/results.tgz" -C "$OUT" r
cat "$OUT/summary.txt"
for f in tests parity step serve_tp1 serve_tp2 pool32 serve32_tp2; do
  [ -f "$R/$f.txt" ] && { echo "== $f"; tail -n 25 "$R/$f.txt"; }
done
