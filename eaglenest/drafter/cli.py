"""``eaglenest train`` and ``eaglenest export`` (wired into eaglenest.cli). Heavy imports happen inside the runners."""

from __future__ import annotations

import argparse
import sys


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML config (target + train sections)")
    parser.add_argument("--data", help="regen output folder (manifest.json + shards/); not with --online")
    parser.add_argument("--online", action="store_true",
                        help="regenerate and capture while training: hidden states stream from the engines to the "
                             "workers and are never written (the same as train.data: online)")
    parser.add_argument("--limit", type=int, help="online: read at most N rows of every source (smoke runs)")
    parser.add_argument("--output", required=True,
                        help="training folder: checkpoints, metrics, plot, export/; rerun with the same folder resumes")
    parser.add_argument("--max-steps", type=int, default=None, help="override train.max_steps")


def run_train(args: argparse.Namespace) -> int:
    from eaglenest.config import load_config
    from eaglenest.drafter.driver import train_drafter

    overrides = {"train.max_steps": args.max_steps} if args.max_steps else None
    cfg = load_config(args.config, overrides)
    online = args.online or cfg.train.data == "online"
    problem = None
    if online and args.data:
        problem = "--data names a regen folder to read; online training regenerates instead: drop --data or --online"
    elif not online and not args.data:
        problem = "pass --data DIR (a regen folder), or train online with --online (train.data: online)"
    elif args.limit is not None and (not online or args.limit < 1):
        problem = "--limit N (N >= 1) caps the sources of an online run; offline, regen's --limit does that"
    if problem:
        print(f"eaglenest train: {problem}", file=sys.stderr)
        return 2
    try:
        summary = train_drafter(cfg, args.data, args.output, online=online, limit=args.limit)
    except (ValueError, FileNotFoundError) as e:
        print(f"eaglenest train: {e}", file=sys.stderr)
        return 2
    if online:
        o = summary["online"]
        print(f"eaglenest train: online: {sum(e['samples'] for e in o['epochs'])} samples trained over "
              f"{len(o['epochs'])} epoch(s); {o['hidden_state_bytes_written']} hidden-state bytes on disk; ledger "
              f"{o['ledger']}")
    print(f"eaglenest train: export written to {summary['export']}; launch it with:")
    _print_launch(summary["export"])
    return 0


def _print_launch(folder) -> None:
    """Each engine's launch settings for an export folder (also in its README.md)."""
    from pathlib import Path

    from eaglenest.drafters.eagle3.format import read_export_config
    from eaglenest.drafters.eagle3.serving import export_summary

    cfg, _, side = read_export_config(folder)
    print(export_summary(cfg, side.get("format") or "sglang", Path(folder).resolve()))


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="a training checkpoint folder, or a training output folder (its newest checkpoint)")
    parser.add_argument("--output", required=True, help="export folder (config.json + model.safetensors)")
    parser.add_argument("--format", choices=["both", "sglang", "vllm"], default="both",
                        help="which engines the folder is for: both (default: SGLang's ids in eagle_config, vLLM's "
                             "physical ids at the top level; one folder loads right in either), sglang, or vllm")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--no-embedding", action="store_true",
                        help="omit embed_tokens.weight (the engines then share the target's embedding)")


def run_export(args: argparse.Namespace) -> int:
    from eaglenest.drafter.export import export_checkpoint

    try:
        out = export_checkpoint(args.checkpoint, args.output, fmt=args.format, dtype=args.dtype,
                                include_embedding=not args.no_embedding)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"eaglenest export: {e}", file=sys.stderr)
        return 2
    print(f"eaglenest export: wrote {out} (format {args.format}); launch it with:")
    _print_launch(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m eaglenest.drafter.cli train|export ...`` (the same as ``eaglenest train|export``)."""
    parser = argparse.ArgumentParser(prog="python -m eaglenest.drafter.cli")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_arguments(sub.add_parser("train"))
    add_export_arguments(sub.add_parser("export"))
    args = parser.parse_args(argv)
    return run_train(args) if args.command == "train" else run_export(args)


if __name__ == "__main__":
    sys.exit(main())
