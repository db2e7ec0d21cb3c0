"""``eaglenest capture``: generate a few answers with the configured target and capture their hidden states.

A quick end-to-end check of an engine (tiny target on CPU, or a real model on GPU) before a long regen job.
"""

from __future__ import annotations

import argparse
import json
import time

DEFAULT_PROMPTS = [
    "What is 12 plus 7?",
    "Tell me about alice in paris.",
    "Write a python function add_3 of a and x.",
    "What is the weather in oslo?",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config (target section); default: the embedded tiny target")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    from eaglenest.config import load_config
    from eaglenest.engines import SamplingParams, load_engine

    cfg = load_config(args.config)
    t0 = time.perf_counter()
    engine = load_engine(cfg.target)
    t_load = time.perf_counter() - t0
    convs = [[{"role": "user", "content": q}] for q in DEFAULT_PROMPTS]
    t0 = time.perf_counter()
    gens = engine.generate(convs, SamplingParams(max_new_tokens=args.max_new_tokens))
    t_gen = time.perf_counter() - t0
    seqs = [engine.render_prompt(c) + g.token_ids for c, g in zip(convs, gens, strict=True)]
    t0 = time.perf_counter()
    caps = engine.capture(seqs)
    t_cap = time.perf_counter() - t0
    info = engine.info
    summary = {
        "target": info.model,
        "engine": info.engine_version,
        "layers": info.num_layers,
        "hidden_size": info.hidden_size,
        "aux_layer_ids": list(getattr(engine, "aux_layer_ids", [])),
        "load_s": round(t_load, 2),
        "generated_tokens": sum(len(g.token_ids) for g in gens),
        "generate_s": round(t_gen, 2),
        "captured_tokens": sum(c.aux_hidden_states.shape[0] for c in caps),
        "capture_s": round(t_cap, 2),
        "aux_shape": list(caps[0].aux_hidden_states.shape),
        "last_shape": list(caps[0].last_hidden_state.shape),
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for q, g in zip(DEFAULT_PROMPTS, gens, strict=True):
            print(f"> {q}\n  {g.text[:100]!r} ({len(g.token_ids)} tokens, {g.finish_reason})")
        for k, v in summary.items():
            print(f"{k:>18}: {v}")
    return 0
