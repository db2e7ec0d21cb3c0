"""``eaglenest tune``: a schedule (batch bucket -> speculative config, or off) measured on the serving engine.

    eaglenest tune --config configs/demo.yaml --drafter out/train/export --output out/tune
    eaglenest tune --config configs/gpu-small.yaml --drafter D --batch-sizes 1,2,4,8,16,32,64,128,256 --output out/tune

Measures tok/s of the plain engine (the baseline), of speculation off and of every candidate shape at each batch
size (``eaglenest bench``'s engines and loop: the transformers reference decoder on CPU, SGLang on GPUs), with
repeats and a drift check, and writes into the output folder ``measurements.jsonl`` (kept as it goes: re-run the same
command after a kill and it continues), ``schedule.json`` (serve it with ``serve.schedule``), ``schedule.md`` and
``schedule.png`` (the curves). The schedule records target, drafter and engine: serve refuses it for anything else.
``--verify`` then measures the schedule as serve launches it beside the measurements that chose it (on SGLang one
engine start more, then the baseline's drift run) and writes ``verify/bench-sweep.{json,md,png}``: what ``eaglenest
bench --schedule`` reports, without a second run of the baseline and of every static config.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="eaglenest YAML (target, tune, serve sections); flags override it")
    p.add_argument("--drafter", default=None, help="drafter export folder (default: tune/bench/serve.drafter)")
    p.add_argument("--prompts", default=None, help="held-out prompts JSONL (default: tune.prompts, bench.prompts)")
    p.add_argument("--batch-sizes", default=None, help="comma-separated, e.g. 1,2,4,8,16,32,64,128,256")
    p.add_argument("--steps", default=None, help="chain candidates (num_steps, topk 1), e.g. 1,2,3,5,7")
    p.add_argument("--trees", default=None, help="topk > 1 shapes steps-topk-tokens, e.g. 5-4-8 ('' for none)")
    p.add_argument("--temperatures", default=None, help="comma-separated, e.g. 0,0.7 (a choice must hold at each)")
    p.add_argument("--repeats", type=int, default=None, help="rounds per measurement (>= 2: their spread is the noise)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--num-prompts", type=int, default=None, help="prompts per measurement at least")
    p.add_argument("--noise-floor", type=float, default=None, help="smallest relative difference treated as real")
    p.add_argument("--engine", choices=["hf", "sglang"], default=None, help="default: target.engine of the config")
    p.add_argument("--output", default=None, help="folder for measurements.jsonl, schedule.json/.md/.png")
    p.add_argument("--verify", action="store_true", default=None,
                   help="then measure the schedule beside what chose it, in the same run (output/verify/bench-sweep.*: "
                        "baseline, best static config, schedule; as `eaglenest bench --schedule` reports)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be integers separated by commas, got {text!r}") from None


def _floats(text: str, flag: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be numbers separated by commas, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from eaglenest.bench_cli import parse_sweep
    from eaglenest.config import load_config

    cfg = load_config(args.config)
    tc = cfg.target if args.engine is None else cfg.target.model_copy(update={"engine": args.engine})
    t = cfg.tune
    drafter = args.drafter or cfg.resolve(t.drafter) or cfg.resolve(cfg.bench.drafter) or cfg.resolve(cfg.serve.drafter)
    prompts_path = args.prompts or cfg.resolve(t.prompts) or cfg.resolve(cfg.bench.prompts)
    out = args.output or cfg.resolve(t.output)
    missing = [n for n, v in (("--drafter", drafter), ("--prompts", prompts_path), ("--output", out)) if not v]
    if missing:
        print(f"eaglenest tune: give {', '.join(missing)} (or tune.drafter / tune.prompts / tune.output in --config)",
              file=sys.stderr)
        return 2
    if not Path(drafter).is_dir():
        print(f"eaglenest tune: drafter folder {drafter} does not exist", file=sys.stderr)
        return 2
    try:
        updates = {k: v for k, v in {
            "batch_sizes": _ints(args.batch_sizes, "--batch-sizes") if args.batch_sizes else None,
            "steps": _ints(args.steps, "--steps") if args.steps else None,
            "trees": (parse_sweep(args.trees) if args.trees.strip() else []) if args.trees is not None else None,
            "temperatures": _floats(args.temperatures, "--temperatures") if args.temperatures else None,
            "repeats": args.repeats, "max_new_tokens": args.max_new_tokens, "num_prompts": args.num_prompts,
            "noise_floor": args.noise_floor, "verify": args.verify}.items() if v is not None}
        t = type(t).model_validate({**t.model_dump(), **updates})
    except (ValueError, ValidationError) as e:
        print(f"eaglenest tune: {e}", file=sys.stderr)
        return 2
    if any(tree.topk == 1 for tree in t.trees):
        print("eaglenest tune: --trees takes topk > 1 shapes; chains are --steps", file=sys.stderr)
        return 2
    return _tune(cfg, tc, t, drafter, prompts_path, Path(out), progress=not args.no_progress)


def _tune(cfg, tc, t, drafter: str, prompts_path: str, out: Path, *, progress: bool) -> int:
    from eaglenest.speculative.evaluate import PromptFileError
    from eaglenest.speculative.schedule_plot import summary_lines
    from eaglenest.speculative.tune import TuneError, TuneSettings, candidate_labels
    from eaglenest.speculative.tune_run import engine_options, tune_to_folder

    settings = TuneSettings(batch_sizes=list(t.batch_sizes), candidates=candidate_labels(t.steps, t.trees),
                            temperatures=list(t.temperatures), repeats=t.repeats, max_new_tokens=t.max_new_tokens,
                            num_prompts=t.num_prompts, noise_floor=t.noise_floor, prompts=str(prompts_path),
                            engine_options=engine_options(tc.engine))
    try:
        outcome = tune_to_folder(cfg, tc, settings, drafter, out, verify=bool(t.verify), progress=progress)
    except (PromptFileError, TuneError) as e:
        print(f"eaglenest tune: {e}", file=sys.stderr)
        return 2
    schedule, path = outcome.schedule, outcome.path
    print("\n".join(["eaglenest tune: schedule (batch sizes -> what runs):", *summary_lines(schedule)]))
    if schedule.drift and not schedule.drift["all_within_noise"]:
        w = schedule.drift["worst"]
        print(f"eaglenest tune: WARNING the baseline drifted {100 * w['relative']:+.1f}% at batch {w['batch_size']} "
              f"(noise {100 * w['noise']:.1f}%): the machine was not steady; re-run on a quiet machine",
              file=sys.stderr)
    unsafe = [b.label for b in schedule.buckets if not b.safe]
    if unsafe:
        print(f"eaglenest tune: in bucket(s) {', '.join(unsafe)} even speculation off was slower than the baseline "
              "beyond noise (see schedule.md)", file=sys.stderr)
    print(f"wrote {path}, {out / 'schedule.md'}, {out / 'schedule.png'}; serve it with serve.schedule: {path}")
    return 0
