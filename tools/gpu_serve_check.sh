#!/usr/bin/env bash
# Device call 2: GPU pytest, kernel check, Qwen3-4B-shaped bf16 bench through runner + engine loop,
# then `memra serve` on the CUDA backend driven by tools/loadgen.py at concurrency 32.
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 MEMRA_CACHE_DIR=/tmp/mcache
t0=$(date +%s)
timeout 60 python3 -m pytest -q tests/gpu -p no:cacheprovider > "$OUT/pytest.log" 2>&1
timeout 90 python3 tools/gpu_kernels_check.py --out /tmp/kern_out --quick > "$OUT/kernels.log" 2>&1
cat /tmp/kern_out/table.txt >> "$OUT/kernels.log" 2>/dev/null; cp /tmp/kern_out/results.json "$OUT/kernels.json" 2>/dev/null
python3 tools/make_checkpoint.py --shape qwen3-4b --out /dev/shm/q4b > "$OUT/q4b.log" 2>&1
timeout 200 python3 -m engine.cli bench /dev/shm/q4b --backend cuda --concurrency 1,8,32 --json "$OUT/q4b.json" >> "$OUT/q4b.log" 2>&1
echo "bench done at $(( $(date +%s) - t0 )) s" >> "$OUT/q4b.log"
python3 -m engine.cli serve /dev/shm/q4b --backend cuda --port 8123 > "$OUT/serve.log" 2>&1 &
for i in $(seq 1 90); do curl -sf localhost:8123/health >/dev/null && break; sleep 1; done
timeout 120 python3 tools/loadgen.py --url http://127.0.0.1:8123 --requests 64 --concurrency 32 --prompt-words 150 --max-tokens 128 --json "$OUT/loadgen.json" >> "$OUT/serve.log" 2>&1
echo "total $(( $(date +%s) - t0 )) s" >> "$OUT/serve.log"
