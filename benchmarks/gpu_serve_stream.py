"""Streaming through the SGLang serving adapter on a GPU (serve.backends.Backend + SGLangDecoder on SGLangEngine).

    python benchmarks/gpu_serve_stream.py --out $OUT/stream     # on the GPU, with the bundle (no Ray needed)

What a client of ``eaglenest serve`` with ``target.engine: sglang`` gets, measured on the adapter itself:

a. 8 concurrent greedy requests x 256 tokens (``ignore_eos``): chunks per request, time to first token vs time to the
   last one, and whether each streamed answer equals ``SGLangEngine.generate_ids`` on the same prompt (batch
   composition can flip bf16 near-ties, so this is reported as a fraction, not asserted).
b. A request admitted while 4 long ones run: its first token arrives before the long ones finish.
c. A stream cancelled mid-way ends with "cancelled"; a request submitted after it still completes.
d. One request at a time, streamed vs ``generate_ids`` (same batch composition): identical token for token.

Random-init ~0.25B Llama on the tiny tokenizer (decoding speed is what matters here, not the text). Writes
``stream.json`` into ``--out`` and prints it; exits 1 when (b), (c) or (d) fails or nothing streamed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


class Recorder:
    """A job's events with their arrival times; ``done`` is set on the final one."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.chunks = 0
        self.final = None
        self.done = threading.Event()

    def __call__(self, ev) -> None:
        if ev.token_ids:
            self.chunks += 1
            self.times.append(time.perf_counter() - self.t0)
            self.tokens += ev.token_ids
        if ev.final:
            self.final = ev
            self.done.set()


def submit(backend, prompt, sampling) -> tuple[object, Recorder]:
    from eaglenest.serve.backends import Job

    rec = Recorder()
    job = Job(list(prompt), sampling, rec)
    backend.submit(job)
    return job, rec


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (None: equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    from gpu_sglang import big_target, target_cfg

    from eaglenest.engines.base import SamplingParams
    from eaglenest.engines.sglang.engine import SGLangEngine
    from eaglenest.serve.backends import Backend, SGLangDecoder

    path = big_target(a.out)
    engine = SGLangEngine(target_cfg(path, "sglang", mem_fraction_static=0.5))
    backend = Backend(engine, SGLangDecoder(engine, max_batch=64), name="sglang")
    backend.start()
    tok = engine.tokenizer
    prompts = [tok.encode(f"Request {i}: tell a long story about the number {i} and the sea, in many details.")
               for i in range(12)]
    greedy = SamplingParams(max_new_tokens=a.max_new_tokens, ignore_eos=True)
    rec: dict = {"target": path, "max_new_tokens": a.max_new_tokens}
    t_start = time.perf_counter()
    engine.generate_ids(prompts[:1], SamplingParams(max_new_tokens=8))  # engine start + warm-up
    rec["engine_start_s"] = round(time.perf_counter() - t_start, 1)

    # a. 8 concurrent streams
    runs = [submit(backend, p, greedy) for p in prompts[:8]]
    for _, r in runs:
        r.done.wait(300)
    want = engine.generate_ids(prompts[:8], greedy)
    rec["a"] = {
        "finished": sum(r.final is not None and r.final.finish_reason is not None for _, r in runs),
        "chunks_per_request": [r.chunks for _, r in runs],
        "ttft_ms": [round(1000 * r.times[0], 1) if r.times else None for _, r in runs],
        "last_token_ms": [round(1000 * r.times[-1], 1) if r.times else None for _, r in runs],
        "tokens": [len(r.tokens) for _, r in runs],
        "equal_to_generate_ids": sum(r.tokens == g.token_ids for (_, r), g in zip(runs, want, strict=True)) / 8,
        "first_difference": [_first_difference(r.tokens, g.token_ids) for (_, r), g in zip(runs, want, strict=True)],
        "generate_ids_twice_first_difference": [
            _first_difference(g.token_ids, h.token_ids)
            for g, h in zip(want, engine.generate_ids(prompts[:8], greedy), strict=True)],
        "accept_stats": [getattr(r.final.stats, "verify_steps", None) if r.final else None for _, r in runs],
    }
    rec["a"]["median_ttft_over_e2e"] = round(statistics.median(
        t / e for t, e in zip(rec["a"]["ttft_ms"], rec["a"]["last_token_ms"], strict=True) if t and e), 3)

    # b. a late request joins running long ones
    long = SamplingParams(max_new_tokens=4 * a.max_new_tokens, ignore_eos=True)
    longs = [submit(backend, p, long) for p in prompts[8:12]]
    while not all(r.tokens for _, r in longs):
        time.sleep(0.005)
    _, late = submit(backend, prompts[0], SamplingParams(max_new_tokens=16, ignore_eos=True))
    late.done.wait(120)
    first_long_end = None
    for _, r in longs:
        r.done.wait(300)
    first_long_end = min(r.t0 + r.times[-1] for _, r in longs)
    late_first = late.t0 + late.times[0] if late.times else None
    rec["b"] = {"late_ttft_ms": round(1000 * late.times[0], 1) if late.times else None,
                "late_first_token_before_long_ones_end": bool(late_first and late_first < first_long_end),
                "long_tokens": [len(r.tokens) for _, r in longs]}

    # c. cancel mid-stream, then the engine still serves
    job, victim = submit(backend, prompts[1], long)
    while len(victim.tokens) < 32:
        time.sleep(0.002)
    job.cancel()
    victim.done.wait(60)
    _, after = submit(backend, prompts[2], SamplingParams(max_new_tokens=32, ignore_eos=True))
    after.done.wait(120)
    rec["c"] = {"cancelled_error": getattr(victim.final, "error", None), "cancelled_at_tokens": len(victim.tokens),
                "after_tokens": len(after.tokens),
                "after_finish": getattr(after.final, "finish_reason", None)}
    # d. one request alone, streamed vs generate_ids alone (same batch composition: must be identical)
    alone = []
    for p in prompts[3:6]:
        _, r = submit(backend, p, greedy)
        r.done.wait(120)
        alone.append(_first_difference(r.tokens, engine.generate_ids([p], greedy)[0].token_ids))
    rec["d"] = {"alone_first_difference": alone}
    backend.close()

    ok = (rec["a"]["finished"] == 8 and min(rec["a"]["chunks_per_request"]) > 1
          and rec["b"]["late_first_token_before_long_ones_end"]
          and rec["c"]["cancelled_error"] == "cancelled" and rec["c"]["after_tokens"] == 32
          and rec["c"]["cancelled_at_tokens"] < 4 * a.max_new_tokens
          and all(d is None for d in rec["d"]["alone_first_difference"]))
    rec["ok"] = ok
    (a.out / "stream.json").write_text(json.dumps(rec, indent=2))
    print(json.dumps(rec, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
