#!/usr/bin/env bash
# gpu_session.sh stages in parallel groups, each pinned to its own GPUs, on one multi-GPU box:
#   bash benchmarks/gpu_parallel.sh "0,1:multiturn_tier migration_stall" "2:spec" "3:fp8_fused"
# Each group runs its stages in order with CUDA_VISIBLE_DEVICES set (so "cuda:0" is the group's
# first GPU) and its logs under $OUT/g<i>/. Groups share the host's CPUs: a figure from one group
# is measured beside the others' work (say so where it is reported). At the end every result is
# packed into $OUT/results.tgz and the rest of $OUT removed (a call brings back few files);
# each group's summary is printed last. A group still running after GROUP_LIMIT seconds (540) is
# stopped, so that what the others measured still comes back.
set -uo pipefail
OUT=${OUT:-/tmp/out}
here=$(cd "$(dirname "$0")" && pwd)
(R=/tmp/env-check; source "$here/gpu_env.sh")  # the carried wheels installed once, not per group
pids=()
i=0
for group in "$@"; do
  gpus=${group%%:*}
  stages=${group#*:}
  mkdir -p "$OUT/g$i"
  # shellcheck disable=SC2086  # stages are words
  (CUDA_VISIBLE_DEVICES=$gpus OUT="$OUT/g$i" timeout --kill-after=10 "${GROUP_LIMIT:-540}" \
     bash "$here/gpu_session.sh" $stages > "$OUT/g$i/session.txt" 2>&1) &
  pids+=($!)
  i=$((i + 1))
done
for pid in "${pids[@]}"; do wait "$pid"; done
tar czf /tmp/results.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tgz "$OUT/"
rm -rf /tmp/unpacked && mkdir -p /tmp/unpacked && tar xzf "$OUT/results.tgz" -C /tmp/unpacked
for d in /tmp/unpacked/g*; do
  echo "##### $(basename "$d")"
  cat "$d/summary.txt" 2>/dev/null
  for t in "$d"/*table*.txt; do [ -f "$t" ] && cat "$t"; done
done
