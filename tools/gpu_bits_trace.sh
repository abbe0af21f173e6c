#!/usr/bin/env bash
# Issue #38 item 3 on the real files: tools/gpu_bits_trace.py for the cases of
# tests/gpu/test_batch_invariance_gpu.py that failed on an H100 (Gemma 3 270M batched and verify
# rows, SmolLM2 verify rows across position 256). Run from the checkout root on the GPU machine;
# output to stdout and $OUT/bits_trace.txt (/tmp without OUT).
set -u
export PYTHONPATH=$PWD
log=${OUT:-/tmp}/bits_trace.txt
{
for args in "--model smollm2 verify --depth 253" \
            "--model gemma3-270m batched --depths 5,60,200,250" \
            "--model gemma3-270m batched --depths 3,17,130,255,256,300,530" \
            "--model gemma3-270m verify --depth 8" \
            "--model gemma3-270m verify --depth 253" \
            "--model gemma3-270m verify --depth 300"; do
    echo "=== $args"
    timeout 240 python tools/gpu_bits_trace.py $args 2>&1 | grep -v "^INFO" | tail -60
done
} | tee "$log"
