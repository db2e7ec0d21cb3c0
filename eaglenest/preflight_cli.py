"""``eaglenest preflight``: check a target + drafter + algorithm + engine before serving; non-zero exit on failure."""

from __future__ import annotations

import argparse
import json
import sys

from eaglenest.drafters.registry import engine_algorithm_names


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True,
                   help="target model folder (its config.json is read; 'tiny' = the embedded tiny target)")
    p.add_argument("--drafter", required=True, help="exported drafter folder (config.json + safetensors)")
    p.add_argument("--algorithm", choices=engine_algorithm_names(), default=None,
                   help="speculative algorithm to check; default: derived from the drafter checkpoint")
    p.add_argument("--engine", choices=["hf", "sglang", "vllm"], default="hf",
                   help="serving engine whose layer-id convention and loader apply (default hf, the reference "
                        "decoder); vllm also checks what vLLM's loader accepts and prints its speculative_config")
    p.add_argument("--context-length", type=int, default=None,
                   help="serving context length, when smaller than the target's max_position_embeddings")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    from eaglenest.drafters.preflight import run_preflight

    target = args.target
    if target == "tiny":
        from eaglenest.engines.tiny import ensure_tiny_target

        target = str(ensure_tiny_target())
    report = run_preflight(target, args.drafter, algorithm=args.algorithm, engine=args.engine,
                           context_length=args.context_length)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.format())
    if not report.ok:
        print(report.failure_message(), file=sys.stderr)
        return 1
    return 0
