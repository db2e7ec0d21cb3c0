"""What structured output costs the reference decoder, and what drafting under the grammar gives back.

Side by side in one process, on the same prompts and JSON Schema (greedy, one batch): plain decoding free and
constrained, and speculative decoding constrained with a draft chain that proposes under the grammar ("guided"), the
same chain drafting free ("unguided"), and a tree drafting free (a tree is only ever unguided: served, a step with a
constrained row drafts the chain of its depth, the guided chain's row). Drafters: the target drafting for itself (the
best a drafter can be: what speculation could give) and an untrained EAGLE-3 drafter (the worst). Rounds are
interleaved (``--repeats``); each figure is the median. Reported: tokens/s, accept length (tokens per target
forward), and speed relative to plain constrained decoding. Every constrained answer is checked to parse under the
schema.

    OMP_NUM_THREADS=1 python benchmarks/structured_output.py [--repeats 3] [--max-tokens 96] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["city", "unit", "days"],
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
            "type": "object", "additionalProperties": False, "required": ["day", "high", "low", "sky"],
            "properties": {"day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
                           "high": {"type": "integer", "minimum": -40, "maximum": 50},
                           "low": {"type": "integer", "minimum": -40, "maximum": 50},
                           "sky": {"enum": ["sunny", "cloudy", "rain", "snow"]}}}},
    },
}
QUESTIONS = ["What is the weather in paris?", "Write a short poem about the sea.", "What is 8 plus 24?",
             "How do I sort a list in Python?", "Hello! Who are you?", "List three colors.",
             "Tell me a fact about the moon.", "Why is the sky blue?"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import jsonschema
    import torch

    from eaglenest.config import SpecConfig, TargetConfig
    from eaglenest.drafter.spec_fit import drafter_config_for
    from eaglenest.drafters.eagle3.model import Eagle3Drafter
    from eaglenest.engines.base import OutputConstraint, SamplingParams
    from eaglenest.engines.hf import HFEngine
    from eaglenest.engines.tiny import ensure_tiny_target
    from eaglenest.speculative.decoder import BaselineDecoder, SpecDecoder
    from eaglenest.speculative.draft import TargetSelfDraft
    from eaglenest.speculative.guide import canonical_schema

    torch.manual_seed(0)
    engine = HFEngine.from_config(TargetConfig(model=str(ensure_tiny_target()), device="cpu", dtype="float32"))
    prompts = [engine.render_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]
    free = SamplingParams(max_new_tokens=args.max_tokens)
    constrained = SamplingParams(max_new_tokens=args.max_tokens, constraint=OutputConstraint(canonical_schema(SCHEMA)))
    cfg = drafter_config_for(engine, engine.aux_layer_ids, draft_vocab_size=engine.info.vocab_size)
    untrained = Eagle3Drafter(cfg)
    with torch.no_grad():  # the whole vocabulary: d2t offsets 0, every target token in the draft vocabulary
        untrained.init_from_target(engine.embed_weight(), engine.lm_head_weight(),
                                   torch.zeros(cfg.draft_vocab_size, dtype=torch.long),
                                   torch.ones(cfg.vocab_size, dtype=torch.bool))
    chain, tree = SpecConfig(num_steps=4, topk=1, num_draft_tokens=5), SpecConfig(num_steps=4, topk=3,
                                                                                   num_draft_tokens=8)
    rows = {"plain, free": (BaselineDecoder.from_engine(engine), free),
            "plain, constrained": (BaselineDecoder.from_engine(engine), constrained)}
    for name, draft in (("self-draft", TargetSelfDraft(engine.model)), ("untrained EAGLE-3", untrained.eval())):
        rows[f"{name} chain, guided"] = (SpecDecoder.from_engine(engine, draft, chain), constrained)
        rows[f"{name} chain, unguided"] = (SpecDecoder.from_engine(engine, draft, chain, guided_drafting=False),
                                           constrained)
        rows[f"{name} tree, unguided"] = (SpecDecoder.from_engine(engine, draft, tree, guided_drafting=False),
                                          constrained)

    speed: dict[str, list[float]] = {k: [] for k in rows}
    accept: dict[str, float] = {}
    answers: dict[str, list[list[int]]] = {}
    for rnd in range(args.repeats):
        for name, (dec, sampling) in rows.items():
            t0 = time.perf_counter()
            out = dec.generate(prompts, sampling)
            wall = time.perf_counter() - t0
            speed[name].append(sum(r.completion_tokens for r in out) / wall)
            accept[name] = statistics.fmean(r.accept_length for r in out)
            answers[name] = [r.token_ids for r in out]
            if sampling.constraint is not None:
                for r in out:
                    if r.finish_reason == "stop":
                        jsonschema.validate(json.loads(r.text), SCHEMA)
        print(f"round {rnd + 1}/{args.repeats} done", file=sys.stderr)
    reference = answers["plain, constrained"]
    for name in rows:
        if name != "plain, free":
            assert answers[name] == reference, f"{name}: greedy answers differ from plain constrained decoding"
    base = statistics.median(speed["plain, constrained"])
    table = []
    print(f"{'decoder':34s} {'tok/s':>8s} {'accept len':>10s} {'vs plain constrained':>21s}")
    for name in rows:
        tps = statistics.median(speed[name])
        table.append({"decoder": name, "tokens_per_s": tps, "accept_length": accept[name],
                      "vs_constrained": tps / base})
        print(f"{name:34s} {tps:8.1f} {accept[name]:10.2f} {tps / base:20.2f}x")
    if args.out:
        args.out.write_text(json.dumps({"rows": table, "repeats": args.repeats, "max_tokens": args.max_tokens},
                                       indent=2))


if __name__ == "__main__":
    main()
