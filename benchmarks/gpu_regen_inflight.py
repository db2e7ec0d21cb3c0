"""Regen's engine with batches in flight on a GPU: do several threads' batches generate together through SGLang, and
are their recorded hidden states still right?

One SGLang engine as regen runs it (``SGLangEngine(regen=True)``, ``capture: generation``: hooks recording, the loop
driver submitting every thread's batch with ``async_generate``) on a small random bf16 Llama. Side by side in one
run, on the same prompts:

- ``one at a time``: the batches one after another from one thread (what ``regen.batches_in_flight: 1`` does);
- ``in flight``: the same batches from N threads at once (``regen.batches_in_flight: N``), each thread generating
  and then assembling its own batch's states, as the engine actor's threads do;

then every sequence of the in-flight run is checked: served from its recordings (no fallback), and for the first
ones, the recorded states against SGLang's prefill capture of the same sequence (``SGLangCaptureRunner``) at every
position training reads, with a one-layer-off control that must fail the tolerance. Small enough to run next to
the end-to-end runner's stand-in pre-training in the same device call:

    source .gpu/bin/install.sh && python3 benchmarks/gpu_regen_inflight.py --out $OUT/inflight
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_capture_generation import TOLERANCE, states_vs_prefill, within_tolerance  # noqa: E402
from gpu_regen_gap import build_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/inflight-out")
    ap.add_argument("--work", default="/tmp/inflight")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--threads", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--check", type=int, default=16)
    ap.add_argument("--mem-fraction", type=float, default=0.25)
    a = ap.parse_args()
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    rec: dict = {"args": vars(a)}
    try:
        run(a, model, rec)
    except Exception as e:  # noqa: BLE001 - the record says what failed
        import traceback

        rec["error"] = f"{type(e).__name__}: {e}"[:2000]
        rec["traceback"] = traceback.format_exc()[-4000:]
    (out / "inflight.json").write_text(json.dumps(rec, indent=2, default=str))
    print(json.dumps(rec, indent=2, default=str))
    return 0 if rec.get("passed") else 1


def run(a: argparse.Namespace, model: Path, rec: dict) -> None:
    import torch

    from eaglenest.config import SGLangEngineConfig, TargetConfig
    from eaglenest.engines.base import CaptureHint, SamplingParams, render_chat_ids
    from eaglenest.engines.sglang.engine import SGLangEngine
    from eaglenest.engines.tiny import corpus_chats

    t = time.perf_counter()
    if not (model / "config.json").is_file():
        model.mkdir(parents=True, exist_ok=True)
        build_model(model, hidden=a.hidden, layers=a.layers, intermediate=3 * a.hidden,
                    kv_heads=max(1, a.hidden // 512), device="cpu")
    rec["model_build_s"] = round(time.perf_counter() - t, 1)
    cfg = TargetConfig(model=str(model), engine="sglang", device="cuda", dtype="bfloat16",
                       sglang=SGLangEngineConfig(mem_fraction_static=a.mem_fraction, context_length=2048,
                                                 capture="generation", capture_max_tokens=8192))
    t = time.perf_counter()
    eng = SGLangEngine(cfg, regen=True)
    eng.start()
    rec["engine_start_s"] = round(time.perf_counter() - t, 1)
    rec["driver"] = eng._driver is not None
    users = [m["content"] for c in corpus_chats() for m in c["messages"] if m["role"] == "user" and m["content"]]
    n = a.batches * a.batch_size
    prompts = [render_chat_ids(eng.tokenizer, [{"role": "user", "content": f"{users[i % len(users)]} ({i})"}],
                               add_generation_prompt=True) for i in range(n)]
    batches = [prompts[i:i + a.batch_size] for i in range(0, n, a.batch_size)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=a.max_new_tokens)
    results: dict[int, tuple] = {}

    def one(k: int) -> None:
        """A batch as an engine actor's thread runs it: generate, then assemble its states from the recordings."""
        gens = eng.generate_ids(batches[k], sp)
        seqs = [p + g.token_ids for p, g in zip(batches[k], gens, strict=True)]
        masks = [[0] * len(p) + [1] * len(g.token_ids) for p, g in zip(batches[k], gens, strict=True)]
        caps = eng.capture(seqs, hints=[CaptureHint(g.meta["capture_ref"], m) for g, m in zip(gens, masks,
                                                                                               strict=True)])
        results[k] = (gens, seqs, masks, caps)

    one(0)  # warm-up (kernels, first requests)
    eng.recorder.counts.clear()
    t = time.perf_counter()
    for k in range(a.batches):
        one(k)
    serial_s = time.perf_counter() - t
    serial_tokens = sum(len(g.token_ids) for k in range(a.batches) for g in results[k][0])
    results.clear()
    eng.recorder.counts.clear()
    errors: list[str] = []

    def worker(ks: list[int]) -> None:
        try:
            for k in ks:
                one(k)
        except Exception as e:  # noqa: BLE001
            errors.append(f"{type(e).__name__}: {e}")

    t = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(list(range(i, a.batches, a.threads)),))
               for i in range(a.threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    inflight_s = time.perf_counter() - t
    if errors:
        raise RuntimeError(f"in-flight threads failed: {errors[:3]}")
    tokens = sum(len(g.token_ids) for k in range(a.batches) for g in results[k][0])
    rec["one_at_a_time"] = {"seconds": round(serial_s, 2), "tokens": serial_tokens,
                            "tokens_per_s": round(serial_tokens / serial_s, 1)}
    rec["in_flight"] = {"threads": a.threads, "seconds": round(inflight_s, 2), "tokens": tokens,
                        "tokens_per_s": round(tokens / inflight_s, 1), "served_from": dict(eng.recorder.counts),
                        "placed": dict(eng.recorder.sink.served),
                        "fallback_reasons": eng.recorder.fallback_reasons[-3:]}
    rec["in_flight_vs_one_at_a_time"] = round((tokens / inflight_s) / (serial_tokens / serial_s), 3)
    print("one at a time", rec["one_at_a_time"], "in flight", rec["in_flight"], flush=True)

    seqs = [s for k in range(a.batches) for s in results[k][1]][:a.check]
    masks = [m for k in range(a.batches) for m in results[k][2]][:a.check]
    caps = [c for k in range(a.batches) for c in results[k][3]][:a.check]
    worst = states_vs_prefill(eng, seqs, masks, caps)
    rec["correctness"] = {"sequences": len(seqs), **{k: round(v, 5) for k, v in worst.items()},
                          "tolerance": TOLERANCE}
    eng.close()
    torch.cuda.empty_cache()
    rec["passed"] = (rec["driver"] and within_tolerance(worst)
                     and rec["in_flight"]["served_from"].get("prefill", 0) == 0 and len(results) == a.batches
                     and rec["in_flight"]["placed"].get("at_capture", 0) == 0)  # every row placed as it arrived


if __name__ == "__main__":
    sys.exit(main())
