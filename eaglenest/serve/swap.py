"""Swap the drafter of a running application with no failed request: Ray Serve's rolling replacement, with surge.

How: the application is deployed again with the new drafter folder as its argument, which Ray Serve treats as a new
version of the deployment, and with ``max_surge_percent`` (Ray 2.60): the new replicas start (preflight, engine,
self-test) while the old ones keep serving, and only once a new replica is running does Serve stop an old one,
gracefully: it takes no new request and its streams in flight finish on the old drafter (up to
``graceful_shutdown_timeout_s``, ``serve.drain_timeout_s`` + 5). Without surge (Serve's default, 0) an old replica
stops before its replacement starts, which leaves a one-replica application without a replica for the start-up time.

Why not an in-place draft swap: SGLang 0.5.14's ``update_weights_from_disk`` reloads the target and the draft
together (minutes of a paused engine for a 1T target), and the hf backend's running sequences hold the old drafter's
KV cache. A rolling replacement works for both engines; its cost is room for one more replica during the swap (GPUs
included: without free capacity the new replica waits and the old one keeps serving).
"""

from __future__ import annotations

import time
from typing import Any

from eaglenest.config import EaglenestConfig

ACTIVE_STATES = ("STARTING", "UPDATING", "RECOVERING", "STOPPING", "PENDING_MIGRATION")


def replica_states(app: str) -> dict[str, int]:
    """Replica counts by state over the application's deployments ({} when it is not running): the ingress, and with
    ``serve.route.placement: deployments`` its speculative and plain engine deployments, which a swap also rolls."""
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None:
        return {}
    counts: dict[str, int] = {}
    for deployment in status.deployments.values():
        for state, n in deployment.replica_states.items():
            key = str(getattr(state, "value", state))
            counts[key] = counts.get(key, 0) + int(n)
    return counts


def redeploy_drafter(cfg: EaglenestConfig, drafter: str | None, *, app: str, route_prefix: str = "/",
                     surge_percent: int = 100, timeout_s: float = 900.0) -> dict[str, Any]:
    """Replace the application's replicas by ones serving ``drafter`` (preflight first); returns when only new
    replicas are left (the old ones drained), with the seconds each phase took.

    Raises ``TimeoutError`` naming the replica states when that takes longer than ``timeout_s`` (the old replicas then
    still serve: with surge nothing is stopped before its replacement runs).
    """
    from ray import serve

    from eaglenest.serve.deployment import make_app

    t0 = time.monotonic()
    target = make_app(cfg, drafter, options={"max_surge_percent": int(surge_percent)})  # refuses a bad drafter here
    serve.run(target, name=app, route_prefix=route_prefix)
    running = time.monotonic() - t0
    states = replica_states(app)
    while any(states.get(s, 0) for s in ACTIVE_STATES):
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"application {app!r}: replicas still {states} {timeout_s:.0f} s after the swap began "
                               "(a replica that cannot start: its log; no room for the surge replica: free capacity)")
        time.sleep(0.5)
        states = replica_states(app)
    return {"drafter": drafter, "new_running_s": round(running, 2),
            "old_drained_s": round(time.monotonic() - t0, 2), "replicas": states}


__all__ = ["redeploy_drafter", "replica_states"]
