"""``eaglenest serve`` and its non-blocking Python API: ``start_serve(cfg, drafter) -> url`` / ``stop_serve()``.

Imports of Ray, torch and FastAPI happen inside the functions, so ``eaglenest --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any

from eaglenest.ray_private import PROXY_CALLBACK_ENV
from eaglenest.runtime import LOCAL_RAY_ENV, TASK_ENV
from eaglenest.serve.arrival import PROXY_CALLBACK

RAY_ENV_DEFAULTS = {
    **LOCAL_RAY_ENV,
    **TASK_ENV,
    # Ray Serve's own throughput settings (read when Serve's processes start, so they must be in the environment of
    # the Ray that runs Serve): proxy -> replica over gRPC, and the replica runs our handlers on its event loop
    # instead of handing every request to a second thread. With the decoder process (serve.decoder_process) they
    # took the throughput lost to serving at 16 streams from 17% to 3-5% on a decode-bound target (BENCHMARKS.md).
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    # Serve's proxies stamp each request's arrival (serve.arrival), so TTFT and queue time start where the client's do
    PROXY_CALLBACK_ENV: PROXY_CALLBACK,
}

_STATE: dict[str, Any] = {"owns_ray": False, "apps": []}


def _ray_env() -> None:
    for k, v in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)


def start_serve(
    cfg: Any,
    drafter_dir: str | None = None,
    *,
    host: str | None = None,
    port: int | None = None,
    name: str = "eaglenest",
    route_prefix: str = "/",
    num_cpus: float | None = None,
) -> str:
    """Deploy the app on Ray Serve and return its base URL (``http://host:port[prefix]``) once it is running.

    Connects to the running Ray (or starts a local one) and starts Serve's HTTP proxy on ``host:port`` (default:
    ``serve.host`` / ``serve.port``). The OpenAI client uses ``base_url=url + "/v1"``. A failed preflight raises
    before anything is deployed; a replica whose self-test fails still starts and reports unhealthy on ``/health``.
    Call again with another ``name`` and ``route_prefix`` to add an application to the same Serve instance.
    """
    return start_apps([AppSpec(cfg, drafter_dir, name, route_prefix)], host=host or cfg.serve.host,
                      port=port or cfg.serve.port, num_cpus=num_cpus)[0]


@dataclass
class AppSpec:
    """One application of :func:`start_apps`."""

    cfg: Any
    drafter_dir: str | None = None
    name: str = "eaglenest"
    route_prefix: str = "/"


def start_apps(apps: list[AppSpec], *, host: str = "127.0.0.1", port: int = 8000,
               num_cpus: float | None = None) -> list[str]:
    """Deploy several applications on one Serve instance at once (their replicas start in parallel); URLs in order."""
    _ray_env()
    import ray
    from ray import serve
    from ray.serve.api import RunTarget

    from eaglenest.ray_private import serve_start, worker_niceness_option
    from eaglenest.runtime import init_ray
    from eaglenest.serve.deployment import make_app

    if not ray.is_initialized():
        # Ray starts workers at nice 15 by default; a serving replica that loses the CPU to any other process on
        # the node decodes several times slower (measured here), so replicas run at normal priority. That and
        # num_cpus are options of a Ray we start; attached to a running cluster (`ray job submit`, `ray start`),
        # the cluster's own settings apply.
        local: dict[str, Any] = {"log_to_driver": False, **worker_niceness_option(0)}
        if num_cpus is not None:
            local["num_cpus"] = num_cpus
        _STATE["owns_ray"] = init_ray(**local)
    targets = [RunTarget(target=make_app(a.cfg, a.drafter_dir), name=a.name, route_prefix=a.route_prefix)
               for a in apps]  # preflight first: nothing starts for a bad drafter
    client = serve_start(http_options={"host": host, "port": int(port)})
    actual = client.http_config
    if (actual.host, int(actual.port)) != (host, int(port)):
        raise RuntimeError(f"Ray Serve already runs on {actual.host}:{actual.port}, not {host}:{port}; stop it "
                           f"(serve shutdown) or use that address")
    serve.run_many(targets)
    _STATE["apps"].extend(a.name for a in apps)
    return [f"http://{host}:{port}{a.route_prefix.rstrip('/')}" for a in apps]


def stop_serve(name: str | None = None, *, drain: bool = True) -> None:
    """Delete one application (``name``) or shut Serve down.

    Shutting down drains first (serve.drain): every replica stops admitting (503 + Retry-After) and its running
    requests finish, up to its ``serve.drain_timeout_s`` after which they end with an error event; only then is
    Serve stopped (its own shutdown stops the HTTP proxies at once, which would cut open streams). Ray itself is
    shut down too when ``start_serve`` started it.
    """
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    if name is not None:
        serve.delete(name)
        if name in _STATE["apps"]:
            _STATE["apps"].remove(name)
        return
    if drain:
        from eaglenest.serve.drain import clear_drain, drain_serve

        try:
            drain_serve()
        except Exception as e:  # no Serve running, or its controller is gone: nothing left to drain
            print(f"drain skipped: {type(e).__name__}: {e}", flush=True)
    _STATE["apps"].clear()
    if _STATE["owns_ray"]:
        # nothing outlives a Ray we started: after the drain, stopping Ray stops Serve with it, in ~1.5 s instead
        # of Serve's own replica-by-replica shutdown (~3 s more), which kept the process past its drain deadline
        ray.shutdown()
        _STATE["owns_ray"] = False
        return
    serve.shutdown()
    from eaglenest.serve.live_stats import drop_live_stats
    from eaglenest.serve.vllm_metrics import drop_stores

    drop_stores()
    drop_live_stats()
    if drain:
        clear_drain()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="eaglenest YAML config (target: and serve: sections)")
    p.add_argument("--drafter", default=None, help="exported drafter folder (default serve.drafter; none = baseline)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default serve.port)")
    p.add_argument("--host", default=None, help="bind address (default serve.host, 127.0.0.1)")


def _argv(args: argparse.Namespace) -> list[str]:
    """The same ``serve`` command line, for the supervised child."""
    argv = ["serve", "--config", args.config]
    for flag, value in (("--drafter", args.drafter), ("--port", args.port), ("--host", args.host)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def run(args: argparse.Namespace) -> int:
    from eaglenest.config import load_config
    from eaglenest.runtime import running_cluster_address
    from eaglenest.serve.supervise import exit_now, is_child, job_stop_warning, parent_gone, supervise

    cfg = load_config(args.config)
    if cfg.serve.schedule and not is_child():  # a stale schedule is refused before Ray or an engine starts
        from eaglenest.serve.schedule import prepare_schedule
        from eaglenest.speculative.schedule import ScheduleError

        try:
            prepare_schedule(cfg, args.drafter or cfg.resolve(cfg.serve.drafter), driver=True)
        except ScheduleError as e:
            print(f"eaglenest serve: {e}", file=sys.stderr, flush=True)
            return 2
    if not is_child() and running_cluster_address() is None:
        # the Ray we start must not share our process group: a group SIGTERM would kill it before the drain
        return supervise(_argv(args), cfg.serve.drain_timeout_s)
    warning = job_stop_warning(cfg.serve.drain_timeout_s)
    if warning:
        print(warning, flush=True)
    url = start_serve(cfg, args.drafter, host=args.host, port=args.port)
    print(f"eaglenest serving {cfg.serve.model_name} at {url}  (OpenAI base_url {url}/v1, health {url}/health)")
    print("press Ctrl-C to stop", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(0.2):
            if parent_gone():
                print("the supervising process is gone", flush=True)
                break
    except KeyboardInterrupt:
        pass
    print("stopping (running requests finish first) ...", flush=True)
    stop_serve()
    print("stopped", flush=True)
    if is_child():
        exit_now(0)
    return 0
