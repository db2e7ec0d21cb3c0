"""Every private or internal Ray API eaglenest uses, in one place, each with the reason the public API does not do.

Ray is pinned (pyproject: ``ray==2.60.0``); these names may change in any release. Code elsewhere reaches them only
through the functions below, and ``tests/unit/test_ray_private.py`` checks that each listed name still exists with
the shape used here, so an upgrade that breaks one fails there first, naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

PRIVATE_APIS: dict[str, str] = {
    "ray._private.services.canonicalize_bootstrap_address":
        "runtime.running_cluster_address: the public API cannot ask whether ray.init() would attach to a running "
        "cluster (RAY_ADDRESS, or `ray start` on this machine) before calling it; driver-only options must be left "
        "out when it would",
    "ray.init(_system_config=...)":
        "serve: Ray starts workers at nice 15; a serving replica that loses the CPU decodes several times slower, so "
        "a Ray that eaglenest starts for serving runs its workers at niceness 0 (worker_niceness has no public flag)",
    "ray.serve._private.api.serve_start":
        "serve.cli.start_apps: public serve.start() returns nothing; the client it creates tells whether an already "
        "running Serve listens on another host/port than asked (then we refuse instead of serving elsewhere)",
    "ray.experimental.internal_kv":
        "serve.drain: a cluster-wide key-value store that the driver and every replica reach without an actor "
        "(drain requests and per-replica in-flight reports while Serve shuts down)",
    "ray._config.metrics_report_interval_ms":
        "regen.pipeline: the interval at which workers export metrics; the driver waits that long before exiting so "
        "the final gauges of a `ray job submit` run reach Prometheus",
    "ray.train.v2 TorchTrainer._create_default_callbacks (PlacementGroupCleanerCallback)":
        "drafter.driver: Train V2's placement-group cleaner asks the state API of whatever Ray instance it finds; "
        "with several Ray instances on one machine it can kill our running workers (see trainer_class)",
    "ray.data.DataContext.use_datasource_v2":
        "regen.sources: the V2 parquet read path adds a whole-CPU ListFiles task that waits behind the engine actors "
        "on small clusters; the flag is an internal DataContext field",
    "ray._private.worker.global_worker.node.metrics_export_port":
        "tests: the port of this node's Prometheus endpoint, scraped by the metrics tests",
    "ray._private.state.jobs / actors":
        "tests: whether a killed driver's job is dead and its actors' states and process ids, read from the GCS (the "
        "public state API needs the dashboard, which the test session's Ray runs without)",
    "ray.autoscaler._private.util.prepare_config / validate_config":
        "tests: `ray up`'s own config preparation and schema validation of cluster.yaml (no public equivalent)",
    "RAY_JOB_CONFIG_JSON_ENV_VAR, RAY_JOB_STOP_WAIT_TIME_S (ray.dashboard.modules.job.job_supervisor)":
        "serve.supervise: a job's driver cannot ask the public API whether `ray job stop` will SIGKILL it (3 s after "
        "its SIGTERM unless the job's runtime env raises RAY_JOB_STOP_WAIT_TIME_S), which cuts the drain short",
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH (ray.serve._private.constants)":
        "serve.arrival: the only hook Ray Serve offers in front of its HTTP proxy; its middleware stamps each "
        "request's arrival, so TTFT and queue time include the proxy's routing and queueing",
}
"""Each private/internal Ray API used -> why it is needed."""

JOB_DRIVER_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
"""set by Ray's job supervisor in the environment of a submitted job's entrypoint"""
JOB_STOP_WAIT_ENV, JOB_STOP_WAIT_DEFAULT_S = "RAY_JOB_STOP_WAIT_TIME_S", 3
"""`ray job stop`: SIGTERM, then SIGKILL this many seconds later (an integer; read from the job's runtime env)"""
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
"""read by every Serve proxy when it starts: ``module:function`` returning Starlette middlewares for its app"""


def bootstrap_address() -> str | None:
    """The cluster address ``ray.init()`` would attach to, else None; raises ConnectionError when ``RAY_ADDRESS``
    names an address nobody answers at."""
    from ray._private.services import canonicalize_bootstrap_address

    return canonicalize_bootstrap_address(None)


def worker_niceness_option(niceness: int) -> dict[str, Any]:
    """``ray.init`` keyword arguments that start the local Ray's workers at ``niceness`` (driver-only)."""
    return {"_system_config": {"worker_niceness": niceness}}


def serve_start(http_options: dict[str, Any]) -> Any:
    """Start (or connect to) Serve's controller and proxies; the returned client has ``http_config``."""
    from ray.serve._private.api import serve_start as _serve_start

    return _serve_start(http_options=http_options)


def internal_kv() -> tuple[Callable, Callable, Callable, Callable]:
    """Ray's cluster-wide KV store: ``(get, put, delete, list)``, each taking ``namespace=``."""
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get, _internal_kv_list, _internal_kv_put

    return _internal_kv_get, _internal_kv_put, _internal_kv_del, _internal_kv_list


def metrics_report_interval_s() -> float:
    """How often Ray workers export metrics, in seconds."""
    import ray

    return ray._config.metrics_report_interval_ms() / 1000


def trainer_class() -> type:
    """TorchTrainer without Train V2's placement-group cleaner.

    The cleaner asks the Ray state API (with no address) whether the controller is alive. When several Ray instances
    run on one machine (CI, shared dev boxes) it can reach another instance's dashboard, which does not know our
    controller and answers "not found"; the cleaner then removes our placement group and kills the running workers.
    A job's placement groups are removed by Ray when the job ends anyway, so nothing leaks without it.
    """
    from ray.train.torch import TorchTrainer

    class EaglenestTorchTrainer(TorchTrainer):
        def _create_default_callbacks(self):  # Ray 2.60 (pinned): the trainer's default callback list
            callbacks = super()._create_default_callbacks()
            return [c for c in callbacks if type(c).__name__ != "PlacementGroupCleanerCallback"]

    return EaglenestTorchTrainer


DATA_CONTEXT_INTERNAL_FIELDS = ("use_datasource_v2",)
"""DataContext fields eaglenest sets that are not part of Ray Data's documented options."""


def metrics_export_port() -> int:
    """The Prometheus port of this driver's node (Ray must be initialized)."""
    import ray

    return ray._private.worker.global_worker.node.metrics_export_port


def driver_job_actors(driver_pid: int) -> tuple[bool, list[dict[str, Any]]] | None:
    """The job whose driver had ``driver_pid``: (is it dead, its actors that are not detached, each with ``State``
    and ``Pid``); None when no job had that driver (Ray must be initialized)."""
    from ray._private import state

    jobs = [j for j in state.jobs() if j["DriverPid"] == driver_pid]
    if not jobs:
        return None
    actors = [a for a in state.actors().values() if a["JobID"] == jobs[0]["JobID"] and not a["IsDetached"]]
    return bool(jobs[0]["IsDead"]), actors


def autoscaler_config_tools() -> tuple[Callable[[dict], dict], Callable[[dict], None]]:
    """``(prepare_config, validate_config)`` of ``ray up``."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    return prepare_config, validate_config
