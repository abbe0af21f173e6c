#!/usr/bin/env bash
# Issue #34's table on the lent GPU for the checkout it runs in: run it once on the "before" tree and
# once on the "after" tree on the same warm machine (same card), with the same LABEL scheme.
#   STAGES="bf16 q4km serve" LABEL=after bash tools/gpu_issue34.sh     (each stage fits one call)
# bf16:  memra bench on the Qwen3-4B-shaped bf16 checkpoint: decode at every CUDA-graph bucket,
#        depth 0 and 4096, prefill, the copy roofline, RSS after load (memory rows)
# q4km:  the same on a random-block q4_k_m GGUF of that shape
# serve: memra serve on the bf16 checkpoint: warm HTTP-ready (second start, kernel cache warm), the
#        server's lines on where the start's time went and on the graph captures it runs after ready,
#        loadgen c=32 441-word prompts 128 tokens: a warm-up run (seed 1), the measured cold run (seed
#        2: prompts the prefix cache has not seen) and the same prompts again (every prompt a prefix
#        hit but its trailing partial block: the c=32 warm row), warm-prefix
#        TTFT at 1k/4k/15k words (tools/warm_prefix.py, every send), idle RSS from /metrics
# Results under $OUT/$LABEL/; the checkpoints stay in /dev/shm between calls on a warm machine.
# A "before" tree without tools/warm_prefix.py or the RSS rows: copy this script and
# tools/warm_prefix.py into it (they need only tools/loadgen.py and the memra CLI); RSS then comes
# from ps only.
set -u
OUT=${OUT:-/tmp/gpu_out}; LABEL=${LABEL:-run}; R="$OUT/$LABEL"; mkdir -p "$R"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 MEMRA_CACHE_DIR=${MEMRA_CACHE_DIR:-/dev/shm/mcache}
ck() {  # write a checkpoint once per machine
  [ -e "$2" ] || python3 tools/make_checkpoint.py --shape qwen3-4b --out "$2" $1 >> "$R/checkpoints.log" 2>&1
}
for stage in ${STAGES:-bf16 q4km serve}; do
  case $stage in
  bf16)
    ck "" /dev/shm/q4b
    timeout 560 python3 -m engine.cli bench /dev/shm/q4b --backend cuda --json "$R/bench_bf16.json" > "$R/bench_bf16.txt" 2>&1
    ;;
  q4km)
    ck "--gguf q4_k_m" /dev/shm/q4b_q4km.gguf
    timeout 560 python3 -m engine.cli bench /dev/shm/q4b_q4km.gguf --backend cuda --json "$R/bench_q4km.json" > "$R/bench_q4km.txt" 2>&1
    ;;
  serve)
    ck "" /dev/shm/q4b
    for start in cold warm; do  # the first start fills the kernel cache; the second is the warm figure
      t0=$(date +%s.%N)
      python3 -m engine.cli serve /dev/shm/q4b --backend cuda --port 8123 > "$R/serve_$start.log" 2>&1 &
      pid=$!
      for i in $(seq 1 2400); do curl -sf localhost:8123/ready >/dev/null && break; sleep 0.05; done
      echo "$start HTTP-ready $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.2f", b - a}') s, RSS $(ps -o rss= -p $pid) KiB" | tee -a "$R/serve.txt"
      # the captures after ready (engine.runner_warm): wait for them, so the rows below measure the same server
      for i in $(seq 1 400); do grep -q "background warm-up done\|background warm-up failed" "$R/serve_$start.log" && break; sleep 0.05; done
      grep -E "memra: loading|kernels:|runner ready in|backend, ready in|model .* ready in|warm-prefix passes|background warm-up" "$R/serve_$start.log" \
        | sed "s/^/  $start log: /" | tee -a "$R/serve.txt"
      [ $start = warm ] && break
      kill -TERM $pid; wait $pid
    done
    curl -s localhost:8123/metrics | grep -E "^(process_resident_memory_bytes|memra_process_peak_resident_bytes)" | tee -a "$R/serve.txt"
    for run in warmup:1 cold:2 hit:2; do
      echo "loadgen ${run%%:*} (seed ${run#*:})" >> "$R/serve.txt"
      timeout 120 python3 tools/loadgen.py --url http://127.0.0.1:8123 --requests 32 --concurrency 32 --seed ${run#*:} \
        --prompt-words 441 --max-tokens 128 --temperature 0 --ignore-eos --json "$R/loadgen_${run%%:*}.json" >> "$R/serve.txt" 2>&1
    done
    timeout 200 python3 tools/warm_prefix.py --url http://127.0.0.1:8123 --words 1000,4000,15000 --repeats 5 \
      --json "$R/warm_prefix.json" >> "$R/serve.txt" 2>&1
    curl -s localhost:8123/metrics | grep -E "^(process_resident_memory_bytes|memra_process_peak_resident_bytes)" | tee -a "$R/serve.txt"
    echo "after the load: RSS $(ps -o rss= -p $pid) KiB" | tee -a "$R/serve.txt"
    kill -TERM $pid; wait $pid
    ;;
  *) echo "unknown stage $stage (bf16, q4km, serve)"; exit 2 ;;
  esac
done
