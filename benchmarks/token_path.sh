#!/usr/bin/env bash
# What the services cost per token on the CPU: the same workload through the offline engine,
# through router + gRPC + one colocated worker, and through router + prefill + decode (shm
# transport), one after the other in one run on one machine; prints output tokens/s of each.
#   bash benchmarks/token_path.sh [--model tandem-demo] [--num-requests 64] ...
set -euo pipefail
cd "$(dirname "$0")/.."
# One compute thread per process (override with OMP_NUM_THREADS): the model's compute then has a
# core of its own in every run, and the comparison isolates the cost of the services' path.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
OUT=${OUT:-$(mktemp -d)}
ARGS=(--model tandem-demo --load-format auto --devices cpu --dtype float32 --workload fixed --prompt-len 32
      --output-len 64 --num-requests 64 --seed 0 --no-progress "$@")
python3 benchmarks/serve.py --mode offline "${ARGS[@]}" --out "$OUT/offline.json" > "$OUT/offline.txt"
python3 benchmarks/serve.py --launch colocated --rate inf "${ARGS[@]}" --out "$OUT/colocated.json" > "$OUT/colocated.txt"
python3 benchmarks/serve.py --launch disaggregated --num-prefill 1 --num-decode 1 --rate inf "${ARGS[@]}" --out "$OUT/disagg.json" > "$OUT/disagg.txt"
python3 - "$OUT" <<'PY'
import json, platform, sys
out = sys.argv[1]
off = json.load(open(f"{out}/offline.json"))
rows = [("offline engine (LLM.generate)", off["output_throughput"], off["output_tokens"])]
for name, f in (("router + gRPC + 1 colocated worker", "colocated"),
                ("router + gRPC + prefill + decode (shm)", "disagg")):
    s = json.load(open(f"{out}/{f}.json"))["runs"][0]["summary"]
    rows.append((name, s["output_throughput"], s["output_tokens"]))
print(f"{off['workload']} on {platform.machine()} ({off.get('card') or 'cpu'}), model {off['model']}")
print(f"{'path':<42}{'output tok/s':>14}{'vs offline':>12}{'tokens':>9}")
for name, tps, n in rows:
    print(f"{name:<42}{tps:>14.1f}{tps / rows[0][1]:>12.2f}{n:>9}")
PY
