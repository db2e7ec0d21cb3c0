"""Ray bootstrap: attach to a running cluster, or start a local one with driver-only options.

``ray.init`` refuses driver-only options (``_system_config``, ``num_cpus``, ...) when it connects to an existing
cluster: a ``ray job submit`` driver (``RAY_ADDRESS`` set) or a machine where ``ray start`` ran (Ray finds it through
its temp dir). :func:`init_ray` asks :func:`running_cluster_address` first and passes such options only to a Ray it
starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

LOCAL_RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # one machine: keep every Ray process on loopback
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}
"""Defaults for a Ray that eaglenest starts itself (a user's own environment wins)."""
TASK_ENV = {"TOKENIZERS_PARALLELISM": "false"}
"""Every worker's environment: tokenizers' own threads fight Ray's workers for cores (and warn after fork)."""


def running_cluster_address() -> str | None:
    """The cluster ``ray.init()`` would attach to (``RAY_ADDRESS``, or the last ``ray start`` here), else None.

    Uses Ray's own resolution (private in Ray 2.60: the public API has no "would ray.init attach?" question; see
    :mod:`eaglenest.ray_private`), so the answer matches what ``ray.init`` then does.
    """
    from eaglenest.ray_private import bootstrap_address

    try:
        return bootstrap_address()
    except ConnectionError:  # RAY_ADDRESS names an address nobody answers at: let ray.init say so
        return "unreachable"


@dataclass(frozen=True)
class RayStart:
    """What :func:`start_or_attach` did: ``started`` a local Ray (the caller shuts it down) or attached."""

    started: bool
    dashboard_url: str | None = None


def start_or_attach(**local_only: Any) -> RayStart:
    """Attach to the running cluster, or start a local Ray with ``local_only`` options.

    The one Ray bootstrap of every command (regen, train, serve, demo): each attaches the same way under
    ``ray job submit`` or next to ``ray start``, and only a Ray it starts gets driver-only options.
    """
    import ray

    if ray.is_initialized():
        return RayStart(False)
    runtime_env = {"env_vars": dict(TASK_ENV)}
    if running_cluster_address() is not None:
        ctx = ray.init(runtime_env=runtime_env)
        return RayStart(False, _dashboard(ctx))
    for k, v in LOCAL_RAY_ENV.items():
        os.environ.setdefault(k, v)
    ctx = ray.init(runtime_env=runtime_env, **local_only)
    return RayStart(True, _dashboard(ctx))


def _dashboard(ctx: Any) -> str | None:
    url = getattr(ctx, "dashboard_url", None)
    return f"http://{url}" if url else None


def init_ray(**local_only: Any) -> bool:
    """:func:`start_or_attach`; True when it started a local Ray."""
    return start_or_attach(**local_only).started
