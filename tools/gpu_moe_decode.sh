#!/usr/bin/env bash
# Issue #35's MoE decode speed on the lent GPU, for the checkout it runs in (results under $OUT/moe/):
#   STAGES="tests ckpt bench" bash tools/gpu_moe_decode.sh        (split the stages over calls if
#                                                                  one would pass the 10 minutes;
#   BATCHES=1,2,4 the decode batch sizes)
# tests: the MoE GPU tests (every kernel against numpy, the tiny model against the reference,
#        batched equal to solo, graph equal to eager)
# ckpt:  the Qwen3-30B-A3B-shaped random-block q4_k_m GGUF at $MODEL (default /dev/shm/q30.gguf),
#        written once per machine
# bench: memra bench on it, decode at BATCHES (default 1,2,4,8,16,32), depth 0 and 4096
# kernels: the batch-1 expert GEMVs alone at the Qwen3-30B-A3B shape, moe_gemv against the
#        moe_gemv_q8 block shapes (tools/bench_moe_gemv.py; not in the default stages)
# ab:    memra bench --quick at BATCHES, the default then each variant (VARIANTS: lines of
#        name=MEMRA_TUNE spec; none by default) and each plan without a post-pass named in WITHOUT,
#        ROUNDS times alternating (default 1)
# trace: tools/gpu_trace_decode.py --batch 1 over the same variants and, for each lowering post-pass
#        named in WITHOUT (space-separated, e.g. "fold_router_norm route_in_glu"), one planned
#        without it ($R/trace_*; not in the defaults)
set -u
OUT=${OUT:-/tmp/gpu_out}; R="$OUT/moe"; mkdir -p "$R"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 MEMRA_CACHE_DIR=${MEMRA_CACHE_DIR:-/dev/shm/mcache}
M=${MODEL:-/dev/shm/q30.gguf}; B=${BATCHES:-1,2,4,8,16,32}
VARIANTS=${VARIANTS:-}; WITHOUT=${WITHOUT:-}
# memra bench in this process, planned without the lowering post-pass named in argv[1] (none: "")
BENCH_PY='import sys
import engine.lowering  # (every unit and post-pass registered)
from engine.lowering.registry import POST_PASSES
skip = sys.argv.pop(1)
if skip and not any(fn.__name__ == skip for _, fn in POST_PASSES):
    sys.exit(f"no post-pass {skip!r}")
POST_PASSES[:] = [(o, fn) for o, fn in POST_PASSES if fn.__name__ != skip]
from engine.cli import main
sys.exit(main(sys.argv[1:]))'
bench() {  # NAME [extra memra bench args]; WITHOUT_PASS: a lowering post-pass the plan leaves out
  local name=$1; shift
  timeout 300 python3 -c "$BENCH_PY" "${WITHOUT_PASS:-}" bench "$M" --backend cuda --batches "$B" "$@" \
    --json "$R/bench_$name.json" > "$R/bench_$name.txt" 2>&1
  grep -E "^decode|^prefill" "$R/bench_$name.txt" | sed "s/^/$name /"
}
for stage in ${STAGES:-tests ckpt bench}; do
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
  kernels)
    timeout 300 python3 tools/bench_moe_gemv.py > "$R/kernels.txt" 2>&1
    grep -E "^\|" "$R/kernels.txt" || tail -5 "$R/kernels.txt"
    ;;
  ab)
    for r in $(seq 1 "${ROUNDS:-1}"); do
      bench "ab_default_r$r" --quick
      while IFS= read -r v; do
        [ -n "$v" ] && MEMRA_TUNE="${v#*=}" bench "ab_${v%%=*}_r$r" --quick
      done <<< "$VARIANTS"
      for p in $WITHOUT; do WITHOUT_PASS=$p bench "ab_without_${p}_r$r" --quick; done
    done
    ;;
  trace)
    args=()
    while IFS= read -r v; do [ -n "$v" ] && args+=(--variant "$v"); done <<< "$VARIANTS"
    for p in $WITHOUT; do args+=(--without "$p"); done
    timeout 400 python3 tools/gpu_trace_decode.py --model "$M" --batch 1 --out "$R/trace" ${args[@]+"${args[@]}"} \
      > "$R/trace.log" 2>&1
    tail -25 "$R/trace.log"
    ;;
  *) echo "unknown stage $stage (tests, ckpt, bench, kernels, ab, trace)"; exit 2 ;;
  esac
done
