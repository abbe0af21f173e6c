#!/usr/bin/env bash
# One device call that checks and times memra on the lent GPU, stage by stage, each time-boxed so
# the call ends inside the device tool's 10-minute limit (BUDGET seconds, default 560). Logs go to
# $RES/<stage>.log; after each stage $OUT/res.tgz is rewritten (what is under $OUT comes back even
# when the call is killed). Method and current numbers: docs/PERFORMANCE.md.
#   STAGES="checks pytest bench serve" bash tools/gpu_session.sh          (on the GPU machine)
# Stages: checks (kernel checks, tests/gpu/test_kernels.py), pytest (all of tests/gpu), bench
# (memra bench on Qwen3-4B-shaped bf16 and QUANTS GGUFs), profile (per-kernel decode breakdown),
# variants (the A/Bs of the VARIANTS file, default tools/variants.txt), trace, ncu, runner, serve
# (memra run twice + memra serve answering a chat request), targets (issue #4's table).
# TAG=_x names this run's logs <stage>_x.log. STAGES_H200 replaces STAGES when the card is an H200.
# DRYRUN=1 (no GPU): the variants are planned by tools/plan_variants.py (each must give a plan), and
# every other command is only printed.
set -u
if [ -n "${DRYRUN:-}" ]; then
  ckpt() { :; }
  nvidia-smi() { :; }
  timeout() { shift; "$@"; }
  python3() {
    if [ "${1:-}" = tools/gpu_decode_profile.py ]; then shift; "${DRY_PY:-.venv/bin/python}" tools/plan_variants.py "$@"
    else echo "[dry run] python3 $*" | cut -c1-160; fi
  }
