"""Re-tune on promotion: a drafter that passed the gate gets its own schedule before it is swapped in.

``serve.schedule`` is bound to the drafter's weights (serve refuses it for any other), and what pays off at each load
depends on the drafter: a candidate that accepts more may speculate at larger batches than the live one did, one that
accepts less may have to stop earlier. So where the application serves a schedule, promotion measures the candidate
with the settings the live schedule was measured with (batch sizes, candidates, temperatures, repeats, prompts),
on this machine's serving engine, and swaps drafter and schedule together; a rollback restores both.

The re-tune is also a second gate, on throughput: in every batch size both schedules measured, the candidate's
schedule must gain at least as much over its own baseline as the live one did over its, within ``flywheel.tolerance``
(or the bucket's measured noise, if larger). A candidate that drafts better but speeds up less (e.g. a deeper chain
the engine pays more for) is refused here, before any replica changes.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from eaglenest.config import EaglenestConfig
from eaglenest.flywheel.context import Flywheel
from eaglenest.speculative.schedule import Schedule


@dataclass
class ScheduleComparison:
    """The candidate's schedule against the live one, bucket by measured batch size."""

    keeps: bool
    rows: list[dict[str, Any]] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare_schedules(live: Schedule, candidate: Schedule, tolerance: float) -> ScheduleComparison:
    """Per batch size both measured: each schedule's choice as a ratio to its own run's baseline (machines drift
    between runs; the ratio does not carry the drift). The candidate loses a bucket when its ratio falls below the
    live one's by more than ``tolerance`` or the bucket's noise in either run."""
    theirs = {b.max_batch: b for b in candidate.buckets if b.measured}
    rows, reasons = [], []
    for b in (b for b in live.buckets if b.measured and b.max_batch in theirs):
        c = theirs[b.max_batch]
        allowance = max(tolerance, b.noise, c.noise)
        lost = c.choice.median_ratio < b.choice.median_ratio * (1 - allowance)
        rows.append({"batch_size": b.max_batch, "live": b.choice.label, "live_x_baseline": b.choice.median_ratio,
                     "candidate": c.choice.label, "candidate_x_baseline": c.choice.median_ratio,
                     "allowance": round(allowance, 4), "lost": lost})
        if lost:
            reasons.append(f"batch {b.max_batch}: the candidate's schedule runs {c.choice.label} at "
                           f"{c.choice.median_ratio:.3f}x its baseline, the live one {b.choice.label} at "
                           f"{b.choice.median_ratio:.3f}x (allowed {100 * allowance:.1f}% less)")
    if not rows:
        reasons.append("the two schedules share no measured batch size")
    return ScheduleComparison(keeps=bool(rows) and not reasons, rows=rows, reasons=reasons)


def with_schedule(cfg: EaglenestConfig, schedule: str | None) -> EaglenestConfig:
    """``cfg`` serving ``schedule`` (None: no schedule)."""
    return cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"schedule": schedule})})


def tune_prompts(fw: Flywheel, live: Schedule) -> str:
    """The prompt file the re-tune decodes: ``flywheel.retune_prompts``, else the live schedule's own (where it is
    on this machine), else ``tune.prompts`` / ``bench.prompts``."""
    recorded = str((live.settings or {}).get("prompts") or "")
    for given in (fw.settings.retune_prompts, recorded, fw.cfg.tune.prompts, fw.cfg.bench.prompts):
        path = fw.cfg.resolve(given) if given else None
        if path and Path(path).is_file():
            return str(path)
    raise FileNotFoundError(f"no prompt file to re-tune with: the live schedule's ({recorded or 'none recorded'}) is "
                            "not on this machine; set flywheel.retune_prompts (or tune.prompts) to held-out prompts")


def check_retunable(fw: Flywheel, schedule_path: str) -> None:
    """Refuse, before a turn trains, a live schedule that cannot be re-tuned (settings or prompts missing)."""
    from eaglenest.speculative.tune_run import settings_of

    live = Schedule.load(schedule_path)
    settings_of(live)
    tune_prompts(fw, live)


def retune(fw: Flywheel, drafter: str, live_schedule: str, label: str) -> dict[str, Any]:
    """Tune ``drafter`` as the live schedule was tuned, compare the two; the audit log's ``retune`` record."""
    from eaglenest.speculative.tune_run import settings_of, tune_to_folder

    t0 = time.time()
    live = Schedule.load(live_schedule)
    settings = replace(settings_of(live), prompts=tune_prompts(fw, live))
    out = fw.workdir / "schedules" / label
    outcome = tune_to_folder(fw.cfg, fw.cfg.target, settings, drafter, out, progress=False)
    comparison = compare_schedules(live, outcome.schedule, fw.settings.tolerance)
    if not comparison.keeps:
        fw.metrics.count("refusals")  # the throughput gate refused it: a refusal like the gate's
    return fw.audit.write("retune", drafter=drafter, live_schedule=live_schedule, schedule=str(outcome.path),
                          buckets={b.label: b.choice.label for b in outcome.schedule.buckets},
                          keeps=comparison.keeps, comparison=comparison.to_dict(), seconds=round(time.time() - t0, 1))


__all__ = ["ScheduleComparison", "check_retunable", "compare_schedules", "retune", "tune_prompts", "with_schedule"]
