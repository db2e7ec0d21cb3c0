"""Capture during generation on a GPU: is it right, and how close does regen get to SGLang's own generation?

``target.sglang.capture: generation`` records the aux and final states inside SGLang's scheduler while it generates
(``eaglenest.engines.sglang.hooks``) instead of running a second, teacher-forced prefill. One run, on an
8B-shaped random bf16 Llama (throughput and state layout do not depend on the weights), answers three questions:

1. ``engine``: SGLang's own offline ``Engine.generate`` over all prompts in one call (CUDA graphs and radix cache
   on: the reference; and again with CUDA graphs off, no hooks), then eaglenest's recording engine (graphs and radix
   cache off, hooks on) over the same prompts in one call, and the assembly of every sequence's states;
2. ``correctness``: for the first prompts, the recorded states vs the prefill capture of the same sequences
   (``SGLangCaptureRunner``, SGLang's model code teacher-forced), at every position training reads, plus a control
   with the capture shifted one layer (an off-by-one tap must fail the tolerance);
3. ``regen``: ``run_regen`` on a local Ray (Ray Data, one GPU actor) with capture during generation, steady state
   tokens/s against (1); ``regen-inflightN`` (N = 2..4) the same with ``regen.batches_in_flight: N`` (every batch in
   flight in SGLang's running batch at once); ``regen-fp8`` with fp8 storage. Each regen record carries the
   manifest's batch timeline (start, end, generate and capture seconds per batch).

    source .gpu/bin/install.sh && source .gpu/r1/install_ray.sh && \\
        python3 benchmarks/gpu_capture_generation.py --out $OUT/gencap
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_regen_gap import build_model, chats  # noqa: E402

TOLERANCE = 3e-2  # bf16 kernels of a batched decode vs a prefill differ in rounding (BENCHMARKS.md, capture checks)


def target_cfg(model: Path, capture: str, disable_cuda_graph: bool = False):
    from eaglenest.config import SGLangEngineConfig, TargetConfig

    return TargetConfig(model=str(model), engine="sglang", device="cuda", dtype="bfloat16",
                        sglang=SGLangEngineConfig(mem_fraction_static=0.55, context_length=2048, capture=capture,
                                                  disable_cuda_graph=disable_cuda_graph))


def offline_generate(model: Path, prompts: list[list[int]], max_new: int, *, eager: bool) -> tuple[dict, float]:
    """SGLang's own ``Engine.generate`` over every prompt in one call (after a 64-prompt warm-up)."""
    import torch

    from eaglenest.engines.sglang.engine import SGLangEngine

    raw_sp = {"temperature": 0.0, "max_new_tokens": max_new}
    eng = SGLangEngine(target_cfg(model, "prefill", disable_cuda_graph=eager))
    t = time.perf_counter()
    eng.engine.generate(input_ids=prompts[:64], sampling_params=raw_sp)
    start = time.perf_counter() - t
    t = time.perf_counter()
    n = sum(o["meta_info"]["completion_tokens"] for o in eng.engine.generate(input_ids=prompts, sampling_params=raw_sp))
    s = time.perf_counter() - t
    eng.close()
    torch.cuda.empty_cache()
    return {"tokens": n, "seconds": round(s, 2), "tokens_per_s": round(n / s, 1)}, round(start, 1)


