"""``eaglenest standin-target DIR --sharegpt FILE``: build the GPU stand-in target (see eaglenest.engines.standin).

``--arch llama`` (the default): a small Llama grown to Llama-3-8B's shape. ``--arch deepseek_v3``: a small
DeepseekV3 grown to Kimi-K2.5's widths (``eaglenest.engines.standin_deepseek``; ``--preset small``: hidden 4096, 32
layers, ``--preset tiny``: CPU sizes); ``--routed-experts`` sets how many routed experts the wide model stores (the
size is printed before anything is built).
"""

from __future__ import annotations

import argparse
import json

ARCHS = ("llama", "deepseek_v3")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("output", help="folder to write: model/ (the wide target), base/ (the small one), prompts/")
    p.add_argument("--sharegpt", default=None, help="a ShareGPT JSON-array dump (may be cut short); required unless "
                   "--size-only")
    p.add_argument("--arch", choices=ARCHS, default="llama",
                   help="llama: Llama-3-8B's shape (default); deepseek_v3: Kimi-K2.5's widths (MLA + MoE)")
    p.add_argument("--preset", choices=("default", "small", "tiny"), default="default",
                   help="deepseek_v3 only: default = Kimi-K2.5's widths (hidden 7168, 61 layers); small = hidden 4096, "
                        "32 layers, Kimi's MLA head dims (a shorter GPU session); tiny = CPU-sized shapes of every "
                        "mechanism (smoke runs and tests)")
    p.add_argument("--routed-experts", type=int, default=None,
                   help="deepseek_v3: routed experts per MoE layer in the wide model (default 8; Kimi has 384; "
                        "each costs 5.3 GB at Kimi's widths; those past the small model's are never routed)")
    p.add_argument("--experts-per-token", type=int, default=None,
                   help="deepseek_v3: experts chosen per token, in both models (default 8, Kimi's)")
    p.add_argument("--size-only", action="store_true",
                   help="deepseek_v3: print the wide model's parameters and bytes, build nothing")
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
                   help="JSON object overriding the spec's fields (e.g. a tiny shape for a CPU smoke run); "
                        "'wide' takes a WideShape (llama) or DeepseekWideShape (deepseek_v3) object")


def _spec(args: argparse.Namespace):
    over = json.loads(args.spec_json) if args.spec_json else {}
    if args.steps is not None:
        over["train_steps"] = args.steps
    if args.max_seconds is not None:
        over["max_seconds"] = args.max_seconds
    if args.arch == "llama":
        from eaglenest.engines.standin import StandinSpec
        from eaglenest.engines.widen import WideShape

        if args.preset != "default" or args.routed_experts or args.experts_per_token or args.size_only:
            raise SystemExit("--preset, --routed-experts, --experts-per-token and --size-only are for --arch "
                             "deepseek_v3")
        if "wide" in over:
            over["wide"] = WideShape(**over["wide"])
        return StandinSpec(**over)
    from dataclasses import replace

    from eaglenest.engines.standin_deepseek import DEEPSEEK_PRESETS, with_experts

    base = DEEPSEEK_PRESETS[args.preset]
    if "wide" in over:
        over["wide"] = replace(base.wide, **over["wide"])
    return with_experts(replace(base, **over), args.routed_experts, args.experts_per_token)


def run(args: argparse.Namespace) -> int:
    spec = _spec(args)
    kw = dict(device=args.device, num_train_prompts=args.train_prompts, num_heldout_prompts=args.heldout_prompts,
              train_after_cut=args.train_after_cut, log=lambda m: print(m, flush=True))
    if args.arch == "deepseek_v3":
        from eaglenest.engines.standin_deepseek import build_deepseek_standin, size_report

        size = size_report(spec, spec.vocab_size)
        print(f"deepseek_v3 stand-in: {spec.wide.n_routed_experts} routed experts, {spec.wide.num_experts_per_tok} "
              f"per token: {size['total'] / 1e9:.2f}B parameters = {size['gb']} GB bf16 on disk and on the GPU "
              f"({size['routed'] / 1e9:.2f}B in routed experts), {size['active_per_token'] / 1e9:.2f}B active per "
              "token", flush=True)
        if args.size_only:
            return 0
        if not args.sharegpt:
            raise SystemExit("--sharegpt is required")
        report = build_deepseek_standin(args.sharegpt, args.output, spec, **kw)
    else:
        from eaglenest.engines.standin import build_standin

        if not args.sharegpt:
            raise SystemExit("--sharegpt is required")

        report = build_standin(args.sharegpt, args.output, spec, **kw)
    pre, wide = report["pretrain"], report["wide"]
    print(f"stand-in written to {args.output}: {wide['base_parameters'] / 1e6:.0f}M pre-trained "
          f"({pre['steps']} steps, final loss {pre['final_loss']}) grown to {wide['parameters'] / 1e9:.2f}B; "
          f"prompts {report['prompts']['train']} train / {report['prompts']['heldout']} held out", flush=True)
    return 0
