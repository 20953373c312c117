#!/usr/bin/env bash
# What the services cost per token on the CPU: the same workload through the offline engine,
# through one colocated worker driven on its Stream call (no router), through router + gRPC +
# one colocated worker, and through router + prefill + decode (shm transport), in one run on one
# machine. ROUNDS rounds (default 3), each running the four in turn, so a noisy neighbour hits
# all of them alike; prints each path's median output tokens/s (and its range), the engine steps
# each worker ran (from its metrics) and the CPU time per output token of each process (/proc).
#   bash benchmarks/serving/token_path.sh [--client-procs 1] [--pin] [--num-requests 64] ...
# --pin gives every process a physical core of its own (client, each worker and its engine core,
# router; the offline engine the first worker's), so what the path costs is not mixed with the OS sharing cores.
#   ROUNDS=5 bash benchmarks/serving/token_path.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# One compute thread per process (override with OMP_NUM_THREADS): the model's compute then has a
# core of its own in every run, and the comparison isolates the cost of the services' path.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
ROUNDS=${ROUNDS:-3}
# Each path first runs the workload's 64 requests (16 tokens out) unmeasured: a fresh stack's
# first burst opens connections and walks cold code paths in every process, which a 2-second
# measurement would otherwise count.
ARGS=(--model tandem-demo --load-format auto --devices cpu --dtype float32 --workload fixed --prompt-len 32
      --output-len 64 --num-requests 64 --warmup 64 --seed 0 --no-progress "$@")
for r in $(seq 1 "$ROUNDS"); do
  python3 benchmarks/serving/serve.py --mode offline "${ARGS[@]}" --out "$OUT/offline-$r.json" > "$OUT/offline-$r.txt"
  python3 benchmarks/serving/worker_stream.py "${ARGS[@]}" --out "$OUT/worker-$r.json" > "$OUT/worker-$r.txt"
  python3 benchmarks/serving/serve.py --launch colocated --rate inf "${ARGS[@]}" --out "$OUT/colocated-$r.json" > "$OUT/colocated-$r.txt"
  python3 benchmarks/serving/serve.py --launch disaggregated --num-prefill 1 --num-decode 1 --rate inf "${ARGS[@]}" --out "$OUT/disagg-$r.json" > "$OUT/disagg-$r.txt"
done
python3 - "$OUT" "$ROUNDS" <<'PY'
import json, os, platform, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])

def load(name):
    runs = []
    for r in range(1, rounds + 1):
        rep = json.load(open(f"{out}/{name}-{r}.json"))
        s = rep if name in ("offline", "worker") else rep["runs"][0]["summary"]
        steps = ({"engine": rep["step_time"]["steps"]} if name == "offline"
                 else s["engine_steps"])
        runs.append((s["output_throughput"], s["output_tokens"], s["cpu_s"], rep, steps,
                     s.get("threads", {})))
    return runs

paths = [("offline engine (LLM.generate)", load("offline")),
         ("1 colocated worker, one Stream call", load("worker")),
         ("router + gRPC + 1 colocated worker", load("colocated")),
         ("router + gRPC + prefill + decode (shm)", load("disagg"))]
base = statistics.median(tps for tps, *_ in paths[0][1])
first = paths[0][1][0][3]
print(f"{first['workload']} x{first['num_requests']} on {platform.machine()} "
      f"({os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}), "
      f"model {first['model']}, {rounds} rounds, "
      + ("a physical core per process" if first.get("pinned") else "processes not pinned"))
print(f"{'path':<40}{'tok/s median':>13}{'range':>15}{'vs offline':>11}"
      f"  engine steps (median)  CPU µs per token (median)")
for name, runs in paths:
    tps = [t for t, *_ in runs]
    med = statistics.median(tps)
    procs = sorted({p for _, _, cpu, *_ in runs for p in cpu})
    per_tok = {p: statistics.median(cpu[p] / n * 1e6 for _, n, cpu, *_ in runs) for p in procs}
    total = sum(per_tok.values())
    cpu = ", ".join(f"{p} {v:.0f}" for p, v in per_tok.items())
    workers = sorted({w for *_, steps, _ in runs for w in steps})
    steps = ", ".join(f"{w} {statistics.median(s[w] for *_, s, _ in runs):.0f}" for w in workers)
    print(f"{name:<40}{med:>13.1f}{f'{min(tps):.0f}-{max(tps):.0f}':>15}{med / base:>11.2f}"
          f"  {steps:<22}  {cpu} (total {total:.0f})")
print("workers' threads, CPU µs per token and times preempted (medians): main = gRPC's event "
      "loop, py-threads = other Python threads (gRPC's poller among them); core.* = the engine "
      "core process: core.main the engine loop, core.py-threads its command reader")
for name, runs in paths[1:]:
    for w in sorted({w for *_, th in runs for w in th if w not in ("router", "client")}):
        names = sorted({t for *_, th in runs for t in th.get(w, {})})
        per = {t: (statistics.median(th[w].get(t, {}).get("cpu_s", 0) / n * 1e6
                                     for _, n, *_, th in runs),
                   statistics.median(th[w].get(t, {}).get("preempted", 0) for *_, th in runs))
               for t in names}
        top = sorted(per.items(), key=lambda kv: -kv[1][0])
        print(f"  {name:<40}{w:<9}" + ", ".join(f"{t} {c:.0f} ({p:.0f}×)" for t, (c, p) in top
                                                 if c >= 1))
PY
