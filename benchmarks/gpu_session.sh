#!/usr/bin/env bash
# One GPU-box session: install the carried wheels, then run the named stages, each logging to
# $OUT/<stage>.txt (and JSON where the script writes one). Usage on the device:
#   bash benchmarks/gpu_session.sh correctness perf
# Stages: correctness (GPU tests + CUDA parity), kernels, transfer, transfer_nixl,
# transfer_nixl_env, fp8_blocks, sweep, decode, sched, kv_dtype, fp8kv_steps,
# kernels_gpu, decode8b, decode_ops, ratio4, tokenpath, servepath, fp8, fp8_fusion, defaults, structured,
# pulls, profile, offline, layouts, compare, spec, spec_batch, multiturn_tier, migration_stall,
# changing_mix, rolling, router_procs, spec_latency, pack, pd_pace, decode_tiles, tile_sweep, fp8kv_tiles,
# fp8kv_short, fp8kv_ab.
# Several groups of stages at once, each on its own GPUs: gpu_parallel.sh.
set -uo pipefail
OUT=${OUT:-/tmp/out}
R=$OUT  # each stage's log straight in $OUT
source "$(dirname "$0")/gpu_env.sh"

run() {  # run NAME CMD...: log, time, never stop the session
  local name=$1; shift
  local t0=$(date +%s)
  echo "=== $name: $*" | tee -a "$OUT/summary.txt"
  "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "=== $name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$OUT/summary.txt"
  tail -n 25 "$OUT/$name.txt"
}

serve_in() {  # serve_in TREE: serve.py's path in that checkout (flat before benchmarks/ had sub-folders)
  if [ -f "$1/benchmarks/serving/serve.py" ]; then echo benchmarks/serving/serve.py
  else echo benchmarks/serve.py; fi
}

