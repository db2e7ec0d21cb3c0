"""One engine as a Ray Serve deployment of its own (``serve.route.placement: deployments``): no HTTP, a stream of
:class:`~eaglenest.serve.jobs.DecodeEvent` batches per request, called by the routing ingress through a handle.

Why a deployment per engine: a target that fills its tensor-parallel group (Kimi-K2.5 on 8 GPUs) cannot hold a
speculative and a plain copy on one replica's GPUs; two deployments, each on GPUs of its own, can, and the ingress
(CPU only) routes between them by live load (:mod:`eaglenest.serve.route_policy`). Each engine deployment keeps its
own health check (a dead decoder restarts that replica only) and its own graceful shutdown.
"""

# no `from __future__ import annotations`: Ray Serve reads the deployment's signatures at runtime
import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from eaglenest.config import EaglenestConfig
from eaglenest.engines.base import SamplingParams
from eaglenest.serve.jobs import DecodeEvent, Job

log = logging.getLogger("eaglenest.serve")

ENGINE_DEPLOYMENT_OPTIONS: dict[str, Any] = {
    "graceful_shutdown_timeout_s": 35.0,
    "graceful_shutdown_wait_loop_s": 1.0,
    "health_check_period_s": 10.0,
    "health_check_timeout_s": 30.0,
    "max_constructor_retry_count": 2,
}


@serve.deployment(**ENGINE_DEPLOYMENT_OPTIONS)
class EngineDeployment:
    """One started backend (the decoder in its own process on hf, SGLang's engine on GPUs); ``generate`` streams a
    request's events in the batches the decoder commits them."""

    def __init__(self, config: dict[str, Any], drafter: str | None, side: str) -> None:
        from eaglenest.engines.location import resolve_target_path
        from eaglenest.serve.backends import make_backend

        logging.basicConfig(level=logging.INFO)
        cfg = EaglenestConfig.model_validate(config)
        self.side = side
        self.backend = make_backend(cfg, drafter)
        self.model_path = str(resolve_target_path(cfg.target))
        self.running = 0
        self.peak = 0
        self.served = 0
        log.info("%s engine deployment ready (%s, drafter %s)", side, self.backend.name, drafter or "none")

    def facts(self) -> dict[str, Any]:
        """What the ingress needs to stand in for this engine: target info, tokenizer folder, speculation."""
        b = self.backend
        return {"info": b.info, "model_path": self.model_path, "speculative": b.speculative,
                "algorithm": b.algorithm, "name": b.name, "side": self.side}

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> AsyncIterator[list[DecodeEvent]]:
        """The request's events, each yield what the decoder committed since the last one; the caller going away
        (a client disconnect passed on by the ingress) cancels the job at the decoder's next step."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[DecodeEvent] = asyncio.Queue()
        job = Job(list(prompt_ids), sampling, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev))
        self.running += 1
        self.peak = max(self.peak, self.running)
        self.served += 1
        try:
            try:
                self.backend.submit(job)
            except RuntimeError as e:
                yield [DecodeEvent([], error=str(e))]
                return
            while True:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                yield batch
                if batch[-1].final:
                    return
        except asyncio.CancelledError:
            job.cancel()
            raise
        finally:
            self.running -= 1

    def load(self) -> dict[str, int]:
        """This replica's requests now, at most at once, and in all since it started: what the routing ingress
        replicas sent it together (each of them sees only its own share)."""
        return {"running": self.running, "peak": self.peak, "served": self.served}

    def check_health(self) -> None:
        if not self.backend.alive:
            raise RuntimeError(f"{self.side} engine is not running: {self.backend.fatal}")

    def __del__(self) -> None:
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.close()


def bind_engines(cfg: EaglenestConfig, drafter: str | None, *, surge_percent: int | None = None
                 ) -> dict[str, Any] | None:
    """``placement: deployments``: the speculative and the plain engine deployment, bound for the ingress (keyword
    ``speculative_engine`` / ``plain_engine``); None where the replica runs its engines itself. Refused, naming the
    fix, where the ingress replicas could not share the speculative range (each needs one request of it) or would
    change in number (autoscaling). ``surge_percent``: a drafter swap's ``max_surge_percent``, for the engines too (the
    speculative deployment is the one a new drafter replaces)."""
    s = cfg.serve
    route = s.route
    if not (route.by_load and route.placement == "deployments" and drafter is not None and s.schedule):
        return None
    from eaglenest.serve.route_policy import ingress_share
    from eaglenest.serve.routed import route_configs
    from eaglenest.serve.schedule import prepare_schedule

    sched = prepare_schedule(cfg, drafter, check=False)  # checked by make_app (driver) and by the ingress
    plan = sched.plan if sched is not None else None
    if plan is None or plan.mode != "routed" or plan.route_limit is None:
        return None  # the ingress logs why the schedule does not route (serve.schedule's notes)
    if s.autoscaling:
        raise ValueError("serve.route.placement: deployments splits the engines' ranges over a fixed number of "
                         "routing ingress replicas (each counts what it routed); set serve.num_replicas without "
                         "serve.autoscaling, and scale the engines with serve.route.speculative_replicas / "
                         "serve.route.plain_replicas")
    ingress_share(plan.route_limit * route.speculative_replicas, s.num_replicas)  # refused here, before deploying
    fast_cfg, plain_cfg = route_configs(cfg, plan.spec, plan.route_limit, shared_gpus=False)
    resources = {"num_cpus": s.num_cpus_per_replica, "num_gpus": s.num_gpus_per_replica}
    headroom = max(4, s.max_concurrent_requests // 8)
    surge = {} if surge_percent is None else {"max_surge_percent": int(surge_percent)}
    out = {}
    for side, side_cfg, side_drafter, replicas, most in (
            ("speculative", fast_cfg, drafter, route.speculative_replicas, plan.route_limit),
            ("plain", plain_cfg, None, route.plain_replicas, s.max_concurrent_requests * s.num_replicas)):
        out[f"{side}_engine"] = EngineDeployment.options(
            name=f"eaglenest-{side}", num_replicas=replicas, ray_actor_options=resources,
            graceful_shutdown_timeout_s=s.drain_timeout_s + 5.0, max_ongoing_requests=most + headroom, **surge,
        ).bind(side_cfg.model_dump(), side_drafter, side)
    return out
