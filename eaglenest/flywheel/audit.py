"""The flywheel's audit log and its alerts: every decision with its numbers, appended as one JSON line.

Why a file next to the metrics: a promotion or a rollback must be explainable afterwards (which candidate, measured on
which prompts, against which live drafter, with which thresholds), and Prometheus keeps numbers, not reasons. Each
record has ``time`` (Unix seconds), ``event`` (``turn``, ``gate``, ``swap``, ``watch``, ``rollback``, ...) and the
event's fields. A rollback is also POSTed as JSON to ``flywheel.alert_webhook`` when one is set (and counted in
``eaglenest_flywheel_rollbacks``, which the ``EaglenestDrafterRolledBack`` alert reads).
"""

from __future__ import annotations

import json
import logging
import math
import time
import urllib.request
from pathlib import Path
from typing import Any

log = logging.getLogger("eaglenest.flywheel")

AUDIT_FILE = "audit.jsonl"


class AuditLog:
    """Append-only JSON lines at ``path``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        rec = {"time": math.floor(time.time() * 1000) / 1000, "event": event, **fields}  # ms, never after the event
        with self.path.open("a") as f:
            f.write(json.dumps(rec, sort_keys=True, default=str) + "\n")
        return rec

    def read(self, event: str | None = None) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        recs = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        return [r for r in recs if event is None or r.get("event") == event]


def send_alert(url: str | None, alert: dict[str, Any], timeout: float = 10.0) -> str | None:
    """POST ``alert`` as JSON to ``url``; returns None when delivered, else why not (never raises: the rollback
    itself must not depend on the alert channel)."""
    if not url:
        return "no flywheel.alert_webhook set"
    body = json.dumps(alert, default=str).encode()
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - the operator's configured URL
            if resp.status >= 300:
                return f"HTTP {resp.status}"
    except Exception as e:
        log.warning("alert webhook %s failed: %s", url, e)
        return f"{type(e).__name__}: {e}"
    return None


__all__ = ["AUDIT_FILE", "AuditLog", "send_alert"]