def prompts_of(tokenizer, records: list[dict]) -> list[list[int]]:
    from eaglenest.engines.base import render_chat_ids

    return [render_chat_ids(tokenizer, [{"role": "user", "content": r["conversations"][0]["value"]}],
                            add_generation_prompt=True) for r in records]


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def states_vs_prefill(eng, seqs: list[list[int]], masks: list[list[int]], caps: list) -> dict[str, float]:
    """Recorded states vs SGLang's prefill capture of the same sequences (``SGLangCaptureRunner``) at every position
    training reads: the worst relative errors (aux, final) and, as a control, the smallest aux error against a capture
    one layer off (an off-by-one tap must fail the tolerance)."""
    from eaglenest.contracts.states import unread_state_positions

    pre = eng.capture_runner.capture(seqs, eng.aux_layer_ids)
    shifted = eng.capture_runner.capture(seqs, [k + 1 for k in eng.aux_layer_ids])
    worst = {"aux": 0.0, "last": 0.0, "control_aux": float("inf")}
    for i, s in enumerate(seqs):
        read = [x for x in range(len(s)) if x not in unread_state_positions(len(s), masks[i])]
        worst["aux"] = max(worst["aux"], rel(caps[i].aux_hidden_states[read], pre[i].aux_hidden_states[read]))
        worst["last"] = max(worst["last"], rel(caps[i].last_hidden_state[read], pre[i].last_hidden_state[read]))
        worst["control_aux"] = min(worst["control_aux"], rel(caps[i].aux_hidden_states[read],
                                                             shifted[i].aux_hidden_states[read]))
    return worst


def within_tolerance(worst: dict[str, float]) -> bool:
    return worst["aux"] <= TOLERANCE and worst["last"] <= TOLERANCE and worst["control_aux"] > TOLERANCE


def engine_phase(model: Path, records: list[dict], max_new: int, n_check: int) -> dict:
    import torch

    from eaglenest.engines.base import CaptureHint, SamplingParams
    from eaglenest.engines.sglang.engine import SGLangEngine

    out: dict = {}
    eng = SGLangEngine(target_cfg(model, "generation"), regen=True)
    prompts = prompts_of(eng.tokenizer, records)
    out["offline_engine_generate"], out["reference_start_s"] = offline_generate(model, prompts, max_new, eager=False)
    print("offline Engine.generate (graphs on)", out["offline_engine_generate"], flush=True)
    out["offline_engine_generate_graphs_off"], _ = offline_generate(model, prompts, max_new, eager=True)
    print("offline Engine.generate (graphs off, no hooks)", out["offline_engine_generate_graphs_off"], flush=True)

    sp = SamplingParams(temperature=0.0, max_new_tokens=max_new)
    t = time.perf_counter()
    warm = eng.generate_ids(prompts[:64], sp)
    eng.capture([p + g.token_ids for p, g in zip(prompts[:64], warm, strict=True)],
                hints=[CaptureHint(g.meta["capture_ref"], [0] * len(p) + [1] * len(g.token_ids))
                       for p, g in zip(prompts[:64], warm, strict=True)])
    out["recording_start_s"] = round(time.perf_counter() - t, 1)
    eng.recorder.counts.clear()
    t = time.perf_counter()
    gens = eng.generate_ids(prompts, sp)
    s_gen = time.perf_counter() - t
    n = sum(len(g.token_ids) for g in gens)
    seqs = [p + g.token_ids for p, g in zip(prompts, gens, strict=True)]
    masks = [[0] * len(p) + [1] * len(g.token_ids) for p, g in zip(prompts, gens, strict=True)]
    t = time.perf_counter()
    caps = eng.capture(seqs, hints=[CaptureHint(g.meta["capture_ref"], m) for g, m in zip(gens, masks, strict=True)])
    s_cap = time.perf_counter() - t
    out["recording_engine"] = {
        "tokens": n, "generate_seconds": round(s_gen, 2), "assemble_seconds": round(s_cap, 2),
        "generate_tokens_per_s": round(n / s_gen, 1), "tokens_per_s_with_assembly": round(n / (s_gen + s_cap), 1),
        "stored_tokens": sum(len(x) for x in seqs), "served_from": dict(eng.recorder.counts),
        "fallback_reasons": eng.recorder.fallback_reasons[-5:]}
    print("recording engine", out["recording_engine"], flush=True)

    # correctness: the first n_check sequences through the prefill capture runner, same engine process
    n_seq = min(n_check, len(seqs))
    worst = states_vs_prefill(eng, seqs[:n_seq], masks[:n_seq], caps[:n_seq])
    out["correctness"] = {"sequences": n_seq, "aux_layer_ids": eng.aux_layer_ids,
                          "max_rel_error_aux": worst["aux"], "max_rel_error_last": worst["last"],
                          "min_rel_error_one_layer_off": worst["control_aux"], "tolerance": TOLERANCE,
                          "passed": within_tolerance(worst)}
    print("correctness", out["correctness"], flush=True)
    eng.close()
    torch.cuda.empty_cache()
    return out


