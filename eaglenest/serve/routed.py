"""Routing by live load (``serve.route``): a speculative and a plain engine behind one replica.

Why: a drafter pays at low load and costs at high load (BENCHMARKS.md: 1.96x at batch 1, 0.43x at 256 on the Llama
stand-in). An engine that cannot switch speculation per batch (SGLang without adaptive mode, or adaptive mode whose
"off" still runs a verify forward and measured slower than the baseline) would have to serve one configuration for
the whole expected load, and the only one safe from 1 to 256 is no drafter: the batch-1 gain is lost. Two engines
keep both: the speculative one serves low load, the plain one everything above it.

The rule, per request: it goes to the speculative engine when that engine runs fewer than ``limit`` requests *and
the plain engine is idle*; otherwise to the plain engine. The second condition is the point: two engines decoding at
the same time share the GPU by time-slicing, so a split load (one request on each) would be slower than both on the
plain engine at batch 2. Under rising load the speculative engine's last requests finish while the plain engine takes
every new one; under falling load requests return to the speculative engine once the plain one has drained. Each
engine runs in a process of its own (:class:`~eaglenest.serve.process_backend.ProcessBackend`), the plain one started
first so that it sizes its memory from the whole GPU; the speculative one's KV pool is capped
(``serve.route.speculative_max_total_tokens``): it never runs more than ``limit`` requests.

Requests answered by the plain engine report no verify steps, so they never count as speculation that was bypassed
(accept length metrics and alerts count only requests that drafted).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from eaglenest.config import EaglenestConfig
from eaglenest.engines.base import TargetInfo
from eaglenest.serve.jobs import BackendBase, DecodeEvent, Job, SpecStats
from eaglenest.serve.route_policy import (
    PLAIN,
    SPECULATIVE,
    MarginalPolicy,
    OverflowPolicy,
    SharedGpuPolicy,
    ingress_share,
    predicted_ratios,
    schedule_curves,
)
from eaglenest.speculative.routed_engine import speculative_target

log = logging.getLogger(__name__)


class RoutedBackend(BackendBase):
    """Two started backends behind one ``submit``: ``speculative`` for live loads up to ``limit``, ``plain`` beyond,
    by ``policy`` (default: the one-GPU-group rule of the module docstring; :mod:`eaglenest.serve.route_policy`).
    Facts (tokenizer, target info, algorithm) are the speculative engine's."""

    def __init__(self, speculative: BackendBase, plain: BackendBase, limit: int,
                 policy: SharedGpuPolicy | MarginalPolicy | OverflowPolicy | None = None) -> None:
        if limit < 1:
            raise ValueError(f"serve.route.limit must be at least 1, got {limit}")
        self.speculative_backend = speculative
        self.plain_backend = plain
        self.limit = limit
        self.policy = policy or SharedGpuPolicy(limit)
        self.name = f"{speculative.name}-routed"
        self._lock = threading.Lock()
        self._running = {SPECULATIVE: 0, PLAIN: 0}
        self.routed = {SPECULATIVE: 0, PLAIN: 0}
        """requests sent to each engine since start (/health, tests)"""
        self.on_route: Callable[[str], None] | None = None
        """called with the engine of every request (the replica's metrics counter)"""
        self.predicted: dict[int, float] = {}
        """deployments: per load, the curves' tok/s over the same GPUs all plain (/health)"""
        self.routers = 1
        """deployments: the routing ingress replicas that share the engines (this one routes its share)"""

    # ---- facts
    @property
    def fatal(self) -> str | None:  # type: ignore[override]
        for side, b in ((SPECULATIVE, self.speculative_backend), (PLAIN, self.plain_backend)):
            if b.fatal:
                return f"{side} engine: {b.fatal}"
        return None

    @property
    def info(self) -> TargetInfo:
        return self.speculative_backend.info

    @property
    def tokenizer(self) -> Any:
        return self.speculative_backend.tokenizer

    @property
    def speculative(self) -> bool:
        return True

    @property
    def algorithm(self) -> str | None:
        return self.speculative_backend.algorithm

    @property
    def alive(self) -> bool:
        return self.speculative_backend.alive and self.plain_backend.alive

    def route_state(self) -> dict[str, Any]:
        """For /health: the limit, the requests each engine runs now and how many each has taken."""
        with self._lock:
            state = {"limit": self.limit, "placement": self.policy.placement, "running": dict(self._running),
                     "routed": dict(self.routed), "ingress_replicas": self.routers}
        if self.predicted:
            state["predicted_vs_plain"] = {str(n): round(r, 3) for n, r in self.predicted.items()}
        return state

    # ---- routing
    def choose(self) -> str:
        """The engine the next request goes to, counted as running there (call :meth:`_done` when it ends)."""
        with self._lock:
            side = self.policy.choose(self._running[SPECULATIVE], self._running[PLAIN])
            self._running[side] += 1
            self.routed[side] += 1
        return side

    def _done(self, side: str) -> None:
        with self._lock:
            self._running[side] -= 1

    def submit(self, job: Job) -> None:
        side = self.choose()
        if self.on_route is not None:
            try:
                self.on_route(side)
            except Exception:  # the metrics must never fail a request
                log.warning("could not count a routed request", exc_info=True)
        deliver = job.emit_fn

        def emit(ev: DecodeEvent) -> None:
            if side == PLAIN:  # the plain engine drafted nothing: no verify steps, whatever it reports
                ev.stats = SpecStats() if ev.stats is not None else None
            if ev.final:
                self._done(side)
            deliver(ev)

        job.emit_fn = emit
        try:
            (self.speculative_backend if side == SPECULATIVE else self.plain_backend).submit(job)
        except Exception:
            job.emit_fn = deliver
            self._done(side)
            raise

    def close(self, timeout: float = 10.0) -> None:
        for b in (self.speculative_backend, self.plain_backend):
            try:
                b.close(timeout)
            except Exception:  # closing one must not keep the other open
                log.exception("closing the %s engine failed", b.name)


