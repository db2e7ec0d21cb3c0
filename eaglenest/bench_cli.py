"""``eaglenest bench``: speculative decoding vs the plain baseline on the same engine, with a sweep.

    eaglenest bench --target tiny --drafter out/train/export --prompts tests/fixtures/prompts/heldout.jsonl \\
        --sweep 2-1-3,3-1-4,4-3-8 --output out/bench
    eaglenest bench --config configs/demo.yaml            # target + bench sections (bench.drafter or serve.drafter)
    eaglenest bench ... --engine sglang                   # same command shape on SGLang (GPU)
    eaglenest bench ... --drafter llama=out/a/export --drafter mla=out/b/export   # two drafters, one baseline
    eaglenest bench --target tiny --drafter out/train/export --suite mt-bench,humaneval --num-prompts 16
    eaglenest bench ... --batch-size 1,2,4,8 --schedule out/tune/schedule.json   # baseline, best static, schedule

Prints tok/s, accept length and speedup per config, the best config, and says plainly when speculation loses.
Writes ``bench.json``, ``bench.md`` and ``bench.png`` into the output folder (``bench-bs<N>.*`` per batch size,
and ``bench-sweep.*``: baseline, best static config and schedule side by side). ``--fail-if-slower`` exits 1 when no
config beats the baseline (for scripts and CI).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="eaglenest YAML (target + bench sections); flags override it")
    p.add_argument("--target", default=None, help="'tiny', a local HF model folder or a hub id")
    p.add_argument("--drafter", action="append", default=None, metavar="[LABEL=]PATH",
                   help="drafter export folder; give it several times (optionally LABEL=PATH) to compare drafters "
                        "against one baseline in one run (configs are then named LABEL:steps-topk-tokens)")
    p.add_argument("--prompts", default=None, help="JSONL of prompts ({'messages': [...], 'domain': ...})")
    p.add_argument("--suite", default=None,
                   help="instead of --prompts: comma-separated prompt suites (mt-bench, humaneval, bfcl, sharegpt, or "
                        "a JSONL file; eaglenest.speculative.suites), --num-prompts of each; MT-Bench's second turns "
                        "follow the target's own greedy answers (hf engine; on sglang first turns only)")
    p.add_argument("--engine", choices=["hf", "sglang"], default=None, help="default: target.engine of the config")
    p.add_argument("--sweep", default=None,
                   help="comma-separated num_steps-topk-num_draft_tokens configs, e.g. 2-1-3,3-1-4,4-4-8")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--batch-size", default=None,
                   help="batch size, or several comma-separated (e.g. 1,8: with SGLang each engine starts once and "
                        "is measured at each; one report per batch size)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--output", default=None, help="folder for bench.json, bench.md and bench.png")
    p.add_argument("--ceiling", action="store_true",
                   help="SGLang: also run each config with every draft token accepted (SGLang's own "
                        "SGLANG_SIMULATE_ACC_LEN): the speedup a perfect drafter of this shape would give")
    p.add_argument("--no-drift-check", action="store_true",
                   help="SGLang: skip the baseline's second run after the sweep (saves an engine start)")
    p.add_argument("--fail-if-slower", action="store_true", help="exit 1 when speculation loses")
    p.add_argument("--schedule", default=None,
                   help="a tuned schedule (eaglenest tune's schedule.json) measured as one more variant, as serve "
                        "applies it; default sweep: its candidates, default batch sizes: its measured ones")


def parse_sweep(text: str):
    """``"3-1-4,5-4-8"`` -> SpecConfigs (validated: topk 1 needs steps + 1 tokens, budget fits the tree)."""
    from eaglenest.config import SpecConfig

    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        parts = item.split("-")
        if len(parts) != 3 or not all(x.isdigit() for x in parts):
            raise ValueError(f"sweep item {item!r} must be num_steps-topk-num_draft_tokens, e.g. 3-1-4")
        s, k, n = (int(x) for x in parts)
        out.append(SpecConfig(num_steps=s, topk=k, num_draft_tokens=n))
    if not out:
        raise ValueError("--sweep is empty; e.g. --sweep 3-1-4")
    return out


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from eaglenest.config import load_config
    from eaglenest.speculative.bench import plot_bench, report_markdown, run_bench_batches
    from eaglenest.speculative.evaluate import PromptFileError, load_prompts

    cfg = load_config(args.config)
    tc, bc = cfg.target, cfg.bench
    updates = {k: v for k, v in {"model": args.target, "device": args.device, "dtype": args.dtype,
                                 "engine": args.engine}.items() if v is not None}
    tc = tc.model_copy(update=updates)
    given = args.drafter or [x for x in (cfg.resolve(bc.drafter) or cfg.resolve(cfg.serve.drafter),) if x]
    prompts_path = None if args.suite else (args.prompts or cfg.resolve(bc.prompts))
    if not given or not (prompts_path or args.suite) or (args.suite and args.prompts):
        print("eaglenest bench: give --drafter and --prompts or --suite (or bench.drafter / bench.prompts in "
              "--config)", file=sys.stderr)
        return 2
    try:
        drafters = parse_drafters(given)
    except ValueError as e:
        print(f"eaglenest bench: {e}", file=sys.stderr)
        return 2
    drafter = drafters[None] if list(drafters) == [None] else drafters
    try:
        sweep = parse_sweep(args.sweep) if args.sweep else list(bc.sweep)
        if args.suite:
            from eaglenest.speculative.suites import load_suite

            records = [r for n in args.suite.split(",") if n.strip()
                       for r in load_suite(n.strip(), args.num_prompts or bc.num_prompts)[0]]
            prompts_path = args.suite
        else:
            records = load_prompts(prompts_path, args.num_prompts or bc.num_prompts)
    except (ValueError, ValidationError, PromptFileError) as e:
        print(f"eaglenest bench: {e}", file=sys.stderr)
        return 2
    try:
        batch_sizes = parse_batch_sizes(args.batch_size) if args.batch_size else [bc.batch_size]
    except ValueError as e:
        print(f"eaglenest bench: {e}", file=sys.stderr)
        return 2
    schedule = None
    if args.schedule:
        try:
            schedule, sweep, batch_sizes = _with_schedule(args, tc, drafters, sweep, batch_sizes)
        except ValueError as e:
            print(f"eaglenest bench: {e}", file=sys.stderr)
            return 2
    common = {"max_new_tokens": args.max_new_tokens or bc.max_new_tokens, "repeats": args.repeats or bc.repeats,
              "batch_sizes": batch_sizes, "temperature": args.temperature}
    whole = schedule is not None or max(batch_sizes) > len(records)  # every batch size runs whole batches
    if schedule is not None:
        common["plans"] = {"schedule": schedule}
    if tc.engine == "hf":
        if args.ceiling:
            print("eaglenest bench: --ceiling needs --engine sglang (it uses SGLang's acceptance simulation)",
                  file=sys.stderr)
            return 2
        from eaglenest.engines.hf import HFEngine

        engine = HFEngine.from_config(tc)
        prompts = _prompt_list(engine, records, common["max_new_tokens"])
        reports = run_bench_batches(engine, drafter, prompts, sweep, engine="hf", **common,
                                    prompts_for=_whole_batches(prompts) if whole else None)
    else:
        reports = _run_sglang(tc, drafter, records, sweep,
                              {**common, "ceiling": args.ceiling, "drift_check": not args.no_drift_check},
                              expected=(1, max(batch_sizes)), whole=whole, serve=cfg.serve)
    out_dir = args.output or cfg.resolve(bc.output)
    wins = True
    for report in reports:
        report.update({"target": tc.model, "prompts": str(prompts_path),
                       "drafter": str(drafter) if isinstance(drafter, (str, Path)) else None,
                       "drafters": {str(k): str(v) for k, v in drafters.items()}})
        print(report_markdown(report))
        if out_dir:
            out = Path(out_dir)
            out.mkdir(parents=True, exist_ok=True)
            stem = "bench" if len(reports) == 1 else f"bench-bs{report['batch_size']}"
            (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
            (out / f"{stem}.md").write_text(report_markdown(report))
            if report["configs"]:  # every config failed: the report says why, there is nothing to plot
                plot_bench(report, out / f"{stem}.png")
            print(f"wrote {out / stem}.json, .md, .png")
        if not report["speculation_wins"]:
            print(f"batch {report['batch_size']}: {report['verdict']}", file=sys.stderr)
            wins = False
    if len(reports) > 1:
        from eaglenest.speculative.bench_report import write_sweep

        write_sweep(reports, Path(out_dir) if out_dir else None)
    if not wins and args.fail_if_slower:
        return 1
    return 0


def parse_drafters(items: list[str]) -> dict[str | None, str]:
    """``["a/export"]`` -> ``{None: "a/export"}``; several -> ``{label: folder}``, each ``LABEL=PATH`` or a bare
    folder labelled by its name (its parent's name for an ``export`` folder). Folders must exist, labels differ."""
    pairs: list[tuple[str, str]] = []
    for item in items:
        label, sep, path = item.partition("=")
        if not sep or Path(item).is_dir():
            p = Path(item)
            label, path = (p.parent.name if p.name == "export" else p.name), item
        if not Path(path).is_dir():
            raise ValueError(f"drafter folder {path} does not exist")
        pairs.append((label, path))
    if len(pairs) == 1 and "=" not in items[0]:
        return {None: pairs[0][1]}
    labels = [label for label, _ in pairs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"drafter labels must differ, got {labels}; name them with LABEL=PATH")
    return dict(pairs)


def parse_batch_sizes(text: str) -> list[int]:
    """``"1,8"`` -> [1, 8]; every size a positive integer, no repeats."""
    try:
        sizes = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--batch-size must be integers separated by commas (e.g. 1,8), got {text!r}") from None
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise ValueError(f"--batch-size must list distinct positive integers, got {text!r}")
    return sizes


def _prompt_list(engine, records: list[dict], max_new_tokens: int) -> list[list[int]]:
    """Token ids of every prompt; a suite's later turns follow the target's own greedy answers to the earlier ones."""
    from eaglenest.engines.base import SamplingParams
    from eaglenest.speculative.evaluate import prompt_ids
    from eaglenest.speculative.suite_eval import conversation_prompts

    def ids_of(messages, record):
        return prompt_ids(engine.tokenizer, {"messages": messages, "tools": record.get("tools")})

    def answers(ids):
        sp = SamplingParams(max_new_tokens=max_new_tokens)
        return [g.text for i in range(0, len(ids), 16) for g in engine.generate_ids(ids[i:i + 16], sp)]

    if not any(r.get("followups") for r in records):
        return [prompt_ids(engine.tokenizer, r) for r in records]
    return conversation_prompts(records, answers, ids_of)


def _run_sglang(tc, drafter, records, sweep, common, *, expected: tuple[int, int] = (1, 256), whole: bool = False,
                serve: Any = None):
    from eaglenest.engines.sglang.engine import SGLangEngine
    from eaglenest.speculative.bench import run_bench_batches
    from eaglenest.speculative.evaluate import prompt_ids
    from eaglenest.speculative.sglang_variants import sglang_factory

    probe = SGLangEngine(tc)  # tokenizer + chat template only; the engine itself starts lazily
    if any(r.get("followups") for r in records):
        print("eaglenest bench: on sglang the suites' first turns only (later turns need the target's answers; "
              "eaglenest eval --suite asks them)", file=sys.stderr)
    prompts = [prompt_ids(probe.tokenizer, r) for r in records]
    return run_bench_batches(None, drafter, prompts, sweep, engine="sglang",
                             sglang_factory=sglang_factory(tc, expected, serve),
                             prompts_for=_whole_batches(prompts) if whole else None, **common)


def _whole_batches(prompts):
    """At each batch size, whole batches over at least the given prompts (cycled): batch 256 runs 256 at once."""
    from eaglenest.speculative.tune import prompts_for

    return lambda bs: prompts_for(prompts, bs, len(prompts))


def _with_schedule(args, tc, drafters, sweep, batch_sizes):
    """The schedule (checked against this target, drafter and engine), and the sweep and batch sizes it implies
    unless given: its candidates, its measured batch sizes."""
    from eaglenest.speculative.identity import serving_identity
    from eaglenest.speculative.schedule import Schedule

    if list(drafters) != [None]:
        raise ValueError("--schedule is measured on the drafter it was tuned for: give one --drafter")
    schedule = Schedule.load(args.schedule)
    schedule.check(serving_identity(tc, drafters[None]), path=args.schedule,
                   fix=f"eaglenest tune --config {args.config} --drafter {drafters[None]}")
    if not args.sweep and schedule.settings.get("candidates"):
        sweep = parse_sweep(",".join(schedule.settings["candidates"]))
    if not args.batch_size:
        batch_sizes = [b.max_batch for b in schedule.buckets if b.measured]
    return schedule, sweep, batch_sizes
