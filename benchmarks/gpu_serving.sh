#!/usr/bin/env bash
# Serving benchmarks on a 4-GPU box in one call: three lanes run side by side on separate GPUs.
#   lane A (GPU 0):    CUDA parity check, Llama-3.1-8B: Tandem colocated, offline engine,
#                      transformers static generate and continuous batching (1,000 ShareGPT-like)
#   lane B (GPU 1):    the same on Llama-3.2-1B, offline with GPU-time sampling
#   lane C (GPU 2,3):  prompt-heavy mix, 1 prefill + 1 decode against 2 colocated workers
# then, with lanes A and B done, the KV transfer and decode-step benchmarks on GPUs 0 and 1.
# Everything lands in $OUT/results.tgz (logs and JSON) plus $OUT/summary.txt.
set -uo pipefail
LIMIT=${LIMIT:-540}
source "$(dirname "$0")/gpu_env.sh"
HF_LIMIT=${HF_LIMIT:-90}

lane_a() {
  export CUDA_VISIBLE_DEVICES=0
  [ -n "${PARITY:-}" ] && TANDEM_TEST_DEVICE=cuda step parity python3 -m pytest -q -p no:cacheprovider tests/e2e/test_parity.py -k "greedy_matches and (llama or qwen3)"
  step serve_8b $SERVE --model $B8 --log-dir "$R/logs_serve_8b" --out "$R/serve_8b.json"
  step offline_8b python3 benchmarks/serving/serve.py --mode offline --model $B8 --dtype bfloat16 --load-format dummy --devices cuda:0 --workload sharegpt --num-requests 1000 --gpu-time-every 0 --no-progress --out "$R/offline_8b.json"
  step hf_static_8b python3 benchmarks/serving/hf_baseline.py --model $B8 --mode static --batch-size 64 --workload sharegpt --num-requests 1000 --time-limit $HF_LIMIT --no-progress --out "$R/hf_static_8b.json"
  step hf_cb_8b python3 benchmarks/serving/hf_baseline.py --model $B8 --mode cb --workload sharegpt --num-requests 1000 --time-limit $HF_LIMIT --no-progress --out "$R/hf_cb_8b.json"
}

lane_b() {
  export CUDA_VISIBLE_DEVICES=1
  step serve_1b $SERVE --model $B1 --log-dir "$R/logs_serve_1b" --out "$R/serve_1b.json"
  step offline_1b python3 benchmarks/serving/serve.py --mode offline --model $B1 --dtype bfloat16 --load-format dummy --devices cuda:0 --workload sharegpt --num-requests 1000 --gpu-time-every 10 --no-progress --out "$R/offline_1b.json"
  step hf_static_1b python3 benchmarks/serving/hf_baseline.py --model $B1 --mode static --batch-size 64 --workload sharegpt --num-requests 1000 --time-limit $HF_LIMIT --no-progress --out "$R/hf_static_1b.json"
  step hf_cb_1b python3 benchmarks/serving/hf_baseline.py --model $B1 --mode cb --workload sharegpt --num-requests 1000 --time-limit $HF_LIMIT --no-progress --out "$R/hf_cb_1b.json"
}

lane_c() {
  export CUDA_VISIBLE_DEVICES=2,3
  for layout in 1P1D 2C; do
    step ratio_$layout python3 benchmarks/serving/ratio.py --model $B8 --dtype bfloat16 --load-format dummy --gpus 2 --layouts $layout --workloads prompt-heavy --rates ${RATES:-8 16} --num-requests ${RATIO_REQUESTS:-150} --slo-ttft-ms 1000 --slo-itl-ms 50 --no-progress --out-dir "$R/ratio2" --log-dir "$R/ratio2/logs_$layout"
  done
}

lane_a & A=$!
lane_b & B=$!
lane_c & C=$!
wait $A $B
[ -n "${MICRO:-}" ] && ( export CUDA_VISIBLE_DEVICES=0,1
  step kv_transfer python3 benchmarks/transfer/kv_transfer.py --ttft-model $B8 --out "$R/kv_transfer.json"
  step decode_step_8b python3 benchmarks/engine/decode_step.py --model $B8 --batch 1 64 --context 1024 --out "$R/decode_step_8b.json"
  step decode_step_1b python3 benchmarks/engine/decode_step.py --model $B1 --batch 1 64 256 --context 1024 --out "$R/decode_step_1b.json" )
wait $C
python3 benchmarks/serving/ratio.py --report-only --out-dir "$R/ratio2" > "$R/ratio2_report.txt" 2>&1
tar czf "$OUT/results.tgz" -C "$OUT" r
cat "$OUT/summary.txt"
