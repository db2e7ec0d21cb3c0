"""Served accept length per drafter of one application: what the flywheel's post-swap watch compares.

Why per drafter: during a rolling swap the old replica finishes its streams while the new one already answers, and
an application-wide counter (``GET /metrics``) mixes the two; the watch needs the new drafter's requests alone and the
old drafter's recent level. Every replica sends each finished request that drafted (drafter folder, verify steps,
accepted draft tokens, completion tokens) to one small detached Ray actor per application (``drafter-stats:<app>``,
zero CPUs, created by the first replica that needs it), fire and forget as ``serve.vllm_metrics`` does; the flywheel,
attached to the same Ray, reads it with :func:`read_live_stats`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from eaglenest.contracts.metrics import accept_length
from eaglenest.serve.jobs import SpecStats

log = logging.getLogger("eaglenest.serve")

NAMESPACE = "eaglenest"
ACTOR_PREFIX = "drafter-stats:"
RECENT = 4096
"""requests kept per drafter for the 'recent level' (pooled over the last N of them)"""


class DrafterStatsStore:
    """The actor: totals and the recent requests of every drafter the application has served."""

    def __init__(self) -> None:
        self.by: dict[str, dict[str, Any]] = {}

    def add(self, drafter: str, verify_steps: int, accepted: int, tokens: int, at: float) -> None:
        d = self.by.setdefault(drafter, {"requests": 0, "verify_steps": 0, "accepted_tokens": 0,
                                         "completion_tokens": 0, "first_at": at, "last_at": at,
                                         "recent": deque(maxlen=RECENT)})
        d["requests"] += 1
        d["verify_steps"] += verify_steps
        d["accepted_tokens"] += accepted
        d["completion_tokens"] += tokens
        d["last_at"] = at
        d["recent"].append((verify_steps, accepted))

    def snapshot(self, last: int = 0) -> dict[str, dict[str, Any]]:
        """Totals per drafter, and the pooled accept length of its ``last`` requests (0: of all of them)."""
        out = {}
        for name, d in self.by.items():
            recent = list(d["recent"])[-last:] if last else list(d["recent"])
            out[name] = {k: v for k, v in d.items() if k != "recent"}
            out[name]["accept_length"] = accept_length(d["verify_steps"], d["accepted_tokens"])
            out[name]["recent_requests"] = len(recent)
            out[name]["recent_accept_length"] = accept_length(sum(r[0] for r in recent), sum(r[1] for r in recent))
        return out


class LiveStats:
    """Replica side: count each finished request under the replica's drafter (no drafter: nothing to count)."""

    def __init__(self, drafter: str | None, app: str | None = None) -> None:
        self.drafter = drafter
        self.app = app
        self._actor: Any = None

    def _store(self) -> Any:
        if self._actor is None:
            import ray

            cls = ray.remote(num_cpus=0)(DrafterStatsStore)
            self._actor = cls.options(name=ACTOR_PREFIX + str(self.app), namespace=NAMESPACE, lifetime="detached",
                                      get_if_exists=True).remote()
        return self._actor

    def record(self, stats: SpecStats, completion_tokens: int) -> None:
        """Fire and forget; never raises (the stats must not fail a request)."""
        if self.drafter is None or self.app is None or stats.verify_steps == 0:
            return
        try:
            self._store().add.remote(self.drafter, stats.verify_steps, stats.accepted_tokens, completion_tokens,
                                     time.time())
        except Exception:
            log.warning("could not record the drafter's live stats", exc_info=True)


def read_live_stats(app: str, *, last: int = 0, timeout: float = 30.0) -> dict[str, dict[str, Any]]:
    """Per-drafter stats of application ``app`` ({} before its first request that drafted); needs Ray attached."""
    import ray

    try:
        actor = ray.get_actor(ACTOR_PREFIX + app, namespace=NAMESPACE)
    except ValueError:
        return {}
    return ray.get(actor.snapshot.remote(last), timeout=timeout)


def drop_live_stats() -> None:
    """Kill every application's stats actor (``stop_serve``: a later deployment starts from zero)."""
    import ray
    from ray.util import list_named_actors

    for entry in list_named_actors(all_namespaces=True):
        if entry.get("namespace") == NAMESPACE and str(entry.get("name", "")).startswith(ACTOR_PREFIX):
            try:
                ray.kill(ray.get_actor(entry["name"], namespace=NAMESPACE))
            except Exception:
                log.debug("stats actor %s already gone", entry["name"], exc_info=True)


__all__ = ["DrafterStatsStore", "LiveStats", "drop_live_stats", "read_live_stats"]
