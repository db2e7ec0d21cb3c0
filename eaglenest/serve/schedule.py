"""``serve.schedule``: load a tuned schedule, refuse a stale one, decide how the engine applies it, and say so.

- **hf** (the reference decoder): every running batch's size picks its bucket's configuration at every decoding
  step, speculation off included (``SpecDecoder(policy=...)``; off steps defer the drafter's catch-up).
- **routed** (``serve.route.by_load``, either engine): a speculative engine with the configuration safe up to the
  widest load the schedule measured safe for a drafter, beside a plain engine that takes the requests beyond it
  (:mod:`eaglenest.serve.routed`); SGLang uses it only where neither adaptive mode nor one configuration keeps the
  schedule's promise, hf only when asked (its per-step policy is otherwise better).
- **sglang**: SGLang's adaptive speculation configured with each bucket's measured chain candidates
  (``speculative_adaptive_config``); where SGLang refuses adaptive mode (attention DP, multi-layer EAGLE, two-batch
  overlap) or a bucket has no chain within noise of the baseline, one configuration that is safe over
  ``serve.expected_batch_size`` (the plain engine when none is). :meth:`Schedule.sglang_plan` decides; the replica
  logs why at start and /health shows it.

The identity check runs once, in the replica, before any engine starts: a schedule tuned on another target,
drafter or engine is refused with the ``eaglenest tune`` command that fixes it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglenest.config import EaglenestConfig
from eaglenest.speculative.identity import serving_identity
from eaglenest.speculative.schedule import Bucket, Schedule, ScheduleError, SGLangPlan
from eaglenest.speculative.schedule_select import OFF, Option

log = logging.getLogger("eaglenest.serve")


@dataclass
class ServeSchedule:
    """A schedule as one replica applies it."""

    schedule: Schedule
    path: str
    engine: str
    plan: SGLangPlan | None = None
    notes: list[str] = field(default_factory=list)

    def applied(self, b: Bucket) -> Option:
        """What this replica runs in bucket ``b`` (its measured figures where there are some)."""
        off = Option(OFF, 0, 1, 1, 1.0, 1.0, float(b.baseline_tok_per_s or 0.0))
        if self.plan is None:
            return b.choice
        if self.plan.mode == "adaptive":
            return b.chain_choice or off
        if self.plan.mode == "plain" or self.plan.spec is None:
            return off
        if self.plan.mode == "routed" and (b.max_batch is None or b.max_batch > (self.plan.route_limit or 0)):
            return off  # the plain engine takes loads above the limit
        s = self.plan.spec
        label = f"{s.num_steps}-{s.topk}-{s.num_draft_tokens}"
        return next((o for o in b.options if o.label == label),
                    Option(label, s.num_steps, s.topk, s.num_draft_tokens, 0.0, 0.0, 0.0))

    def describe(self) -> list[str]:
        """One line per bucket: what runs there."""
        return [f"batch {b.label}: {self.applied(b).label}" for b in self.schedule.buckets]

    def health(self) -> dict[str, Any]:
        return {"path": self.path, "mode": self.plan.mode if self.plan else "per-step", "notes": self.notes,
                "buckets": {b.label: self.applied(b).label for b in self.schedule.buckets}}


def prepare_schedule(cfg: EaglenestConfig, drafter: str | None, *, check: bool = True,
                     driver: bool = False) -> ServeSchedule | None:
    """The configured schedule, checked against what this replica serves (None without ``serve.schedule``).

    ``driver``: checked where ``eaglenest serve`` runs, before anything is deployed: everything for the hf engine
    (it runs there too), only the target (when its folder is here) and drafter for SGLang (the head node of a cluster
    has no GPU to describe the engine by; each replica checks the engine before its engine starts)."""
    if not cfg.serve.schedule:
        return None
    path = str(cfg.resolve(cfg.serve.schedule))
    if drafter is None:
        raise ScheduleError(f"serve.schedule ({path}) was tuned for a drafter: give serve.drafter (or --drafter), "
                            "or remove serve.schedule to serve without speculation")
    schedule = Schedule.load(path)
    if check:
        fix = (f"eaglenest tune --config <this serving config> --drafter {drafter} --output {Path(path).parent} "
               "(on this machine and engine)")
        parts: tuple[str, ...] = ("target", "drafter", "engine")
        if driver and cfg.target.engine == "sglang":
            from eaglenest.engines.location import local_target_folder

            parts = ("target", "drafter") if local_target_folder(cfg) is not None else ("drafter",)
        schedule.check(serving_identity(cfg.target, drafter, parts=parts), path=path, fix=fix, parts=parts)
    expected = cfg.serve.expected_batch_size or [1, cfg.serve.max_concurrent_requests]
    route = cfg.serve.route
    if cfg.target.engine != "sglang":
        routed = schedule.route_plan(expected[0], route.limit) if route.by_load else None
        if routed is not None:
            return ServeSchedule(schedule, path, "hf", routed, [ROUTED_HEAD, *routed.notes])
        notes = ["hf: each running batch's size picks its bucket's configuration at every decoding step (off "
                 "included)"]
        if route.by_load:
            notes.append("serve.route.by_load is on, but no load the schedule measured is safe for a drafter: "
                         "routing is off")
        return ServeSchedule(schedule, path, "hf", None, notes)
    plan = schedule.sglang_plan(cfg.target.sglang.extra_args, expected=(expected[0], expected[1]), provenance=path,
                                route=route.by_load, route_limit=route.limit)
    head = {"adaptive": "sglang: adaptive speculation with each bucket's measured chain candidates",
            "static": "sglang: one static configuration for every batch size",
            "plain": "sglang: no drafter (the schedule does not speculate under these settings)",
            "routed": ROUTED_HEAD}[plan.mode]
    return ServeSchedule(schedule, path, "sglang", plan, [head, *plan.notes])


ROUTED_HEAD = ("two engines routed by live load (serve.route.by_load): a speculative one for low load, a plain one "
               "beyond it")


def log_schedule(s: ServeSchedule) -> None:
    """What an operator needs to read at start."""
    log.info("serving schedule %s", s.path)
    for line in [*s.notes, *s.describe()]:
        log.info("  %s", line)
