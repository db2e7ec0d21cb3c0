"""``eaglenest standin-target DIR --sharegpt FILE``: build the GPU stand-in target (see eaglenest.engines.standin)."""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("output", help="folder to write: model/ (the wide target), base/ (the small one), prompts/")
    p.add_argument("--sharegpt", required=True, help="a ShareGPT JSON-array dump (may be cut short)")
    p.add_argument("--device", default="cuda", help="where to pre-train (cuda; cpu only for tiny smoke shapes)")
    p.add_argument("--steps", type=int, default=None, help="pre-training steps (default: the spec's)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop pre-training early past this many seconds (reported; default: run every step)")
    p.add_argument("--train-prompts", type=int, default=2048, help="regen prompts to write (prompts/train.jsonl)")
    p.add_argument("--heldout-prompts", type=int, default=128, help="bench prompts to write (prompts/heldout.jsonl)")
    p.add_argument("--train-after-cut", type=int, default=0,
                   help="up to this many regen prompts from records after the pre-training cut (after the held-out "
                        "ones: conversations the stand-in never saw, like the bench's); the rest from before it")
    p.add_argument("--spec-json", default=None,
                   help="JSON object overriding StandinSpec fields (e.g. a tiny shape for a CPU smoke run); "
                        "'wide' takes a WideShape object")


def run(args: argparse.Namespace) -> int:
    from eaglenest.engines.standin import StandinSpec, build_standin
    from eaglenest.engines.widen import WideShape

    over = json.loads(args.spec_json) if args.spec_json else {}
    if "wide" in over:
        over["wide"] = WideShape(**over["wide"])
    if args.steps is not None:
        over["train_steps"] = args.steps
    if args.max_seconds is not None:
        over["max_seconds"] = args.max_seconds
    spec = StandinSpec(**over)
    report = build_standin(args.sharegpt, args.output, spec, device=args.device,
                           num_train_prompts=args.train_prompts, num_heldout_prompts=args.heldout_prompts,
                           train_after_cut=args.train_after_cut, log=lambda m: print(m, flush=True))
    pre, wide = report["pretrain"], report["wide"]
    print(f"stand-in written to {args.output}: {wide['base_parameters'] / 1e6:.0f}M pre-trained "
          f"({pre['steps']} steps, final loss {pre['final_loss']}) grown to {wide['parameters'] / 1e9:.2f}B; "
          f"prompts {report['prompts']['train']} train / {report['prompts']['heldout']} held out", flush=True)
    return 0
