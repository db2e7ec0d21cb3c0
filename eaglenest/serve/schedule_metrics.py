"""A replica's tuned schedule as Prometheus series: what each bucket runs, what runs now, and whether it pays.

Series (:data:`eaglenest.contracts.metrics.SERVE_SCHEDULE`): per bucket, the schedule's num_steps (0 = off), the
tuned tok/s of the baseline and of the bucket's choice, and its noise; the live batch size and the num_steps of the
latest step; which bucket is live; and per bucket the decode speed of finished requests over the tuned baseline's
per-request speed at the concurrency they ran at (the baseline curve interpolated in log batch size), as a moving
average. The "speculation slower than baseline" alert compares that ratio with ``1 - noise`` in the live bucket.

Live state: on the hf backend every decoding step reports (batch size, num_steps) with its events
(:meth:`ScheduleMonitor.observe`); on SGLang the requests in flight stand for the batch and the schedule's steps for
that bucket for what runs (SGLang's scheduler does not report its step choice). Gauges are re-reported every second
(Ray's agent drops a gauge series not reported for two export intervals).
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from eaglenest.contracts import metrics as contract
from eaglenest.speculative.schedule import Bucket, Schedule
from eaglenest.speculative.schedule_select import Option

log = logging.getLogger(__name__)


class ScheduleMonitor:
    """Live schedule state of one replica, published as gauges (``use_ray``) and readable by /health."""

    def __init__(self, model: str, schedule: Schedule, *, applied: Callable[[Bucket], Option],
                 inflight: Callable[[], int], from_events: bool, use_ray: bool = True, smoothing: float = 0.2,
                 interval_s: float = 1.0) -> None:
        self.model = model
        self.schedule = schedule
        self.applied = applied
        """what this replica runs in a bucket (hf: the choice; SGLang: the chain choice, or one config for all)"""
        self.inflight = inflight
        self.from_events = from_events
        """hf: the decoder reports each step's mode; sglang: the mode is the schedule's for the requests in flight"""
        self.smoothing = smoothing
        self.values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._gauges = {m.name: _ray_gauge(m) if use_ray else None for m in contract.SERVE_SCHEDULE}
        self._lock = threading.Lock()
        self._mode: tuple[int, int] = (0, 0)
        self._history: deque[tuple[float, int]] = deque(maxlen=20_000)
        self._history.append((time.perf_counter(), 0))
        self._speedup: dict[str, float] = {}
        measured = [b for b in schedule.buckets if b.measured and b.baseline_tok_per_s]
        self._curve = [(math.log2(b.max_batch), float(b.baseline_tok_per_s)) for b in measured]
        for b in schedule.buckets:
            tags = {"bucket": b.label}
            runs = applied(b)
            self._set(contract.SCHEDULE_NUM_STEPS, runs.num_steps, tags)
            self._set(contract.SCHEDULE_TOLERANCE, b.noise, tags)
            self._set(contract.BUCKET_ACTIVE, 0.0, tags)
            if b.measured and b.baseline_tok_per_s:
                chosen = runs.tok_per_s if runs.tok_per_s > 0 else b.baseline_tok_per_s
                self._set(contract.SCHEDULE_TUNED_TPS, b.baseline_tok_per_s, {**tags, "variant": "baseline"})
                self._set(contract.SCHEDULE_TUNED_TPS, chosen, {**tags, "variant": "schedule"})
        self._stop = threading.Event()
        self._interval = interval_s
        self._thread = threading.Thread(target=self._loop, name="eaglenest-schedule-metrics", daemon=True)
        self._thread.start()

    # ---- inputs
    def observe(self, mode: tuple[int, int]) -> None:
        """A decoding step ran at (batch size, num_steps) (called for every event: keep it cheap)."""
        if mode != self._mode:
            with self._lock:
                self._mode = mode
                self._history.append((time.perf_counter(), mode[0]))

    def finished(self, first_token_at: float | None, last_token_at: float | None, completion_tokens: int) -> None:
        """One request ended: its decode speed against the tuned baseline at the concurrency it saw."""
        if first_token_at is None or last_token_at is None or completion_tokens < 2:
            return
        decode_s = last_token_at - first_token_at
        if decode_s <= 0 or not self._curve:
            return
        c = max(self.mean_batch(first_token_at, last_token_at), 1.0)
        base_per_request = self.baseline_tok_per_s(c) / c
        if base_per_request <= 0:
            return
        ratio = (completion_tokens - 1) / decode_s / base_per_request
        label = self.schedule.bucket_for(max(1, round(c))).label
        with self._lock:
            old = self._speedup.get(label)
            self._speedup[label] = ratio if old is None else (1 - self.smoothing) * old + self.smoothing * ratio
            value = self._speedup[label]
        self._set(contract.BUCKET_SPEEDUP, value, {"bucket": label})

    # ---- derived
    def baseline_tok_per_s(self, batch: float) -> float:
        """The tuned baseline's tok/s at ``batch`` concurrent requests (log-linear between measured sizes)."""
        x = math.log2(max(batch, 1.0))
        xs = [p[0] for p in self._curve]
        i = bisect.bisect_left(xs, x)
        if i <= 0:
            return self._curve[0][1]
        if i >= len(xs):
            return self._curve[-1][1]
        (x0, y0), (x1, y1) = self._curve[i - 1], self._curve[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    def mean_batch(self, t0: float, t1: float) -> float:
        """Time-weighted live batch size over ``[t0, t1]``."""
        with self._lock:
            hist = list(self._history)
        total, prev_t, prev_n = 0.0, t0, 0
        for t, n in hist:
            if t <= t0:
                prev_n = n
                continue
            if t >= t1:
                break
            total += (t - prev_t) * prev_n
            prev_t, prev_n = t, n
        total += (t1 - prev_t) * prev_n
        return total / (t1 - t0) if t1 > t0 else float(prev_n)

    def live(self) -> dict[str, Any]:
        n, steps = self._mode
        bucket = self.schedule.bucket_for(max(n, 1)).label if n > 0 else None
        return {"batch_size": n, "num_steps": steps, "bucket": bucket}

    # ---- publishing
    def _tick(self) -> None:
        inflight = self.inflight()
        if not self.from_events or inflight == 0:
            n = inflight
            steps = self.applied(self.schedule.bucket_for(n)).num_steps if n > 0 else self._mode[1]
            self.observe((n, steps))
        live = self.live()
        self._set(contract.LIVE_BATCH_SIZE, live["batch_size"], {})
        self._set(contract.LIVE_NUM_STEPS, live["num_steps"], {})
        for b in self.schedule.buckets:
            self._set(contract.BUCKET_ACTIVE, 1.0 if b.label == live["bucket"] else 0.0, {"bucket": b.label})
        with self._lock:
            items = list(self.values.items())
        for (name, tags), value in items:  # re-report: Ray drops gauges not reported for a while
            gauge = self._gauges.get(name)
            if gauge is not None:
                gauge.set(value, tags=dict(tags))

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._tick()
            except Exception:  # noqa: BLE001 - metrics must never take the replica down
                log.debug("schedule metrics tick failed", exc_info=True)

    def _set(self, metric: contract.Metric, value: float, tags: dict[str, str]) -> None:
        full = tuple(sorted({"model": self.model, **tags}.items()))
        with self._lock:
            self.values[(metric.name, full)] = float(value)
        gauge = self._gauges.get(metric.name)
        if gauge is not None:
            gauge.set(float(value), tags=dict(full))

    def value(self, metric: contract.Metric, **tags: str) -> float | None:
        """The last value of a series (tests, /health)."""
        return self.values.get((metric.name, tuple(sorted({"model": self.model, **tags}.items()))))

    def stop(self) -> None:
        self._stop.set()


def _ray_gauge(m: contract.Metric) -> Any:
    return contract.ray_metric(m)
