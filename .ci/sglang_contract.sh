#!/usr/bin/env bash
# CPU contract tests of the SGLang backend against the real sglang 0.5.14 package (no GPU needed).
#
# Called by .ci/run as:   bash .ci/sglang_contract.sh
# It builds (once, then reuses) a separate venv with sglang==0.5.14 --no-deps, the local CPU torch 2.13 wheel and the
# few packages sglang's ServerArgs / ModelConfig import, then runs tests/unit/test_sglang_contract.py inside it.
# sglang never enters the main venv. Wheels are cached under ~/.cache/pip, so a rebuild is quick.
#   SGLANG_CONTRACT_VENV   where the venv lives (default /tmp/eaglenest-sglang-venv)
#   SGLANG_CONTRACT_REBUILD=1   rebuild it from scratch
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${SGLANG_CONTRACT_VENV:-/tmp/eaglenest-sglang-venv}
PY=${PYTHON:-python3}

# The full closure of what sglang.srt.server_args / configs.model_config / models.{llama,deepseek_v2} import on a CPU
# box (reference/sglang.md §G, re-derived for 0.5.14), every version pinned and installed with --no-deps: no resolver
# work, reproducible CI. transformers/tokenizers are sglang 0.5.14's own pins (the GPU bundle's too; newer transformers
# breaks its import). torch is the local CPU wheel (PIP_FIND_LINKS); never an unpinned torch (it would be CUDA).
PINS=(
  sglang==0.5.14 torch==2.13.0 transformers==5.8.1 tokenizers==0.22.2 huggingface_hub==1.33.0 hf-xet==1.8.0
  safetensors==0.8.0 numpy==2.4.6 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 typing_extensions==4.16.0 PyYAML==6.0.4 regex==2026.11.19 packaging==26.4 tqdm==4.70.1
  filelock==4.3.1 fsspec==2026.9.0 Jinja2==3.1.6 MarkupSafe==3.0.4 networkx==3.6.1 sympy==1.14.0 mpmath==1.3.0
  requests==2.34.2 urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1 charset-normalizer==3.5.3
  httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1 click==8.5.1 typer==0.29.2 rich==15.0.0
  shellingham==1.5.4 markdown-it-py==4.3.0 mdurl==0.1.2 Pygments==2.21.0 annotated-doc==0.0.7
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0 multidict==7.2.1
  propcache==0.5.4 yarl==1.25.1 orjson==3.13.0 pybase64==1.5.1 pillow==13.0.0 starlette==1.10.0 openai==2.6.1
  distro==1.9.0 jiter==0.19.0 partial-json-parser==0.2.1.1.post7 pyzmq==27.3.0 dill==0.4.1 sentencepiece==0.2.3
  msgspec==0.23.0 setproctitle==1.3.8 psutil==7.2.2 einops==0.8.2 compressed-tensors==0.20.1 loguru==0.7.3
  gguf==0.19.0 ipython==9.18.1 ipython_pygments_lexers==1.1.1 traitlets==5.16.1 jedi==0.20.1 parso==0.8.7
  prompt_toolkit==3.0.53 wcwidth==0.9.4 pexpect==4.9.0 ptyprocess==0.7.0 stack-data==0.6.3 asttokens==3.0.2
  executing==2.3.0 pure_eval==0.2.4 matplotlib-inline==0.2.2
  pytest==9.2.0 pytest-timeout==2.4.0 iniconfig==2.3.1 pluggy==1.7.0
)
STAMP_TEXT="$(printf '%s\n' "${PINS[@]}")"

if [ "${SGLANG_CONTRACT_REBUILD:-0}" = 1 ]; then rm -rf "$VENV"; fi
if [ ! -f "$VENV/.eaglenest-stamp" ] || [ "$(cat "$VENV/.eaglenest-stamp")" != "$STAMP_TEXT" ]; then
  t0=$(date +%s)
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  # --no-compile: byte-compiling all of torch costs more CPU than the tests; only imported modules get compiled.
  if ! "$VENV/bin/pip" install -q --no-deps --no-compile "${PINS[@]}" > "$VENV.install.log" 2>&1; then
    grep -v "^WARNING: Location" "$VENV.install.log" >&2
    echo "sglang contract venv: pip install failed (log: $VENV.install.log)" >&2
    exit 1
  fi
  "$VENV/bin/python" -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('2.13.0') and '+cpu' in v else f'torch {v} is not the CPU 2.13.0 wheel')"
  echo "$STAMP_TEXT" > "$VENV/.eaglenest-stamp"
  echo "sglang contract venv built in $(( $(date +%s) - t0 ))s at $VENV"
fi

cd "$ROOT"
# eaglenest is imported from the source tree (PYTHONPATH), not installed: the venv holds no Ray.
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" EAGLENEST_SGLANG_CONTRACT=1 \
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/unit/test_sglang_contract.py tests/unit/test_sglang_contract_limits.py \
  tests/unit/test_sglang_contract_adaptive.py "$@"
