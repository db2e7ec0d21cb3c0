#!/usr/bin/env bash
# CPU contract tests of the SGLang backend against the real sglang 0.5.14 package (no GPU needed).
#
# Called by .ci/run as:   bash .ci/sglang_contract.sh
# It builds (once, then reuses) a separate venv with sglang==0.5.14 --no-deps, the local CPU torch 2.13 wheel and the
# few packages sglang's ServerArgs / ModelConfig import, then runs tests/test_sglang_contract.py inside it.
# sglang never enters the main venv. Wheels are cached under ~/.cache/pip, so a rebuild is quick.
#   SGLANG_CONTRACT_VENV   where the venv lives (default /tmp/eaglenest-sglang-venv)
#   SGLANG_CONTRACT_REBUILD=1   rebuild it from scratch
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${SGLANG_CONTRACT_VENV:-/tmp/eaglenest-sglang-venv}
PY=${PYTHON:-python3}

# Everything the imports of sglang.srt.server_args / configs.model_config need on a CPU box (reference/sglang.md §G),
# pinned so CI is reproducible. transformers/tokenizers are sglang 0.5.14's own pins (the GPU bundle's too).
NO_DEPS=(sglang==0.5.14 compressed-tensors==0.20.1 loguru==0.7.3 gguf==0.19.0 msgspec==0.23.0)
WITH_DEPS=(
  "torch==2.13.0" transformers==5.8.1 tokenizers==0.22.2 numpy tqdm pybase64 requests ipython "pydantic>=2.6"
  aiohttp safetensors orjson packaging pillow starlette "openai==2.6.1" partial_json_parser huggingface_hub pyzmq
  dill sentencepiece pyyaml setproctitle psutil einops pytest pytest-timeout
)
STAMP_TEXT="$(printf '%s\n' "${NO_DEPS[@]}" "${WITH_DEPS[@]}")"

if [ "${SGLANG_CONTRACT_REBUILD:-0}" = 1 ]; then rm -rf "$VENV"; fi
if [ ! -f "$VENV/.eaglenest-stamp" ] || [ "$(cat "$VENV/.eaglenest-stamp")" != "$STAMP_TEXT" ]; then
  t0=$(date +%s)
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  # torch comes from the local CPU wheel (find-links); never let pip resolve a CUDA build.
  "$VENV/bin/pip" install -q --no-deps "${NO_DEPS[@]}"
  "$VENV/bin/pip" install -q "${WITH_DEPS[@]}"
  "$VENV/bin/python" -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('2.13.0') and '+cpu' in v else f'torch {v} is not the CPU 2.13.0 wheel')"
  echo "$STAMP_TEXT" > "$VENV/.eaglenest-stamp"
  echo "sglang contract venv built in $(( $(date +%s) - t0 ))s at $VENV"
fi

cd "$ROOT"
# eaglenest is imported from the source tree (PYTHONPATH), not installed: the venv holds no Ray.
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" EAGLENEST_SGLANG_CONTRACT=1 \
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_sglang_contract.py "$@"