fi
OUT=${OUT:-/tmp/gpu_out}; RES=${RES:-/tmp/res}; mkdir -p "$OUT" "$RES"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1 MEMRA_CACHE_DIR=/tmp/mcache MEMRA_DEFAULT_MODEL=${MEMRA_DEFAULT_MODEL:-/nonexistent.gguf}
t0=$(date +%s)
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - t0) )); }
pack() { echo "[$1 done at $(( $(date +%s) - t0 )) s]" >> $RES/times.log; tar czf "$OUT/res.tgz" --exclude=kcache -C $RES . 2>/dev/null; }
box() { local want=$1; local l; l=$(left); [ "$l" -lt 20 ] && echo 1 && return; [ "$want" -gt $(( l - 10 )) ] && want=$(( l - 10 )); echo "$want"; }
# the Qwen3-4B-shaped GGUF of type $1 in /dev/shm (random weights, built once per machine)
[ -n "${DRYRUN:-}" ] || ckpt() { [ -f /dev/shm/q4b_$1.gguf ] || python3 tools/make_checkpoint.py --shape qwen3-4b --gguf $1 --out /dev/shm/q4b_$1.gguf > $RES/mk_$1.log 2>&1; }
# ab NAME SECONDS TYPE --variant NAME='MEMRA_TUNE spec' ...: the profile against each variant on that
# file, b1 and b8 (BATCHES=1: b1 only) (tools/gpu_decode_profile.py: GPU time, wall, same-bits check)
ab() {
  local name=$1 secs=$2 q=$3; shift 3; ckpt "$q"
  timeout "$(box "$secs")" python3 tools/gpu_decode_profile.py --out $RES/${name}_$q --model /dev/shm/q4b_$q.gguf --batches "${BATCHES:-1,8}" "$@" > $RES/${name}_$q.log 2>&1
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; python3 -m engine.cli profiles; } > $RES/profiles.log 2>&1
gpu_name=${DRY_GPU:-$(command nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)}
STAGES=${STAGES:-checks pytest bench}
case "$gpu_name" in *H200*) [ -n "${STAGES_H200:-}" ] && STAGES=$STAGES_H200 ;; esac
echo "card: ${gpu_name:-unknown}; stages: $STAGES" >> $RES/times.log
for st in $STAGES; do
  case $st in
  checks)  # every kernel family against numpy through engine.cuda
    timeout "$(box 200)" python3 -m pytest -q -ra tests/gpu/test_kernels.py -p no:cacheprovider > $RES/checks${TAG:-}.log 2>&1; pack checks ;;
  pytest)
    timeout "$(box 300)" python3 -m pytest -q -ra -s tests/gpu -p no:cacheprovider > $RES/pytest${TAG:-}.log 2>&1; pack pytest ;;
  bench)  # memra bench on the Qwen3-4B-shaped bf16 checkpoint (CONC concurrencies) and QUANTS GGUFs
    [ -d /dev/shm/q4b ] || python3 tools/make_checkpoint.py --shape qwen3-4b --out /dev/shm/q4b > $RES/bf16${TAG:-}.log 2>&1
    timeout "$(box 200)" python3 -m engine.cli bench /dev/shm/q4b --backend cuda ${BENCH_FLAGS:-} $( [ "${CONC:-1,8,32}" = none ] || echo --concurrency "${CONC:-1,8,32}" ) --json $RES/bf16${TAG:-}.json >> $RES/bf16${TAG:-}.log 2>&1; pack bf16
    for q in ${QUANTS:-q8_0 q4_k_m}; do
      ckpt $q
      timeout "$(box 100)" python3 -m engine.cli bench /dev/shm/q4b_$q.gguf --backend cuda --quick --json $RES/$q${TAG:-}.json >> $RES/$q${TAG:-}.log 2>&1; pack $q
    done ;;
  profile)  # where a decode step's time goes (host vs GPU, per kernel) on PROFILE_SHAPES, and the
    # SmolLM2-shaped q4_1 GGUF, b1 and b8
    [ -f /dev/shm/smol_q4_1.gguf ] || python3 tools/make_checkpoint.py --shape smollm2-135m --gguf q4_1 --out /dev/shm/smol_q4_1.gguf > $RES/mk_smol.log 2>&1
    timeout "$(box 300)" python3 tools/gpu_decode_profile.py --out $RES/profile${TAG:-} --breakdown --model /dev/shm/smol_q4_1.gguf \
      --shapes "${PROFILE_SHAPES:-smollm2-135m,qwen3-0.6b,qwen3-4b}" --batches 1,8 > $RES/profile${TAG:-}.log 2>&1; pack profile ;;
  variants)  # the A/Bs of the VARIANTS file (one per line: QUANT NAME MEMRA_TUNE-SPEC), the profile
    # first, per quant on its Qwen3-4B-shaped GGUF; BREAKDOWN=1 adds the per-kernel breakdown
    declare -A vargs=()
    while read -r q name spec; do
      case "$q" in ''|'#'*) continue ;; esac
      vargs[$q]+="--variant $(printf '%q' "$name=$spec") "
    done < "${VARIANTS:-tools/variants.txt}"
    for q in "${!vargs[@]}"; do
      eval "ab variants 200 $q ${BREAKDOWN:+--breakdown} ${vargs[$q]}"
    done
    grep -h "b1  \|b8  \|rel" $RES/variants_*.log > $RES/variants.sum 2>/dev/null; pack variants ;;
  trace)  # a decode step's block timeline (tools/gpu_trace_decode.py) on the TRACE_Q file, the
    # profile and each TRACE_VARIANTS line (NAME=SPEC, one per line)
    q=${TRACE_Q:-q4_k_m}; ckpt "$q"
    args=(); while IFS= read -r v; do [ -n "$v" ] && args+=(--variant "$v"); done <<< "${TRACE_VARIANTS:-}"
    timeout "$(box 240)" python3 tools/gpu_trace_decode.py --out $RES/trace_$q --model /dev/shm/q4b_$q.gguf "${args[@]}" > $RES/trace_$q.log 2>&1
    pack trace ;;
  ncu)  # Nsight Compute on one batch-1 decode step (tools/gpu_ncu_decode.py) of each NCU_QUANTS file
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    for q in ${NCU_QUANTS:-q4_k_m q8_0}; do
      ckpt $q
      timeout "$(box 200)" "$NCU" --profile-from-start off --clock-control none --target-processes all \
        --kernel-name regex:"${NCU_KERNELS:-gemv}" --launch-count "${NCU_COUNT:-24}" \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        --section WarpStateStats --section SchedulerStats --section InstructionStats --section SourceCounters \
        --export $RES/ncu_$q --force-overwrite \
        python3 tools/gpu_ncu_decode.py --model /dev/shm/q4b_$q.gguf ${NCU_VARIANT:+--variant "$NCU_VARIANT"} > $RES/ncu_$q.run.log 2>&1
      "$NCU" --import $RES/ncu_$q.ncu-rep --page details --print-units base > $RES/ncu_$q.log 2>&1
    done; pack ncu ;;
  runner)
    timeout "$(box 150)" python3 tools/gpu_runner_check.py --out $RES/runner${TAG:-} > $RES/runner${TAG:-}.log 2>&1; pack runner ;;
  serve)  # the CLI on the GPU (device auto-detected): memra run greedy twice on a Qwen3-0.6B-shaped
    # random bf16 checkpoint (the two texts must be equal), then memra serve on it answering one
    # chat request (tools/loadgen.py) and /metrics; $RES/serve.sum says what came back.
    # tools/gpu_serve_check.sh is the full serving check (real SmolLM2, SDK tests, load)
    [ -d /dev/shm/q06 ] || python3 tools/make_checkpoint.py --shape qwen3-0.6b --out /dev/shm/q06 > $RES/serve.log 2>&1
    for i in 1 2; do
      timeout "$(box 60)" python3 -m engine.cli run /dev/shm/q06 --prompt "the first words" --max-tokens 32 --stats > $RES/serve_run$i.txt 2>> $RES/serve.log
    done
    { nvidia-smi --query-gpu=name --format=csv,noheader | head -1; grep -h "backend, ready\|decode_tok_s" $RES/serve.log | tail -4
      cmp -s $RES/serve_run1.txt $RES/serve_run2.txt && echo "memra run: greedy text equal on two runs" || echo "memra run: texts differ or missing"; } > $RES/serve.sum
    python3 -m engine.cli serve /dev/shm/q06 --port 8642 >> $RES/serve.log 2>&1 & spid=$!
    for i in $(seq 1 90); do curl -sf localhost:8642/ready >/dev/null && break; sleep 1; done
    timeout "$(box 90)" python3 tools/loadgen.py --url http://127.0.0.1:8642 --requests 1 --concurrency 1 --max-tokens 16 \
      --temperature 0 --ignore-eos >> $RES/serve.sum 2>&1
    echo "memra serve: metrics lines $(curl -sf localhost:8642/metrics | grep -c '^memra_')" >> $RES/serve.sum
    kill $spid 2>/dev/null; wait $spid 2>/dev/null; grep -h "ready in .*backend)" $RES/serve.log | tail -1 >> $RES/serve.sum; pack serve ;;
  targets)  # issue #4's targets against what this call measured (tools/targets_table.py; a figure
    # from a card other than the H200 is never "met"): the bench stage's JSON and the profile stage's b1 rows
    args=()
    for kv in qwen3-4b-q4_k_m=q4_k_m.json qwen3-4b-q8_0=q8_0.json qwen3-4b-bf16=bf16.json; do
      [ -f "$RES/${kv#*=}" ] && args+=(--result "${kv%%=*}=$RES/${kv#*=}")
    done
    if [ -f $RES/profile/decode_profile.json ]; then
      args+=(--result "qwen3-0.6b-bf16=$RES/profile/decode_profile.json#qwen3-0.6b")
      args+=(--result "smollm2-135m-q4_1=$RES/profile/decode_profile.json#smol_q4_1.gguf")
    fi
    python3 tools/targets_table.py "${args[@]}" > $RES/targets.md 2>&1; pack targets ;;
  *) echo "unknown stage $st (see the head of tools/gpu_session.sh)" | tee -a $RES/times.log ;;
  esac
done
echo "total $(( $(date +%s) - t0 )) s" >> $RES/times.log; pack end
# the stages' summaries on stdout too, so the call's own output shows the numbers
for f in $RES/*.sum; do [ -f "$f" ] && { echo "== $f"; cat "$f"; }; done; cat $RES/times.log
