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
from eaglenest.speculative.routed_engine import speculative_target

log = logging.getLogger(__name__)

SPECULATIVE, PLAIN = "speculative", "plain"


class RoutedBackend(BackendBase):
    """Two started backends behind one ``submit``: ``speculative`` for live loads up to ``limit``, ``plain`` beyond
    (the rule in the module docstring). Facts (tokenizer, target info, algorithm) are the speculative engine's."""

    def __init__(self, speculative: BackendBase, plain: BackendBase, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"serve.route.limit must be at least 1, got {limit}")
        self.speculative_backend = speculative
        self.plain_backend = plain
        self.limit = limit
        self.name = f"{speculative.name}-routed"
        self._lock = threading.Lock()
        self._running = {SPECULATIVE: 0, PLAIN: 0}
        self.routed = {SPECULATIVE: 0, PLAIN: 0}
        """requests sent to each engine since start (/health, tests)"""
        self.on_route: Callable[[str], None] | None = None
        """called with the engine of every request (the replica's metrics counter)"""

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
            return {"limit": self.limit, "running": dict(self._running), "routed": dict(self.routed)}

    # ---- routing
    def choose(self) -> str:
        """The engine the next request goes to, counted as running there (call :meth:`_done` when it ends)."""
        with self._lock:
            side = (SPECULATIVE if self._running[PLAIN] == 0 and self._running[SPECULATIVE] < self.limit
                    else PLAIN)
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


def route_configs(cfg: EaglenestConfig, spec: Any, limit: int) -> tuple[EaglenestConfig, EaglenestConfig]:
    """(speculative engine's config, plain engine's config) for the two decoder processes: neither has a schedule
    or routing of its own; the speculative one serves ``spec`` for at most ``limit`` requests, in a KV pool sized
    for them (SGLang)."""
    s = cfg.serve
    base = {"schedule": None, "route": s.route.model_copy(update={"by_load": False})}
    shape = spec.model_dump(exclude={"algorithm"}) if spec is not None else {}
    fast_serve = s.model_copy(update={**base, "spec": s.spec.model_copy(update=shape),
                                      "max_concurrent_requests": limit, "max_batch_size": min(limit, s.max_batch_size)})
    fast = cfg.model_copy(update={"serve": fast_serve, "target": speculative_target(cfg.target, s, limit)})
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
