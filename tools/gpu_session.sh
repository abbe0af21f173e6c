#!/usr/bin/env bash
# One device call that checks and times everything on the lent GPU, in priority order, each stage
# time-boxed so the call ends inside the device tool's 10-minute limit. Every stage's log goes to
# $RES/<stage>.log; after each stage $OUT/res.tgz is rewritten (the tool returns at most 8
# files, and what is under $OUT comes back even when the call is killed).
#   STAGES="checks pytest bf16 quant runner" bash tools/gpu_session.sh     (on the GPU machine)
# TAG=_x names this run's logs <stage>_x.log (an A/B in one call: MEMRA_TUNE=... TAG=_tuned ...).
# DRYRUN=1 (the development machine, no GPU): every A/B variant of the named stages is checked by
# tools/plan_variants.py (it must give a plan; the logs under $RES say how many batch-1 kernels
# it changes), and every other command is only printed.
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
# file, b1 and b8 (BATCHES=1: b1 only) (tools/gpu_decode_profile.py: GPU time, wall, same-bits check), in $RES/NAME_TYPE*
ab() {
  local name=$1 secs=$2 q=$3; shift 3; ckpt "$q"
  timeout "$(box "$secs")" python3 tools/gpu_decode_profile.py --out $RES/${name}_$q --model /dev/shm/q4b_$q.gguf --batches "${BATCHES:-1,8}" "$@" > $RES/${name}_$q.log 2>&1
}
C=gemv_coop  # the tuning section the A/B stages vary
# the h200 profile's gemv_coop.q8x_type_tuning entries at the twelfth session's start, for the A/Bs
# that replace the whole map (MEMRA_TUNE sets a knob's whole value): q8_0, q4_k, q6_k, then q4_0 / q4_1
T8="q8x_threads: 512, q8x_b1_rows_per_warp: 1, q8x_ksplit_threads: 640"
T4="q8x_threads: 320, q8x_ksplit_threads: 640, q8x_rows_per_warp: 1, q8x_b1_rows_per_warp: 1, q8x_lanes_per_row: 8, q8x_ksplit: 4"
T6="q8x_lanes_per_row: 16, q8x_rows_per_warp: 1, q8x_ksplit: 2, q8x_ksplit_threads: 640"
TR="q4_0: {q8x_ksplit_threads: 640, q8x_ksplit_min_n: 2048}, q4_1: {q8x_ksplit_threads: 640, q8x_ksplit_min_n: 2048}"
CHUNK4="q8x_wsm_chunks: 5, q8x_wsm_chunk_min_k: 8192"  # the q4_k down in five k chunks (profile since)
# TT [Q4 [Q6 [Q8]]]: that whole map as the twentieth session's start had it (the profile before its
# batch-1 unroll), each type's entry extended by the ", knob: value" text given for it
TT() { echo "$C.q8x_type_tuning={q8_0: {$T8, q8x_stage_rounds: 2, q8x_stage_rounds_min_k: 8192${3:-}}, q4_k: {$T4, $CHUNK4${1:-}}, q6_k: {$T6, q8x_wsm_kb: 100${2:-}}, $TR}"; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; python3 -m engine.cli profiles; } > $RES/profiles.log 2>&1
# STAGES_H200="...": the stages to run instead of STAGES when the lent card is an H200 (the issue's
# targets are H200 numbers; the device tool may lend an H100 for the same call). DRY_GPU names the
# card in a dry run.
gpu_name=${DRY_GPU:-$(command nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)}
STAGES=${STAGES:-checks pytest bf16 quant runner}
case "$gpu_name" in *H200*) [ -n "${STAGES_H200:-}" ] && STAGES=$STAGES_H200 ;; esac
echo "card: ${gpu_name:-unknown}; stages: $STAGES" >> $RES/times.log
for st in $STAGES; do
  case $st in
  checks)
    for c in gemm attention gemv; do
      [ -f tools/gpu_check_$c.py ] && timeout "$(box 100)" python3 tools/gpu_check_$c.py --out $RES/$c > $RES/check_$c.log 2>&1
      pack check_$c
    done
    timeout "$(box 90)" python3 tools/gpu_kernels_check.py --out $RES/kern --quick > $RES/kernels.log 2>&1; pack kernels ;;
  wgmma)  # the Hopper prefill GEMM: correctness (every tile config, tails, arena-spanning maps) + TFLOP/s
    timeout "$(box 150)" python3 tools/gpu_check_gemm_wgmma.py --out $RES/wgmma ${WGMMA_ARGS:-} > $RES/check_wgmma.log 2>&1; pack wgmma ;;
  pytest)
    timeout "$(box 150)" python3 -m pytest -q -ra -s tests/gpu -p no:cacheprovider > $RES/pytest${TAG:-}.log 2>&1; pack pytest ;;
  bf16)
    [ -d /dev/shm/q4b ] || python3 tools/make_checkpoint.py --shape qwen3-4b --out /dev/shm/q4b > $RES/bf16${TAG:-}.log 2>&1
    timeout "$(box 200)" python3 -m engine.cli bench /dev/shm/q4b --backend cuda ${BENCH_FLAGS:-} $( [ "${CONC:-1,8,32}" = none ] || echo --concurrency "${CONC:-1,8,32}" ) --json $RES/bf16${TAG:-}.json >> $RES/bf16${TAG:-}.log 2>&1; pack bf16 ;;
  quant)
    for q in ${QUANTS:-q8_0 q4_k_m}; do
      ckpt $q
      timeout "$(box 100)" python3 -m engine.cli bench /dev/shm/q4b_$q.gguf --backend cuda --quick --json $RES/$q${TAG:-}.json >> $RES/$q${TAG:-}.log 2>&1; pack $q
    done ;;
  gemvok)  # the decode GEMV correctness checks only (every code path of TYPES, no timing)
    timeout "$(box 120)" python3 tools/gpu_check_gemv.py --out $RES/gemvok --types ${OK_TYPES:-bf16,q4_k,q8_0r,q6_kr,q4_1} --sections none > $RES/check_gemvok.log 2>&1; pack gemvok ;;
  coop)  # the decode GEMV layouts side by side (classic vs warp-cooperative), correctness + GB/s
    # (GEMV_ARGS="--variants REGEX --rows 1" narrows the table)
    timeout "$(box 260)" python3 tools/gpu_check_gemv.py --out $RES/coop --types ${COOP_TYPES:-q4_k,q6_kr,q8_0r,q6_k} --sections bandwidth --budget 400 ${GEMV_ARGS:-} > $RES/check_coop.log 2>&1; pack coop ;;
  pdloff)  # the runner benchmark with programmatic dependent launch off (the A/B of the runner stage)
    MEMRA_PDL=0 timeout "$(box 120)" python3 tools/gpu_runner_check.py --out $RES/runner_nopdl --models qwen3-0.6b,smollm2-135m > $RES/runner_nopdl.log 2>&1; pack pdloff ;;
  profile)  # where a decode step's time goes (host vs GPU, per kernel) on PROFILE_SHAPES; for tuning
    # A/Bs run tools/gpu_decode_profile.py --variant NAME='spec' directly (specs contain spaces)
    timeout "$(box 300)" python3 tools/gpu_decode_profile.py --out $RES/profile${TAG:-} --breakdown --shapes "${PROFILE_SHAPES:-smollm2-135m,qwen3-0.6b,qwen3-4b}" > $RES/profile${TAG:-}.log 2>&1; pack profile ;;
  kparts)  # the q8x k split over blocks (gemv_coop.q8x_kparts): its GPU test, then the A/B on the
    # Qwen3-4B q8_0 / q4_k_m files (QUANTS), b1 and b8, P = 2 / 4 / 8 on the long-k GEMVs
    timeout "$(box 60)" python3 -m pytest -q -s tests/gpu/test_quant_models.py -k "q8x_kparts or coop_q8x" -p no:cacheprovider > $RES/kparts_test.log 2>&1
    for q in ${QUANTS:-q8_0 q4_k_m}; do
      ab kparts 90 $q --variant kp2="$C.q8x_kparts=2; $C.q8x_kparts_min_k=8192" --variant kp4="$C.q8x_kparts=4; $C.q8x_kparts_min_k=8192" \
        --variant kp8="$C.q8x_kparts=8; $C.q8x_kparts_min_k=8192"
    done; pack kparts ;;
  tilepf)  # the next row tile's loads in a tile's last step (gemv_coop.tile_prefetch): its GPU test
    # (the same bits), then the A/B with unroll 4 and the k split over blocks for q4_k / q6_k
    timeout "$(box 90)" python3 -m pytest -q -s tests/gpu/test_quant_models.py -k "tile_prefetch" -p no:cacheprovider > $RES/tilepf_test.log 2>&1
    KP="$C.q8x_kparts=2; $C.q8x_kparts_min_k=8192; $C.q8x_kparts_types=[q4_k, q6_k]"
    for q in ${QUANTS:-q8_0 q4_k_m}; do
      ab tilepf 150 $q --variant tp="$C.tile_prefetch=true" --variant u4="$C.unroll=4" --variant tpu4="$C.tile_prefetch=true; $C.unroll=4" \
        --variant kp2="$KP" --variant tpkp2="$C.tile_prefetch=true; $KP"
    done; pack tilepf ;;
  resgrid)  # capped q8x grids fitted to the resident blocks (gemv_coop.q8x_resident_grid), with the
    # profile before tile_prefetch / the q4_k k split as "prev"
    for q in ${QUANTS:-q8_0 q4_k_m}; do
      ab resgrid 120 $q --variant rg="$C.q8x_resident_grid=true" --variant rg8="$C.q8x_resident_grid=true; $C.q8x_blocks_per_sm=8" \
        --variant prev="$C.tile_prefetch=false; $C.q8x_kparts=1"
    done; pack resgrid ;;
  minb)  # q8x registers capped for more resident blocks (gemv_coop.q8x_min_blocks)
    for q in ${QUANTS:-q8_0 q4_k_m}; do
      ab minb 100 $q --variant mb3="$C.q8x_min_blocks=3" --variant mb4="$C.q8x_min_blocks=4" --variant norg="$C.q8x_resident_grid=false"
    done; pack minb ;;
  down)  # the n = 2560 q8x GEMVs (o, down) on the resident grid: tile shapes and k splits
    ab down 150 q8_0 --variant kp2="$C.q8x_kparts_types=[]" --variant ks4="$C.q8x_ksplit=4" --variant rpw1="$C.q8x_rows_per_warp=1" \
      --variant t512="$C.q8x_threads=512" --variant bps2="$C.q8x_blocks_per_sm=2" --variant ks6144="$C.q8x_ksplit_max_n=6144"
    ab down 150 q4_k_m --variant ksall="$C.q8x_ksplit_types=[]" --variant rpw1="$C.q8x_rows_per_warp=1" --variant t512="$C.q8x_threads=512"
    pack down ;;
  shapes)  # q8_0 tile shapes: the batch-1 GEMVs without the k split at 1 row per warp (53 registers:
    # 2 blocks of 512 threads per SM), the n = 2560 k-split GEMVs in 640-thread blocks (20-row tiles:
    # 128 blocks, one wave on 132 SMs), with the per-kernel breakdown; q4_k_m: the breakdown, and the
    # q4_k o / down GEMVs k-split in 640-thread blocks
    T="$C.q8x_type_tuning={q8_0: {q8x_threads: 512"
    ab shapes 280 q8_0 --breakdown --variant b1r1="$T, q8x_b1_rows_per_warp: 1}}" --variant kst640="$T, q8x_ksplit_threads: 640}}" \
      --variant both="$T, q8x_b1_rows_per_warp: 1, q8x_ksplit_threads: 640}}"
    ab shapes 150 q4_k_m --breakdown --variant q4ks640="$C.q8x_ksplit_types=[q8_0, q4_k]; $T}, q4_k: {q8x_ksplit_threads: 640}}"
    pack shapes ;;
  q4b1)  # q4_k_m: the batch-1 q4_k / q6_k GEMVs without the k split at 1 row per warp (fewer
    # registers, more resident blocks), on the eighth session's profile
    T="$C.q8x_type_tuning={q8_0: {q8x_threads: 512, q8x_b1_rows_per_warp: 1, q8x_ksplit_threads: 640}"
    ab q4b1 130 q4_k_m --variant q4r1="$T, q4_k: {q8x_ksplit_threads: 640, q8x_b1_rows_per_warp: 1}}" \
      --variant q6r1="$T, q4_k: {q8x_ksplit_threads: 640}, q6_k: {q8x_b1_rows_per_warp: 1}}" \
      --variant q46r1="$T, q4_k: {q8x_ksplit_threads: 640, q8x_b1_rows_per_warp: 1}, q6_k: {q8x_b1_rows_per_warp: 1}}"
    pack q4b1 ;;
  small)  # the Qwen3-0.6B-shaped bf16 decode step at batch 1: classic GEMV block shapes, the direct
    # attention kernel's warps, the rmsnorm block, the warp-cooperative bf16 GEMV; per-kernel breakdown
    timeout "$(box 200)" python3 tools/gpu_decode_profile.py --out $RES/small --shapes qwen3-0.6b --batches 1 --breakdown \
      --variant u4="gemv.unroll=4" --variant t128="gemv.threads=128" --variant t512="gemv.threads=512" \
      --variant t512r8="gemv.threads=512; gemv.rows_per_block=8" --variant dw4="attention_decode.direct_warps=4" \
      --variant nt128="norm.threads=128" --variant coopbf="$C.types=[q8_0, q4_k, q6_k, q4_0, q4_1, bf16]" > $RES/small.log 2>&1
    pack small ;;
  shortn)  # the small bf16 shapes at batch 1: gemv.unroll 4, and the GEMVs with n <= 1024 (o, down of
    # Qwen3-0.6B; qkv, o, down of SmolLM2) in 512- or 1024-thread blocks (gemv.b1_short_n_threads)
    S="gemv.short_n_max=1024; gemv.b1_short_n_threads"
    timeout "$(box 200)" python3 tools/gpu_decode_profile.py --out $RES/shortn --shapes qwen3-0.6b,smollm2-135m --batches 1,8 \
      --variant u4="gemv.unroll=4" --variant s512="$S=512" --variant u4s512="gemv.unroll=4; $S=512" \
      --variant u4s1024="gemv.unroll=4; $S=1024" > $RES/shortn.log 2>&1
    pack shortn ;;
  q6ks)  # q4_k_m: the q6_k weights with n <= 2560 (v, down) k-split too, in 640- / 512-thread blocks
    T="$C.q8x_ksplit_types=[q8_0, q4_k, q6_k]; $C.q8x_type_tuning={q8_0: {q8x_threads: 512, q8x_b1_rows_per_warp: 1, q8x_ksplit_threads: 640}, q4_k: {q8x_ksplit_threads: 640}"
    ab q6ks 150 q4_k_m --breakdown --variant q6ks640="$T, q6_k: {q8x_ksplit_threads: 640}}" --variant q6ks512="$T, q6_k: {q8x_ksplit_threads: 512}}"
    pack q6ks ;;
  q4kregs)  # q4_k q8x kernels capped at 80 registers (3 blocks per SM instead of 2 with tile_pf; no
    # spills at b1, 96 bytes at b8), the other types not (q6_kr spills): measured 2026-12-04, no gain at b1
    # (q6_kr: 154 registers with tile_pf, 1 block per SM; min blocks 2 gives 128 with 20 bytes of spills)
    ab q4kregs 100 q4_k_m --variant q4mb3="$C.q8x_type_tuning={q8_0: {q8x_threads: 512}, q4_k: {q8x_min_blocks: 3}}" \
      --variant q6mb2="$C.q8x_type_tuning={q8_0: {q8x_threads: 512}, q6_k: {q8x_min_blocks: 2}}" \
      --variant both="$C.q8x_type_tuning={q8_0: {q8x_threads: 512}, q4_k: {q8x_min_blocks: 3}, q6_k: {q8x_min_blocks: 2}}"
    pack q4kregs ;;
  ncu)  # Nsight Compute on one batch-1 decode step (tools/gpu_ncu_decode.py) of each NCU_QUANTS file:
    # the first NCU_COUNT GEMV launches (layers 0..), speed of light, memory, occupancy, warp stalls,
    # instruction mix, SASS hot spots; reports as text in $RES/ncu_<type>.log (+ .ncu-rep)
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
      pack ncu_$q
    done ;;
  lanes)  # q8x lanes per row (gemv_coop.q8x_lanes_per_row): its GPU test (against the reference),
    # then the q4_k_m A/B with the per-kernel breakdown: q4_k at 8 / 16 lanes per row (1 or 2 rows
    # per lane group, k split 4 / 2 in 640-thread blocks), q6_k at 8 / 16 lanes (the profile since:
    # q4_k at 8, q6_k at 16), q6_k in 128-thread blocks or k-split
    timeout "$(box 120)" python3 -m pytest -q -s tests/gpu/test_quant_models.py -k "lanes" -p no:cacheprovider > $RES/lanes_test.log 2>&1
    pack lanes_test
    Q4="q4_k: {q8x_ksplit_threads: 640, q8x_rows_per_warp: 1, q8x_b1_rows_per_warp: 1"
    L8="$Q4, q8x_lanes_per_row: 8, q8x_ksplit: 4}"
    Q6="q6_k: {q8x_lanes_per_row: 8, q8x_rows_per_warp: 1"
    ab lanes 500 q4_k_m --breakdown --variant l8="$C.q8x_type_tuning={$L8}" \
      --variant l8r2="$C.q8x_type_tuning={$Q4, q8x_lanes_per_row: 8, q8x_ksplit: 4, q8x_b1_rows_per_warp: 2}}" \
      --variant l16="$C.q8x_type_tuning={$Q4, q8x_lanes_per_row: 16, q8x_ksplit: 2}}" \
      --variant l8q6="$C.q8x_type_tuning={$L8, $Q6}}" --variant q6t128="$C.q8x_type_tuning={$L8, $Q6, q8x_threads: 128}}" \
      --variant q6ks="$C.q8x_ksplit_types=[q8_0, q4_k, q4_0, q4_1, q6_k]; $C.q8x_type_tuning={$L8, $Q6, q8x_ksplit: 4, q8x_ksplit_threads: 640}}" \
      --variant q6l16="$C.q8x_type_tuning={$L8, q6_k: {q8x_lanes_per_row: 16, q8x_rows_per_warp: 1}}"
    pack lanes ;;
  lanesq8)  # q8_0 at 16 / 8 lanes per row (the n = 2560 k-split GEMVs in 20-row tiles)
    Q8="q8_0: {q8x_threads: 512, q8x_b1_rows_per_warp: 1, q8x_ksplit_threads: 640, q8x_rows_per_warp: 1"
    ab lanesq8 200 q8_0 --variant l16="$C.q8x_type_tuning={$Q8, q8x_lanes_per_row: 16, q8x_ksplit: 2}}" \
      --variant l8="$C.q8x_type_tuning={$Q8, q8x_lanes_per_row: 8, q8x_ksplit: 4}}"
    pack lanesq8 ;;
  smolq41)  # the SmolLM2-shaped q4_1 GGUF (q4_1r GEMVs): memra bench --quick
    [ -f /dev/shm/smol_q4_1.gguf ] || python3 tools/make_checkpoint.py --shape smollm2-135m --gguf q4_1 --out /dev/shm/smol_q4_1.gguf > $RES/mk_smol.log 2>&1
    timeout "$(box 90)" python3 -m engine.cli bench /dev/shm/smol_q4_1.gguf --backend cuda --quick --json $RES/smol_q4_1${TAG:-}.json > $RES/smol_q4_1${TAG:-}.log 2>&1
    pack smolq41 ;;
  norm1)  # the batch-1 norm prologue from the staging loads (one staging round: stage_rounds 2 for
    # 256-thread blocks), q4_k in 512-thread blocks, the q4_k q|k / v GEMVs k-split, q6_k in 128-thread blocks
    T="$C.q8x_type_tuning={q8_0: {q8x_threads: 512, q8x_b1_rows_per_warp: 1, q8x_ksplit_threads: 640}, q4_k: {q8x_ksplit_threads: 640, q8x_rows_per_warp: 1, q8x_b1_rows_per_warp: 1, q8x_lanes_per_row: 8, q8x_ksplit: 4"
    Q6="q6_k: {q8x_lanes_per_row: 16, q8x_rows_per_warp: 1"
    ab norm1 300 q4_k_m --breakdown --variant sr2="$C.q8x_stage_rounds=2" \
      --variant t512="$T, q8x_threads: 512}, $Q6}}" --variant ks5120="$C.q8x_ksplit_max_n=5120" \
      --variant t512ks="$T, q8x_threads: 512}, $Q6}}; $C.q8x_ksplit_max_n=5120" \
      --variant q6t128="$T}, $Q6, q8x_threads: 128}}"
    pack norm1 ;;
  wsm)  # the q8x row tile bulk-copied into shared memory (gemv_coop.q8x_wsm_kb): its GPU tests, then the
    # A/B on the q4_k_m file (the q6_k down projection with its k split over blocks and without wsm,
    # or without the split and with wsm in 256- / 640-thread blocks) and on the q8_0 one, then the
    # kernel checks (every wsm case against the numpy twin)
    timeout "$(box 120)" python3 -m pytest -q -s tests/gpu/test_quant_models.py -k "wsm or forked" -p no:cacheprovider > $RES/wsm_test.log 2>&1
    pack wsm_test
    Q4="q4_k: {q8x_ksplit_threads: 640, q8x_rows_per_warp: 1, q8x_b1_rows_per_warp: 1, q8x_lanes_per_row: 8, q8x_ksplit: 4}"
    W="$C.q8x_wsm_kb=200"
    ab wsm 260 q4_k_m --breakdown --variant wsm="$W" --variant wsm6="$W; $C.q8x_kparts=1" \
      --variant wsm6ks="$W; $C.q8x_kparts=1; $C.q8x_ksplit_types=[q8_0, q4_k, q4_0, q4_1, q6_k]; $C.q8x_type_tuning={$Q4, q6_k: {q8x_lanes_per_row: 8, q8x_rows_per_warp: 1, q8x_ksplit: 4, q8x_ksplit_threads: 640}}"
    pack wsm_q4
    ab wsm 100 q8_0 --variant wsm="$W"
    pack wsm_q8
    timeout "$(box 150)" python3 tools/gpu_check_gemv.py --out $RES/wsmok --types q4_k,q8_0r,q6_kr,q4_1r --sections none > $RES/check_wsm.log 2>&1
    pack wsmok ;;
  wsm2)  # batch-1 wsm where every tile fits one round of resident blocks (not gate|up, not the
    # lm_head), then with the q6_k down projection k-split in 640-thread blocks instead of over two
    # blocks (16 lanes x 2 or 8 lanes x 4 per row), on q4_k_m with the breakdown; then q8_0
    Q4="q4_k: {q8x_ksplit_threads: 640, q8x_rows_per_warp: 1, q8x_b1_rows_per_warp: 1, q8x_lanes_per_row: 8, q8x_ksplit: 4}"
    W="$C.q8x_wsm_kb=200"; KS="$C.q8x_kparts=1; $C.q8x_ksplit_types=[q8_0, q4_k, q4_0, q4_1, q6_k]"
    ab wsm2 300 q4_k_m --breakdown --variant wsm1="$W" \
      --variant wsm1q6="$W; $KS; $C.q8x_type_tuning={$Q4, q6_k: {q8x_lanes_per_row: 16, q8x_rows_per_warp: 1, q8x_ksplit: 2, q8x_ksplit_threads: 640}}" \
      --variant wsm1q6l8="$W; $KS; $C.q8x_type_tuning={$Q4, q6_k: {q8x_lanes_per_row: 8, q8x_rows_per_warp: 1, q8x_ksplit: 4, q8x_ksplit_threads: 640}}"
    pack wsm2_q4
    ab wsm2 100 q8_0 --variant wsm1="$W"
    pack wsm2_q8 ;;
  trig)  # decode_graph.early_trigger (the batch-1 coop GEMVs call pdl_trigger() after their first
    # loads) on the q4_k_m and q8_0 files and the SmolLM2-shaped q4_1 one, with wsm off for reference
    ab trig 110 q4_k_m --variant trig="decode_graph.early_trigger=true" --variant nowsm="$C.q8x_wsm_kb=0"
    pack trig_q4
    ab trig 80 q8_0 --variant trig="decode_graph.early_trigger=true"
    pack trig_q8
    [ -f /dev/shm/smol_q4_1.gguf ] || python3 tools/make_checkpoint.py --shape smollm2-135m --gguf q4_1 --out /dev/shm/smol_q4_1.gguf > $RES/mk_smol.log 2>&1
    timeout "$(box 90)" python3 tools/gpu_decode_profile.py --out $RES/trig_smol --model /dev/shm/smol_q4_1.gguf --batches 1,8 \
      --variant trig="decode_graph.early_trigger=true" --variant nowsm="$C.q8x_wsm_kb=0" > $RES/trig_smol.log 2>&1
    pack trig_smol ;;
  t320)  # q4_k GEMVs without the k split (q|k, gate|up) in 320-thread blocks: 40-row tiles, one
    # staging round of x at k = 2560 (the norm from the staging loads), q|k in 128 blocks
    T="$C.q8x_type_tuning={q8_0: {q8x_threads: 512, q8x_b1_rows_per_warp: 1, q8x_ksplit_threads: 640}, q6_k: {q8x_lanes_per_row: 16, q8x_rows_per_warp: 1, q8x_ksplit: 2, q8x_ksplit_threads: 640}"
    Q4="q8x_ksplit_threads: 640, q8x_rows_per_warp: 1, q8x_b1_rows_per_warp: 1, q8x_lanes_per_row: 8, q8x_ksplit: 4}}"
    ab t320 150 q4_k_m ${T320_BREAKDOWN---breakdown} --variant t320="$T, q4_k: {q8x_threads: 320, $Q4" \
      ${T320_MORE:+--variant t384="$T, q4_k: {q8x_threads: 384, $Q4" --variant t448="$T, q4_k: {q8x_threads: 448, $Q4"}
    grep -h "b1  \|b8  " $RES/t320_*.log > $RES/t320.sum
    pack t320 ;;
  attn)  # the short-context decode attention kernel on the q4_k_m file: warps and query-head split
    ab attn 200 q4_k_m --breakdown --variant dw4="attention_decode.direct_warps=4" --variant dw16="attention_decode.direct_warps=16" \
      --variant qs2="attention_decode.direct_qsplit=2" --variant qs1="attention_decode.direct_qsplit=1"
    pack attn ;;
  fork)  # decode_graph.fork_linears (a q4_k_m layer's v GEMV on a second stream beside q|k): its GPU
    # test (the same bits, graphs and eager), then the A/B on the q4_k_m file with the breakdown
    timeout "$(box 120)" python3 -m pytest -q -s tests/gpu/test_quant_models.py -k "forked" -p no:cacheprovider > $RES/fork_test.log 2>&1
    pack fork_test
    ab fork 200 q4_k_m --breakdown --variant fork="decode_graph.fork_linears=true" --variant nofork="decode_graph.fork_linears=false"
    pack fork ;;
  trace)  # a decode step's block timeline (tools/gpu_trace_decode.py) on the q4_k_m file (TRACE_Q),
    # the profile and each TRACE_VARIANTS line (NAME=SPEC, one per line)
    q=${TRACE_Q:-q4_k_m}; ckpt "$q"
    args=(); while IFS= read -r v; do [ -n "$v" ] && args+=(--variant "$v"); done <<< "${TRACE_VARIANTS:-}"
    timeout "$(box 240)" python3 tools/gpu_trace_decode.py --out $RES/trace_$q --model /dev/shm/q4b_$q.gguf "${args[@]}" > $RES/trace_$q.log 2>&1
    pack trace ;;
  q6fix)  # the q6_kr scale bytes by selects (no local-memory stack frame): q6_kr / q6_k GEMV
    # correctness, the quantised-model GPU tests, the q4_k_m decode step (GPU time) and its trace
    timeout "$(box 100)" python3 tools/gpu_check_gemv.py --out $RES/q6ok --types q6_kr,q6_k --sections none > $RES/q6ok.log 2>&1; pack q6ok
    timeout "$(box 150)" python3 -m pytest -q -ra -s tests/gpu/test_quant_models.py -p no:cacheprovider > $RES/q6_pytest.log 2>&1; pack q6_pytest
    ab q6fix 100 q4_k_m
    grep -h "b1  \|b8  " $RES/q6fix_*.log > $RES/q6fix.sum; pack q6fix
    timeout "$(box 120)" python3 tools/gpu_trace_decode.py --out $RES/trace_q6fix --model /dev/shm/q4b_q4_k_m.gguf > $RES/trace_q6fix.log 2>&1
    pack q6fix_trace ;;
  wsmc)  # wsm row tiles copied in k chunks, one mbarrier each (gemv_coop.q8x_wsm_chunks): the wsm
    # GEMV checks (chunked and whole), the wsm quantised-model GPU tests, then the q4_k_m / q8_0 A/B
    timeout "$(box 100)" python3 tools/gpu_check_gemv.py --out $RES/wsmc_ok --types q4_k,q6_kr,q8_0r,q4_1r --sections none --checks "'wsm'" > $RES/wsmc_ok.log 2>&1
    timeout "$(box 120)" python3 -m pytest -q -ra -p no:cacheprovider tests/gpu/test_quant_models.py -k wsm > $RES/wsmc_pytest.log 2>&1
    { grep -h 'correctness:' $RES/wsmc_ok/gpu_check_gemv.txt; tail -2 $RES/wsmc_pytest.log; } > $RES/wsmc.sum; pack wsmc_ok
    ab wsmc ${WSMC_SECS:-170} q4_k_m ${WSMC_VARIANTS:---variant c4="$C.q8x_wsm_chunks=4" --variant c8="$C.q8x_wsm_chunks=8" --variant c16="$C.q8x_wsm_chunks=16"}
    grep -h "b1  \|b8  " $RES/wsmc_q4_k_m.log >> $RES/wsmc.sum; pack wsmc_q4
    ab wsmc 100 q8_0 --variant c8="$C.q8x_wsm_chunks=8" --variant c16="$C.q8x_wsm_chunks=16"
    grep -h "b1  \|b8  " $RES/wsmc_q8_0.log >> $RES/wsmc.sum; pack wsmc ;;
  wsmc2)  # k chunks on the down projections only (k >= 8192: 20-row tiles, 40-140 copies), per type
    ab wsmc2 200 q4_k_m \
      --variant dq4c2="$C.q8x_type_tuning={q8_0: {$T8}, q4_k: {$T4, q8x_wsm_chunks: 2, q8x_wsm_chunk_min_k: 8192}, q6_k: {$T6}, $TR}" \
      --variant dq4c5="$C.q8x_type_tuning={q8_0: {$T8}, q4_k: {$T4, $CHUNK4}, q6_k: {$T6}, $TR}" \
      --variant dq6c2="$C.q8x_type_tuning={q8_0: {$T8}, q4_k: {$T4}, q6_k: {$T6, q8x_wsm_chunks: 2, q8x_wsm_chunk_min_k: 8192}, $TR}" \
      --variant both2="$C.q8x_wsm_chunks=2; $C.q8x_wsm_chunk_min_k=8192"
    grep -h "b1  \|b8  " $RES/wsmc2_q4_k_m.log > $RES/wsmc2.sum; pack wsmc2 ;;
  rounds)  # the down projections' two x staging rounds in flight at once (q8x_stage_rounds 2: the
    # only q8x GEMVs whose x takes two rounds of their threads), alone and with q4_k down chunks
    DQ4C5="$C.q8x_type_tuning={q8_0: {$T8}, q4_k: {$T4, $CHUNK4}, q6_k: {$T6}, $TR}"
    ab rounds 200 q4_k_m --variant r2="$C.q8x_stage_rounds=2" --variant dq4c5="$DQ4C5" --variant r2c5="$C.q8x_stage_rounds=2; $DQ4C5" --breakdown
    grep -h "b1  \|b8  " $RES/rounds_q4_k_m.log > $RES/rounds.sum; pack rounds_q4
    ab rounds 100 q8_0 --variant r2="$C.q8x_stage_rounds=2"
    grep -h "b1  \|b8  " $RES/rounds_q8_0.log >> $RES/rounds.sum; pack rounds ;;
  staging)  # the x staging after pdl_wait: the norm weights loaded before it (q8x_early_norm_w), and
    # both staging rounds of the down projections in flight (per type, k >= 8192: not the lm_head)
    R2="q8x_stage_rounds: 2, q8x_stage_rounds_min_k: 8192"
    R2D="$C.q8x_type_tuning={q8_0: {$T8, $R2}, q4_k: {$T4, $CHUNK4, $R2}, q6_k: {$T6, $R2}, $TR}"
    ab staging 200 q4_k_m --variant enw="$C.q8x_early_norm_w=true" --variant r2d="$R2D" --variant both="$C.q8x_early_norm_w=true; $R2D"
    grep -h "b1  \|b8  " $RES/staging_q4_k_m.log > $RES/staging.sum; pack staging_q4
    ab staging 150 q8_0 --variant enw="$C.q8x_early_norm_w=true" --variant r2d="$R2D" --variant both="$C.q8x_early_norm_w=true; $R2D"
    grep -h "b1  \|b8  " $RES/staging_q8_0.log >> $RES/staging.sum; pack staging ;;
  eres)  # the k-split GEMVs reading their residual right after pdl_wait (q8x_early_residual): GEMV
    # checks of it, then the q4_k_m / q8_0 A/B
    timeout "$(box 80)" python3 tools/gpu_check_gemv.py --out $RES/eres_ok --types q4_k,q6_kr,q8_0r,q4_1r --sections none --checks "early_res" > $RES/eres_ok.log 2>&1
    grep -h 'correctness:' $RES/eres_ok/gpu_check_gemv.txt > $RES/eres.sum; pack eres_ok
    for q in q4_k_m q8_0; do
      ab eres 100 $q --variant ers="$C.q8x_early_residual=true"
      grep -h "b1  \|b8  " $RES/eres_$q.log >> $RES/eres.sum; pack eres_$q
    done ;;
  glu)  # the batch-1 q8x gate|up GEMV storing silu(gate) * up (gemv_coop.q8x_glu): its same-bits GPU
    # test, then the q4_k_m / q8_0 A/B, alone and with both of the downs' x staging rounds in flight
    timeout "$(box 120)" python3 -m pytest -q -s tests/gpu/test_quant_models.py -k "coop_glu" -p no:cacheprovider > $RES/glu_test.log 2>&1
    tail -2 $RES/glu_test.log > $RES/glu.sum; pack glu_test
    R2="q8x_stage_rounds: 2, q8x_stage_rounds_min_k: 8192"
    GR2="$C.q8x_glu=true; $C.q8x_type_tuning={q8_0: {$T8, $R2}, q4_k: {$T4, $CHUNK4, $R2}, q6_k: {$T6, $R2}, $TR}"
    for q in q4_k_m q8_0; do
      ab glu 150 $q --variant glu="$C.q8x_glu=true" --variant glur2="$GR2"
      grep -h "b1  \|b8  " $RES/glu_$q.log >> $RES/glu.sum; pack glu_$q
    done ;;
  bps1)  # the q6_k down off wsm (q6_k q8x_wsm_kb 100, in the profile since), against the profile of
    # the time; its second variant (the q4_k gate|up at one block per SM) needed a per-type
    # q8x_blocks_per_sm (commit 3284813, reverted: 1316.5 -> 1443.9 us)
    R2="q8x_stage_rounds: 2, q8x_stage_rounds_min_k: 8192"
    NW6="$C.q8x_type_tuning={q8_0: {$T8, $R2}, q4_k: {$T4, $CHUNK4}, q6_k: {$T6, q8x_wsm_kb: 100}, $TR}"
    ab bps1 150 q4_k_m --variant nw6="$NW6"
    grep -h "b1  \|b8  " $RES/bps1_q4_k_m.log > $RES/bps1.sum; pack bps1 ;;
  vwsm)  # on top of the profile (the q6_k down off wsm): the q6_k v GEMV's 42 KB row tiles off it too
    R2="q8x_stage_rounds: 2, q8x_stage_rounds_min_k: 8192"
    V40="$C.q8x_type_tuning={q8_0: {$T8, $R2}, q4_k: {$T4, $CHUNK4}, q6_k: {$T6, q8x_wsm_kb: 40}, $TR}"
    ab vwsm 100 q4_k_m --variant v40="$V40"
    grep -h "b1  \|b8  " $RES/vwsm_q4_k_m.log > $RES/vwsm.sum; pack vwsm ;;
  q6down)  # the q6_k down projection now off wsm (streamed through registers): both x staging rounds
    # in flight, the k split over 4 warp groups, 8 lanes per row
    R2="q8x_stage_rounds: 2, q8x_stage_rounds_min_k: 8192"
    Q6="q8x_rows_per_warp: 1, q8x_ksplit_threads: 640, q8x_wsm_kb: 100"
    V() { echo "$C.q8x_type_tuning={q8_0: {$T8, $R2}, q4_k: {$T4, $CHUNK4}, q6_k: {$1}, $TR}"; }
    ab q6down 200 q4_k_m --variant r2="$(V "$T6, q8x_wsm_kb: 100, $R2")" \
      --variant ks4="$(V "q8x_lanes_per_row: 16, q8x_ksplit: 4, $Q6")" --variant l8="$(V "q8x_lanes_per_row: 8, q8x_ksplit: 2, $Q6")"
    grep -h "b1  \|b8  " $RES/q6down_q4_k_m.log > $RES/q6down.sum; pack q6down ;;
  attn14)  # the A/B of the profile (the decode attention's table_first on) against it off on q4_k_m
    # (its attention waits for the v GEMV's join), every GPU test on the profile, then with
    # ATTN_Q8=1 q8_0. Its run in the fourteenth session also had wait_first (commit 5a28dc8: the
    # rope-fused kernel waits first and loads its rope rows with the table): 1305.2 -> 1312.8 us
    A=attention_decode
    ab attn14 150 q4_k_m --variant off="$A.table_first=false"
    grep -h "b1  \|b8  " $RES/attn14_q4_k_m.log > $RES/attn14.sum; pack attn14_q4_k_m
    timeout "$(box 170)" python3 -m pytest -q -ra -s tests/gpu -p no:cacheprovider > $RES/pytest_attn14.log 2>&1; pack pytest_attn14
    tail -3 $RES/pytest_attn14.log >> $RES/attn14.sum
    [ -n "${ATTN_Q8:-}" ] && ab attn14 120 q8_0 --variant off="$A.table_first=false"
    grep -h "b1  \|b8  " $RES/attn14_q8_0.log >> $RES/attn14.sum 2>/dev/null; pack attn14_q8_0 ;;
  pair15)  # the fifteenth session's q4_k_m A/Bs (written without a GPU; never run yet): q|k and v
    # as one launch (decode_graph.pair_linears: kernels/gemv_pair.cu.j2): as it compiles (64
    # registers, 36 bytes of spills in the q6_k part), with __launch_bounds__(320, 3) (64, no
    # spills) or (320, 2) (77 registers: two blocks per SM), and spread to two blocks per SM by
    # shared memory (pair_min_smem_kb 76; the eleventh session's spread of q|k alone lost because
    # the forked v then came late); first the pair's GPU tests (the same bits as apart). Expect
    # rel != 0: a q4_k v's k split is 2 in the pair, 4 alone (tests/test_plan.py)
    timeout "$(box 100)" python3 -m pytest -q -ra -s tests/gpu/test_quant_models.py -k "paired or forked" -p no:cacheprovider > $RES/pair15_test.log 2>&1
    tail -3 $RES/pair15_test.log > $RES/pair15.sum; pack pair15_test
    P=decode_graph.pair_linears=true; S=decode_graph.pair_min_smem_kb
    M=decode_graph.pair_min_blocks
    for v in "$P" "$P; $M=3" "$P; $M=2"; do  # what the device's NVRTC allocates (the dev machine's is newer)
      echo "== $v" >> $RES/pair15_regs.log; timeout 60 python3 tools/kernel_resources.py --tune "$v" >> $RES/pair15_regs.log 2>&1
    done
    grep -h "==\|q,k,v" $RES/pair15_regs.log >> $RES/pair15.sum
    ab pair15 330 q4_k_m --variant pair="$P" --variant pair3="$P; $M=3" --variant pair2="$P; $M=2" --variant pair76="$P; $M=3; $S=76"
    grep -h "b1  \|b8  \|rel" $RES/pair15_q4_k_m.log >> $RES/pair15.sum; pack pair15_q4_k_m ;;
  pa16)  # the sixteenth session's q4_k_m A/Bs (written without a GPU; never run yet), in one call:
    # the pair (pair15's variants pair, pair2, pair76) against the pair that also runs the short
    # attention (decode_graph.pair_attention: kernels/gemv_pair_attention.cu.j2; its plan sets
    # __launch_bounds__(320, 2), since the attention part takes registers: two blocks per SM, like
    # pair2), with one query head per unit and with two (direct_qsplit 2: 16 units, fewer blocks
    # that run one); first the GPU tests of both (the same bits as apart / as the
    # pair), then the device NVRTC's registers; batch 1 only (nothing here changes batch 8).
    # Expect rel != 0 against the profile (a q4_k v's k split is 2 in the pair, 4 alone) and pa's
    # rel == pair's rel (the same bits as the pair)
    timeout "$(box 150)" python3 -m pytest -q -ra -s tests/gpu/test_quant_models.py -k "paired or forked or pair_attention" -p no:cacheprovider > $RES/pa16_test.log 2>&1
    trc=$?; tail -3 $RES/pa16_test.log > $RES/pa16.sum; echo "tests rc $trc" >> $RES/pa16.sum; pack pa16_test
    P=decode_graph.pair_linears=true; S=decode_graph.pair_min_smem_kb; M=decode_graph.pair_min_blocks
    A="$P; decode_graph.pair_attention=true"
    for v in "$P" "$P; $M=2" "$A"; do  # what the device's NVRTC allocates (the dev machine's is newer)
      echo "== $v" >> $RES/pa16_regs.log
      timeout 40 python3 tools/kernel_resources.py --tune "$v" --mode "$( [ "$v" = "$A" ] && echo short1 || echo decode1 )" >> $RES/pa16_regs.log 2>&1
    done
    grep -h "==\|q,k,v" $RES/pa16_regs.log >> $RES/pa16.sum
    # (a failed or hung test, rc != 0: the A/B of the pair variants only, so a broken kernel cannot eat the call)
    PA=(--variant pa="$A" --variant paq2="$A; attention_decode.direct_qsplit=2"); [ "$trc" = 0 ] || PA=()
    BATCHES=1 ab pa16 360 q4_k_m --variant pair="$P" --variant pair2="$P; $M=2" --variant pair76="$P; $M=3; $S=76" "${PA[@]}"
    grep -h "b1  \|b8  \|rel" $RES/pa16_q4_k_m.log >> $RES/pa16.sum; pack pa16_q4_k_m ;;
  pa17)  # the seventeenth session: the profile (since: the pair in __launch_bounds__(320, 2)) against
    # the pair that also runs the short attention with each unit on its own block (the q tile of its
    # middle q row waits for the unit's tiles: kernels/gemv_pair.cu.j2), one and two query heads per
    # unit; first the fused GPU tests (rc != 0: no fused A/B), the device NVRTC's registers, then a
    # block trace of the profile and the fused launch. Expect pa's rel == 0 (the same bits)
    timeout "$(box 120)" python3 -m pytest -q -ra -s tests/gpu/test_quant_models.py -k "paired or pair_attention" -p no:cacheprovider > $RES/pa17_test.log 2>&1
    trc=$?; tail -3 $RES/pa17_test.log > $RES/pa17.sum; echo "tests rc $trc" >> $RES/pa17.sum; pack pa17_test
    A="decode_graph.pair_attention=true"
    for v in "decode_graph.pair_min_blocks=2" "$A"; do
      echo "== $v" >> $RES/pa17_regs.log
      timeout 40 python3 tools/kernel_resources.py --tune "$v" --mode "$( [ "$v" = "$A" ] && echo short1 || echo decode1 )" >> $RES/pa17_regs.log 2>&1
    done
    grep -h "==\|q,k,v\|?" $RES/pa17_regs.log >> $RES/pa17.sum
    if [ "$trc" = 0 ]; then
      BATCHES=1 ab pa17 200 q4_k_m --variant pa="$A" --variant paq2="$A; attention_decode.direct_qsplit=2"
      grep -h "b1  \|rel" $RES/pa17_q4_k_m.log >> $RES/pa17.sum; pack pa17_q4_k_m
      timeout "$(box 200)" python3 tools/gpu_trace_decode.py --out $RES/trace17 --model /dev/shm/q4b_q4_k_m.gguf --variant pa="$A" > $RES/trace17.log 2>&1
      grep -h "==\|ERROR" $RES/trace17/trace.txt >> $RES/pa17.sum; pack trace17
    fi ;;
  trig17)  # attention_decode.trigger (the short-context direct attention calls pdl_trigger() at its
    # start, so the o GEMV launches beside it: the seventeenth session's trace had the o blocks
    # start only after the attention ended, and land their weight tile 1.9 us after their wait):
    # the A/B on the q4_k_m file (b1, b8), the runner / model GPU tests with the knob on (MEMRA_TUNE), the A/B on
    # the q8_0 file, then memra bench --quick on the q4_k_m file with it
    T=attention_decode.trigger=true
    ab trig17 100 q4_k_m --variant trig="$T"
    grep -h "b1  \|b8  " $RES/trig17_q4_k_m.log > $RES/trig17.sum; pack trig17_q4_k_m
    MEMRA_TUNE="$T" timeout "$(box 130)" python3 -m pytest -q -ra tests/gpu/test_runner_cuda.py tests/gpu/test_runner_features.py tests/gpu/test_quant_models.py tests/gpu/test_pdl_launch.py -p no:cacheprovider > $RES/trig17_test.log 2>&1
    trc=$?; tail -2 $RES/trig17_test.log >> $RES/trig17.sum; echo "tests rc $trc" >> $RES/trig17.sum; pack trig17_test
    ab trig17 100 q8_0 --variant trig="$T"
    grep -h "b1  \|b8  " $RES/trig17_q8_0.log >> $RES/trig17.sum; pack trig17_q8_0
    MEMRA_TUNE="$T" timeout "$(box 100)" python3 -m engine.cli bench /dev/shm/q4b_q4_k_m.gguf --backend cuda --quick --json $RES/bench17_trig.json > $RES/bench17_trig.log 2>&1
    grep -h "decode\|prefill" $RES/bench17_trig.log >> $RES/trig17.sum; pack bench17_trig ;;
  pf19)  # the nineteenth session (built without a GPU): tools/gpu_l2_bench.py first (does a
    # prefetch into L2 make a later stream faster: cold / warm / after a prefetch and an idle
    # window / prefetched beside another stream); then the direct batch-1 attention prefetches its
    # layer's o weight (and the gate|up's first KB) into L2 while it runs, the window the block
    # traces show DRAM idle in (attention_decode.l2_prefetch_*). The GPU test first (the same bits,
    # replayed and eager, bulk at the start and lines after pdl_wait), then the b1 A/B on the
    # q4_k_m file: o at the start / after pdl_wait / marked evict_last, o + 8 MB / 16 MB of
    # gate|up, with trigger_b1; the o GEMV prefetching 8 / 16 MB of gate|up once its tile has
    # landed (decode_graph.o_prefetch_next_kb), alone and with the attention's; every batch-1 q8x
    # GEMV keeping the weight stream 8 / 16 / 32 MB ahead (decode_graph.l2_stream_kb); then the
    # q8_0 file. Expect rel 0 everywhere. (Ran in the twentieth session on an H100: the attention's
    # and the o GEMV's prefetches won and are the profile inside the o window; the stream lost
    # and decode_graph.l2_stream_kb was removed, so its st* variants now fail as unknown knobs.)
    A=attention_decode; O="$A.l2_prefetch_o=true"; L="$A.l2_prefetch_late=true"
    timeout "$(box 60)" python3 tools/gpu_l2_bench.py --out $RES/l2 > $RES/l2bench.log 2>&1
    { cat $RES/l2/l2.txt 2>/dev/null || tail -5 $RES/l2bench.log; } > $RES/pf19.sum; pack l2bench
    timeout "$(box 100)" python3 -m pytest -q -ra tests/gpu/test_quant_models.py -k "l2_prefetch" -p no:cacheprovider > $RES/pf19_test.log 2>&1
    trc=$?; echo "tests rc $trc: $(tail -1 $RES/pf19_test.log)" >> $RES/pf19.sum; pack pf19_test
    timeout 60 python3 tools/kernel_resources.py --tune "$O; $A.l2_prefetch_next_kb=8192" --mode short1 > $RES/pf19_regs.log 2>&1
    grep -h "attention" $RES/pf19_regs.log >> $RES/pf19.sum
    if [ "$trc" = 0 ]; then
      K="$A.l2_prefetch_keep=true"; N16="$A.l2_prefetch_next_kb=16384"; OG=decode_graph.o_prefetch_next_kb; ST=decode_graph.l2_stream_kb
      # (a variant costs about 2.5 s once the file is loaded; the profile and the first three run
      # twice, to see the noise between runs of one call)
      BATCHES=1 ab pf19 300 q4_k_m --variant o="$O" --variant olate="$O; $L" --variant okeep="$O; $K" \
        --variant o8m="$O; $A.l2_prefetch_next_kb=8192" --variant o16late="$O; $L; $N16" --variant o16keep="$O; $L; $K; $N16" \
        --variant otrig="$O; $A.trigger_b1=true" --variant og8="$OG=8192" --variant og16="$OG=16384" \
        --variant o_og8="$O; $OG=8192" --variant olate_og16="$O; $L; $OG=16384" \
        --variant st8="$ST=8192" --variant st16="$ST=16384" --variant st32="$ST=32768" --variant o_st16="$O; $ST=16384" \
        --variant profile2="" --variant o_2="$O" --variant olate_2="$O; $L" --variant o16late_2="$O; $L; $N16" --variant og8_2="$OG=8192" \
        --variant st16_2="$ST=16384"
      grep -h "b1  \|rel" $RES/pf19_q4_k_m.log >> $RES/pf19.sum; pack pf19_q4_k_m
      BATCHES=1 ab pf19 100 q8_0 --variant o="$O" --variant olate="$O; $L" --variant og8="$OG=8192" --variant o_og8="$O; $OG=8192" \
        --variant st16="$ST=16384" --variant st32="$ST=32768"
      grep -h "b1  \|rel" $RES/pf19_q8_0.log >> $RES/pf19.sum; pack pf19_q8_0
    fi ;;
  u19)  # the nineteenth session (built without a GPU): the batch-1 q4_k GEMVs with twice the
    # segments in flight per lane (gemv_coop.q8x_type_tuning q4_k q8x_b1_unroll 4: two 48-byte
    # segment loads per lane and row a step instead of one; the ninth session's Nsight run had
    # gate|up stalled on long scoreboards). NVRTC 13.5 here: gate|up 81 -> 82 registers, q|k|v
    # pairs 77 / 80 -> 89 / 88, q4_k down 58 -> 78, no spills (the q6_k down at unroll 4 spills
    # 276 bytes, so q6_k keeps 2). The GPU model tests with it on (MEMRA_TUNE), then the b1 A/B on
    # the q4_k_m file (rel 0 expected: the same sums in the same order). U4 is the h200 profile's
    # q8x_type_tuning with the knob added.
    # U4S: the same for the k <= 4096 GEMVs only (q|k|v, o, gate|up; the q4_k down keeps 58
    # registers), U4R: U4S with both downs capped at 56 registers (stage room20), so that every
    # kernel's next one fits beside it (tools/kernel_resources.py, "next" column)
    CAP=", q8x_b1_maxnreg: 56, q8x_b1_maxnreg_min_k: 8192"; S4=", q8x_b1_unroll: 4, q8x_b1_unroll_max_k: 4096"
    U4="$(TT ", q8x_b1_unroll: 4")"; U4S="$(TT "$S4")"; U4R="$(TT "$S4$CAP" ", q8x_b1_unroll: 1$CAP")"
    MEMRA_TUNE="$U4" timeout "$(box 150)" python3 -m pytest -q -ra tests/gpu/test_quant_models.py -k "quantised_gguf or paired" -p no:cacheprovider > $RES/u19_test.log 2>&1
    trc=$?; echo "tests (U4) rc $trc: $(tail -1 $RES/u19_test.log)" > $RES/u19.sum; pack u19_test
    timeout 60 python3 tools/kernel_resources.py --tune "$U4" --mode decode1 > $RES/u19_regs.log 2>&1
    grep -h "linear" $RES/u19_regs.log >> $RES/u19.sum
    if [ "$trc" = 0 ]; then
      BATCHES=1 ab u19 150 q4_k_m --variant u4="$U4" --variant u4s="$U4S" --variant u4r="$U4R" --variant profile2="" \
        --variant u4_2="$U4" --variant u4s_2="$U4S" --variant u4r_2="$U4R"
      grep -h "b1  \|rel" $RES/u19_q4_k_m.log >> $RES/u19.sum; pack u19_q4_k_m
    fi ;;
  sweep19)  # knobs measured before the q|k|v pair (seventeenth session) changed which kernels
    # share the SMs, measured again on the profile at b1, each once (about 2.5 s a variant; a
    # lead then gets its own A/B with repeats): the direct attention in 2 query splits / 4 warps /
    # triggering early, the pair at 3 blocks per SM, the q4_k GEMVs at 16 / 4 lanes per row and
    # in 256 / 384-thread blocks (the h200 type tuning otherwise)
    A=attention_decode
    tt() { echo "$C.q8x_type_tuning={q8_0: {$T8, q8x_stage_rounds: 2, q8x_stage_rounds_min_k: 8192}, q4_k: {$1, $CHUNK4}, q6_k: {$T6, q8x_wsm_kb: 100}, $TR}"; }
    BATCHES=1 ab sweep19 200 q4_k_m --variant qs2="$A.direct_qsplit=2" --variant dw4="$A.direct_warps=4" \
      --variant trig="$A.trigger=true" --variant pmb3="decode_graph.pair_min_blocks=3" \
      --variant l16="$(tt "${T4/q8x_lanes_per_row: 8/q8x_lanes_per_row: 16}")" \
      --variant l4="$(tt "${T4/q8x_lanes_per_row: 8/q8x_lanes_per_row: 4}")" \
      --variant t256="$(tt "${T4/q8x_threads: 320/q8x_threads: 256}")" \
      --variant t384="$(tt "${T4/q8x_threads: 320/q8x_threads: 384}")" --variant profile2=""
    grep -h "b1  \|rel" $RES/sweep19_q4_k_m.log > $RES/sweep19.sum; pack sweep19 ;;
  sweep21)  # the twenty-first session, on the profile as the twentieth session left it (batch-1
    # unroll 4 on the k <= 4096 GEMVs, the attention window): a per-kernel breakdown of the
    # profile, then knobs once each at b1 on the q4_k_m file (a lead gets its own A/B with
    # repeats): the direct attention in 2 query splits / 4 warps, the pair at 3 blocks per SM, q4_k
    # in 256 / 384-thread blocks and at k split 2, q6_k at 8 lanes per row, the o GEMV's gate|up
    # prefetch at 6 / 12 MB, the attention's 2 MB of gate|up beside the o prefetch
    S4=", q8x_b1_unroll: 4, q8x_b1_unroll_max_k: 4096"; A=attention_decode; OG=decode_graph.o_prefetch_next_kb
    P() { TT "$S4" "$S4" "$S4"; }  # the profile's type tuning (the tests check TT + S4 is the profile)
    T256="$(T4="${T4/q8x_threads: 320/q8x_threads: 256}"; P)"; T384="$(T4="${T4/q8x_threads: 320/q8x_threads: 384}"; P)"
    KS2="$(T4="${T4/q8x_ksplit: 4/q8x_ksplit: 2}"; P)"; L8="$(T6="${T6/q8x_lanes_per_row: 16/q8x_lanes_per_row: 8}"; P)"
    BATCHES=1 ab sweep21 200 q4_k_m --breakdown --variant profile_tt="$(P)" --variant qs2="$A.direct_qsplit=2" --variant dw4="$A.direct_warps=4" \
      --variant pmb3="decode_graph.pair_min_blocks=3" --variant t256="$T256" --variant t384="$T384" --variant ks2="$KS2" \
      --variant q6l8="$L8" --variant og6="$OG=6144" --variant og12="$OG=12288" --variant profile2=""
    grep -h "b1  \|rel" $RES/sweep21_q4_k_m.log > $RES/sweep21.sum; pack sweep21 ;;
  small21)  # the issue's small-model targets on the profile: the SmolLM2-shaped q4_1 GGUF, the
    # Qwen3-0.6B and SmolLM2-shaped bf16 checkpoints, b1 and b8 (GPU time and wall)
    [ -f /dev/shm/smol_q4_1.gguf ] || python3 tools/make_checkpoint.py --shape smollm2-135m --gguf q4_1 --out /dev/shm/smol_q4_1.gguf > $RES/mk_smol.log 2>&1
    timeout "$(box 120)" python3 tools/gpu_decode_profile.py --out $RES/small21 --model /dev/shm/smol_q4_1.gguf --shapes qwen3-0.6b,smollm2-135m \
      --batches 1,8 > $RES/small21.log 2>&1
    grep -h "b1  \|b8  " $RES/small21.log > $RES/small21.sum; pack small21 ;;
  targets)  # issue #4's targets against what this call measured (tools/targets_table.py; a figure
    # from a card other than the H200 is never "met"): h20's q4_k_m bench, quant's q8_0, bf16's
    # full bench and small21's b1 rows, where they exist
    args=()
    for kv in qwen3-4b-q4_k_m=bench20_q4_k_m.json qwen3-4b-q8_0=q8_0.json qwen3-4b-bf16=bf16.json; do
      [ -f "$RES/${kv#*=}" ] && args+=(--result "${kv%%=*}=$RES/${kv#*=}")
    done
    if [ -f $RES/small21/decode_profile.json ]; then
      args+=(--result "qwen3-0.6b-bf16=$RES/small21/decode_profile.json#qwen3-0.6b")
      args+=(--result "smollm2-135m-q4_1=$RES/small21/decode_profile.json#smol_q4_1.gguf")
    fi
    python3 tools/targets_table.py "${args[@]}" > $RES/targets.md 2>&1; pack targets ;;
  u20)  # the twentieth session, after u19 on an H100 (q4_k unroll 4 on the k <= 4096 GEMVs: 1464
    # -> 1352 / 1359 us): the next steps of that knob on the q4_k_m file. U(Q4 extra, Q6 extra)
    # builds the type tuning; q4_k at unroll 6 (max k 4096), q6_k at unroll 4 on k <= 4096 (the
    # pair's v, the lm_head), both, the q4_k down capped at 56 beside u4s, q4_k at 16 lanes with
    # u4s; then q8_0 at batch-1 unroll 4 (all k / k <= 4096) on the q8_0 file
    S4=", q8x_b1_unroll: 4, q8x_b1_unroll_max_k: 4096"; S6=", q8x_b1_unroll: 6, q8x_b1_unroll_max_k: 4096"
    CAP=", q8x_b1_maxnreg: 56, q8x_b1_maxnreg_min_k: 8192"
    BATCHES=1 ab u20 200 q4_k_m --variant u4s="$(TT "$S4")" --variant u6s="$(TT "$S6")" --variant u4s_q6="$(TT "$S4" "$S4")" \
      --variant u6s_q6="$(TT "$S6" "$S4")" --variant u4s_mr4="$(TT "$S4$CAP")" \
      --variant u4s_l16="$(TT "${S4/, q8x_b1_unroll: 4/, q8x_lanes_per_row: 16, q8x_b1_unroll: 4}")" \
      --variant u4s_2="$(TT "$S4")" --variant u6s_2="$(TT "$S6")" --variant u4s_q6_2="$(TT "$S4" "$S4")"
    grep -h "b1  \|rel" $RES/u20_q4_k_m.log > $RES/u20.sum; pack u20_q4_k_m
    BATCHES=1 ab u20 100 q8_0 --variant q8u4="$(TT "" "" ", q8x_b1_unroll: 4")" \
      --variant q8u4s="$(TT "" "" ", q8x_b1_unroll: 4, q8x_b1_unroll_max_k: 4096")" --variant q8u4_2="$(TT "" "" ", q8x_b1_unroll: 4")"
    grep -h "b1  \|rel" $RES/u20_q8_0.log >> $RES/u20.sum; pack u20_q8_0 ;;
  c20)  # the twentieth session, after u20 and pf19 on an H100: the two winners together. B is the
    # batch-1 unroll 4 on the k <= 4096 GEMVs (q4_k and q6_k: u4s_q6, 1467 -> 1351 us), then the
    # attention's o prefetch (pf19 o: -20 us, o8m: -55, otrig: -46) and the o GEMV's gate|up
    # prefetch (og8: -32 / -42, o_og8: -61) on top of it; the q8_0 file the same with q8_0 unroll 4
    # on k <= 4096 (q8u4s: 1864 -> 1845)
    S4=", q8x_b1_unroll: 4, q8x_b1_unroll_max_k: 4096"; A=attention_decode; O="$A.l2_prefetch_o=true"
    B="$(TT "$S4" "$S4" "$S4")"; OG=decode_graph.o_prefetch_next_kb
    BATCHES=1 ab c20 200 q4_k_m --variant b="$B" --variant b_o="$B; $O" --variant b_o8m="$B; $O; $A.l2_prefetch_next_kb=8192" \
      --variant b_o4m="$B; $O; $A.l2_prefetch_next_kb=4096" --variant b_otrig="$B; $O; $A.trigger_b1=true" \
      --variant b_og8="$B; $OG=8192" --variant b_og4="$B; $OG=4096" --variant b_o_og8="$B; $O; $OG=8192" \
      --variant b_otrig_og8="$B; $O; $A.trigger_b1=true; $OG=8192" --variant b_o8m_trig="$B; $O; $A.l2_prefetch_next_kb=8192; $A.trigger_b1=true" \
      --variant b_2="$B" --variant b_o_og8_2="$B; $O; $OG=8192" --variant b_o8m_2="$B; $O; $A.l2_prefetch_next_kb=8192" \
      --variant b_otrig_og8_2="$B; $O; $A.trigger_b1=true; $OG=8192"
    grep -h "b1  \|rel" $RES/c20_q4_k_m.log > $RES/c20.sum; pack c20_q4_k_m
    BATCHES=1 ab c20 100 q8_0 --variant b="$B" --variant b_og8="$B; $OG=8192" --variant b_o_og8="$B; $O; $OG=8192" --variant b_2="$B"
    grep -h "b1  \|rel" $RES/c20_q8_0.log >> $RES/c20.sum; pack c20_q8_0 ;;
  d20)  # the twentieth session: around c20's best on an H100 (B + the attention's o prefetch +
    # trigger_b1 + the o GEMV's 8 MB of gate|up: 1467.6 -> 1305.0 / 1309.9 us; B + o + 4 MB of
    # gate|up from the attention: 1311.8)
    S4=", q8x_b1_unroll: 4, q8x_b1_unroll_max_k: 4096"; A=attention_decode; O="$A.l2_prefetch_o=true"; T="$A.trigger_b1=true"
    B="$(TT "$S4" "$S4" "$S4")"; OG=decode_graph.o_prefetch_next_kb; N4="$A.l2_prefetch_next_kb=4096"; N2="$A.l2_prefetch_next_kb=2048"
    BATCHES=1 ab d20 150 q4_k_m --variant b_otrig_og8="$B; $O; $T; $OG=8192" --variant b_o4m_trig="$B; $O; $N4; $T" \
      --variant b_o4m_trig_og4="$B; $O; $N4; $T; $OG=4096" --variant b_otrig_og4="$B; $O; $T; $OG=4096" \
      --variant b_o2m_trig_og8="$B; $O; $N2; $T; $OG=8192" --variant b_o4m="$B; $O; $N4" --variant b_otrig_og16="$B; $O; $T; $OG=16384" \
      --variant b_otrig_og8_2="$B; $O; $T; $OG=8192" --variant b_o4m_trig_2="$B; $O; $N4; $T" --variant b_otrig_og4_2="$B; $O; $T; $OG=4096"
    grep -h "b1  \|rel" $RES/d20_q4_k_m.log > $RES/d20.sum; pack d20_q4_k_m ;;
  r20)  # the twentieth session: the candidate profile (NEW: batch-1 unroll 4 on the k <= 4096 q4_k /
    # q6_k / q8_0 GEMVs, the attention's o prefetch + trigger_b1 and the o GEMV's 8 MB gate|up
    # prefetch on layers whose o weight is at most 8 MB) against the profile, b1 and b8, on every
    # file the targets name: Qwen3-4B q4_k_m and q8_0, the SmolLM2-shaped q4_1 GGUF, the Qwen3-0.6B
    # and SmolLM2-shaped bf16 checkpoints; NEW4 the same with the o window from 1 MB
    S4=", q8x_b1_unroll: 4, q8x_b1_unroll_max_k: 4096"; A=attention_decode
    NEW="$(TT "$S4" "$S4" "$S4"); $A.l2_prefetch_o=true; $A.trigger_b1=true; decode_graph.o_prefetch_next_kb=8192; decode_graph.o_window_max_kb=8192"
    NEW4="$NEW; decode_graph.o_window_min_kb=1024"
    BATCHES=1,8 ab r20 120 q4_k_m --variant new="$NEW" --variant new_2="$NEW"
    BATCHES=1,8 ab r20 120 q8_0 --variant new="$NEW" --variant new_2="$NEW"
    grep -h "b1  \|b8  \|rel" $RES/r20_q4_k_m.log $RES/r20_q8_0.log > $RES/r20.sum; pack r20_4b
    [ -f /dev/shm/smol_q4_1.gguf ] || python3 tools/make_checkpoint.py --shape smollm2-135m --gguf q4_1 --out /dev/shm/smol_q4_1.gguf > $RES/mk_smol.log 2>&1
    timeout "$(box 120)" python3 tools/gpu_decode_profile.py --out $RES/r20_small --model /dev/shm/smol_q4_1.gguf --shapes qwen3-0.6b,smollm2-135m \
      --batches 1,8 --variant new="$NEW" --variant new4="$NEW4" --variant new_2="$NEW" > $RES/r20_small.log 2>&1
    grep -h "b1  \|b8  \|rel" $RES/r20_small.log >> $RES/r20.sum; pack r20_small ;;
  old20)  # the twentieth session's profile (batch-1 unroll 4 on k <= 4096, the attention window's
    # prefetches and trigger) against the one before it (OLD), b1 and b8, on both Qwen3-4B files
    OLD="$(TT); attention_decode.l2_prefetch_o=false; attention_decode.trigger_b1=false; decode_graph.o_prefetch_next_kb=0"
    BATCHES=1,8 ab old20 150 q4_k_m --variant old="$OLD" --variant profile2="" --variant old_2="$OLD"
    BATCHES=1,8 ab old20 120 q8_0 --variant old="$OLD" --variant profile2=""
    grep -h "b1  \|b8  \|rel" $RES/old20_q4_k_m.log $RES/old20_q8_0.log > $RES/old20.sum; pack old20 ;;
  h20)  # the twentieth session's last call, lean: the profile against the one before it (OLD) on
    # the q4_k_m file at b1, memra bench --quick on it, then the GPU tests as far as the budget goes
    OLD="$(TT); attention_decode.l2_prefetch_o=false; attention_decode.trigger_b1=false; decode_graph.o_prefetch_next_kb=0"
    BATCHES=1 ab h20 90 q4_k_m --variant old="$OLD" --variant profile2="" --variant old_2="$OLD"
    grep -h "b1  \|rel" $RES/h20_q4_k_m.log > $RES/h20.sum; pack h20_ab
    timeout "$(box 100)" python3 -m engine.cli bench /dev/shm/q4b_q4_k_m.gguf --backend cuda --quick --json $RES/bench20_q4_k_m.json > $RES/bench20_q4_k_m.log 2>&1
    grep -h "copy\|decode\|prefill" $RES/bench20_q4_k_m.log >> $RES/h20.sum; pack h20_bench
    timeout "$(box 300)" python3 -m pytest -q -ra -x tests/gpu -p no:cacheprovider > $RES/pytest20.log 2>&1
    tail -3 $RES/pytest20.log >> $RES/h20.sum; pack h20_pytest ;;
  room20)  # the twentieth session (built without a GPU): room for the next layer's q|k|v pair
    # blocks beside the down projection (docs/kernels.md, "Room beside the down projection"). A
    # 640-thread down block at 58 / 79 registers (q4_k / q6_k) plus a 320-thread pair block at 80
    # is more than an SM's 65 536, so the pair's early-launched blocks wait for the down to end.
    # The GPU test first (the same bits), then the b1 A/B on the q4_k_m file: the pair at 64
    # registers (pair_min_blocks 3), the q6_k GEMVs at batch-1 unroll 1 (the q6_k down at 58), both,
    # and the q6_k down capped at 56 (__maxnreg__, 24 bytes of spills) beside the 80-register pair
    # (tools/kernel_resources.py's "next" column shows which kernel's blocks fit beside which);
    # and both downs capped at 56 (the q4_k down needs 53, no spills), so a down block also fits
    # beside one of the gate|up's two blocks per SM
    P3="decode_graph.pair_min_blocks=3"; U1="$(TT "" ", q8x_b1_unroll: 1")"; CAP=", q8x_b1_maxnreg: 56, q8x_b1_maxnreg_min_k: 8192"
    MR="$(TT "" ", q8x_b1_unroll: 1$CAP")"; MR2="$(TT "$CAP" ", q8x_b1_unroll: 1$CAP")"; MR4="$(TT "$CAP")"
    timeout "$(box 100)" python3 -m pytest -q -ra tests/gpu/test_quant_models.py -k "register_room" -p no:cacheprovider > $RES/room20_test.log 2>&1
    trc=$?; echo "tests rc $trc: $(tail -1 $RES/room20_test.log)" > $RES/room20.sum; pack room20_test
    timeout 60 python3 tools/kernel_resources.py --tune "$MR2" --mode decode1 > $RES/room20_regs.log 2>&1
    timeout 60 python3 tools/kernel_resources.py --tune "$U1; $P3" --mode decode1 >> $RES/room20_regs.log 2>&1
    grep -h "linear" $RES/room20_regs.log >> $RES/room20.sum
    if [ "$trc" = 0 ]; then
      BATCHES=1 ab room20 170 q4_k_m --variant p3="$P3" --variant u1="$U1" --variant p3u1="$U1; $P3" --variant mr56="$MR" \
        --variant mr4="$MR4" --variant mr56both="$MR2" --variant profile2="" --variant p3u1_2="$U1; $P3" --variant mr56_2="$MR" \
        --variant mr56both_2="$MR2"
      grep -h "b1  \|rel" $RES/room20_q4_k_m.log >> $RES/room20.sum; pack room20_q4_k_m
    fi ;;
  s18)  # the eighteenth session: gemv_coop.q8x_glu_balance (each gate|up block's pairs as one range:
    # no idle last round) and attention_decode.trigger_b1 (the direct attention's pdl_trigger() at
    # batch 1 only, a SHORT1 launch): their GPU tests (the same bits; graphs == eager with both on),
    # then the b1 A/B on the q4_k_m file and the balance on the q8_0 file. Expect rel 0 everywhere
    # (ran once: the balance lost, q4_k_m 1253.5 -> 1288.8 us, q8_0 1502.1 -> 1549.2, and its code
    # was removed after commit a02a9ff, so this stage no longer runs as written)
    B="$C.q8x_glu_balance=true"; T="attention_decode.trigger_b1=true"
    timeout "$(box 150)" python3 -m pytest -q -ra tests/gpu/test_quant_models.py -k "coop_glu" -p no:cacheprovider > $RES/s18_test.log 2>&1
    echo "glu tests rc $?: $(tail -1 $RES/s18_test.log)" > $RES/s18.sum; pack s18_test
    MEMRA_TUNE="$B; $T" timeout "$(box 120)" python3 -m pytest -q -ra tests/gpu/test_runner_cuda.py tests/gpu/test_pdl_launch.py -p no:cacheprovider > $RES/s18_run.log 2>&1
    echo "runner tests (both on) rc $?: $(tail -1 $RES/s18_run.log)" >> $RES/s18.sum; pack s18_run
    BATCHES=1 ab s18 200 q4_k_m --variant bal="$B" --variant trig1="$T" --variant both="$B; $T"
    grep -h "b1  \|rel" $RES/s18_q4_k_m.log >> $RES/s18.sum; pack s18_q4_k_m
    BATCHES=1 ab s18 120 q8_0 --variant bal="$B"
    grep -h "b1  \|rel" $RES/s18_q8_0.log >> $RES/s18.sum; pack s18_q8_0 ;;
  final14)  # memra bench --quick on the q4_k_m file (then q8_0, as far as the budget goes)
    for q in q4_k_m q8_0; do
      ckpt $q
      timeout "$(box 110)" python3 -m engine.cli bench /dev/shm/q4b_$q.gguf --backend cuda --quick --json $RES/bench14_$q.json > $RES/bench14_$q.log 2>&1
      grep -h "decode\|prefill" $RES/bench14_$q.log >> $RES/final14.sum; pack bench14_$q
    done ;;
  final13)  # the thirteenth session's closing checks: every GPU test, the A/B of the profile against
    # the session's start (no coop glu, the q6_k down in shared memory), memra bench (an earlier run
    # of this stage also had a variant with 384-thread q4_k blocks: q4_k_m 1341.4 -> 1368.8 us)
    timeout "$(box 200)" python3 -m pytest -q -ra -s tests/gpu -p no:cacheprovider > $RES/pytest_final.log 2>&1; pack pytest_final
    R2="q8x_stage_rounds: 2, q8x_stage_rounds_min_k: 8192"
    START="$C.q8x_glu=false; $C.q8x_type_tuning={q8_0: {$T8, $R2}, q4_k: {$T4, $CHUNK4}, q6_k: {$T6}, $TR}"
    ab fin13 130 q4_k_m --variant start="$START"; pack fin13_q4_k_m
    ab fin13 90 q8_0 --variant start="$START"; pack fin13_q8_0
    for q in q4_k_m q8_0; do
      ckpt $q
      timeout "$(box 100)" python3 -m engine.cli bench /dev/shm/q4b_$q.gguf --backend cuda --quick --json $RES/bench_$q.json > $RES/bench_$q.log 2>&1; pack bench_$q
    done
    { tail -3 $RES/pytest_final.log; grep -h "b1  \|b8  " $RES/fin13_*.log; grep -h "decode\|prefill" $RES/bench_*.log; } > $RES/final.sum
    pack final13 ;;
  final12)  # the twelfth session's closing checks: every GPU test, the GEMV checks of the wsm k chunks
    # and the early norm weights, the A/B of the profile against the session's start (PREV) and
    # without the early norm weights, memra bench
    timeout "$(box 200)" python3 -m pytest -q -ra -s tests/gpu -p no:cacheprovider > $RES/pytest_final.log 2>&1; pack pytest_final
    timeout "$(box 100)" python3 tools/gpu_check_gemv.py --out $RES/ok12 --types q4_k,q6_kr,q8_0r,q4_1r --sections none --checks "'wsm'|coopq8n|early_res" > $RES/ok12.log 2>&1; pack ok12
    PREV="$C.q8x_early_norm_w=false; $C.q8x_early_residual=false; $C.q8x_type_tuning={q8_0: {$T8}, q4_k: {$T4}, q6_k: {$T6}, $TR}"
    for q in q4_k_m q8_0; do
      ab fin12 100 $q --variant prev="$PREV"
      pack fin12_$q
    done
    for q in q4_k_m q8_0; do
      ckpt $q
      timeout "$(box 100)" python3 -m engine.cli bench /dev/shm/q4b_$q.gguf --backend cuda --quick --json $RES/bench_$q.json > $RES/bench_$q.log 2>&1; pack bench_$q
    done
    { tail -3 $RES/pytest_final.log; grep -h 'correctness:' $RES/ok12/gpu_check_gemv.txt; grep -h "b1  \|b8  " $RES/fin12_*.log; grep -h "decode\|prefill" $RES/bench_*.log; } > $RES/final.sum
    pack final12 ;;
  final11)  # the eleventh session's closing checks: every GPU test, the GEMV checks of the coop
    # types, memra bench on the Qwen3-4B q4_k_m / q8_0 files, and a trace of the q4_k_m step
    timeout "$(box 200)" python3 -m pytest -q -ra -s tests/gpu -p no:cacheprovider > $RES/pytest_final.log 2>&1; pack pytest_final
    timeout "$(box 100)" python3 tools/gpu_check_gemv.py --out $RES/gemvok --types q4_k,q8_0r,q6_kr,q4_1r,q6_k --sections none > $RES/check_gemvok.log 2>&1; pack gemvok
    for q in q4_k_m q8_0; do
      ckpt $q
      timeout "$(box 100)" python3 -m engine.cli bench /dev/shm/q4b_$q.gguf --backend cuda --quick --json $RES/bench_$q.json > $RES/bench_$q.log 2>&1; pack bench_$q
    done
    timeout "$(box 60)" python3 tools/gpu_trace_decode.py --out $RES/trace_final --model /dev/shm/q4b_q4_k_m.gguf > $RES/trace_final.log 2>&1
    { tail -3 $RES/pytest_final.log; grep -h 'correctness:' $RES/gemvok/gpu_check_gemv.txt; grep -h "decode\|prefill" $RES/bench_*.log; } > $RES/final.sum
    pack final11 ;;
  host)  # the small bf16 shapes' decode step, wall vs GPU-only (the host share per step)
    timeout "$(box 120)" python3 tools/gpu_decode_profile.py --out $RES/host${TAG:-} --shapes "${HOST_SHAPES:-qwen3-0.6b,smollm2-135m}" --batches 1,8 > $RES/host${TAG:-}.log 2>&1; pack host ;;
  cli)  # the CLI on the GPU (device auto-detected): memra run greedy twice on a Qwen3-0.6B-shaped
    # random bf16 checkpoint (the two texts must be equal), then memra serve on it answering one
    # chat request (tools/loadgen.py) and /metrics; $RES/cli.sum says what came back.
    # tools/gpu_serve_check.sh is the full serving check (real SmolLM2, SDK tests, load)
    [ -d /dev/shm/q06 ] || python3 tools/make_checkpoint.py --shape qwen3-0.6b --out /dev/shm/q06 > $RES/cli.log 2>&1
    for i in 1 2; do
      timeout "$(box 60)" python3 -m engine.cli run /dev/shm/q06 --prompt "the first words" --max-tokens 32 --stats > $RES/cli_run$i.txt 2>> $RES/cli.log
    done
    { nvidia-smi --query-gpu=name --format=csv,noheader | head -1; grep -h "backend, ready\|decode_tok_s" $RES/cli.log | tail -4
      cmp -s $RES/cli_run1.txt $RES/cli_run2.txt && echo "memra run: greedy text equal on two runs" || echo "memra run: texts differ or missing"; } > $RES/cli.sum
    python3 -m engine.cli serve /dev/shm/q06 --port 8642 >> $RES/cli.log 2>&1 & spid=$!
    for i in $(seq 1 90); do curl -sf localhost:8642/ready >/dev/null && break; sleep 1; done
    # one greedy streaming chat request through tools/loadgen.py (its table: ok / errors, TTFT)
    timeout "$(box 90)" python3 tools/loadgen.py --url http://127.0.0.1:8642 --requests 1 --concurrency 1 --max-tokens 16 \
      --temperature 0 --ignore-eos >> $RES/cli.sum 2>&1
    echo "memra serve: metrics lines $(curl -sf localhost:8642/metrics | grep -c '^memra_')" >> $RES/cli.sum
    kill $spid 2>/dev/null; wait $spid 2>/dev/null; grep -h "ready in .*backend)" $RES/cli.log | tail -1 >> $RES/cli.sum; pack cli ;;
  runner)
    timeout "$(box 150)" python3 tools/gpu_runner_check.py --out $RES/runner${TAG:-} > $RES/runner${TAG:-}.log 2>&1; pack runner ;;
  esac
done
echo "total $(( $(date +%s) - t0 )) s" >> $RES/times.log; pack end
# the stages' summaries on stdout too, so the call's own output shows the numbers
for f in $RES/*.sum; do [ -f "$f" ] && { echo "== $f"; cat "$f"; }; done; cat $RES/times.log
