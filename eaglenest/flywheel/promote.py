"""Promotion: gate -> stage -> (re-tune) -> swap without downtime -> watch -> keep or roll back, each step in the
audit log.

``promote`` is ``eaglenest promote``; a flywheel turn ends with it. Its parts are public so that a caller can put
something between them (the e2e test breaks the staged weights after the gate, as a failed weight sync would).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglenest.flywheel.context import Flywheel
from eaglenest.flywheel.gate import GateDecision, run_gate
from eaglenest.flywheel.retune import check_retunable, retune, with_schedule
from eaglenest.flywheel.store import stage
from eaglenest.flywheel.watch import baseline, rollback, watch


def check_swappable(fw: Flywheel) -> None:
    """Refuse, before a turn trains for hours, a loop whose swap could not happen: ``serve.schedule`` records the
    drafter it was tuned with and every candidate is another drafter, so the flywheel re-tunes each candidate
    (``flywheel.retune``), which needs the live schedule's settings and prompts."""
    schedule = fw.live_schedule()
    if not schedule:
        return
    if not fw.settings.retune:
        raise ValueError(f"the application serves schedule {schedule}, tuned for the live drafter, and serve refuses "
                         "it for any other, so no candidate could be swapped in: set flywheel.retune: true (each "
                         "promoted drafter is tuned the same way and swapped in with its own schedule), or gate only "
                         "(eaglenest promote --no-swap)")
    check_retunable(fw, schedule)


def swap_and_watch(fw: Flywheel, staged: str | Path, decision: GateDecision) -> dict[str, Any]:
    """Swap ``staged`` in (rolling replacement), watch its live accept length, roll back if it falls. Where the
    application serves a schedule, ``staged`` is re-tuned first and swapped in with its own schedule (refused, with
    nothing swapped, when that schedule gains less than the live one: :mod:`eaglenest.flywheel.retune`)."""
    from eaglenest.serve import redeploy_drafter

    staged, previous = str(Path(staged).resolve()), decision.live
    out: dict[str, Any] = {"decision": decision.to_dict(), "staged": staged, "swap": None, "watch": None,
                           "rolled_back": False}
    old_schedule = fw.live_schedule()
    cfg, new_schedule = fw.cfg, None
    if old_schedule:
        out["retune"] = retune(fw, staged, old_schedule, Path(staged).name)
        if not out["retune"]["keeps"]:
            return out
        new_schedule = out["retune"]["schedule"]
        cfg = with_schedule(fw.cfg, new_schedule)
    base = baseline(fw, previous, staged)
    swap = redeploy_drafter(cfg, staged, app=fw.settings.app, route_prefix=fw.settings.route_prefix,
                            surge_percent=fw.settings.surge_percent)
    fw.metrics.count("promotions")
    fw.save_state(live=staged, previous=previous,
                  **({"schedule": new_schedule, "previous_schedule": old_schedule} if old_schedule else {}))
    fw.audit.write("swap", previous=previous, schedule=new_schedule, previous_schedule=old_schedule, **swap)
    result = watch(fw, staged, base, decision.predicted)
    fw.audit.write("watch", drafter=staged, **result.to_dict())
    out.update(swap=swap, watch=result.to_dict())
    if result.verdict == "rollback":
        out["rollback"] = rollback(fw, staged, previous, result, decision.digest, schedule=old_schedule)
        out["rolled_back"] = True
    return out


def promote(fw: Flywheel, candidate: str | Path, heldout: list[dict[str, Any]], *, label: str = "manual",
            swap: bool = True) -> dict[str, Any]:
    """Gate ``candidate`` against the live drafter; when it passes (and ``swap``), stage it, swap, watch."""
    decision = run_gate(fw, candidate, heldout)
    if not decision.promote or not swap:
        return {"decision": decision.to_dict(), "staged": None, "swap": None, "watch": None, "rolled_back": False}
    return swap_and_watch(fw, stage(fw.workdir, candidate, label), decision)


__all__ = ["promote", "swap_and_watch"]
