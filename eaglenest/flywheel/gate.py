"""The promotion gate: preflight, then candidate vs live drafter on held-out recent traffic and the regression set.

A candidate is promoted only if it wins on the held-out traffic by ``flywheel.margin`` (relative) and loses on no
prompt set and no domain by more than ``flywheel.tolerance`` (relative): a fine-tune that gains on today's traffic
but forgets the original data is refused (a Kimi-K2.6 fine-tune lost to its base drafter on K2.7 traffic). Both
drafters are measured on the same prompts, through the same target engine, at the serving config
(:mod:`eaglenest.flywheel.measure`). The decision and every number go to the audit log.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eaglenest.contracts.traffic import as_prompt
from eaglenest.flywheel.context import Flywheel
from eaglenest.flywheel.store import digest
from eaglenest.flywheel.traffic import load_jsonl

NO_DRAFTER = {"accept_length": 1.0, "requests": 0, "verify_steps": 0, "per_domain": {}}
"""what the target alone 'accepts' (one token per forward): the bar for the first drafter"""


@dataclass
class GateDecision:
    """What the gate decided, and why."""

    promote: bool
    candidate: str
    live: str | None
    reasons: list[str]
    sets: dict[str, dict[str, Any]] = field(default_factory=dict)
    """prompt set -> {"live": measurement, "candidate": measurement}"""
    preflight: list[str] = field(default_factory=list)
    digest: str | None = None
    """the candidate's weights as measured (the watch tells a changed deployment from a bad drafter)"""

    @property
    def predicted(self) -> float | None:
        """The candidate's accept length on held-out traffic: what the watch expects live."""
        held = self.sets.get("heldout")
        return held["candidate"]["accept_length"] if held else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "predicted": self.predicted}


def losses(live: dict[str, Any], cand: dict[str, Any], tolerance: float) -> list[tuple[str, float, float]]:
    """``[(where, live, candidate)]`` for one prompt set's measurements: where the candidate's accept length is below
    the live drafter's by more than ``tolerance`` (relative), overall (``""``) or in a domain (``"/domain"``)."""
    checks = [("", live["accept_length"], cand["accept_length"])]
    if len(cand["per_domain"]) > 1:
        checks += [(f"/{d}", live["per_domain"].get(d, 1.0), v) for d, v in cand["per_domain"].items()]
    return [(label, lv, cv) for label, lv, cv in checks if cv < lv * (1 - tolerance)]


def decide(sets: dict[str, dict[str, Any]], *, margin: float, tolerance: float) -> tuple[bool, list[str]]:
    """(promote, reasons): a win on ``heldout`` by ``margin``, no loss over ``tolerance`` on any set or domain."""
    reasons: list[str] = []
    held = sets.get("heldout")
    if held is None:
        return False, ["no held-out traffic to measure on"]
    live, cand = held["live"]["accept_length"], held["candidate"]["accept_length"]
    if cand < live * (1 + margin):
        reasons.append(f"does not win on held-out traffic: accept length {cand:.3f} vs live {live:.3f} (needs "
                       f"{live * (1 + margin):.3f}, flywheel.margin {margin:g})")
    for name, pair in sets.items():
        for label, lv, cv in losses(pair["live"], pair["candidate"], tolerance):
            reasons.append(f"loses on {name}{label}: {cv:.3f} vs live {lv:.3f} (more than flywheel.tolerance "
                           f"{tolerance:g})")
    return not reasons, reasons or [f"wins on held-out traffic ({cand:.3f} vs {live:.3f}) and loses nowhere beyond "
                                    f"{tolerance:g}"]


def heldout_prompts(fw: Flywheel, path: str | Path) -> list[dict[str, Any]]:
    """The gate's held-out traffic (a turn's ``heldout.jsonl``) as prompts, at most ``flywheel.max_heldout``."""
    return [as_prompt(r) for r in load_jsonl(path)][-fw.settings.max_heldout:]


def run_gate(fw: Flywheel, candidate: str | Path, heldout: list[dict[str, Any]], *,
             live: str | None = None) -> GateDecision:
    """Preflight ``candidate`` for the serving config, measure it and the live drafter, decide, audit."""
    from eaglenest.drafters.preflight import preflight_for_config
    from eaglenest.engines.location import local_target_folder

    candidate = str(Path(candidate).resolve())
    live = fw.live_drafter() if live is None else live
    report = preflight_for_config(fw.cfg, candidate, folder=local_target_folder(fw.cfg))
    lines = [f"{'ok' if c.ok else 'FAIL'} {c.name}: {c.message}" + (f" (fix: {c.fix})" if c.fix else "")
             for c in report.checks]
    if not report.ok:
        reasons = [f"preflight refused it: [{c.name}] {c.message}" + (f"; fix: {c.fix}" if c.fix else "")
                   for c in report.failures]
        return _record(fw, GateDecision(False, candidate, live, reasons, preflight=lines))
    sets = {k: v for k, v in {"heldout": heldout, "regression": fw.regression_prompts()}.items() if v}
    live_m = fw.measurer.measure_sets(live, sets) if live and sets else {k: NO_DRAFTER for k in sets}
    cand_m = fw.measurer.measure_sets(candidate, sets) if sets else {}
    measured = {k: {"live": live_m[k], "candidate": cand_m[k], "prompts": len(v)} for k, v in sets.items()}
    ok, reasons = decide(measured, margin=fw.settings.margin, tolerance=fw.settings.tolerance)
    return _record(fw, GateDecision(ok, candidate, live, reasons, measured, lines, digest(candidate)))


def _record(fw: Flywheel, d: GateDecision) -> GateDecision:
    for name, pair in d.sets.items():
        for role in ("live", "candidate"):
            fw.metrics.gate(role, name, pair[role]["accept_length"])
    if not d.promote:
        fw.metrics.count("refusals")
    fw.audit.write("gate", decision="promote" if d.promote else "refuse", **d.to_dict(),
                   margin=fw.settings.margin, tolerance=fw.settings.tolerance)
    return d


__all__ = ["GateDecision", "decide", "heldout_prompts", "losses", "run_gate"]
