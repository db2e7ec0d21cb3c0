"""``eaglenest demo``: the whole loop on the embedded tiny target, on a laptop CPU, in one command.

Stages (each reuses its finished output in ``--workdir`` unless ``--fresh``): build the tiny target, generate and
capture (engine smoke check), then the later stages as they exist.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", default="demo-work", help="where every artifact goes (default: ./demo-work)")
    p.add_argument("--config", default=None, help="demo config (default: the packaged configs/demo.yaml)")
    p.add_argument("--fresh", action="store_true", help="redo every stage instead of reusing finished ones")


def _stage(name: str) -> None:
    print(f"\n=== {name} ===", flush=True)


def run(args: argparse.Namespace) -> int:
    from eaglenest.config import load_config
    from eaglenest.engines import SamplingParams, load_engine
    from eaglenest.engines.hf import resolve_model_path

    work = Path(args.workdir).resolve()
    if args.fresh and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    cfg = load_config(args.config or _default_config())
    summary: dict[str, Any] = {"workdir": str(work)}
    t_start = time.perf_counter()

    _stage("1/2 tiny target")
    t0 = time.perf_counter()
    target_path = resolve_model_path(cfg.target)
    summary["target"] = target_path
    print(f"target: {target_path} ({time.perf_counter() - t0:.1f} s)")

    _stage("2/2 generate + capture (engine check)")
    engine = load_engine(cfg.target)
    convs = [[{"role": "user", "content": q}] for q in ("What is 12 plus 7?", "Tell me about alice in paris.")]
    gens = engine.generate(convs, SamplingParams(max_new_tokens=48))
    for conv, g in zip(convs, gens, strict=True):
        print(f"> {conv[0]['content']}\n  {g.text!r} ({len(g.token_ids)} tokens, {g.finish_reason})")
    caps = engine.capture([engine.render_prompt(c) + g.token_ids for c, g in zip(convs, gens, strict=True)])
    h = engine.info.hidden_size
    summary["engine"] = engine.info.engine_version
    summary["aux_layer_ids"] = list(engine.aux_layer_ids)
    summary["captured_tokens"] = sum(c.aux_hidden_states.shape[0] for c in caps)
    summary["bytes_per_token_bf16"] = 8 * h
    summary["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    (work / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _print_summary(summary)
    return 0


def _default_config() -> str:
    here = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
    return str(here)


def _print_summary(summary: dict[str, Any]) -> None:
    _stage("summary")
    width = max(len(k) for k in summary)
    for k, v in summary.items():
        print(f"{k:>{width}}  {v}")
