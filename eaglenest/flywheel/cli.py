"""``eaglenest flywheel`` (the loop, one turn or one every ``flywheel.every_s``) and ``eaglenest promote`` (the gate,
then a swap and the watch). Both attach to the Ray cluster that serves the application (``RAY_ADDRESS``, or run them
with ``ray job submit``): the swap and the watch go through Ray Serve and the per-drafter counts there."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_ROLLED_BACK = 3


def add_flywheel_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="the serving config with its flywheel: section")
    p.add_argument("--serve", default=None, help="the application: its base URL or its Ray Serve name "
                   "(default flywheel.url / flywheel.app)")
    p.add_argument("--once", action="store_true", help="one turn, then exit (for cron or a scheduled Ray job)")


def add_promote_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="the serving config (target, serve.spec; flywheel: thresholds)")
    p.add_argument("--serve", default=None, help="the application: its base URL or its Ray Serve name")
    p.add_argument("--candidate", required=True, help="drafter export folder to gate (and swap in if it passes)")
    p.add_argument("--heldout", default=None, help="traffic records (JSONL) the candidate never trained on; default: "
                   "the latest flywheel turn's held-out split, else the traffic log's newest records")
    p.add_argument("--no-swap", action="store_true", help="gate only: print and audit the decision")


def _attach(need_cluster: bool) -> None:
    from eaglenest.runtime import running_cluster_address, start_or_attach

    if need_cluster and running_cluster_address() is None:
        raise ConnectionError("no running Ray cluster to attach to: the swap and the watch go through the Ray Serve "
                              "that serves the application; run this with RAY_ADDRESS set, next to `ray start`, or "
                              "as `ray job submit -- eaglenest ...`")
    start_or_attach(include_dashboard=False)


def _heldout(fw: Any, given: str | None) -> list[dict[str, Any]]:
    from eaglenest.flywheel.gate import heldout_prompts
    from eaglenest.flywheel.traffic import read_traffic

    if given:
        return heldout_prompts(fw, given)
    turns = sorted(fw.workdir.glob("turn-*/traffic/heldout.jsonl"))
    if turns:
        return heldout_prompts(fw, turns[-1])
    from eaglenest.contracts.traffic import as_prompt

    records, _, _ = read_traffic(fw.traffic_folder())
    return [as_prompt(r) for r in records[-fw.settings.max_heldout:]]


def run_promote(args: argparse.Namespace) -> int:
    from eaglenest.config import load_config
    from eaglenest.flywheel.context import Flywheel
    from eaglenest.flywheel.promote import check_swappable, promote

    cfg = load_config(args.config)
    try:
        fw = Flywheel.create(cfg, args.config, serve=args.serve)
        heldout = _heldout(fw, args.heldout)
        if not heldout:
            raise ValueError("no held-out traffic to gate on: pass --heldout FILE or let traffic reach the log")
        if not args.no_swap:  # the gate alone needs no Ray (its metrics record without one)
            check_swappable(fw)
            _attach(need_cluster=True)
        out = promote(fw, args.candidate, heldout, swap=not args.no_swap)
    except (ValueError, FileNotFoundError, ConnectionError) as e:
        print(f"eaglenest promote: {e}", file=sys.stderr)
        return EXIT_USAGE
    _print(out)
    if not out["decision"]["promote"] or ("retune" in out and not out["retune"]["keeps"]):
        return EXIT_REFUSED
    return EXIT_ROLLED_BACK if out["rolled_back"] else 0


def run_flywheel(args: argparse.Namespace) -> int:
    from eaglenest.config import load_config
    from eaglenest.flywheel.context import Flywheel
    from eaglenest.flywheel.promote import check_swappable
    from eaglenest.flywheel.turn import run_turn

    cfg = load_config(args.config)
    try:
        fw = Flywheel.create(cfg, args.config, serve=args.serve)
        check_swappable(fw)
        every = fw.settings.every_s
        if not args.once and every is None:
            raise ValueError("set flywheel.every_s (seconds between turns) or pass --once")
        _attach(need_cluster=True)
        while True:
            out = run_turn(fw)
            print(f"eaglenest flywheel: turn {out['turn']}: {out['outcome']} (audit {fw.audit.path})", flush=True)
            if args.once:
                return 0
            time.sleep(every or 0)
    except (ValueError, FileNotFoundError, ConnectionError) as e:
        print(f"eaglenest flywheel: {e}", file=sys.stderr)
        return EXIT_USAGE


def _print(out: dict[str, Any]) -> None:
    d = out["decision"]
    print(f"gate: {'PROMOTE' if d['promote'] else 'REFUSE'} {d['candidate']} (live {d['live']})")
    for reason in d["reasons"]:
        print(f"  - {reason}")
    for name, pair in d["sets"].items():
        print(f"  {name}: candidate {pair['candidate']['accept_length']:.3f} vs live "
              f"{pair['live']['accept_length']:.3f} on {pair['prompts']} prompts")
    if out.get("retune"):
        r = out["retune"]
        print(f"re-tune: {'KEEPS' if r['keeps'] else 'REFUSE'} {r['schedule']} ({r['seconds']} s; batch -> what runs: "
              + ", ".join(f"{k}: {v}" for k, v in r["buckets"].items()) + ")")
        for reason in r["comparison"]["reasons"]:
            print(f"  - {reason}")
    if out.get("watch"):
        w = out["watch"]
        print(f"swap: {out['staged']} in {out['swap']['old_drained_s']} s; watch: {w['verdict']}: {w['reason']}")
    if out.get("rolled_back"):
        print(f"ROLLED BACK to {out['rollback']['restored']} (alert: {out['rollback']['alert_delivery']})")
    print(json.dumps({k: v for k, v in out.items() if k != "decision"}, default=str)[:2000])
