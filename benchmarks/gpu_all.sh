#!/usr/bin/env bash
# Every GPU check of eaglenest, in sequence, in ONE device call on the lent H200 (results under $OUT).
#
# Here, first (no device time):
#   bash ../shared/gpu/sglang_bundle.sh                       # -> .gpu/c1, .gpu/c2, .gpu/bin (git-ignored)
#   bash benchmarks/gpu_all.sh --prepare                      # -> .gpu/cache: the pre-trained tiny target, so the
#                                                             #    device does not spend ~1-2 min pre-training it
# Device call (the `run` tool):
#   carry:   [".gpu/c1", ".gpu/c2", ".gpu/bin", ".gpu/cache"]   (+ ".gpu/jit" once a run returned jitcache.tgz)
#   command: bash benchmarks/gpu_all.sh
#   timeout_s: 600
# Afterwards copy $OUT's jitcache.tgz to .gpu/jit/ (saves ~60 s of kernel compiles next time). Results:
#   $OUT/summary.txt (the tables), $OUT/gpu_capture.json, $OUT/sglang/sglang_results.json (+ per-check json/log).
#
# Steps (each isolated: a failing step never stops the next; each is cut at the remaining time budget):
#   capture  benchmarks/gpu_capture.py   transformers backend capture on CUDA bf16 (~1B random Llama)
#   sglang   benchmarks/gpu_sglang.py    SGLang backend checks 1-5 (capture parity, regen throughput, EAGLE3, speed,
#                                        capture during generation vs the prefill capture)
#   stream   benchmarks/gpu_serve_stream.py  the serving adapter streaming from SGLang (TTFT, admission, cancel)
# GPU_ALL_STEPS="capture sglang" picks steps; SGLANG_CHECKS=1,2,3,4,5 picks SGLang checks; GPU_ALL_BUDGET_S (570)
# is the whole run's budget. The device allows 600 s per call and all of it takes ~8-11 min on a fresh machine, so
# the safe plan is two calls (checks 3 and 4 must share a call: the forced-EAGLE run reuses check 3's drafter):
#   call 1: GPU_ALL_STEPS="capture sglang" SGLANG_CHECKS=1,2,5 bash benchmarks/gpu_all.sh
#   call 2: GPU_ALL_STEPS=sglang SGLANG_CHECKS=3,4 bash benchmarks/gpu_all.sh
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

if [ "${1:-}" = "--prepare" ]; then
  mkdir -p .gpu/cache
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" python3 -c "
from eaglenest.engines.tiny import ensure_tiny_target
print(ensure_tiny_target(cache_dir='.gpu/cache'))"
  exit $?
fi

START=$(date +%s)
BUDGET=${GPU_ALL_BUDGET_S:-570}
OUT=${OUT:-/tmp/eaglenest-gpu-out}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
note() { echo "$*" | tee -a "$SUMMARY"; }

if [ -f .gpu/bin/install.sh ]; then
  # shellcheck disable=SC1091
  source .gpu/bin/install.sh
else
  note "WARNING: .gpu/bin/install.sh missing (carry .gpu/c1 .gpu/c2 .gpu/bin); using whatever python3 has"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
# Built targets stay on the device's /tmp (never in $OUT); a carried .gpu/cache seeds it.
export EAGLENEST_GPU_CACHE=/tmp/eaglenest-gpu-models
mkdir -p "$EAGLENEST_GPU_CACHE"
if [ -d .gpu/cache ]; then cp -rn .gpu/cache/. "$EAGLENEST_GPU_CACHE/" 2>/dev/null || true; fi

note "== eaglenest GPU checks $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2
 python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)" 2>&1
 python3 -c "import sglang, transformers; print('sglang', sglang.__version__, 'transformers', transformers.__version__)" 2>&1 | tail -1
) | tee -a "$SUMMARY"

STEPS=${GPU_ALL_STEPS:-capture sglang}
for step in $STEPS; do
  remaining=$(left)
  if [ "$remaining" -lt 40 ]; then note "-- $step: skipped (time budget spent)"; continue; fi
  t0=$(date +%s)
  case "$step" in
    capture)
      timeout -k 5 "$(( remaining < 150 ? remaining : 150 ))" \
        python3 benchmarks/gpu_capture.py --device cuda --json "$OUT/gpu_capture.json" > "$OUT/gpu_capture.log" 2>&1
      rc=$?
      note "-- capture (transformers backend): rc=$rc in $(( $(date +%s) - t0 ))s"
      tail -25 "$OUT/gpu_capture.log" | tee -a "$SUMMARY" >/dev/null ;;
    sglang)
      timeout -k 10 "$remaining" python3 benchmarks/gpu_sglang.py --out "$OUT/sglang" \
        --checks "${SGLANG_CHECKS:-1,2,3,4,5}" --budget-s "$(( remaining - 15 ))" > "$OUT/sglang.log" 2>&1
      rc=$?
      note "-- sglang backend: rc=$rc in $(( $(date +%s) - t0 ))s"
      sed -n '/== eaglenest SGLang GPU checks/,$p' "$OUT/sglang.log" | tee -a "$SUMMARY" ;;
    stream)
      timeout -k 5 "$(( remaining < 300 ? remaining : 300 ))" \
        python3 benchmarks/gpu_serve_stream.py --out "$OUT/stream" > "$OUT/stream.log" 2>&1
      rc=$?
      note "-- serve streaming (SGLang adapter): rc=$rc in $(( $(date +%s) - t0 ))s"
      tail -60 "$OUT/stream.log" | tee -a "$SUMMARY" >/dev/null ;;
    *)
      note "-- $step: unknown step (known: capture sglang stream)" ;;
  esac
done

if declare -F save_jit_cache >/dev/null; then save_jit_cache; fi
note "== done in $(( $(date +%s) - START ))s; results under $OUT"
exit 0
