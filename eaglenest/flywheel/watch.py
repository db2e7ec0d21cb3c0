"""The post-swap watch: the new drafter's live accept length over its first requests, and the rollback.

The gate measured the candidate offline; what matters is what the server does with the bytes that reached it. A
weight sync that silently broke a drafter (accept length 2.71 -> 1.00, no error anywhere) passes every offline check.
So after a swap the watch waits for ``flywheel.watch.requests`` requests that drafted on the new drafter (per-drafter
counts: ``eaglenest.serve.read_live_stats``) and pools their accept length. It is compared with the previous drafter's
level over its last as many requests before the swap (or, without one, with the gate's prediction): more than
``flywheel.watch.tolerance`` below it means a rollback to the previous drafter (the same rolling replacement), an
alert (webhook + ``eaglenest_flywheel_rollbacks``) and the audit entry. Fewer than ``min_requests`` by
``timeout_s`` is inconclusive: the swap stays and the audit says so.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from eaglenest.contracts.metrics import accept_length
from eaglenest.flywheel.audit import send_alert
from eaglenest.flywheel.context import Flywheel
from eaglenest.flywheel.retune import with_schedule
from eaglenest.flywheel.store import digest

ROLLBACK_ALERT = "EaglenestDrafterRolledBack"


@dataclass
class Baseline:
    """Where the drafters stood when the swap began."""

    previous_level: float | None
    previous_requests: int
    new_requests: int
    new_verify_steps: int
    new_accepted: int


@dataclass
class WatchResult:
    verdict: str
    """``keep``, ``rollback`` or ``inconclusive``"""
    live_accept_length: float | None
    requests: int
    previous_level: float | None
    predicted: float | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def baseline(fw: Flywheel, previous: str | None, new: str) -> Baseline:
    """The previous drafter's recent level and the new drafter's counts so far (read before the swap)."""
    from eaglenest.serve import read_live_stats

    n = fw.settings.watch.requests
    stats = read_live_stats(fw.settings.app, last=n)
    prev = stats.get(previous or "", {})
    cur = stats.get(new, {})
    return Baseline(prev.get("recent_accept_length") if prev.get("recent_requests") else None,
                    int(prev.get("recent_requests", 0)), int(cur.get("requests", 0)),
                    int(cur.get("verify_steps", 0)), int(cur.get("accepted_tokens", 0)))


def judge(live: float | None, requests: int, base: Baseline, predicted: float | None, *, tolerance: float,
          min_requests: int) -> tuple[str, str]:
    """(verdict, reason) for the new drafter's live accept length (None: no request drafted)."""
    if live is None or requests < min_requests:
        return "inconclusive", f"only {requests} request(s) drafted on the new drafter (needs {min_requests})"
    ref, what = (base.previous_level, "the previous drafter's recent level") if base.previous_level is not None \
        else (predicted, "the gate's prediction")
    if ref is None:
        return "keep", f"live accept length {live:.3f}; nothing to compare it with"
    if live < ref * (1 - tolerance):
        return "rollback", (f"live accept length {live:.3f} over {requests} requests is below {what} {ref:.3f} by "
                            f"more than {tolerance:g}")
    return "keep", f"live accept length {live:.3f} over {requests} requests; {what} {ref:.3f}"


def watch(fw: Flywheel, new: str, base: Baseline, predicted: float | None) -> WatchResult:
    """Wait for the new drafter's requests (or the timeout) and judge them."""
    from eaglenest.serve import read_live_stats

    w = fw.settings.watch
    deadline = time.monotonic() + w.timeout_s
    requests, steps, accepted = 0, 0, 0
    while True:
        cur = read_live_stats(fw.settings.app).get(new, {})
        requests = int(cur.get("requests", 0)) - base.new_requests
        steps = int(cur.get("verify_steps", 0)) - base.new_verify_steps
        accepted = int(cur.get("accepted_tokens", 0)) - base.new_accepted
        if requests >= w.requests or time.monotonic() >= deadline:
            break
        time.sleep(w.poll_s)
    live = accept_length(steps, accepted) if steps else None
    verdict, reason = judge(live, requests, base, predicted, tolerance=w.tolerance, min_requests=w.min_requests)
    if live is not None:
        fw.metrics.live("after", live)
    if base.previous_level is not None:
        fw.metrics.live("before", base.previous_level)
    return WatchResult(verdict, live, requests, base.previous_level, predicted, reason)


def rollback(fw: Flywheel, bad: str, previous: str | None, result: WatchResult, gated_digest: str | None, *,
             schedule: str | None = None) -> dict:
    """Swap ``previous`` back in (with ``schedule``, the one it was served with, where there was one), alert,
    audit; returns the audit record."""
    from eaglenest.serve import redeploy_drafter

    now = digest(bad)
    changed = gated_digest is not None and now != gated_digest
    cfg = fw.cfg if schedule is None else with_schedule(fw.cfg, schedule)
    swap = redeploy_drafter(cfg, previous, app=fw.settings.app, route_prefix=fw.settings.route_prefix,
                            surge_percent=fw.settings.surge_percent)
    fw.metrics.count("rollbacks")
    fw.save_state(live=previous, previous=None, rolled_back=bad,
                  **({"schedule": schedule, "previous_schedule": None} if schedule is not None else {}))
    alert = {"alert": ROLLBACK_ALERT, "app": fw.settings.app, "url": fw.url, "rolled_back": bad, "restored": previous,
             "restored_schedule": schedule,
             "reason": result.reason, "live_accept_length": result.live_accept_length,
             "previous_level": result.previous_level, "predicted": result.predicted, "requests": result.requests,
             "weights_changed_after_gate": changed, "time": time.time()}
    delivery = send_alert(fw.settings.alert_webhook, alert)
    return fw.audit.write("rollback", **alert, swap=swap, gated_digest=gated_digest, deployed_digest=now,
                          alert_delivery="delivered" if delivery is None else delivery)


__all__ = ["ROLLBACK_ALERT", "Baseline", "WatchResult", "baseline", "judge", "rollback", "watch"]
