"""Graceful drain: stop admitting, let running requests finish up to a deadline, then end them with an error event.

Why not Ray Serve's own shutdown alone: ``serve.shutdown()`` stops the HTTP proxies at the same time as the
replicas drain, so every open stream is cut within a fraction of a second. ``stop_serve`` (and SIGTERM of
``eaglenest serve``) therefore drains *before* shutting Serve down, while the proxies still forward:

1. it writes a drain request (its wall-clock time) into Ray's internal KV (:func:`request_drain`);
2. every replica polls that key (:class:`DrainWatcher`), stops admitting (503 with ``Retry-After``), lets its
   running requests finish until ``serve.drain_timeout_s`` and then cancels the rest, each with a final error
   event (:class:`Drain`); it reports its in-flight count and deadline back under its own key;
3. :func:`wait_drained` returns once every running replica reported zero in flight (or the latest deadline passed),
   and Serve is shut down.

A replica ignores drain requests older than itself, so a stale key cannot drain a later deployment.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

NAMESPACE = "eaglenest"
DEPLOYMENT_NAME = "eaglenest"
"""the ingress deployment (serve.deployment): its replicas run the drain watcher and answer a drain request"""
REQUEST_KEY = "drain-request"
REPORT_PREFIX = "drain-report:"
RETRY_AFTER_S = 5
"""``Retry-After`` of the 503 a draining or unhealthy replica answers (another replica or the restarted server)"""
RETRY_AFTER_BUSY_S = 1
"""``Retry-After`` of a 429: a slot frees as soon as any running request finishes"""


class Drain:
    """One replica's drain: a deadline, and the wake-ups of the requests still running (thread-safe)."""

    def __init__(self) -> None:
        self.deadline: float | None = None
        """monotonic time at which running requests are cancelled; None until the drain begins"""
        self.deadline_wall: float | None = None
        self._wakers: set[Callable[[], None]] = set()
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    @property
    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def begin(self, timeout_s: float) -> bool:
        """Start draining (once); returns False when it had already begun."""
        with self._lock:
            if self.deadline is not None:
                return False
            self.deadline = time.monotonic() + max(timeout_s, 0.0)
            self.deadline_wall = time.time() + max(timeout_s, 0.0)
            self._timer = threading.Timer(max(timeout_s, 0.0), self._expire)
            self._timer.daemon = True
            self._timer.start()
        log.info("draining: no new requests; running ones have %.1f s to finish", timeout_s)
        return True

    def register(self, wake: Callable[[], None]) -> None:
        """``wake`` is called (from a timer thread) when the deadline passes: the request must end itself."""
        with self._lock:
            self._wakers.add(wake)
        if self.expired:
            wake()

    def unregister(self, wake: Callable[[], None]) -> None:
        with self._lock:
            self._wakers.discard(wake)

    def _expire(self) -> None:
        with self._lock:
            wakers = list(self._wakers)
        if wakers:
            log.warning("drain deadline passed: cancelling %d running request(s)", len(wakers))
        for wake in wakers:
            wake()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


# --------------------------------------------------------------------------------------- Ray KV coordination
def _kv() -> tuple[Callable, Callable, Callable, Callable]:
    from eaglenest.ray_private import internal_kv

    return internal_kv()


class DrainWatcher:
    """Replica side: poll for a drain request newer than this replica; while draining, report the in-flight count."""

    def __init__(self, replica_id: str, on_request: Callable[[], None], inflight: Callable[[], int],
                 drain: Drain, interval_s: float = 0.25) -> None:
        self.replica_id = replica_id
        self.on_request = on_request
        self.inflight = inflight
        self.drain = drain
        self.interval_s = interval_s
        self.started = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="eaglenest-drain-watch", daemon=True)

    def start(self) -> DrainWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        get, put, _, _ = _kv()
        while not self._stop.wait(self.interval_s):
            try:
                if not self.drain.draining:
                    raw = get(REQUEST_KEY, namespace=NAMESPACE)
                    if raw and float(raw) >= self.started:
                        self.on_request()
                if self.drain.draining:
                    report = {"inflight": self.inflight(), "deadline": self.drain.deadline_wall}
                    put(REPORT_PREFIX + self.replica_id, json.dumps(report), True, namespace=NAMESPACE)
            except Exception:  # the GCS going away at shutdown is expected
                log.debug("drain watcher poll failed", exc_info=True)


def request_drain() -> None:
    """Driver side: ask every replica started before now to drain."""
    _, put, _, _ = _kv()
    put(REQUEST_KEY, repr(time.time()), True, namespace=NAMESPACE)


def running_replicas() -> int:
    """Ingress replicas Serve reports RUNNING: those that will answer the drain request. An engine deployment
    (``serve.route.placement: deployments``) runs no watcher: its requests come through an ingress, which drains
    them, and Serve's graceful shutdown stops it; counted here, it held every such shutdown to the deadline."""
    from ray import serve

    total = 0
    for app in serve.status().applications.values():
        for name, dep in app.deployments.items():
            if name == DEPLOYMENT_NAME:
                total += sum(n for state, n in dep.replica_states.items() if str(getattr(state, "value", state))
                             == "RUNNING")
    return total


def wait_drained(expected: int, *, first_report_s: float = 10.0, grace_s: float = 3.0,
                 poll_s: float = 0.2) -> bool:
    """Until ``expected`` replicas reported nothing in flight (True), or the latest reported deadline plus
    ``grace_s`` passed, or no replica reported within ``first_report_s`` (False)."""
    get, _, _, keys = _kv()
    began = time.time()
    while True:
        reports = []
        for key in keys(REPORT_PREFIX, namespace=NAMESPACE):
            raw = get(key, namespace=NAMESPACE)
            if raw:
                reports.append(json.loads(raw))
        if len(reports) >= expected and all(r["inflight"] == 0 for r in reports):
            return True
        now = time.time()
        deadlines = [r["deadline"] for r in reports if r.get("deadline")]
        if (deadlines and now > max(deadlines) + grace_s) or (not reports and now - began > first_report_s):
            return False
        time.sleep(poll_s)


def clear_drain() -> None:
    """Forget the request and the reports (the next deployment on this Ray starts clean)."""
    _, _, delete, _ = _kv()
    delete(REQUEST_KEY, namespace=NAMESPACE)
    delete(REPORT_PREFIX, del_by_prefix=True, namespace=NAMESPACE)


def drain_serve() -> bool:
    """Drain every replica of this Ray's Serve; True when all finished their requests before their deadlines."""
    expected = max(running_replicas(), 1)
    request_drain()
    ok = wait_drained(expected)
    time.sleep(0.3)  # the last events leave the proxy before it is stopped
    return ok
