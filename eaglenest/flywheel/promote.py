"""Promotion: gate -> stage -> swap without downtime -> watch -> keep or roll back, each step in the audit log.

``promote`` is ``eaglenest promote``; a flywheel turn ends with it. Its parts are public so that a caller can put
something between them (the e2e test breaks the staged weights after the gate, as a failed weight sync would).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglenest.flywheel.context import Flywheel
from eaglenest.flywheel.gate import GateDecision, run_gate
from eaglenest.flywheel.store import stage
from eaglenest.flywheel.watch import baseline, rollback, watch


def check_swappable(fw: Flywheel) -> None:
    """Refuse, before a turn trains for hours, a loop whose swap serve would refuse: ``serve.schedule`` records the
    drafter it was tuned with, and every candidate is another drafter."""
    if fw.cfg.serve.schedule:
        raise ValueError(f"serve.schedule ({fw.cfg.serve.schedule}) was tuned for the live drafter, and serve refuses "
                         "it for any other, so no candidate could be swapped in: run the flywheel (or promote) with a "
                         "config without serve.schedule, then `eaglenest tune` the promoted drafter and serve its "
                         "schedule; or gate only (eaglenest promote --no-swap)")


def swap_and_watch(fw: Flywheel, staged: str | Path, decision: GateDecision) -> dict[str, Any]:
    """Swap ``staged`` in (rolling replacement), watch its live accept length, roll back if it falls."""
    from eaglenest.serve import redeploy_drafter

    staged, previous = str(Path(staged).resolve()), decision.live
    base = baseline(fw, previous, staged)
    swap = redeploy_drafter(fw.cfg, staged, app=fw.settings.app, route_prefix=fw.settings.route_prefix,
                            surge_percent=fw.settings.surge_percent)
    fw.metrics.count("promotions")
    fw.save_state(live=staged, previous=previous)
    fw.audit.write("swap", previous=previous, **swap)
    result = watch(fw, staged, base, decision.predicted)
    fw.audit.write("watch", drafter=staged, **result.to_dict())
    out: dict[str, Any] = {"decision": decision.to_dict(), "staged": staged, "swap": swap, "watch": result.to_dict(),
                           "rolled_back": False}
    if result.verdict == "rollback":
        out["rollback"] = rollback(fw, staged, previous, result, decision.digest)
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