def route_configs(cfg: EaglenestConfig, spec: Any, limit: int, *,
                  shared_gpus: bool = True) -> tuple[EaglenestConfig, EaglenestConfig]:
    """(speculative engine's config, plain engine's config) for the two decoders: neither has a schedule or routing
    of its own; the speculative one serves ``spec`` for at most ``limit`` requests, in a KV pool sized for them
    (SGLang) where it shares the GPUs with the plain one (``shared_gpus``; a deployment of its own keeps the
    target's memory settings)."""
    s = cfg.serve
    base = {"schedule": None, "route": s.route.model_copy(update={"by_load": False})}
    shape = spec.model_dump(exclude={"algorithm"}) if spec is not None else {}
    fast_serve = s.model_copy(update={**base, "spec": s.spec.model_copy(update=shape),
                                      "max_concurrent_requests": limit, "max_batch_size": min(limit, s.max_batch_size)})
    target = speculative_target(cfg.target, s, limit) if shared_gpus else cfg.target
    fast = cfg.model_copy(update={"serve": fast_serve, "target": target})
    plain = cfg.model_copy(update={"serve": s.model_copy(update=base)})
    return fast, plain


def make_routed_backend(cfg: EaglenestConfig, drafter: str, plan: Any) -> RoutedBackend:
    """Both engines in processes of their own, the plain one first (see the module docstring): a decoder process
    says it is ready only once its engine has started, so the speculative engine sizes its memory from what the
    plain one left."""
    from eaglenest.serve.process_backend import ProcessBackend

    if plan.route_limit is None:
        raise ValueError("a routed plan needs route_limit")
    fast_cfg, plain_cfg = route_configs(cfg, plan.spec, plan.route_limit)
    plain = ProcessBackend(plain_cfg, None)
    try:
        fast = ProcessBackend(fast_cfg, drafter)
    except Exception:
        plain.close()
        raise
    log.info("routing by live load: up to %d request(s) on the speculative engine (%s), more on the plain engine",
             plan.route_limit, plan.spec)
    return RoutedBackend(fast, plain, plan.route_limit)


def deployments_policy(cfg: EaglenestConfig, schedule: Any, plan: Any) -> tuple[MarginalPolicy | OverflowPolicy,
                                                                             dict[int, float]]:
    """``placement: deployments``: the marginal-throughput rule over the schedule's measured curves (each side's
    curve pooled over its replicas; the speculative side's limit is per replica), as one of ``serve.num_replicas``
    routing ingress replicas applies it to its share of the load (route_policy's module docstring), and what the
    whole app predicts against the same replicas all plain at powers of two up to ``serve.max_concurrent_requests``
    per ingress replica; the overflow rule and no prediction where the schedule lacks either curve."""
    route = cfg.serve.route
    routers = cfg.serve.num_replicas
    limit = ingress_share(plan.route_limit * route.speculative_replicas, routers)
    s = plan.spec
    curves = schedule_curves(schedule.buckets, f"{s.num_steps}-{s.topk}-{s.num_draft_tokens}")
    if curves is None:
        return OverflowPolicy(limit), {}
    spec_curve, plain_curve = curves
    policy = MarginalPolicy(spec_curve.pooled(route.speculative_replicas / routers),
                            plain_curve.pooled(route.plain_replicas / routers), limit)
    top = cfg.serve.max_concurrent_requests * routers
    loads = sorted({*(1 << i for i in range(top.bit_length()) if 1 << i <= top), top})
    copies = route.speculative_replicas + route.plain_replicas
    return policy, predicted_ratios(policy, plain_curve, copies, loads, routers)


def make_deployments_routed_backend(cfg: EaglenestConfig, schedule: Any, plan: Any,
                                    engines: dict[str, Any]) -> RoutedBackend:
    """The ingress's side of ``placement: deployments``: the two engine deployments through their handles, routed
    by :func:`deployments_policy`."""
    from eaglenest.serve.handle_backend import HandleBackend

    trust = cfg.target.trust_remote_code
    fast = HandleBackend(engines[SPECULATIVE], trust_remote_code=trust)
    try:
        plain = HandleBackend(engines[PLAIN], trust_remote_code=trust)
    except Exception:
        fast.close()
        raise
    policy, predicted = deployments_policy(cfg, schedule, plan)
    routed = RoutedBackend(fast, plain, policy.limit, policy)
    routed.predicted = predicted
    routed.routers = cfg.serve.num_replicas
    rule = "marginal throughput of the measured curves" if isinstance(policy, MarginalPolicy) else \
        "overflow (the schedule has no curves for this shape)"
    log.info("routing by live load across two deployments: up to %d request(s) on the speculative one (%s), by %s%s",
             policy.limit, plan.spec, rule, f" (this ingress replica's share: 1 of {routed.routers})"
             if routed.routers > 1 else "")
    if predicted:
        worst = min(predicted, key=predicted.__getitem__)
        log.info("  predicted tok/s over the same replicas all plain: %s (lowest %.3fx at %d requests)",
                 ", ".join(f"{n}: {r:.2f}x" for n, r in predicted.items()), predicted[worst], worst)
    return routed
