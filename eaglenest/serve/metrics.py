"""Serve metrics through ``ray.util.metrics`` (exported by Ray's per-node metrics agent with a ``ray_`` prefix).

Names, types, help texts and buckets are the contract in :mod:`eaglenest.contracts.metrics` (shared with
``monitoring/alerts.yml`` and the Grafana dashboard); this module only records values. Accept length counts the bonus
token (1.0 = no draft token accepted: the drafter is bypassed); only requests that drafted (at least one verify step)
are recorded.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from eaglenest.contracts import metrics as contract
from eaglenest.contracts.metrics import ray_metric

METRIC_NAMES = tuple(m.name for m in contract.SERVE)


@dataclass
class RequestStats:
    """What one finished request contributes to the metrics."""

    completion_tokens: int
    ttft_s: float | None
    decode_s: float
    accept_length: float
    draft_tokens: int
    accepted_tokens: int
    speculative: bool
    verify_steps: int = 0
    """target verify forwards after the prefill: 0 = the request never drafted (e.g. max_tokens=1)"""
    queue_s: float | None = None
    """proxy arrival -> handler start; None when the proxy does not stamp arrivals (serve.arrival)"""


def records_accept_length(s: RequestStats) -> bool:
    """Only requests that drafted have an accept length: a baseline server's, or a request that ended before any
    verify step (max_tokens=1, EOS first), would read 1.0, a "bypassed drafter", and pull the collapse alert toward
    a false alarm."""
    return s.speculative and s.verify_steps > 0


class ServeMetrics:
    """All serve metrics of one process; ``smoothing`` weights the newest request in the tokens/s gauges."""

    def __init__(self, model: str, *, baseline_tokens_per_s: float | None = None, smoothing: float = 0.2) -> None:
        self.model = model
        self.tags = {"model": model}
        self.baseline = baseline_tokens_per_s
        self.smoothing = smoothing
        self._tps: float | None = None
        self._lock = threading.Lock()
        self.requests = ray_metric(contract.SERVE_REQUESTS)
        self.ttft = ray_metric(contract.SERVE_TTFT)
        self.queue = ray_metric(contract.SERVE_QUEUE)
        self.itl = ray_metric(contract.SERVE_ITL)
        self.generated = ray_metric(contract.SERVE_GENERATED_TOKENS)
        self.accept = ray_metric(contract.SERVE_ACCEPT_LENGTH)
        self.accept_current = ray_metric(contract.SERVE_ACCEPT_LENGTH_CURRENT)
        self.proposed = ray_metric(contract.SERVE_DRAFT_PROPOSED)
        self.accepted = ray_metric(contract.SERVE_DRAFT_ACCEPTED)
        self.speedup = ray_metric(contract.SERVE_SPEEDUP)
        self.healthy = ray_metric(contract.SERVE_HEALTHY)
        self.tps = ray_metric(contract.SERVE_TOKENS_PER_SECOND)

        self._gauges: dict[int, tuple[Any, float]] = {}
        self._routed: Any = None
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None

    def request(self, route: str, status: int) -> None:
        self.requests.inc(1, tags={"route": route, "status": str(status)})

    def routed(self, engine: str) -> None:
        """serve.route: one request sent to ``engine`` (speculative or plain); the counter is made by the first
        (only a replica that routes has it)."""
        with self._lock:  # the self-test's thread and the event loop may route the first two requests at once
            if self._routed is None:
                self._routed = route_counter()
        self._routed.inc(1, tags={**self.tags, "engine": engine})

    def set_healthy(self, ok: bool) -> None:
        self._set(self.healthy, 1.0 if ok else 0.0)

    def _set(self, gauge: Any, value: float) -> None:
        with self._lock:
            self._gauges[id(gauge)] = (gauge, value)
        gauge.set(value, tags=self.tags)

    def start_refresh(self, interval_s: float = 5.0) -> None:
        """Re-report every gauge's last value periodically: Ray's metrics agent drops a gauge series that has not
        been reported for two export intervals, and a replica's health must stay visible between requests."""
        if self._refresher is not None:
            return

        def loop() -> None:
            while not self._stop.wait(interval_s):
                with self._lock:
                    items = list(self._gauges.values())
                for gauge, value in items:
                    gauge.set(value, tags=self.tags)

        self._refresher = threading.Thread(target=loop, name="eaglenest-metrics-refresh", daemon=True)
        self._refresher.start()

    def stop_refresh(self) -> None:
        self._stop.set()

    def finished(self, s: RequestStats) -> None:
        """Record one finished generation."""
        t = self.tags
        if s.ttft_s is not None:
            self.ttft.observe(max(s.ttft_s, 0.0), tags=t)
        if s.queue_s is not None:
            self.queue.observe(s.queue_s, tags=t)
        if s.completion_tokens > 1 and s.ttft_s is not None:
            self.itl.observe(max(s.decode_s, 0.0) / (s.completion_tokens - 1), tags=t)
        if s.completion_tokens <= 0:
            return
        self.generated.inc(s.completion_tokens, tags=t)
        if records_accept_length(s):
            self.accept.observe(s.accept_length, tags=t)
            self._set(self.accept_current, s.accept_length)
        if s.draft_tokens:
            self.proposed.inc(s.draft_tokens, tags=t)
        if s.accepted_tokens:
            self.accepted.inc(s.accepted_tokens, tags=t)
        if s.completion_tokens > 1 and s.decode_s > 0:
            rate = (s.completion_tokens - 1) / s.decode_s
            with self._lock:
                self._tps = rate if self._tps is None else (1 - self.smoothing) * self._tps + self.smoothing * rate
                tps = self._tps
            self._set(self.tps, tps)
            if self.baseline:
                self._set(self.speedup, tps / self.baseline)

    @property
    def tokens_per_second(self) -> float | None:
        return self._tps


class NullMetrics(ServeMetrics):
    """Same interface, records nothing (in-process engine use without Ray)."""

    def __init__(self, model: str = "", **_: Any) -> None:  # noqa: D107 - no Ray metrics objects
        self.model, self.tags, self.baseline, self.smoothing, self._tps = model, {"model": model}, None, 0.2, None
        self._lock = threading.Lock()

    def request(self, route: str, status: int) -> None:
        pass

    def routed(self, engine: str) -> None:
        pass

    def set_healthy(self, ok: bool) -> None:
        pass

    def start_refresh(self, interval_s: float = 5.0) -> None:
        pass

    def stop_refresh(self) -> None:
        pass

    def finished(self, s: RequestStats) -> None:
        pass


def route_counter() -> Any:
    """``eaglenest_serve_routed_requests`` (contract ``SERVE_ROUTE``)."""
    return ray_metric(contract.SERVE_ROUTED)
