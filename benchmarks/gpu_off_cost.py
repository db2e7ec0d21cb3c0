"""What speculation "off" costs in SGLang's adaptive mode, per attention backend (issue #29's first way forward).

SGLang 0.5.14's adaptive speculation turns a batch-size bucket off with ``num_steps`` 0, but the engine keeps running
the target's verify forward over a one-token tree at those steps. On triton that measured 0.28x of the plain engine
at batch 256 on the H100 (BENCHMARKS.md, thirteenth session), which makes adaptive mode unsafe at high load and left
serve with no drafter (or routing by live load, ``serve.route``). If flashinfer's verify path makes off cost ~nothing,
adaptive mode keeps the batch-1 gain with one engine, on any target (routing needs two copies of the target, which a
Kimi-K2.5 deployment does not have).

The figure does not depend on the weights or the drafter (off never drafts; decoding is forced to a fixed length with
``ignore_eos``), so this builds a random-weight target of the 7.24B Llama stand-in's shape (Llama-3-8B's widths:
hidden 4096, 32 layers, 32 heads / 8 KV heads, intermediate 14336, vocab 128256) and a random EAGLE-3 drafter for it,
and per backend (``--attention``, default flashinfer then triton) starts the plain engine and the engine serve would
start for a schedule that is off there (EAGLE3, adaptive, every bucket at steps 0, SGLang's zero-step draft extend
skipped), each with decode CUDA graphs at the powers of two up to the largest batch, and measures greedy tokens/s at
each ``--batch-sizes`` (batch 1: ``--prompts`` requests one after another; larger: one batch), ``--rounds`` rounds.
Prints off / plain per backend and batch size; writes ``off_cost.json`` into ``--out``. Measured (BENCHMARKS.md,
fifteenth session, H100): flashinfer's off is 0.66x of plain at batch 256 (triton's 0.28x), so it is not free there
either.

    bash benchmarks/gpu_off_cost.sh        # on the device, carry .gpu/c1 .gpu/c2 .gpu/bin; ~8 min estimated
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

LLAMA_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def build_llama(folder: Path, device: str, **overrides: Any) -> Path:
    """A random-weight LlamaForCausalLM of the stand-in's shape (``overrides`` for a smaller one), bf16 safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(**{**LLAMA_8B, **overrides})
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # 8B parameters made in bf16 directly, not via 32 GB of fp32
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    if device != "cpu":
        torch.cuda.empty_cache()  # the engines' scheduler processes size their memory from what is free
    return folder


def engine_kwargs_for(target: Path, drafter: Path | None, attention: str,
                      batch_sizes: list[int]) -> tuple[dict[str, Any], dict]:
    """(sglang.Engine kwargs, environment): the plain engine, or (``drafter``) the adaptive engine pinned off, as
    eaglenest's tune measures "off" (``OffPlan``) and serve launches a schedule; decode graphs as the tune's
    (:func:`gpu_e2e.graph_batch_sizes`)."""
    from gpu_e2e import graph_batch_sizes

    from eaglenest.config import SGLangEngineConfig, SpecConfig
    from eaglenest.contracts.target import TargetSpec
    from eaglenest.engines.sglang.adaptive import AdaptiveSpec, adaptive_kwargs
    from eaglenest.engines.sglang.args import engine_kwargs
    from eaglenest.engines.sglang.limits import speculative_running_requests
    from eaglenest.engines.sglang.spec import speculative_engine_kwargs

    graphs = graph_batch_sizes(",".join(map(str, batch_sizes)))
    cfg = SGLangEngineConfig(mem_fraction_static=0.85, context_length=2048, attention_backend=attention,
                             extra_args={"cuda_graph_bs_decode": graphs, "disable_prefill_cuda_graph": True,
                                         "skip_tokenizer_init": True})
    facts = TargetSpec.read(str(target), context_length=2048)
    if drafter is None:
        return engine_kwargs(str(target), cfg, dtype="bfloat16", target=facts), {}
    off = AdaptiveSpec(((1, (0,)),), provenance="gpu_off_cost: speculation off")
    kw, _ = speculative_engine_kwargs(str(target), cfg, drafter, SpecConfig(num_steps=1, topk=1, num_draft_tokens=2),
                                      target=facts, dtype="bfloat16")
    kw.update(adaptive_kwargs(off, off.write()))
    kw.update(speculative_running_requests(kw, max(batch_sizes)))
    return kw, off.env


