#!/usr/bin/env bash
# One device call that checks and times everything on the lent GPU, in priority order, each stage
# time-boxed so the whole call ends inside the device tool's 10-minute limit. Results under $OUT
# (at most 8 files come back): profiles.txt, runner.log, kernels.log, kernels.json, q4b.log, q4b.json, pytest.log.
#   bash tools/gpu_session.sh            (on the GPU machine, from the repo root)
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1 MEMRA_CACHE_DIR=/tmp/mcache
t0=$(date +%s)
left() { echo $(( ${BUDGET:-570} - ($(date +%s) - t0) )); }
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; python3 -m engine.cli profiles; } > "$OUT/profiles.txt" 2>&1
timeout 200 python3 tools/gpu_runner_check.py --out /tmp/runner_out > "$OUT/runner.log" 2>&1
cat /tmp/runner_out/*.txt >> "$OUT/runner.log" 2>/dev/null
echo "after runner check: $(left) s left" >> "$OUT/runner.log"
timeout $(( $(left) > 150 ? 130 : 60 )) python3 tools/gpu_kernels_check.py --out /tmp/kern_out --quick > "$OUT/kernels.log" 2>&1
cat /tmp/kern_out/table.txt >> "$OUT/kernels.log" 2>/dev/null; cp /tmp/kern_out/results.json "$OUT/kernels.json" 2>/dev/null
if [ "$(left)" -gt 150 ]; then
  { time python3 tools/make_checkpoint.py --shape qwen3-4b --out /dev/shm/q4b; } > "$OUT/q4b.log" 2>&1
  timeout $(( $(left) - 40 )) python3 -m engine.cli bench /dev/shm/q4b --backend cuda --quick --concurrency 1,8,32 --json "$OUT/q4b.json" >> "$OUT/q4b.log" 2>&1
fi
timeout $(( $(left) > 45 ? 40 : 5 )) python3 -m pytest -q tests/gpu -p no:cacheprovider > "$OUT/pytest.log" 2>&1
echo "total $(( $(date +%s) - t0 )) s" >> "$OUT/pytest.log"
