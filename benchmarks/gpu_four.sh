#!/usr/bin/env bash
# Prefill and decode at different tensor-parallel sizes on a four-GPU box (nvidia-h100-x4),
# unattended, bounded by LIMIT seconds; parts run in the order given:
#   ratio8     Llama-3.1-8B bf16: 1P(TP2):2D, 2P:1D(TP2), 2C(TP2), and the best layouts of the
#              earlier four-GPU study (2P:2D, 1P:3D), prompt-heavy and decode-heavy
#   ratio32    Qwen2.5-32B-shaped bf16: the same heterogeneous layouts, and 1P(TP2):1D(TP2)
#   serve32    Qwen2.5-32B-shaped bf16, one colocated worker at TP 2 (GPUs 0, 1): the
#              1,000-request workload; beside it on GPUs 2, 3: `multi` if asked
#   multi      benchmarks/serving/multiturn.py, Llama-3.1-8B bf16, 1P:1D over CUDA IPC, reuse off and on
#   kernels    the Triton kernel tests of tests/gpu on GPU 0
#   parity8    Llama-3.1-8B float32: greedy tokens of a fixed prompt set through each
#              heterogeneous layout against one colocated worker at TP 1
# Usage: OUT=/tmp/out LIMIT=560 bash benchmarks/gpu_four.sh ratio8 | ratio32 | serve32 multi parity8
# Output: $OUT/results.tgz (each part's log and JSON), $OUT/summary.txt; tables printed last.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
PARTS=${*:-ratio8}

RATIO="python3 benchmarks/serving/ratio.py --dtype bfloat16 --load-format dummy --gpus 4 --slo-ttft-ms 1000 --slo-itl-ms 50 --no-progress --workloads prompt-heavy decode-heavy"
multi() {
  CUDA_VISIBLE_DEVICES=2,3 step multi python3 benchmarks/serving/multiturn.py --device cuda \
    --transport cuda_ipc --model $B8 --dtype ${MULTI_DTYPE:-bfloat16} --load-format dummy --num-prefill 1 \
    --num-decode 1 --num-conversations ${MULTI_CONVS:-100} --turns 6 --first-tokens 1024 \
    --new-tokens 128 --output-tokens 128 --rate ${MULTI_RATE:-20} --out "$R/multi.json" \
    --log-dir "$R/logs_multi"
}
for part in $PARTS; do
  case $part in
    ratio8) step ratio8 $RATIO --model $B8 --layouts ${LAYOUTS8:-1Ptp2_2D 2P1Dtp2 2Ctp2 2P2D 1P3D} \
        --rates-for prompt-heavy=${RATE8:-24} --rates-for decode-heavy=${RATE8:-24} \
        --num-requests ${REQ8:-100} --out-dir "$R/ratio8" --log-dir "$R/ratio8/logs"
      python3 benchmarks/serving/ratio.py --report-only --out-dir "$R/ratio8" > "$R/ratio8_report.txt" 2>&1 ;;
    ratio32) step ratio32 $RATIO --model $Q32 --layouts ${LAYOUTS32:-2Ctp2 1Ptp2_1Dtp2 1Ptp2_2D 2P1Dtp2} \
        --rates-for prompt-heavy=${RATE32P:-6} --rates-for decode-heavy=${RATE32D:-8} \
        --num-requests ${REQ32:-60} --out-dir "$R/ratio32" --log-dir "$R/ratio32/logs"
      python3 benchmarks/serving/ratio.py --report-only --out-dir "$R/ratio32" > "$R/ratio32_report.txt" 2>&1 ;;
    serve32)
      [[ " $PARTS " == *" multi "* ]] && { multi & M=$!; }
      CUDA_VISIBLE_DEVICES=0,1 step serve32_tp2 $SERVE --model $Q32 --label qwen32-tp2 \
        --log-dir "$R/logs_serve32" --out "$R/serve32_tp2.json" -- --tensor-parallel-size 2
      [ -n "${M:-}" ] && wait $M ;;
    multi) [[ " $PARTS " == *" serve32 "* ]] || multi ;;
    parity8) step parity8 python3 benchmarks/serving/ratio.py --parity --model $B8 --dtype float32 \
        --load-format dummy --gpus 4 --layouts 1C 1Ptp2_2D 2P1Dtp2 2Ctp2 --out-dir "$R/parity8" \
        --log-dir "$R/parity8/logs" -- --max-num-seqs 16 ;;
    kernels) CUDA_VISIBLE_DEVICES=0 step kernels python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests/gpu/test_paged_attention_gpu.py tests/gpu/test_small_kernels_gpu.py \
        tests/gpu/test_attention_backend_gpu.py tests/gpu/test_fp8_gpu.py ;;
    *) echo "unknown part $part" >> "$OUT/summary.txt" ;;
  esac
done
tar czf "$OUT/results.tgz" -C "$OUT" r
cat "$OUT/summary.txt"
for f in kernels ratio8 ratio8_report ratio32_report serve32_tp2 multi parity8; do
  [ -f "$R/$f.txt" ] && { echo "== $f"; tail -n 30 "$R/$f.txt"; }
done
