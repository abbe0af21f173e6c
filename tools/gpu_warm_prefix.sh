#!/usr/bin/env bash
# Warm-prefix TTFT (issue #34 item 4, issue #36's 16k target) of two trees on the same warm GPU
# machine, for one model per device call:
#   MODEL=dense  bash tools/gpu_warm_prefix.sh     (Qwen3-4B shape, q4_k_m GGUF, random blocks)
#   MODEL=hybrid bash tools/gpu_warm_prefix.sh     (Qwen3.5-4B shape, q4_k_m GGUF, random blocks)
# TREES: "label=dir ..." (default "before=.carry/before after=."): each tree's `memra serve` on the
# model, then tools/warm_prefix.py (this tree's) at about 1k / 4k / 16k prompt tokens (the GGUFs'
# byte-level vocabulary gives ~6.3 tokens a word: 160 / 640 / 2540 words), one cold send and
# REPEATS warm sends each; then (this tree only) tools/gpu_warm_tail.py: the warm tail's GPU time
# per kernel template at depths 1k / 4k / 16k. A "before" tree, made on the lead's machine:
#   mkdir -p .carry/before && git archive <commit> engine kernels models device_profiles | tar -x -C .carry/before
# Results under $OUT/warm_prefix/; checkpoints stay in /dev/shm, kernel cubins in MEMRA_CACHE_DIR.
# A cold machine (checkpoint to write, kernels to compile) may need the trees in separate calls:
# TREES="before=.carry/before" TAIL=0 ..., then TREES="after=." ... (TAIL=0 skips gpu_warm_tail.py).
set -u
OUT=${OUT:-/tmp/gpu_out}; R="$OUT/warm_prefix"; mkdir -p "$R"
export PYTHONUNBUFFERED=1 MEMRA_CACHE_DIR=${MEMRA_CACHE_DIR:-/dev/shm/mcache}
HERE=$(pwd)
case ${MODEL:-dense} in
  dense) shape=qwen3-4b; ck=/dev/shm/q4b_q4km.gguf ;;
  hybrid) shape=qwen3.5-4b; ck=/dev/shm/q35_4b.gguf ;;
  *) echo "MODEL must be dense or hybrid"; exit 2 ;;
esac
ck=${CKPT:-$ck}  # CKPT=, BACKEND=reference and WORDS= dry-run it on a CPU machine
[ -e $ck ] || PYTHONPATH=.:${PYTHONPATH:-} python3 tools/make_checkpoint.py --shape $shape --gguf q4_k_m --out $ck >> "$R/checkpoints.log" 2>&1
for pair in ${TREES:-before=.carry/before after=.}; do
  label=${pair%%=*}
  if ! tree=$(cd "${pair#*=}" 2>/dev/null && pwd) || [ ! -d "$tree/engine" ]; then echo "$label: no tree at ${pair#*=}"; continue; fi
  log="$R/${MODEL:-dense}_$label"
  (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" exec python3 -m engine.cli serve $ck --backend ${BACKEND:-cuda} --port 8125) > "$log.serve.log" 2>&1 &
  pid=$!
  t0=$(date +%s)
  for i in $(seq 1 3600); do curl -sf localhost:8125/ready >/dev/null && break; sleep 0.1; done
  echo "$label ($tree): ready after $(( $(date +%s) - t0 )) s" > "$log.txt"
  timeout 240 python3 tools/warm_prefix.py --url http://127.0.0.1:8125 --words ${WORDS:-160,640,2540} \
    --repeats ${REPEATS:-5} --json "$log.json" >> "$log.txt" 2>&1
  cat "$log.txt"
  kill -TERM $pid; wait $pid
done
[ "${BACKEND:-cuda}" = cuda ] && [ "${TAIL:-1}" = 1 ] || exit 0
timeout 200 env PYTHONPATH="$HERE:${PYTHONPATH:-}" python3 tools/gpu_warm_tail.py $ck --depths 1024,4096,16384 \
  --json "$R/${MODEL:-dense}_tail.json" > "$R/${MODEL:-dense}_tail.txt" 2>&1
tail -n 5 "$R/${MODEL:-dense}_tail.txt"
