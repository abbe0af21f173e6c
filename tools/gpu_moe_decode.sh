#!/usr/bin/env bash
# Issue #35's MoE decode speed on the lent GPU, for the checkout it runs in (results under $OUT/moe/):
#   STAGES="tests ckpt bench ab" bash tools/gpu_moe_decode.sh        (split the stages over calls if
#                                                                      one would pass the 10 minutes;
#   VARIANTS="q8x grouped2" picks the A/Bs; BATCHES=1,2,4 the decode batch sizes)
# tests: the MoE GPU tests (every kernel against numpy, the tiny model against the reference,
#        batched equal to solo, graph equal to eager)
# ckpt:  the Qwen3-30B-A3B-shaped random-block q4_k_m GGUF at $MODEL (default /dev/shm/q30.gguf),
#        written once per machine
# bench: memra bench on it, decode at BATCHES (default 1,2,4,8,16,32), depth 0 and 4096
# ab:    the same bench under each MEMRA_TUNE variant of the moe tuning section, on the same card:
#        grouped2 (moe.slot_rows=0: the grouped GEMVs from 2 rows), slot16 (moe.slot_rows=16: per
#        slot up to 16 rows), unfused (moe.fused_router=false: router GEMV + moe_topk + the rmsnorm
#        launch, as before), nofold (moe.fold_norm=false: moe_router without the rmsnorm), pf1
#        (moe.glu_prefetch=1, down_prefetch=1: the per-slot kernels one raw unit per lane at a time),
#        rpw1 (moe.grouped_rows_per_warp=1: a scan of ids per 4 rows in the grouped GEMVs), q8x
#        (moe.q8x=true: the per-slot q4_k glu with int8 x and dp4a)
set -u
OUT=${OUT:-/tmp/gpu_out}; R="$OUT/moe"; mkdir -p "$R"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 MEMRA_CACHE_DIR=${MEMRA_CACHE_DIR:-/dev/shm/mcache}
M=${MODEL:-/dev/shm/q30.gguf}; B=${BATCHES:-1,2,4,8,16,32}
bench() {  # NAME [MEMRA_TUNE spec]
  MEMRA_TUNE="${2:-}" timeout 300 python3 -m engine.cli bench "$M" --backend cuda --batches "$B" \
    --json "$R/bench_$1.json" > "$R/bench_$1.txt" 2>&1
  grep -E "^decode|^prefill" "$R/bench_$1.txt" | sed "s/^/$1 /"
}
for stage in ${STAGES:-tests ckpt bench ab}; do
  case $stage in
  tests)
    timeout 420 python3 -m pytest -q tests/gpu/test_moe_kernels.py tests/gpu/test_moe_runner.py tests/gpu/test_moe_gemm.py \
      > "$R/pytest.txt" 2>&1
    tail -3 "$R/pytest.txt"
    ;;
  ckpt)
    [ -e "$M" ] || python3 tools/make_checkpoint.py --shape qwen3-30b-a3b --gguf q4_k_m --out "$M" > "$R/ckpt.log" 2>&1
    ls -l "$M"
    ;;
  bench) bench default ;;
  ab)
    for v in ${VARIANTS:-q8x grouped2 slot16 unfused nofold pf1 rpw1}; do
      case $v in
      grouped2) bench grouped2 "moe.slot_rows=0" ;;
      slot16) bench slot16 "moe.slot_rows=16" ;;
      unfused) bench unfused "moe.fused_router=false" ;;
      nofold) bench nofold "moe.fold_norm=false" ;;
      pf1) bench pf1 "moe.glu_prefetch=1; moe.down_prefetch=1" ;;
      rpw1) bench rpw1 "moe.grouped_rows_per_warp=1" ;;
      q8x) bench q8x "moe.q8x=true" ;;
      *) echo "unknown variant $v" ;;
      esac
    done
    ;;
  *) echo "unknown stage $stage (tests, ckpt, bench, ab)"; exit 2 ;;
  esac
done
