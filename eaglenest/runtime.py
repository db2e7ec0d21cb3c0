"""Ray bootstrap: attach to a running cluster, or start a local one with driver-only options.

``ray.init`` refuses driver-only options (``_system_config``, ``num_cpus``, ...) when it connects to an existing
cluster: a ``ray job submit`` driver (``RAY_ADDRESS`` set) or a machine where ``ray start`` ran (Ray finds it through
its temp dir). Commands that want such options for the local case ask :func:`running_cluster_address` first.
"""

from __future__ import annotations

from typing import Any


def running_cluster_address() -> str | None:
    """The cluster ``ray.init()`` would attach to (``RAY_ADDRESS``, or the last ``ray start`` here), else None.

    Uses Ray's own resolution (``ray._private.services.canonicalize_bootstrap_address``, private in Ray 2.60: the
    public API has no "would ray.init attach?" question), so the answer matches what ``ray.init`` then does.
    """
    from ray._private.services import canonicalize_bootstrap_address

    try:
        return canonicalize_bootstrap_address(None)
    except ConnectionError:  # RAY_ADDRESS names an address nobody answers at: let ray.init say so
        return "unreachable"


def init_ray(*, runtime_env: dict[str, Any] | None = None, **local_only: Any) -> bool:
    """Attach to the running cluster, or start a local Ray with ``local_only`` options; True when it started one."""
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"runtime_env": runtime_env} if runtime_env else {}
    if running_cluster_address() is not None:
        ray.init(**kwargs)
        return False
    ray.init(**kwargs, **local_only)
    return True
