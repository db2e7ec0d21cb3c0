"""``eaglenest tiny-target DIR``: write the embedded tiny target as an ordinary Hugging Face model folder."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("output", help="folder to write (config.json, model.safetensors, tokenizer files)")
    p.add_argument("--config", help="YAML config whose target.tiny section sets the shape (default: built-in)")


def run(args: argparse.Namespace) -> int:
    from eaglenest.config import load_config
    from eaglenest.engines.tiny import build_tiny_target

    spec = load_config(args.config).target.tiny
    out = build_tiny_target(args.output, spec)
    print(f"tiny target written to {out} ({spec.num_layers} layers, hidden {spec.hidden_size}, seed {spec.seed})")
    return 0
