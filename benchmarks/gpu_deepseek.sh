#!/usr/bin/env bash
# DeepseekV3 (Kimi-K2.5's architecture) on the H200 with SGLang, in phases that each fit one device call:
#   --phase capture   capture during generation vs SGLang's prefill capture on a random DeepseekV3 with Kimi's MLA dims
#   --phase standin   the DeepseekV3 stand-in (--preset tiny, pre-trained here on a synthetic dump) through SGLang:
#                     greedy tokens vs transformers on the same weights, and the capture check on it
# Carry .gpu/c1 .gpu/c2 .gpu/bin (the SGLang bundle, ../shared/gpu/sglang_bundle.sh); results under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${2:-capture}
[ "${1:-}" = "--phase" ] || { echo "usage: $0 --phase capture|standin"; exit 2; }
source .gpu/bin/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STANDIN=/tmp/eaglenest-ds-standin

build_standin() {
  [ -f "$STANDIN/model/config.json" ] && return 0
  python3 - <<'EOF'
import json, random
words = ("the model answers questions about code math travel history music cooking physics and poems with short "
         "clear sentences that explain each step before the final answer").split()
rng = random.Random(0)
recs = [{"id": f"s{i}", "conversations": [
    {"from": "human", "value": "Question %d: %s?" % (i, " ".join(rng.choice(words) for _ in range(8 + i % 9)))},
    {"from": "gpt", "value": " ".join(rng.choice(words) for _ in range(40 + i % 30))}]} for i in range(600)]
json.dump(recs, open("/tmp/eaglenest-ds-dump.json", "w"))
EOF
  python3 -m eaglenest.cli standin-target "$STANDIN" --sharegpt /tmp/eaglenest-ds-dump.json --arch deepseek_v3 \
    --preset tiny --device cuda 2>&1 | tail -20
}

case "$phase" in
  capture)
    python3 benchmarks/gpu_deepseek_capture.py --out "$OUT" --prompts "${DS_PROMPTS:-256}" --max-new 64 ${DS_KIMI:+--kimi-wrapper} ;;
  standin)
    build_standin && cp "$STANDIN/standin.json" "$OUT/" 2>/dev/null
    python3 benchmarks/gpu_deepseek_capture.py --target "$STANDIN/model" --compare-hf 16 --out "$OUT" \
      --prompts "${DS_PROMPTS:-128}" --max-new 48 ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
rc=$?
save_jit_cache
exit $rc