for stage in "$@"; do
  case $stage in
    correctness)
      run gpu_tests python3 -m pytest -q -x -p no:cacheprovider -m "gpu or gpu2" tests/gpu -rA
      TANDEM_TEST_DEVICE=cuda run parity_cuda python3 -m pytest -q -p no:cacheprovider tests/e2e/test_parity.py
      run generate_8b python3 -m tandem.cli.main generate --model benchmarks/configs/llama-3.1-8b \
        --load-format dummy --device cuda --dtype bfloat16 --max-model-len 4096 \
        --prompt-token-ids 1,2,3,4,5,6,7,8 --prompt-token-ids 9,10,11 --max-tokens 16 --json ;;
    kernels) run kernels python3 benchmarks/kernels/paged_kernels.py --out "$OUT/kernels.json" ;;
    kv_dtype)  # FP8 KV against bf16 KV in the decode kernel, FP8 tile configs swept
      run decode_kv_dtype python3 benchmarks/kernels/decode_kv_dtype.py --out "$OUT/decode_kv_dtype.json" ;;
    tile_sweep)  # unsplit decode attention over tile configurations, registers capped or not,
      # bf16 and FP8 KV
      run tile_sweep python3 benchmarks/kernels/decode_tiles.py --out "$OUT/tile_sweep.json" ;;
    fp8kv_tiles)  # 8B decode steps with an FP8 KV cache, BASE's tree and this one in turn
      for tree in "${BASE:?set BASE}" "$PWD" "$BASE" "$PWD"; do
        tag=$([ "$tree" = "$PWD" ] && echo head || echo base)
        (cd "$tree" && PYTHONPATH=/tmp/site:$tree run "fp8kv_tiles_$tag" python3 \
          benchmarks/engine/decode_step.py --model $B8 --batch ${TILE_BATCHES:-64 96 192 256 512} \
          --context ${TILE_CONTEXT:-1024} --kv-cache-dtype fp8)
        grep -E "^ +[0-9]+ +graphs" "$OUT/fp8kv_tiles_$tag.txt" | sed "s/^/$tag: /" >> "$OUT/fp8kv_tiles_table.txt"
      done ;;
    fp8kv_short)  # FP8 KV against bf16 KV at short contexts and few rows: whole decode steps
      # by kernel kind, then the decode kernel's split launch as a captured graph sizes it
      run fp8kv_short_profile python3 benchmarks/engine/step_profile.py --variants bf16 fp8-kv \
        --decode-batch 1 16 --context 256 --mixed 64+0 --steps 50 --out "$OUT/fp8kv_short_profile.json"
      for len in 448 8192; do
        # shellcheck disable=SC2086  # the configs are words
        run "fp8kv_short_kernel_$len" python3 benchmarks/kernels/decode_kv_dtype.py --batches 1 2 4 16 \
          --contexts 256 1024 --graph-len $len --max-copies 512 --configs ${SHORT_CONFIGS:-n64/w4/s3/f16 \
          n128/w4/s3/f16 n128/w4/s3/f16/m512 n128/w4/s3/f16/r160 n64/w4/s2/f16 n64/w2/s3/f16 \
          n32/w4/s3/f16 n64/w4/s3 n128/w8/s3/f16} --out "$OUT/fp8kv_short_kernel_$len.json"
      done ;;
    fp8kv_ab)  # FP8 KV against bf16 KV in whole decode steps, BASE's tree then this one, each
      # context of AB_CONTEXTS (BASE: the contexts of AB_BASE_CONTEXTS only)
      for tree in "${BASE:?set BASE}" "$PWD"; do
        tag=$([ "$tree" = "$PWD" ] && echo head || echo base)
        ctxs=$([ "$tag" = head ] && echo "${AB_CONTEXTS:-256 1024}" || echo "${AB_BASE_CONTEXTS:-256}")
        for ctx in $ctxs; do
          (cd "$tree" && PYTHONPATH=/tmp/site:$tree run "fp8kv_ab_${tag}_$ctx" python3 \
            benchmarks/engine/decode_step.py --model $B8 --batch 1 16 64 256 512 --context "$ctx" \
            --variants bf16 fp8-kv --out "$OUT/fp8kv_ab_${tag}_$ctx.json")
        done
      done ;;
    fp8kv_steps)  # FP8 KV against bf16 KV in whole decode steps (8B config, CUDA graphs)
      run fp8kv_steps python3 benchmarks/engine/decode_step.py --model benchmarks/configs/llama-3.1-8b \
        --batch 1 16 64 256 512 --context 1024 --variants bf16 fp8-kv --out "$OUT/fp8kv_steps.json" ;;
    transfer) run kv_transfer python3 benchmarks/transfer/kv_transfer.py --ttft-model benchmarks/configs/llama-3.1-8b --out "$OUT/kv_transfer.json" ;;
    # Needs nixl-cu13 and nixl (meta) wheels installed into /tmp/site (README: the GPU run).
    transfer_nixl) run kv_transfer_nixl python3 benchmarks/transfer/kv_transfer.py --nixl \
        --out "$OUT/kv_transfer_nixl.json" ;;
    transfer_nixl_env)  # issue 28: UCX settings that may change its cuda_ipc path (nixl in /tmp/site)
      # (measured and left out: UCX_PROTO_ENABLE=n fails with NIXL_ERR_BACKEND,
      # UCX_MEMTYPE_CACHE=n changes nothing; protoinfo prints the protocols UCX picks)
      for v in "protoinfo:UCX_PROTO_INFO=y" "rails1:UCX_MAX_RNDV_RAILS=1" \
               "get_zcopy:UCX_RNDV_SCHEME=get_zcopy" "put_zcopy:UCX_RNDV_SCHEME=put_zcopy"; do
        # shellcheck disable=SC2086  # an empty setting leaves env with no assignment
        run "nixl_env_${v%%:*}" env ${v#*:} python3 benchmarks/transfer/kv_transfer.py --nixl --repeats 20 \
          --out "$OUT/nixl_env_${v%%:*}.json"
      done ;;
    fp8_blocks)  # issue 20: the per-block cost of a scattered pull, 16- against 32-token blocks
      for bs in 16 32; do
        run "fp8_blocks_$bs" python3 benchmarks/transfer/kv_transfer.py --kv-cache-dtype auto fp8 \
          --block-size $bs --repeats 20 --sweep --out "$OUT/fp8_blocks_$bs.json"
      done ;;
    sweep) run kv_sweep python3 benchmarks/transfer/kv_transfer.py --sweep --repeats 10 --out "$OUT/kv_sweep.json" ;;
    profile)  # where each kind of step's device time goes, by kernel kind (PROFILE_VARIANTS)
      # shellcheck disable=SC2086  # the variants are words
      run step_profile python3 benchmarks/engine/step_profile.py --variants ${PROFILE_VARIANTS:-bf16 fp8-w} \
        --out "$OUT/step_profile.json" ;;
    offline)  # the offline engine's 1,000-request 8B runs, one process each, in the order given:
      # OFFLINE_RUNS="name|workload flags|engine flags;..." e.g.
      # "fcfs0|--workload sharegpt --seed 0|;cp0|--workload sharegpt --seed 0|--scheduling-policy critical-path"
      IFS=';' read -ra runs <<< "${OFFLINE_RUNS:?set OFFLINE_RUNS}"
      for spec in "${runs[@]}"; do
        IFS='|' read -r name wl eng <<< "$spec"
        # shellcheck disable=SC2086  # flags are words
        run "offline_$name" python3 benchmarks/serving/serve.py --mode offline --model "$B8" --dtype bfloat16 \
          --load-format dummy --devices cuda:0 --num-requests 1000 --no-progress --gpu-time-every 0 \
          $wl --out "$OUT/offline_$name.json" -- $eng
        grep -E "requests in|floors|steps:|^ +(prefill|mixed|decode|all)" "$OUT/offline_$name.txt" \
          >> "$OUT/offline_table.txt"
      done ;;
    decode) run decode_step_8b python3 benchmarks/engine/decode_step.py --model benchmarks/configs/llama-3.1-8b \
        --batch 1 64 --context 1024 --out "$OUT/decode_step_8b.json"
      run decode_step_1b python3 benchmarks/engine/decode_step.py --model benchmarks/configs/llama-3.2-1b \
        --batch 1 64 256 --context 1024 --out "$OUT/decode_step_1b.json" ;;
    sched) run scheduler_overhead python3 benchmarks/engine/scheduler_overhead.py ;;
    kernels_gpu) run kernels_gpu python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/gpu/test_paged_attention_gpu.py \
        tests/gpu/test_small_kernels_gpu.py tests/gpu/test_attention_backend_gpu.py ;;
    decode8b) run decode_step_8b python3 benchmarks/engine/decode_step.py --model benchmarks/configs/llama-3.1-8b \
        --batch 1 64 --context 1024 --out "$OUT/decode_step_8b.json" ;;
    decode_tiles)  # unsplit decode attention tiles: the kernel over the decode-graph batches,
      # then 8B decode steps at batches where they differ, BASE's tree and this one in turn
      run tiles python3 benchmarks/kernels/paged_kernels.py --tiles --out "$OUT/tiles.json"
      for tree in "${BASE:?set BASE}" "$PWD"; do
        tag=$([ "$tree" = "$PWD" ] && echo head || echo base)
        (cd "$tree" && PYTHONPATH=/tmp/site:$tree run "decode_tiles_$tag" python3 \
          benchmarks/engine/decode_step.py --model $B8 --batch ${TILE_BATCHES:-72 96 136 192 256 512} \
          --context ${TILE_CONTEXT:-448})
        grep -E "^ +[0-9]+ +graphs" "$OUT/decode_tiles_$tag.txt" | sed "s/^/$tag: /" >> "$OUT/decode_tiles_table.txt"
      done ;;
    decode_ops) run decode_ops timeout 120 python3 benchmarks/kernels/decode_ops.py --batches 1 64 --context 1024 \
        --out "$OUT/decode_ops.json" ;;
    ratio4)  # every 4-GPU prefill:decode layout, two workloads (prompt-heavy at two rates)
      run ratio4 python3 benchmarks/serving/ratio.py --model benchmarks/configs/llama-3.1-8b --dtype bfloat16 \
        --load-format dummy --gpus 4 --layouts 1P3D 2P2D 3P1D 4C --workloads prompt-heavy decode-heavy \
        --rates-for prompt-heavy=12,24 --rates-for decode-heavy=24 --num-requests 100 \
        --slo-ttft-ms 1000 --slo-itl-ms 50 --no-progress --out-dir "$OUT/ratio4" ;;
    tokenpath) CUDA_VISIBLE_DEVICES= run token_path env OUT="$OUT/tokenpath" bash benchmarks/serving/token_path.sh --client-procs 1 ;;
    servepath)  # services against the offline engine on GPUs (SERVE_MODELS: which configs)
      for m in ${SERVE_MODELS:-llama-3.2-1b llama-3.1-8b}; do
        common=(--model benchmarks/configs/$m --dtype bfloat16 --load-format dummy --workload sharegpt
                --num-requests 1000 --no-progress)
        # Unmeasured first: a fresh machine compiles Triton kernels on first use (cached on disk
        # for every later process); whichever path ran first would pay for it.
        run "warm_$m" python3 benchmarks/serving/serve.py --mode offline "${common[@]}" --devices cuda:0 \
          --gpu-time-every 0
        run "offline_$m" python3 benchmarks/serving/serve.py --mode offline "${common[@]}" --devices cuda:0 \
          --gpu-time-every 0 --out "$OUT/offline_$m.json"
        run "colocated_$m" python3 benchmarks/serving/serve.py --launch colocated "${common[@]}" --devices cuda:0 \
          --rate inf --out "$OUT/colocated_$m.json"
        run "disagg_$m" python3 benchmarks/serving/serve.py --launch disaggregated --num-prefill 1 --num-decode 1 \
          "${common[@]}" --devices cuda:0,cuda:1 --rate inf --out "$OUT/disagg_$m.json"
      done ;;
    fp8_fusion)  # FP8 weights: norm/activation + activation quantization fused, against unfused
      run fp8_fusion_gpu_tests python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests/gpu/test_fp8_fusion_gpu.py tests/gpu/test_fp8_gpu.py -rA
      run fp8_fused_quant timeout 600 python3 benchmarks/kernels/fp8_fused_quant.py
      run fp8_fused_quant_static timeout 600 python3 benchmarks/kernels/fp8_fused_quant.py --static
      run fp8_fused_quant_sweep timeout 600 python3 benchmarks/kernels/fp8_fused_quant.py --sweep \
        --m 16,112,256,512,2048,8192 ;;
    fp8)  # issue 20: FP8 KV cache and FP8 weights (Llama-3.1-8B config, dummy weights)
      run fp8_gpu_tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_fp8_gpu.py -rA
      run fp8_gemv timeout 600 python3 benchmarks/kernels/fp8_gemv.py --sweep
      run fp8_decode_8b python3 benchmarks/engine/decode_step.py --model benchmarks/configs/llama-3.1-8b \
        --batch 1 64 256 --context 1024 --variants bf16 fp8-kv fp8-w fp8-w+kv \
        --out "$OUT/fp8_decode_8b.json"
      run fp8_transfer python3 benchmarks/transfer/kv_transfer.py --kv-cache-dtype auto fp8 \
        --ttft-model benchmarks/configs/llama-3.1-8b --out "$OUT/fp8_transfer.json"
      common=(--model benchmarks/configs/llama-3.1-8b --dtype bfloat16 --load-format dummy
              --workload sharegpt --num-requests 1000 --no-progress --devices cuda:0 --gpu-time-every 0)
      run fp8_warm python3 benchmarks/serving/serve.py --mode offline "${common[@]}" -- --kv-cache-dtype fp8 --quantization fp8
      for v in "bf16:" "fp8kv:--kv-cache-dtype fp8" "fp8wkv:--kv-cache-dtype fp8 --quantization fp8"; do
        # shellcheck disable=SC2086  # the flags split on purpose
        run "fp8_offline_${v%%:*}" python3 benchmarks/serving/serve.py --mode offline "${common[@]}" \
          --out "$OUT/fp8_offline_${v%%:*}.json" -- ${v#*:}
      done
      if [ -n "${FP8_ACCURACY_MODEL:-}" ]; then  # a real checkpoint (SmolLM2-135M-Instruct)
        run fp8_accuracy python3 benchmarks/engine/fp8_accuracy.py --model "$FP8_ACCURACY_MODEL" \
          --device cuda --out "$OUT/fp8_accuracy.json"
      fi ;;
    defaults)  # issue 23 item 5: batch cap and token budget for the 8B config on one GPU
      common=(--model $B8 --dtype bfloat16 --load-format dummy --devices cuda:0 --num-requests 1000
              --no-progress --warmup 0 --gpu-time-every 0)
      for v in "s256_b2k:" "s512_b2k:--max-num-seqs 512" "s256_b8k:--max-num-batched-tokens 8192" \
               "s512_b8k:--max-num-seqs 512 --max-num-batched-tokens 8192"; do
        for w in "fixed:--workload fixed --prompt-len 220 --output-len 190" "sg0:--workload sharegpt --seed 0"; do
          # shellcheck disable=SC2086  # the flags split on purpose; engine flags after --
          run "defaults_${w%%:*}_${v%%:*}" python3 benchmarks/serving/serve.py --mode offline "${common[@]}" \
            ${w#*:} --out "$OUT/defaults_${w%%:*}_${v%%:*}.json" -- ${v#*:}
        done
      done ;;
    structured)  # issue 18: json_schema against unconstrained (needs a tokenizer directory)
      run structured python3 benchmarks/engine/structured.py --model $B8 --tokenizer "${STRUCTURED_TOKENIZER:?}" \
        --device cuda:0 --num-requests 256 --max-tokens 256 --rounds 3 --schema unbounded \
        --breakdown --out "$OUT/structured.json" ;;
    pulls)  # decode workers beside KV pulls (needs 2 GPUs): in-stream pulls' tests, then 1P+1D
      # at steady arrival rates (a pull in nearly every decode step) with this tree and, when
      # BASE names another checkout (e.g. the commit before in-stream pulls), with that one
      run pulls_gpu_tests python3 -m pytest -q -p no:cacheprovider -m "gpu or gpu2" -rA \
        tests/gpu/test_kvtransfer_gpu.py tests/gpu/test_disagg_gpu.py
      for tree in "$PWD" ${BASE:+"$BASE"}; do
        tag=$([ "$tree" = "$PWD" ] && echo head || echo base)
        (cd "$tree" && PYTHONPATH=/tmp/site:$tree run "pulls_$tag" python3 "$(serve_in "$tree")" \
          --launch disaggregated --num-prefill 1 --num-decode 1 --model $B8 --dtype bfloat16 \
          --load-format dummy --workload sharegpt --num-requests 600 --rate 20 30 --no-progress \
          --devices cuda:0,cuda:1 --out "$OUT/pulls_$tag.json")
      done ;;
    layouts)  # the serving layouts on two GPUs against the offline engine, one workload
      # (LAYOUT_WORKLOAD), engine flags LAYOUT_FLAGS for every worker: GPU 0 runs the offline
      # engine then router + one colocated worker (and the same two from the BASE checkout when
      # set) while GPU 1 times decode steps of bf16 against FP8 KV; then 1P+1D and two colocated
      # workers on both GPUs.
      wl=${LAYOUT_WORKLOAD:---workload sharegpt --seed 0}
      common=(--model $B8 --dtype bfloat16 --load-format dummy --num-requests 1000 --no-progress)
      one_gpu() {  # TAG TREE: offline then colocated on cuda:0 from TREE
        # shellcheck disable=SC2086  # flags are words
        (cd "$2" && PYTHONPATH=/tmp/site:$2 run "offline_$1" python3 "$(serve_in "$2")" --mode offline \
          "${common[@]}" $wl --devices cuda:0 --gpu-time-every 0 --out "$OUT/offline_$1.json" -- ${LAYOUT_FLAGS:-}
         PYTHONPATH=/tmp/site:$2 run "colocated_$1" python3 "$(serve_in "$2")" --launch colocated \
          "${common[@]}" $wl --devices cuda:0 --rate inf --out "$OUT/colocated_$1.json" -- ${LAYOUT_FLAGS:-})
      }
      (export CUDA_VISIBLE_DEVICES=0
       # unmeasured first: Triton compiles its kernels once per machine (cached on disk after)
       # shellcheck disable=SC2086
       run layout_warm python3 benchmarks/serving/serve.py --mode offline "${common[@]}" --workload fixed \
         --prompt-len 64 --output-len 16 --devices cuda:0 --gpu-time-every 0 -- ${LAYOUT_FLAGS:-}
       one_gpu head "$PWD"
       [ -n "${BASE:-}" ] && one_gpu base "$BASE") &
      lane0=$!
      (export CUDA_VISIBLE_DEVICES=1
       run fp8kv_decode python3 benchmarks/engine/decode_step.py --model $B8 --batch 1 16 64 256 512 \
         --context 1024 --variants bf16 fp8-kv --out "$OUT/fp8kv_decode.json") &
      wait $lane0 $!
      # shellcheck disable=SC2086
      run layout_1p1d python3 benchmarks/serving/serve.py --launch disaggregated --num-prefill 1 --num-decode 1 \
        "${common[@]}" $wl --devices cuda:0,cuda:1 --rate inf --out "$OUT/layout_1p1d.json" -- ${LAYOUT_FLAGS:-}
      # shellcheck disable=SC2086
      run layout_2c python3 benchmarks/serving/serve.py --launch colocated --num-both 2 \
        "${common[@]}" $wl --devices cuda:0,cuda:1 --rate inf --out "$OUT/layout_2c.json" -- ${LAYOUT_FLAGS:-} ;;
    pd_pace)  # 1P+1D under the critical-path policy (the prefill worker's order, the decode
      # worker's paced admissions) on two GPUs, one workload (LAYOUT_WORKLOAD), PD_RUNS of: warm
      # (unmeasured: Triton compiles once a machine), base (1P+1D from the BASE checkout),
      # min<N> (1P+1D, --min-step-tokens N: the fewest decodes a paced step admits up to;
      # min512, max-num-seqs, admits every request as before), colocated (router + one
      # colocated worker on GPU 0), 2c (two colocated workers)
      wl=${LAYOUT_WORKLOAD:---workload sharegpt --seed 0}
      common=(--model $B8 --dtype bfloat16 --load-format dummy --num-requests 1000 --no-progress --rate inf)
      cp=(--scheduling-policy critical-path)
      # the router as four API processes (one cannot take 1,000 requests at once in time:
      # the longest request, the run's critical path, would reach a worker seconds late)
      common+=(--router-arg=--api-processes=4 --router-arg=--responses-store=0)
      pd=(--launch disaggregated --num-prefill 1 --num-decode 1 --devices cuda:0,cuda:1)
      for r in ${PD_RUNS:-warm base min256 min512 colocated 2c}; do
        # shellcheck disable=SC2086  # $wl: flags are words
        case $r in
          warm) run pd_warm python3 benchmarks/serving/serve.py --mode offline --model $B8 --dtype bfloat16 \
                  --load-format dummy --num-requests 200 --no-progress --workload fixed --prompt-len 64 \
                  --output-len 16 --devices cuda:0 --gpu-time-every 0 ;;
          base) (cd "$BASE" && PYTHONPATH=/tmp/site:$BASE run pd_base python3 "$(serve_in "$BASE")" "${pd[@]}" \
                  "${common[@]}" $wl --out "$OUT/pd_base.json" -- "${cp[@]}") ;;
          min*) run "pd_$r" python3 benchmarks/serving/serve.py "${pd[@]}" "${common[@]}" $wl \
                  --out "$OUT/pd_$r.json" -- "${cp[@]}" --min-step-tokens "${r#min}" ;;
          colocated) run pd_colocated python3 benchmarks/serving/serve.py --launch colocated --devices cuda:0 \
                  "${common[@]}" $wl --out "$OUT/pd_colocated.json" -- "${cp[@]}" ;;
          2c) run pd_2c python3 benchmarks/serving/serve.py --launch colocated --num-both 2 \
                  --devices cuda:0,cuda:1 "${common[@]}" $wl --out "$OUT/pd_2c.json" -- "${cp[@]}" ;;
        esac
      done ;;
    router_procs)  # issue 40: router + one colocated worker against the offline engine, the
      # router as 1 and as ROUTER_PROCS API processes (8B config, ShareGPT-like seed 0, 1,000 at once)
      common=(--model $B8 --dtype bfloat16 --load-format dummy --num-requests 1000 --no-progress
              --devices cuda:0 --workload sharegpt --seed 0)
      eng=(-- --scheduling-policy critical-path)
      run rp_warm python3 benchmarks/serving/serve.py --mode offline "${common[@]}" --workload fixed \
        --prompt-len 64 --output-len 16 --gpu-time-every 0 "${eng[@]}"
      run rp_offline python3 benchmarks/serving/serve.py --mode offline "${common[@]}" --gpu-time-every 0 \
        --out "$OUT/rp_offline.json" "${eng[@]}"
      for n in ${ROUTER_PROCS:-4} 1; do
        run "rp_api$n" python3 benchmarks/serving/serve.py --launch colocated --rate inf "${common[@]}" \
          --router-arg=--api-processes=$n --router-arg=--responses-store=0 --out "$OUT/rp_api$n.json" "${eng[@]}"
      done
      grep -hE "requests in|^ +inf|longest" "$OUT"/rp_offline.txt "$OUT"/rp_api*.txt >> "$OUT/rp_table.txt" ;;
    compare)  # the offline engine from this tree and from the BASE checkout, in turn on cuda:0
      # (COMPARE_WORKLOAD, engine flags COMPARE_FLAGS), after one unmeasured warm-up run;
      # COMPARE_MODE=colocated: router + one colocated worker instead of the offline engine
      wl=${COMPARE_WORKLOAD:---workload sharegpt --seed 0}
      mode=(--mode offline)
      [ "${COMPARE_MODE:-}" = colocated ] && mode=(--launch colocated --rate inf)
      common=(--model $B8 --dtype bfloat16 --load-format dummy --num-requests 1000 --no-progress
              --devices cuda:0 --gpu-time-every 0)
      # shellcheck disable=SC2086  # flags are words
      run compare_warm python3 "$(serve_in "$PWD")" --mode offline "${common[@]}" --workload fixed \
        --prompt-len 64 --output-len 16 -- ${COMPARE_FLAGS:-}
      for tree in "${BASE:?set BASE}" "$PWD" "$BASE" "$PWD"; do
        tag=$([ "$tree" = "$PWD" ] && echo head || echo base)
        # shellcheck disable=SC2086
        (cd "$tree" && PYTHONPATH=/tmp/site:$tree run "compare_$tag" python3 "$(serve_in "$tree")" \
          "${mode[@]}" "${common[@]}" $wl -- ${COMPARE_FLAGS:-})
        grep -E "requests in|^ +inf" "$OUT/compare_$tag.txt" | sed "s/^/$tag: /" >> "$OUT/compare_table.txt"
      done ;;
    spec)  # speculative decoding: a verify step's cost (8B config), throughput at batch 64 and
      # 256, and batch-1 latency on a real model (SPEC_MODEL: a checkpoint or .gguf) when set
      run spec_verify python3 benchmarks/engine/spec_decode.py verify --model $B8 \
        --load-format dummy --device cuda -k 3 --out "$OUT/spec_verify.json"
      for k in ${SPEC_KS:-3}; do  # draft tokens per step
        [ -n "${SPEC_MODEL:-}" ] && run "spec_latency_k$k" python3 benchmarks/engine/spec_decode.py \
          latency --model "$SPEC_MODEL" --device cuda -k "$k" --out "$OUT/spec_latency_k$k.json"
      done
      run spec_throughput python3 benchmarks/engine/spec_decode.py throughput --model $B8 \
        --load-format dummy --device cuda --batch 64 256 --out "$OUT/spec_throughput.json" ;;
    spec_latency)  # batch-1 latency alone, one run per k in SPEC_KS (SPEC_MODEL: a checkpoint or
      # .gguf; SPEC_FLAGS: more flags of spec_decode.py latency, e.g. --min-acceptance 0)
      for k in ${SPEC_KS:-3}; do
        # shellcheck disable=SC2086  # SPEC_FLAGS are words
        run "spec_latency_k$k" python3 benchmarks/engine/spec_decode.py latency \
          --model "${SPEC_MODEL:?set SPEC_MODEL}" --device cuda -k "$k" ${SPEC_FLAGS:-} \
          --out "$OUT/spec_latency_k$k.json"
        grep -E "^all|decode steps|steps in flight" "$OUT/spec_latency_k$k.txt" \
          | sed "s/^/k=$k ${SPEC_FLAGS:-}: /" >> "$OUT/spec_table.txt"
      done ;;
    spec_batch)  # speculation at large batches alone (~2 min on an H200): the fixed workload at
      # batch 64 and 256 (8B config, dummy weights) without speculation and with prompt lookup,
      # both in one engine in one process, 3 alternating runs of each after an untimed pair
      run spec_batch python3 benchmarks/engine/spec_decode.py throughput --model $B8 \
        --load-format dummy --device cuda --batch 64 256 --out "$OUT/spec_batch.json" ;;
    multiturn_tier)  # the host KV tier: conversations 4x the pools, 1P (cuda:0) + 1D (cuda:1)
      run multiturn_tier python3 benchmarks/serving/multiturn.py --device cuda --transport cuda_ipc \
        --model $B8 --dtype bfloat16 --load-format dummy --num-prefill 1 --num-decode 1 \
        --num-conversations 100 --turns 6 --first-tokens 512 --new-tokens 128 --output-tokens 64 \
        --rate 20 --host-tier both --oversubscribe 4 --out "$OUT/multiturn_tier.json" ;;
    migration_stall)  # one 32k-token request moved live between decode workers (cuda:0 -> cuda:1)
      run migration_stall python3 benchmarks/serving/migration_stall.py --model $B8 \
        --load-format dummy --dtype bfloat16 --device cuda --max-model-len 34816 \
        --out "$OUT/migration_stall.json" --log-dir "$OUT/migration_stall_logs" ;;
    changing_mix)  # elastic against static and colocated layouts on 4 GPUs: MIX_LAYOUTS (default
      # "elastic 2P2D 4C 1P3D 3P1D") in turn, each on a fresh stack through the same phases
      # (MIX_ARGS: more flags, e.g. --phases ...); a layout starts only while MIX_LAYOUT_S (170)
      # seconds are left before the deadline (LIMIT). JSON and logs of every layout to
      # $OUT/changing_mix.tgz, rewritten after each; the table of those run to $OUT/changing_mix.txt.
      # Layouts of several calls: untar them into one folder, then `changing_mix.py --report`.
      mixdir=/tmp/changing_mix
      mkdir -p "$mixdir/logs"
      for lay in ${MIX_LAYOUTS:-elastic 2P2D 4C 1P3D 3P1D}; do
        if [ $(( DEADLINE - $(date +%s) )) -lt "${MIX_LAYOUT_S:-170}" ]; then
          echo "=== mix_$lay skipped: under ${MIX_LAYOUT_S:-170} s left" | tee -a "$OUT/summary.txt"
          continue
        fi
        # shellcheck disable=SC2086  # MIX_ARGS are words
        (OUT=$mixdir; run "mix_${lay//:/_}" timeout --kill-after=10 $(( DEADLINE - $(date +%s) - 15 )) \
          python3 benchmarks/serving/changing_mix.py --layout "$lay" --model $B8 --dtype bfloat16 \
          --load-format dummy --no-progress --out-dir "$mixdir" --log-dir "$mixdir/logs" ${MIX_ARGS:-})
        tar czf "$OUT/changing_mix.tgz" -C /tmp changing_mix
      done
      python3 benchmarks/serving/changing_mix.py --report --out-dir "$mixdir" > "$OUT/changing_mix.txt" 2>&1
      cat "$mixdir/summary.txt" >> "$OUT/summary.txt"
      for f in "$mixdir"/mix_*.txt; do echo "--- $f"; grep -E "^==|up in|elastic:|goodput|error" "$f"; done \
        >> "$OUT/changing_mix.txt"
      tar czf "$OUT/changing_mix.tgz" -C /tmp changing_mix
      cat "$OUT/changing_mix.txt" ;;
    rolling)  # issue 45: a rolling restart of both decode workers, then the prefill worker
      # killed, under 50 req/s of 128-256-token generations (ROLL_ARGS: more flags); a 1P+2D
      # tandem-demo stack, float32, all three workers on cuda:0
      # shellcheck disable=SC2086  # ROLL_ARGS are words
      run rolling_restart python3 benchmarks/robustness/rolling_restart.py --device cuda:0 \
        --num-blocks 16384 --max-num-batched-tokens 2048 --log-dir "$OUT/rolling_logs" \
        --out "$OUT/rolling_restart.json" ${ROLL_ARGS:-} ;;
    pack) tar czf "$OUT/results.tgz" -C "$OUT" --exclude results.tgz . ;;
    *) echo "unknown stage $stage" ;;
  esac
done
