"""Where regen's generation throughput goes on a GPU: the same prompts through SGLang four ways, in one run.

The end-to-end run (BENCHMARKS.md, "GPU end to end") measured regen's engine generating at 0.17x of SGLang's own
offline ``Engine.generate`` over the same prompts. This separates the suspects on an 8B-shaped random Llama (no
stand-in needed: throughput does not depend on the weights), 512-prompt calls as regen makes them:

1. ``raw``: ``sglang.Engine.generate`` with plain greedy sampling params, in this process;
2. ``eaglenest``: the same engine through ``SGLangEngine.generate_ids`` (eaglenest's per-request sampling dicts);
3. ``regen``: ``run_regen`` on a local Ray (Ray Data actor pool, 1 GPU actor, capture and shard writes included),
   Ray's default worker niceness (15) -- what ``ray start`` gives the regen job;
4. ``regen-nice0``: the same with workers at niceness 0.

    source .gpu/bin/install.sh && source .gpu/r1/install_ray.sh && python3 benchmarks/gpu_regen_gap.py --out $OUT/gap
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def build_model(path: Path, *, hidden: int = 4096, layers: int = 32, intermediate: int = 14336, kv_heads: int = 8,
                device: str = "cuda") -> None:
    """A Llama with random bf16 weights (heads of 128; default: Llama-3-8B's shape), the tiny target's tokenizer and
    chat template; throughput and state layout do not depend on the weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from eaglenest.engines.tiny import build_tokenizer

    tok = build_tokenizer(1024)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=hidden // 128, num_key_value_heads=kv_heads,
                      head_dim=128, max_position_embeddings=4096, tie_word_embeddings=False,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, torch_dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    del model
    torch.cuda.empty_cache()


def chats(n: int) -> list[dict]:
    """n distinct single-turn ShareGPT records from the tiny corpus's user turns."""
    from eaglenest.engines.tiny import corpus_chats

    users = [m["content"] for c in corpus_chats() for m in c["messages"] if m["role"] == "user" and m["content"]]
    return [{"id": f"g{i}", "conversations": [{"from": "human", "value": f"({i}) {users[i % len(users)]}"},
                                              {"from": "gpt", "value": "x"}]} for i in range(n)]


def target_cfg(model: Path):
    from eaglenest.config import SGLangEngineConfig, TargetConfig

    return TargetConfig(model=str(model), engine="sglang", device="cuda", dtype="bfloat16",
                        sglang=SGLangEngineConfig(mem_fraction_static=0.55, context_length=2048))


def engine_phase(model: Path, records: list[dict], max_new: int) -> dict:
    from eaglenest.engines.base import SamplingParams, render_chat_ids
    from eaglenest.engines.sglang.engine import SGLangEngine

    eng = SGLangEngine(target_cfg(model))
    prompts = [render_chat_ids(eng.tokenizer, [{"role": "user", "content": r["conversations"][0]["value"]}],
                               add_generation_prompt=True) for r in records]
    sp = SamplingParams(temperature=0.0, max_new_tokens=max_new)
    t0 = time.perf_counter()
    eng.generate_ids(prompts[:16], sp)
    out = {"engine_start_s": round(time.perf_counter() - t0, 1)}

    def timed(name, fn):
        t = time.perf_counter()
        tokens = fn()
        s = time.perf_counter() - t
        out[name] = {"tokens": tokens, "seconds": round(s, 2), "tokens_per_s": round(tokens / s, 1)}
        print(name, out[name], flush=True)

    raw_sp = {"temperature": 0.0, "max_new_tokens": max_new}
    timed("raw", lambda: sum(o["meta_info"]["completion_tokens"]
                             for o in eng.engine.generate(input_ids=prompts, sampling_params=raw_sp)))
    timed("eaglenest", lambda: sum(len(g.token_ids) for g in eng.generate_ids(prompts, sp)))
    timed("raw_again", lambda: sum(o["meta_info"]["completion_tokens"]
                                   for o in eng.engine.generate(input_ids=prompts, sampling_params=raw_sp)))
    eng.close()
    return out


def regen_phase(model: Path, source: Path, out_dir: Path, max_new: int, niceness: int | None) -> dict:
    import ray

    from eaglenest.config import load_config
    from eaglenest.regen.pipeline import run_regen

    cfg_path = out_dir.parent / f"{out_dir.name}.yaml"
    import yaml

    cfg_path.write_text(yaml.safe_dump({
        "target": target_cfg(model).model_dump(),
        "regen": {"sources": [{"name": "gap", "domain": "chat", "adapter": "sharegpt", "path": str(source)}],
                  "output": str(out_dir), "sampling": {"temperature": 0.0, "max_new_tokens": max_new},
                  "batch_size": 256, "num_actors": 1, "num_cpus_per_actor": 2, "num_gpus_per_actor": 1,
                  "max_tokens": 4096, "rows_per_shard": 128}}))
    cfg = load_config(cfg_path)
    if ray.is_initialized():
        ray.shutdown()
    kw = {"runtime_env": {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}}
    if niceness is not None:
        from eaglenest.ray_private import worker_niceness_option

        kw.update(worker_niceness_option(niceness))
    ray.init(**kw)
    t0 = time.perf_counter()
    s = run_regen(cfg, str(out_dir), log=lambda m: None)
    wall = time.perf_counter() - t0
    ray.shutdown()
    run = s["last_run"]
    gen = run["engine_seconds"]["generate"]
    res = {"wall_s": round(wall, 1), "generated_tokens": run["generated_tokens"],
           "engine_seconds": run["engine_seconds"],
           "generate_only_tokens_per_s": round(run["generated_tokens"] / gen, 1) if gen else None,
           "steady": run["steady"], "niceness": niceness if niceness is not None else "ray default (15)"}
    print(out_dir.name, res, flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/gap-out")
    ap.add_argument("--work", default="/tmp/gap")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--phases", default="engine,regen,regen-nice0")
    a = ap.parse_args()
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    rec: dict = {}
    t = time.perf_counter()
    if not (model / "config.json").is_file():
        build_model(model)
    rec["model_build_s"] = round(time.perf_counter() - t, 1)
    records = chats(a.prompts)
    source = work / "gap.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    for phase in a.phases.split(","):
        try:
            if phase == "engine":
                rec[phase] = engine_phase(model, records, a.max_new_tokens)
            elif phase == "regen":
                rec[phase] = regen_phase(model, source, work / "regen-default", a.max_new_tokens, None)
            elif phase == "regen-nice0":
                rec[phase] = regen_phase(model, source, work / "regen-nice0", a.max_new_tokens, 0)
        except Exception as e:  # noqa: BLE001 - one record per phase
            rec[phase] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        (out / "gap.json").write_text(json.dumps(rec, indent=2))
    print(json.dumps(rec, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
