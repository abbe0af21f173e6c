#!/usr/bin/env bash
# Issue #38 item 3 on the real files: tools/gpu_bits_trace.py for the cases of
# tests/gpu/test_batch_invariance_gpu.py that failed on an H100 (Gemma 3 270M batched and verify
# rows, SmolLM2 verify rows across position 256). Run from the checkout root on the GPU machine:
#   bash tools/gpu_bits_trace.sh [smollm2|gemma3]   (default: both; each case up to 400 s, the
#   first Gemma one including the kernels' compiles on a cold cache)
# Output to stdout and $OUT/bits_trace.txt (/tmp without OUT).
set -u
export PYTHONPATH=$PWD
log=${OUT:-/tmp}/bits_trace.txt
which=${1:-all}
cases=()
if [ "$which" != gemma3 ]; then
    cases+=("--model smollm2 verify --depth 253")
fi
if [ "$which" != smollm2 ]; then
    cases+=("--model gemma3-270m batched --depths 5,60,200,250"
            "--model gemma3-270m batched --depths 3,17,130,255,256,300,530"
            "--model gemma3-270m verify --depth 8"
            "--model gemma3-270m verify --depth 253"
            "--model gemma3-270m verify --depth 300")
fi
{
for args in "${cases[@]}"; do
    echo "=== $args"
    timeout 400 python tools/gpu_bits_trace.py $args 2>&1 | grep -v "^INFO" | tail -60
done
} | tee -a "$log"