def regen_phase(model: Path, source: Path, out_dir: Path, max_new: int, batch: int,
                storage_dtype: str = "bfloat16", in_flight: int = 1) -> dict:
    import ray
    import yaml

    from eaglenest.config import load_config
    from eaglenest.regen.pipeline import run_regen

    shutil.rmtree(out_dir, ignore_errors=True)  # a warm machine keeps /tmp: never resume an earlier call's run
    cfg_path = out_dir.parent / f"{out_dir.name}.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "target": target_cfg(model, "generation").model_dump(),
        "regen": {"sources": [{"name": "gencap", "domain": "chat", "adapter": "sharegpt", "path": str(source)}],
                  "output": str(out_dir), "sampling": {"temperature": 0.0, "max_new_tokens": max_new},
                  "batch_size": batch, "num_actors": 1, "num_cpus_per_actor": 4, "num_gpus_per_actor": 1,
                  "max_tokens": 4096, "rows_per_shard": 128, "storage_dtype": storage_dtype,
                  "batches_in_flight": in_flight}}))
    cfg = load_config(cfg_path)
    ray.init(runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    t0 = time.perf_counter()
    s = run_regen(cfg, str(out_dir), log=lambda m: None)
    wall = time.perf_counter() - t0
    ray.shutdown()
    run = s["last_run"]
    res = {"wall_s": round(wall, 1), "batch_size": batch, "storage_dtype": storage_dtype, "in_flight": in_flight,
           "generated_tokens": run["generated_tokens"],
           "engine_seconds": run["engine_seconds"], "steady": run["steady"],
           "written": run.get("written"), "quarantined": run.get("quarantined_by_engine_stage"),
           "batches": run.get("batches")}
    print("regen", res, flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/gencap-out")
    ap.add_argument("--work", default="/tmp/gencap")
    ap.add_argument("--prompts", type=int, default=2048)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--check", type=int, default=32, help="sequences compared with the prefill capture")
    ap.add_argument("--regen-batch", type=int, default=512)
    ap.add_argument("--phases", default="engine,regen")
    a = ap.parse_args()
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    rec: dict = {"prompts": a.prompts, "max_new_tokens": a.max_new_tokens}
    t = time.perf_counter()
    if not (model / "config.json").is_file():
        build_model(model)
    rec["model_build_s"] = round(time.perf_counter() - t, 1)
    records = chats(a.prompts)
    source = work / "gencap.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    for phase in a.phases.split(","):
        try:
            if phase == "engine":
                rec[phase] = engine_phase(model, records, a.max_new_tokens, a.check)
            elif phase == "regen":
                rec[phase] = regen_phase(model, source, work / "regen-gencap", a.max_new_tokens, a.regen_batch)
            elif phase.startswith("regen-inflight"):  # regen-inflight2 .. regen-inflight4
                n = int(phase.removeprefix("regen-inflight"))
                rec[phase] = regen_phase(model, source, work / f"regen-gencap-{n}", a.max_new_tokens, a.regen_batch,
                                         in_flight=n)
            elif phase == "regen-fp8":
                rec[phase] = regen_phase(model, source, work / "regen-gencap-fp8", a.max_new_tokens, a.regen_batch,
                                         "float8_e4m3fn")
        except Exception as e:  # noqa: BLE001 - one record per phase
            import traceback

            rec[phase] = {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-4000:]}
        (out / "gencap.json").write_text(json.dumps(rec, indent=2))
    if "engine" in rec and "regen" in rec and "offline_engine_generate" in rec["engine"]:
        steady = rec["regen"].get("steady", {}).get("tokens_per_second")
        ref = rec["engine"]["offline_engine_generate"]["tokens_per_s"]
        if steady:
            rec["regen_steady_vs_offline"] = round(steady / ref, 3)
        (out / "gencap.json").write_text(json.dumps(rec, indent=2))
    print(json.dumps(rec, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
