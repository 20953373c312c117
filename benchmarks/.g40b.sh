source benchmarks/gpu_env.sh
common=(--model $B8 --dtype bfloat16 --load-format dummy --num-requests 1000 --no-progress --workload sharegpt --seed ${SEED:-0})
F="--scheduling-policy critical-path"
python3 benchmarks/serving/serve.py --mode offline --model $B8 --dtype bfloat16 --load-format dummy --num-requests 200 --no-progress --workload fixed --prompt-len 64 --output-len 16 --devices cuda:0 --gpu-time-every 0 -- $F > $OUT/warm.txt 2>&1
python3 benchmarks/serving/serve.py --mode offline "${common[@]}" --devices cuda:0 --gpu-time-every 0 -- $F > $OUT/off.txt 2>&1
for i in 1 2; do for tree in .base .; do tag=$([ $tree = . ] && echo head || echo base)$i
  (cd $tree && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/serving/serve.py --launch colocated "${common[@]}" --devices cuda:0 --rate inf --log-dir $OUT/logs_$tag -- $F > $OUT/col_$tag.txt 2>&1)
done; done
echo "offline: $(grep -E 'requests in' $OUT/off.txt | cut -c1-80)"; grep longest $OUT/off.txt
for f in $OUT/col_*.txt; do t=$(basename $f .txt); echo "$t: $(grep -E '^ +inf' $f)"; grep longest $f
python3 - $OUT/logs_${t#col_}/router.log <<'PY'
import json, sys, datetime
st = []
for line in open(sys.argv[1]):
    d = json.loads(line)
    if d.get("event") == "request done" and d.get("usage_output_tokens", 0) > 16:
        t = datetime.datetime.fromisoformat(d["timestamp"].replace("Z", "+00:00")).timestamp()
        st.append(t - d["e2e_seconds"])
st.sort()
print("  router took request k at s:", {k: round(st[k - 1] - st[0], 2) for k in (250, 500, 750, len(st))})
PY
done
