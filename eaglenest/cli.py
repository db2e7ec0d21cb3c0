"""The ``eaglenest`` command line. Subcommands live in their stage's package and are imported only when used."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence

# name -> (module, add-arguments function, run function, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str, str, str]] = {
    "tiny-target": ("eaglenest.tiny_cli", "add_arguments", "run", "build the embedded tiny target into a folder"),
    "standin-target": ("eaglenest.standin_cli", "add_arguments", "run",
                       "build the GPU stand-in target: a small LM pre-trained on a ShareGPT dump, grown to 8B shape"),
    "capture": ("eaglenest.capture_cli", "add_arguments", "run",
                "generate answers with the target and capture its aux hidden states (smoke check of an engine)"),
    "regen": ("eaglenest.regen.cli", "add_arguments", "run",
             "regenerate dataset answers with the target and dump hidden states"),
    "train": ("eaglenest.drafter.cli", "add_train_arguments", "run_train", "train the EAGLE-3 drafter on regen shards"),
    "export": ("eaglenest.drafter.cli", "add_export_arguments", "run_export",
              "export a drafter checkpoint for SGLang / vLLM"),
    "eval": ("eaglenest.drafter.eval_cli", "add_arguments", "run", "accept length of a drafter on held-out prompts"),
    "bench": ("eaglenest.bench_cli", "add_arguments", "run", "speculative vs baseline throughput, with a sweep"),
    "tune": ("eaglenest.tune_cli", "add_arguments", "run",
             "measure speculation vs the baseline per batch size and write a schedule (bucket -> config, or off)"),
    "preflight": ("eaglenest.preflight_cli", "add_arguments", "run",
                 "check a target + drafter + algorithm before serving"),
    "serve": ("eaglenest.serve.cli", "add_arguments", "run",
             "serve the OpenAI-compatible API with speculative decoding"),
    "promote": ("eaglenest.flywheel.cli", "add_promote_arguments", "run_promote",
                "gate a candidate drafter against the live one, swap it in without downtime, watch, roll back"),
    "flywheel": ("eaglenest.flywheel.cli", "add_flywheel_arguments", "run_flywheel",
                 "the loop: served traffic -> capture -> retrain -> gate -> swap -> watch (one turn or on a schedule)"),
    "plan": ("eaglenest.plan_cli", "add_arguments", "run",
             "size a run: samples, tokens, storage per mode (bf16 / fp8 / online), engine and training hours"),
    "demo": ("eaglenest.demo", "add_arguments", "run", "run the whole loop on the embedded tiny target"),
}


def _available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eaglenest",
        description="Turn chat datasets into an EAGLE-3 drafter for a target LLM, and serve it (on Ray).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, add_fn, run_fn, help_text) in SUBCOMMANDS.items():
        if not _available(module):
            continue  # a stage that is not built does not pretend to exist
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=help_text)
        getattr(mod, add_fn)(p)
        p.set_defaults(_run=(module, run_fn))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    module, run_fn = args._run
    from eaglenest.config import ConfigError

    try:
        return int(getattr(importlib.import_module(module), run_fn)(args) or 0)
    except ConfigError as e:
        print(f"eaglenest {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
