#!/usr/bin/env bash
# Issue #36 (Gated-DeltaNet hybrids) on the lent GPU, one stage per device call (each time-boxed):
#   STAGES="tests" bash tools/gpu_hybrid.sh
#   STAGES="dense" bash tools/gpu_hybrid.sh        STAGES="moe" bash tools/gpu_hybrid.sh
#   STAGES="ttft" bash tools/gpu_hybrid.sh
# tests: the hybrid kernel and runner checks (tests/gpu/test_hybrid_*.py, the chunked delta rule and
#        its timing against the recurrent one, a warm tail's attention at depth) and moe_topk at 512 experts
# dense: memra bench on a random-block q4_k_m GGUF of the Qwen3.5-4B shape: decode b1/b8/b32 at depth
#        0 and 4096 with the bytes-read roofline (weights + KV of the attention layers + the recurrent
#        state, read and written), prefill 512 / 4096
# moe:   the same on the Qwen3.6-35B-A3B shape (256 experts, 8 routed + the shared one)
# ttft:  memra serve on the 4B shape as bf16 safetensors (its word-level tokenizer: one token per word),
#        then warm-prefix TTFT at 1k and 16k words (tools/warm_prefix.py:
#        one cold send, then the same prompt again; the repeat restores the state snapshot of its
#        deepest cached block and prefills the rest)
# Results under $OUT/hybrid/; the checkpoints stay in /dev/shm between calls on a warm machine.
set -u
OUT=${OUT:-/tmp/gpu_out}; R="$OUT/hybrid"; mkdir -p "$R"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 MEMRA_CACHE_DIR=${MEMRA_CACHE_DIR:-/dev/shm/mcache}
ck() {  # write a checkpoint once per machine (a q4_k_m GGUF for a .gguf path, else bf16 safetensors)
  case $2 in *.gguf) q="--gguf q4_k_m" ;; *) q="" ;; esac
  [ -e "$2" ] || python3 tools/make_checkpoint.py --shape "$1" $q --out "$2" >> "$R/checkpoints.log" 2>&1
}
for stage in ${STAGES:-tests}; do
  case $stage in
  tests)
    timeout 560 python3 -m pytest -q -ra tests/gpu/test_hybrid_kernels.py tests/gpu/test_hybrid_runner.py \
      tests/gpu/test_delta_chunk_gpu.py tests/gpu/test_tail_attention_gpu.py \
      "tests/gpu/test_moe_kernels.py::test_topk_matches_moe_route" -s > "$R/tests.txt" 2>&1
    tail -n 30 "$R/tests.txt"
    ;;
  dense)
    ck qwen3.5-4b /dev/shm/q35_4b.gguf
    timeout 500 python3 -m engine.cli bench /dev/shm/q35_4b.gguf --backend cuda --batches 1,8,32 \
      --json "$R/bench_4b.json" > "$R/bench_4b.txt" 2>&1
    tail -n 25 "$R/bench_4b.txt"
    ;;
  moe)
    ck qwen3.6-35b-a3b /dev/shm/q36_35b.gguf
    timeout 500 python3 -m engine.cli bench /dev/shm/q36_35b.gguf --backend cuda --batches 1,8,32 \
      --json "$R/bench_35b.json" > "$R/bench_35b.txt" 2>&1
    tail -n 25 "$R/bench_35b.txt"
    ;;
  ttft)
    ck qwen3.5-4b /dev/shm/q35_4b
    python3 -m engine.cli serve /dev/shm/q35_4b --backend cuda --port 8124 > "$R/serve.log" 2>&1 &
    pid=$!
    for i in $(seq 1 4800); do curl -sf localhost:8124/ready >/dev/null && break; sleep 0.05; done
    timeout 300 python3 tools/warm_prefix.py --url http://127.0.0.1:8124 --words 1000,16000 --repeats 3 \
      --json "$R/warm_prefix.json" > "$R/ttft.txt" 2>&1
    cat "$R/ttft.txt"
    kill -TERM $pid; wait $pid
    ;;
  *) echo "unknown stage $stage (tests, dense, moe, ttft)"; exit 2 ;;
  esac
done
