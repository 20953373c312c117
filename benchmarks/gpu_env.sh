# Sourced by the GPU scripts (gpu_four.sh, gpu_tp.sh, gpu_serving.sh, gpu_session.sh): the
# checkout's root as the working directory, the carried wheels (.whl/) installed into /tmp/site,
# the environment every benchmark needs, results under $R (default $OUT/r) with the machine's
# GPUs and versions in $R/gpus.txt, and step() bounded by LIMIT seconds from here.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/out}
R=${R:-$OUT/r}
mkdir -p "$R"
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -f /tmp/site/.tandem-wheels ]; then  # once a machine
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.tandem-wheels
fi
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
export TANDEM_CACHE_DIR=/tmp/tandem-cache
export PYTHONSAFEPATH=1  # a script's directory (benchmarks/kernels/, ...) never shadows packages
{
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  nvidia-smi topo -m
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$R/gpus.txt" 2>&1
B1=benchmarks/configs/llama-3.2-1b
B8=benchmarks/configs/llama-3.1-8b
Q32=benchmarks/configs/qwen2.5-32b
# 1,000 ShareGPT-like requests at once through the router and one colocated worker on cuda:0
# (after `--`: engine flags, e.g. --tensor-parallel-size 2)
SERVE="python3 benchmarks/serving/serve.py --launch colocated --dtype bfloat16 --load-format dummy --devices cuda:0 --workload sharegpt --num-requests 1000 --rate inf --no-progress"
LIMIT=${LIMIT:-560}
DEADLINE=$(( $(date +%s) + LIMIT ))

step() {  # step NAME CMD...: run within the deadline into $R/NAME.txt; exit code and seconds
  local name=$1; shift          # go to $OUT/summary.txt
  local t0=$(date +%s) left=$(( DEADLINE - $(date +%s) ))
  if [ $left -lt 20 ]; then echo "$name skipped (no time left)" >> "$OUT/summary.txt"; return; fi
  timeout --kill-after=10 $left "$@" > "$R/$name.txt" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s" >> "$OUT/summary.txt"
}
