source benchmarks/gpu_env.sh
B8=benchmarks/configs/llama-3.1-8b
common=(--model $B8 --dtype bfloat16 --load-format dummy --num-requests 1000 --no-progress --workload sharegpt --seed 0)
F="--scheduling-policy critical-path"
python3 benchmarks/serving/serve.py --mode offline --model $B8 --dtype bfloat16 --load-format dummy --num-requests 200 --no-progress --workload fixed --prompt-len 64 --output-len 16 --devices cuda:0 --gpu-time-every 0 -- $F > $OUT/warm.txt 2>&1
python3 benchmarks/serving/serve.py --mode offline "${common[@]}" --devices cuda:0 --gpu-time-every 0 --out $OUT/off.json -- $F > $OUT/off.txt 2>&1
python3 benchmarks/serving/serve.py --launch colocated "${common[@]}" --devices cuda:0 --rate inf --out $OUT/col.json --log-dir $OUT/col_logs -- $F > $OUT/col.txt 2>&1
grep -E "requests in|longest|floors" $OUT/off.txt; grep -E "inf |longest" $OUT/col.txt
