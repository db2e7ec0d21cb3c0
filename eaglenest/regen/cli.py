"""``eaglenest regen --config FILE [--output DIR] [--limit N]``: the regen job, locally or as a Ray job.

Works unchanged under ``ray job submit --working-dir . -- eaglenest regen ...`` (the driver attaches to the cluster
through ``RAY_ADDRESS``). Prefer an absolute ``--output`` there: a relative one lands in the job's working folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML config with target: and regen: sections")
    p.add_argument("--output", help="output folder (default: regen.output); rerun with the same folder to resume")
    p.add_argument("--limit", type=int, help="read at most N rows of every source (smoke runs)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of tables")


def run(args: argparse.Namespace) -> int:
    from eaglenest.config import load_config
    from eaglenest.regen.pipeline import run_regen

    if args.limit is not None and args.limit < 1:
        print("eaglenest regen: --limit must be >= 1", file=sys.stderr)
        return 2
    cfg = load_config(args.config)
    summary = run_regen(cfg, args.output, args.limit, log=lambda m: print(m, flush=True))
    print(json.dumps(summary, indent=2, sort_keys=True) if args.json else format_summary(summary), flush=True)
    return 0


def format_summary(s: dict[str, Any]) -> str:
    """Counts per source and per quarantine reason, as the operator reads them at the end of a job."""
    from eaglenest.regen.sources import damage_line

    lines = [f"regen output: {s['output']}",
             f"{'source':<22}{'inputs':>8}{'samples':>9}{'quarantined':>13}{'duplicates':>12}"]
    names = list(s.get("inputs_per_source", {}))
    for n in names + sorted(set(s["samples_per_source"]) - set(names)):
        lines.append(f"{n:<22}{s['inputs_per_source'].get(n, 0):>8}{s['samples_per_source'].get(n, 0):>9}"
                     f"{s.get('quarantined_per_source', {}).get(n, 0):>13}{s['duplicates_per_source'].get(n, 0):>12}")
    lines.append(f"{'total':<22}{sum(s['inputs_per_source'].values()):>8}{s['num_samples']:>9}"
                 f"{s.get('num_quarantined', 0):>13}{sum(s['duplicates_per_source'].values()):>12}")
    lines.append("quarantined per reason: " + (", ".join(f"{r} {n}" for r, n in s["quarantined_per_reason"].items())
                                               or "none"))
    for name, notes in s.get("normalize_notes_per_source", {}).items():
        if any(notes.values()):
            lines.append(f"normalized {name}: {notes.get('leading_turns_dropped', 0)} conversation(s) started with "
                         f"non-user turns (dropped), {notes.get('empty_exchanges_dropped', 0)} exchange(s) with an "
                         "empty turn dropped")
    lines.extend(damage_line(d) for d in s.get("damaged_sources", []))
    run = s.get("last_run", {})
    lines.append(f"this run: {run.get('written', 0)} samples written, {run.get('generated_tokens', 0)} generated "
                 f"tokens, {run.get('truncated_turns', 0)} turns closed at max_new_tokens, "
                 f"{run.get('dropped_turns', 0)} turns cut at max_tokens, "
                 f"{run.get('already_done', 0)} already done, {run.get('wall_seconds', 0)} s")
    lines.append(f"tokens: {s['num_tokens']} ({s['num_loss_tokens']} in the loss), "
                 f"{s['bytes_per_token']:.0f} bytes/token of hidden states ({s['dtype']})")
    return "\n".join(lines)
