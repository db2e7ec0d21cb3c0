#!/usr/bin/env bash
# What speculation "off" costs in SGLang's adaptive mode per attention backend (benchmarks/gpu_off_cost.py), on the
# device: carry .gpu/c1 .gpu/c2 .gpu/bin (the SGLang bundle, ../shared/gpu/sglang_bundle.sh); results in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
source .gpu/bin/install.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout "${OFF_COST_TIMEOUT_S:-570}" python3 benchmarks/gpu_off_cost.py --out "$OUT" "$@" 2>&1 | tee "$OUT/off_cost.log" | grep -v "it/s]" | tail -60