def measure(eng: Any, prompts: list[list[int]], batch: int, new_tokens: int, rounds: int,
            sequential: int) -> dict[str, Any]:
    """Greedy tokens/s of ``rounds`` rounds (batch 1: ``sequential`` requests one after another), after a warm-up."""
    sp = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    groups = [[p] for p in prompts[:sequential]] if batch == 1 else [prompts[:batch]]
    # Warm-up: every request twice. The first pass misses the prefix cache (full prefill), the second hits it, as
    # every measured round does; each path compiles on its first use. One request once left round 1 at 45 vs 154
    # tok/s (fifteenth session), every request once still 38.7 vs 148.7 (eighteenth): likely the hit path, still cold.
    for _ in range(2):
        for g in groups:
            eng.generate(input_ids=g, sampling_params=sp)
    rates = []
    for _ in range(rounds):
        tokens, secs = 0, 0.0
        for g in groups:
            t0 = time.perf_counter()
            out = eng.generate(input_ids=g, sampling_params=sp)
            secs += time.perf_counter() - t0
            tokens += sum(int(o["meta_info"]["completion_tokens"]) for o in out)
        rates.append(tokens / secs)
    return {"tok_per_s_rounds": [round(r, 1) for r in rates], "tok_per_s": round(statistics.median(rates), 1)}


def run(target: Path, drafter: Path, backends: list[str], batch_sizes: list[int], args: argparse.Namespace,
        save: Any) -> list[dict[str, Any]]:
    from eaglenest.engines.sglang.adaptive import environment
    from eaglenest.engines.sglang.engine import sglang_symbol

    Engine = sglang_symbol("sglang:Engine")
    prompts = [[100 + (31 * i + 7 * j) % 30000 for j in range(args.prompt_tokens)] for i in range(max(batch_sizes))]
    records: list[dict[str, Any]] = []
    for attention in backends:
        for name, d in (("plain", None), ("off", drafter)):
            rec: dict[str, Any] = {"attention": attention, "engine": name}
            t0 = time.perf_counter()
            try:
                kw, env = engine_kwargs_for(target, d, attention, batch_sizes)
                with environment(env):
                    eng = Engine(**kw)
                rec["start_s"] = round(time.perf_counter() - t0, 1)
                try:
                    rec["batches"] = {str(b): measure(eng, prompts, b, args.new_tokens, args.rounds, args.prompts)
                                      for b in batch_sizes}
                finally:
                    eng.shutdown()
            except Exception as e:  # noqa: BLE001 - a backend that fails here is a result (recorded), not a crash
                rec["error"] = f"{type(e).__name__}: {e}"[:1500]
            rec["total_s"] = round(time.perf_counter() - t0, 1)
            print(f"[off cost] {json.dumps(rec)}", flush=True)
            records.append(rec)
            save(records)
    return records


def ratios(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """off / plain per backend and batch size, and each backend's plain engine against the first backend's."""
    by = {(r["attention"], r["engine"]): r.get("batches") for r in records}
    first = records[0]["attention"] if records else None
    rows = []
    for attention in dict.fromkeys(r["attention"] for r in records):
        plain, off = by.get((attention, "plain")), by.get((attention, "off"))
        for b in (plain or {}):
            row = {"attention": attention, "batch": int(b), "plain": plain[b]["tok_per_s"]}
            if off and b in off:
                row["off"] = off[b]["tok_per_s"]
                row["off_vs_plain"] = round(off[b]["tok_per_s"] / plain[b]["tok_per_s"], 3)
            base = by.get((first, "plain"))
            if base and b in base and attention != first:
                row[f"plain_vs_{first}_plain"] = round(plain[b]["tok_per_s"] / base[b]["tok_per_s"], 3)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/out")
    p.add_argument("--work", default="/tmp/offcost")
    p.add_argument("--attention", default="flashinfer,triton",
                   help="backends, comma-separated (flashinfer first: triton's figure is the thirteenth session's)")
    p.add_argument("--batch-sizes", default="1,256")
    p.add_argument("--prompts", type=int, default=8, help="requests one after another at batch 1")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=None,
                   help="fewer layers than the stand-in's 32 (every per-step cost is per layer, so off / plain moves "
                        "little; a shorter lease)")
    p.add_argument("--small", action="store_true", help="a 6-layer, narrow model (a rehearsal of the building)")
    p.add_argument("--build-only", action="store_true", help="build the target and drafter, start no engine")
    a = p.parse_args(argv)
    from gpu_jit_warm import build_drafters

    t0 = time.perf_counter()
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    small = ({"hidden_size": 256, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 512, "vocab_size": 4096} if a.small else {})
    if a.layers:
        small = {**small, "num_hidden_layers": a.layers}
    target = build_llama(work / "target", a.device, **small)
    drafter = build_drafters(target, work, draft_vocab=min(32000, (small or LLAMA_8B)["vocab_size"]),
                             shapes=("llama",))["llama"]
    built_s = round(time.perf_counter() - t0, 1)
    print(f"[off cost] built the target and a drafter in {built_s} s", flush=True)

    def save(records: list[dict[str, Any]]) -> None:
        (out / "off_cost.json").write_text(json.dumps({"built_s": built_s, "engines": records,
                                                       "ratios": ratios(records), "args": vars(a),
                                                       "seconds": round(time.perf_counter() - t0, 1)}, indent=2))

    records = [] if a.build_only else run(target, drafter, [x for x in a.attention.split(",") if x],
                                          [int(x) for x in a.batch_sizes.split(",")], a, save)
    save(records)
    for row in ratios(records):
        print(f"[off cost] {json.dumps(row)}", flush=True)
    print(f"[off cost] done in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
