"""fp8 vs bf16 hidden-state storage: does a drafter trained on fp8 shards accept as much as one trained on bf16?

    python benchmarks/fp8_storage.py [--chats 300] [--steps 150] [--seeds 0,1,2]

The tiny target's chats are regenerated and captured once (as ``eaglenest regen`` does), then stored both ways
through the shard contract itself (``contracts.shards.tensor_to_bytes`` / ``bytes_to_tensor``: bf16, and fp8 with a
power-of-two scale per token and state): same samples, same order, same seeds, same steps. Each seed trains one
drafter per storage; all are evaluated on the same held-out prompts with the reference decoder (greedy, chain
3-1-4). Prints bytes per token of both and the accept lengths; writes ``fp8_storage.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402


def stored(captured, dtype: str):
    """The captured samples as a trainer reads them back from shards written in ``dtype``."""
    from dataclasses import replace

    from eaglenest.contracts.shards import bytes_to_tensor, tensor_to_bytes

    out, nbytes, tokens = [], 0, 0
    for c in captured:
        h = c.last.shape[-1]
        a, b = tensor_to_bytes(c.aux, dtype, states=3), tensor_to_bytes(c.last, dtype)
        nbytes, tokens = nbytes + len(a) + len(b), tokens + c.aux.shape[0]
        out.append(replace(c, aux=bytes_to_tensor(a, dtype, 3 * h, states=3).to(c.aux.dtype),
                           last=bytes_to_tensor(b, dtype, h).to(c.last.dtype)))
    return out, nbytes / tokens


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chats", type=int, default=300)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(REPO / "out" / "bench" / "fp8_storage"))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from eaglenest.config import SpecConfig, TargetConfig
    from eaglenest.drafter.spec_fit import FitConfig, capture_samples, chat_prompt_answer, fit_drafter
    from eaglenest.engines.base import SamplingParams
    from eaglenest.engines.hf import HFEngine
    from eaglenest.engines.tiny import corpus_chats
    from eaglenest.speculative.evaluate import evaluate_acceptance, load_prompts

    engine = HFEngine.from_config(TargetConfig(model="tiny", device="cpu", dtype="float32"))
    samples = chat_prompt_answer(engine, corpus_chats()[: a.chats], regenerate=True, max_new_tokens=96,
                                 batch_size=32)
    captured = capture_samples(engine, samples, list(engine.aux_layer_ids))
    data = {}
    bytes_per_token = {}
    for dtype in ("bfloat16", "float8_e4m3fn"):
        data[dtype], bytes_per_token[dtype] = stored(captured, dtype)
    h = engine.info.hidden_size
    print(f"[data] {len(samples)} samples; hidden-state bytes/token: bf16 {bytes_per_token['bfloat16']:.1f} "
          f"({bytes_per_token['bfloat16'] / h:.3f}*H), fp8 {bytes_per_token['float8_e4m3fn']:.1f} "
          f"({bytes_per_token['float8_e4m3fn'] / h:.3f}*H)", flush=True)
    heldout = load_prompts(REPO / "tests" / "fixtures" / "prompts" / "heldout.jsonl", limit=a.num_prompts)
    spec = SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)
    results: dict[str, list[float]] = {k: [] for k in data}
    seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    for seed in seeds:
        for dtype, caps in data.items():
            t0 = time.perf_counter()
            fit = fit_drafter(engine, samples, FitConfig(steps=a.steps, batch_size=16, ttt_steps=4,
                                                         learning_rate=3e-3, seed=seed), captured=caps)
            rep = evaluate_acceptance(engine, fit.drafter, heldout, spec, sampling=SamplingParams(max_new_tokens=48))
            results[dtype].append(rep["accept_length"])
            print(f"[{dtype} seed {seed}] held-out accept length {rep['accept_length']:.3f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    mean = {k: statistics.mean(v) for k, v in results.items()}
    rel = (mean["float8_e4m3fn"] - mean["bfloat16"]) / mean["bfloat16"]
    doc = {"samples": len(samples), "steps": a.steps, "seeds": seeds, "heldout_prompts": len(heldout),
           "hidden_size": h, "bytes_per_token": bytes_per_token, "accept_length": results, "mean": mean,
           "fp8_vs_bf16_relative": rel, "command": " ".join(["python", "benchmarks/fp8_storage.py"] + sys.argv[1:])}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_storage.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"mean accept length: bf16 {mean['bfloat16']:.3f}, fp8 {mean['float8_e4m3fn']:.3f} "
          f"({100 * rel:+.2f}%); per seed bf16 {results['bfloat16']}, fp8 {results['float8_e4m3fn']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
