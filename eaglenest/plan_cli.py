"""``eaglenest plan --config F``: size a regen + training run (samples, tokens, storage per mode, hours); no GPU."""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="eaglenest YAML (target, regen and train sections)")
    p.add_argument("--hidden-size", type=int, default=None,
                   help="the target's hidden size (default: read from its config.json; needed for a hub id)")
    p.add_argument("--prompt-tokens", type=float, default=None,
                   help="average prompt tokens per sample (default: 512, a placeholder: measure yours)")
    p.add_argument("--answer-tokens", type=float, default=None,
                   help="average generated tokens per sample (default: regen.sampling.max_new_tokens, the bound)")
    p.add_argument("--engine-tokens-per-s", type=float, default=None,
                   help="generated tok/s of one engine (regen's steady state or `eaglenest bench`'s baseline)")
    p.add_argument("--gpus-per-engine", type=int, default=None, help="default: regen.num_gpus_per_actor")
    p.add_argument("--capture-share", type=float, default=None,
                   help="capture / (generate + capture) seconds of a regen pass (a regen manifest's "
                        "last_run.engine_seconds): the cost of an online epoch after the first, as a share of a pass")
    p.add_argument("--train-tokens-per-s", type=float, default=None,
                   help="training tok/s of one worker (the trainer's progress line, benchmarks/train_step.py)")


def run(args: argparse.Namespace) -> int:
    from eaglenest.config import load_config
    from eaglenest.sizing import SizingInputs, count_source, format_plan, plan

    cfg = load_config(args.config)
    pc = cfg.plan

    def pick(flag, field):  # a flag beats the config's plan section
        return flag if flag is not None else field

    notes: list[str] = []
    hidden = pick(args.hidden_size, pc.hidden_size) or _hidden_size(cfg)
    if hidden is None:
        print(f"eaglenest plan: cannot read the hidden size of {cfg.target.model} here (not a local folder); give "
              "--hidden-size or plan.hidden_size", file=sys.stderr)
        return 2
    share = pick(args.capture_share, pc.capture_share)
    if share is not None and not 0 < share <= 1:
        print(f"eaglenest plan: --capture-share {share} is not a share of a regen pass (0 < share <= 1)",
              file=sys.stderr)
        return 2
    sources = [count_source(s.name, cfg.resolve(s.path), s.max_samples) for s in cfg.regen.sources]
    prompt = pick(args.prompt_tokens, pc.prompt_tokens)
    if prompt is None:
        prompt = 512.0
        notes.append("prompt tokens per sample assumed 512: pass --prompt-tokens (e.g. from a small regen's manifest)")
    answer = pick(args.answer_tokens, pc.answer_tokens)
    if answer is None:
        answer = float(cfg.regen.sampling.max_new_tokens)
        notes.append(f"generated tokens per sample taken as max_new_tokens ({answer:,.0f}): an upper bound for one "
                     "regenerated turn; pass --answer-tokens")
    inp = SizingInputs(hidden_size=hidden, sources=sources, prompt_tokens=prompt, answer_tokens=answer,
                       engine_tokens_per_s=pick(args.engine_tokens_per_s, pc.engine_tokens_per_s),
                       num_engines=cfg.regen.num_actors,
                       gpus_per_engine=args.gpus_per_engine or max(1, int(cfg.regen.num_gpus_per_actor)),
                       train_tokens_per_s=pick(args.train_tokens_per_s, pc.train_tokens_per_s),
                       num_workers=cfg.train.num_workers, epochs=cfg.train.epochs,
                       capture_share=share, notes=notes)
    print(format_plan(inp, plan(inp)))
    return 0


def _hidden_size(cfg) -> int | None:
    """From the target's config.json when it is a local folder (or the tiny target's spec)."""
    import json
    from pathlib import Path

    if cfg.target.model == "tiny":
        return cfg.target.tiny.hidden_size
    p = Path(cfg.resolve(cfg.target.model) or "") / "config.json"
    if not p.is_file():
        return None
    raw = json.loads(p.read_text())
    text = raw.get("text_config") or raw
    return int(text["hidden_size"])
