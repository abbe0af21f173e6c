#!/usr/bin/env bash
# The serving checks on the lent GPU, in two device calls (the SmolLM2 GGUF is 98 MB and one call
# carries at most 64 MiB): split it here with
#   f=~/.cache/memra/models/SmolLM2-135M-Instruct.Q4_1.gguf; head -c 52000000 $f > .carry/smol_a; tail -c +52000001 $f > .carry/smol_b
#   stage a (carry .carry/smol_a):        bash tools/gpu_serve_check.sh a   [then any other checks]
#   stage b (carry .carry/smol_b, .whl):  bash tools/gpu_serve_check.sh b
# Stage b joins the halves, then runs: greedy SmolLM2 on CUDA vs the reference (64 tokens), the
# openai/anthropic SDK smoke + load test of tests/test_serve_smollm2.py against `memra serve
# --backend cuda`, and a Qwen3-4B-shaped bf16 checkpoint through the engine loop (memra bench) and
# through HTTP (memra serve + tools/loadgen.py) on the same workload: 32 requests at once, 432-word
# prompts (~440 tokens), 128 tokens each, greedy, ignore_eos. Results under $OUT.
#   stage hostile (carry .whl):           bash tools/gpu_serve_check.sh hostile
# Stage hostile runs tools/hostile_check.py at scale against `memra serve --backend cuda` on a
# Qwen3-4B-shaped checkpoint: 1,000 oversized prompts, 1,000 half-sent connections, a 200-request
# overload burst, then 10,000 mixed requests (OpenAI chat/completions, Anthropic messages, streaming
# and not) at concurrency 64 with 20 % client disconnects; $OUT/hostile.json holds the figures (5xx,
# leaked blocks, RSS idle/after/drift, health latency, tok/s). OVERSIZED= and LOAD= shrink it.
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT" build
SHA=b179c9523d0e6a0f
if [ "${1:-}" = hostile ]; then
  t_start=$(date +%s)
  [ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 MEMRA_CACHE_DIR=${MEMRA_CACHE_DIR:-/tmp/mcache}
  ckpt=${CKPT:-/dev/shm/q4b}  # CKPT= and BACKEND=reference let the stage be dry-run on a CPU machine
  [ -f $ckpt/config.json ] || python3 tools/make_checkpoint.py --shape qwen3-4b --out $ckpt > "$OUT/hostile_ckpt.log" 2>&1
  python3 -m engine.cli serve $ckpt --backend ${BACKEND:-cuda} --port 8124 > "$OUT/hostile_serve.log" 2>&1 &
  serve_pid=$!
  for i in $(seq 1 120); do curl -sf localhost:8124/ready >/dev/null && break; sleep 1; done
  left=$(( ${HOSTILE_BUDGET:-585} - ($(date +%s) - t_start) - 15 ))  # leave time for the SIGTERM drain
  echo "hostile_check gets $left s" > "$OUT/hostile.log"
  timeout $left python3 tools/hostile_check.py --url http://127.0.0.1:8124 --pid $serve_pid \
    --oversized ${OVERSIZED:-1000} --slow 1000 --burst 200 --burst-tokens 256 --load ${LOAD:-10000} \
    --concurrency 64 --disconnect-fraction 0.2 --max-tokens 64 --max-duration $(( left - 90 )) \
    --json "$OUT/hostile.json" >> "$OUT/hostile.log" 2>&1
  echo "hostile_check exit $?" >> "$OUT/hostile.log"
  t0=$(date +%s); kill -TERM $serve_pid; wait $serve_pid
  echo "memra serve exit $? after SIGTERM, $(( $(date +%s) - t0 )) s" >> "$OUT/hostile.log"
  exit 0
fi
if [ "${1:-}" = a ]; then
  cp .carry/smol_a build/smol_a && cp .carry/smol_a /dev/shm/smol_a && echo "stage a: saved $(stat -c %s build/smol_a) bytes"
  exit 0
fi
a=build/smol_a; [ -f $a ] || a=/dev/shm/smol_a
cat $a .carry/smol_b > /dev/shm/smol.gguf
got=$(sha256sum /dev/shm/smol.gguf | cut -c1-16)
echo "smollm2 gguf sha256 $got (want $SHA)" | tee "$OUT/serve.log"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl/sdk/*.whl
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 MEMRA_CACHE_DIR=/tmp/mcache MEMRA_DEFAULT_MODEL=/dev/shm/smol.gguf
t0=$(date +%s)
timeout 120 python3 -m pytest -q -s tests/gpu/test_real_models.py -k smollm2 -p no:cacheprovider > "$OUT/smollm2.log" 2>&1
MEMRA_TEST_BACKEND=cuda timeout 200 python3 -m pytest -q -ra tests/test_serve_smollm2.py -p no:cacheprovider >> "$OUT/smollm2.log" 2>&1
echo "smollm2 stages done at $(( $(date +%s) - t0 )) s" >> "$OUT/smollm2.log"
[ -n "${SMOLLM2_ONLY:-}" ] && exit 0
python3 tools/make_checkpoint.py --shape qwen3-4b --out /dev/shm/q4b >> "$OUT/serve.log" 2>&1
timeout 150 python3 -m engine.cli bench /dev/shm/q4b --backend cuda --skip-runner --concurrency 32,32 --prompt-tokens 440 --gen-tokens 128 --json "$OUT/engine32.json" >> "$OUT/serve.log" 2>&1
python3 -m engine.cli serve /dev/shm/q4b --backend cuda --port 8123 > "$OUT/memra_serve.log" 2>&1 &
serve_pid=$!
for i in $(seq 1 90); do curl -sf localhost:8123/health >/dev/null && break; sleep 1; done
# the first closed batch captures the CUDA graphs of every bucket: a warm-up run, then the measured one
# (the engine bench's second c=32 row is its warm figure)
for run in warm measured; do
  timeout 100 python3 tools/loadgen.py --url http://127.0.0.1:8123 --requests 32 --concurrency 32 --prompt-words 432 --max-tokens 128 --temperature 0 --ignore-eos --json "$OUT/loadgen_$run.json" >> "$OUT/serve.log" 2>&1
done
timeout 100 python3 tools/loadgen.py --url http://127.0.0.1:8123 --requests 64 --concurrency 32 --prompt-words 150 --max-tokens 128 --json "$OUT/loadgen_sampled.json" >> "$OUT/serve.log" 2>&1
kill -TERM $serve_pid; wait $serve_pid  # SIGTERM: the server drains and frees the GPU
echo "total $(( $(date +%s) - t0 )) s" >> "$OUT/serve.log"
