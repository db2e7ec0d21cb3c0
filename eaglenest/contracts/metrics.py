"""Every Prometheus metric eaglenest emits (name, type, help, tags, buckets), and the accept-length definition.

The alert rules (``monitoring/alerts.yml``), the Grafana dashboard (``monitoring/build_dashboard.py``) and the tests
query these series; serve, regen and drafter training create their metric objects from the definitions here
(:func:`ray_metric`), so a name or a type is written once. Ray's metrics agent exports a metric as ``ray_<name>``,
a counter as ``ray_<name>_total`` and a histogram as ``ray_<name>_bucket/_sum/_count`` (:meth:`Metric.exported`).

Accept length (:func:`accept_length`) is SGLang's ``spec_accept_length``: tokens per target verify forward with the
target's bonus token counted, so 1.0 means no draft token was ever accepted (the drafter is bypassed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["counter", "gauge", "histogram"]

RAY_PREFIX = "ray_"


def accept_length(verify_steps: int, accepted_tokens: int) -> float:
    """Mean tokens per target verify forward, bonus token included: ``1 + accepted / steps`` (1.0 with no step)."""
    return 1.0 + accepted_tokens / verify_steps if verify_steps else 1.0


@dataclass(frozen=True)
class Metric:
    """One metric as the code creates it and monitoring queries it."""

    name: str
    kind: Kind
    help: str
    tag_keys: tuple[str, ...] = ()
    boundaries: tuple[float, ...] = ()
    """histogram buckets (upper bounds)"""

    def exported(self) -> tuple[str, ...]:
        """The series names Prometheus scrapes from Ray's metrics agent."""
        base = RAY_PREFIX + self.name
        if self.kind == "counter":
            return (base if base.endswith("_total") else base + "_total",)
        if self.kind == "histogram":
            return tuple(f"{base}_{s}" for s in ("bucket", "sum", "count"))
        return (base,)


def ray_metric(m: Metric) -> Any:
    """The ``ray.util.metrics`` object for ``m`` (works with or without a connected Ray; records once connected)."""
    from ray.util import metrics

    if m.kind == "counter":
        return metrics.Counter(m.name, m.help, tag_keys=m.tag_keys)
    if m.kind == "gauge":
        return metrics.Gauge(m.name, m.help, tag_keys=m.tag_keys)
    return metrics.Histogram(m.name, m.help, boundaries=list(m.boundaries), tag_keys=m.tag_keys)


# --------------------------------------------------------------------------------------------------------- serve
_MODEL = ("model",)
SERVE_REQUESTS = Metric("eaglenest_serve_requests", "counter", "HTTP requests by route and status code",
                        ("route", "status"))
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0,
                    5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0)
"""TTFT and queue buckets, at most 1.5x apart from 0.1 s to 30 s: Ray exports a histogram's sum from bucket midpoints
(ray:_private/telemetry/open_telemetry_metric_recorder.py), so the buckets bound the error of its mean too"""
SERVE_TTFT = Metric("eaglenest_serve_ttft_seconds", "histogram",
                    "time from the request's arrival at Ray Serve's HTTP proxy to its first token (leaving the "
                    "replica, for a stream)", _MODEL, _LATENCY_BUCKETS)
SERVE_QUEUE = Metric("eaglenest_serve_queue_seconds", "histogram",
                     "time from the request's arrival at Ray Serve's HTTP proxy until its replica's handler started "
                     "(Serve's routing and queueing; the decoder's own queue is in TTFT only)", _MODEL,
                     (0.001, *_LATENCY_BUCKETS))
SERVE_ITL = Metric("eaglenest_serve_inter_token_latency_seconds", "histogram",
                   "mean time between output tokens of a request, after the first", _MODEL,
                   (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
SERVE_GENERATED_TOKENS = Metric("eaglenest_serve_generated_tokens", "counter", "completion tokens generated", _MODEL)
SERVE_ACCEPT_LENGTH = Metric("eaglenest_serve_accept_length", "histogram",
                             "per-request accept length (tokens per target verify step, bonus token counted)", _MODEL,
                             (1.0, 1.05, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0))
SERVE_ACCEPT_LENGTH_CURRENT = Metric("eaglenest_serve_accept_length_current", "gauge",
                                     "accept length of the latest finished request", _MODEL)
SERVE_DRAFT_PROPOSED = Metric("eaglenest_serve_draft_tokens_proposed", "counter", "draft tokens proposed to the target",
                              _MODEL)
SERVE_DRAFT_ACCEPTED = Metric("eaglenest_serve_draft_tokens_accepted", "counter", "draft tokens accepted by the target",
                              _MODEL)
SERVE_SPEEDUP = Metric("eaglenest_serve_speedup_vs_baseline", "gauge",
                       "decode tokens/s per request over serve.baseline_tokens_per_s (the last benchmark)", _MODEL)
SERVE_HEALTHY = Metric("eaglenest_serve_replica_healthy", "gauge", "1 when the replica passed its self-test", _MODEL)
SERVE_TOKENS_PER_SECOND = Metric("eaglenest_serve_tokens_per_second", "gauge",
                                 "decode tokens/s per request (moving average)", _MODEL)
SERVE = (SERVE_REQUESTS, SERVE_TTFT, SERVE_QUEUE, SERVE_ITL, SERVE_GENERATED_TOKENS, SERVE_ACCEPT_LENGTH,
         SERVE_ACCEPT_LENGTH_CURRENT, SERVE_DRAFT_PROPOSED, SERVE_DRAFT_ACCEPTED, SERVE_SPEEDUP, SERVE_HEALTHY,
         SERVE_TOKENS_PER_SECOND)

# ----------------------------------------------------------------------------------- serve: routing by live load
SERVE_ROUTED = Metric("eaglenest_serve_routed_requests", "counter",
                      "requests a replica routing by live load (serve.route) sent to each engine (speculative, plain)",
                      ("model", "engine"))
SERVE_ROUTE = (SERVE_ROUTED,)
"""created only by a replica that routes (serve.route.by_load)"""

# ---------------------------------------------------------------------------------------- serve: the traffic log
SERVE_TRAFFIC_LOGGED = Metric("eaglenest_serve_traffic_logged", "counter",
                              "sampled requests written to the traffic log (serve.traffic_log)", _MODEL)
SERVE_TRAFFIC_DROPPED = Metric("eaglenest_serve_traffic_dropped", "counter",
                               "sampled requests the traffic log dropped instead of delaying them (queue_full, "
                               "write_error)", ("model", "reason"))
TRAFFIC = (SERVE_TRAFFIC_LOGGED, SERVE_TRAFFIC_DROPPED)

# ---------------------------------------------------------------------------------------- serve: tuned schedule
# A replica serving a tuned schedule (serve.schedule) publishes what the schedule says per batch bucket (bucket:
# "1", "3-4", "257+"), which bucket the live batch is in, what runs now, and how fast requests in each bucket decode
# against the tuned baseline there. The slower-than-baseline alert reads these when they exist.
_BUCKET = ("model", "bucket")
SCHEDULE_NUM_STEPS = Metric("eaglenest_serve_schedule_num_steps", "gauge",
                            "num_steps the tuned schedule applies in the bucket (0 = speculation off)", _BUCKET)
SCHEDULE_TUNED_TPS = Metric("eaglenest_serve_schedule_tuned_tokens_per_second", "gauge",
                            "tok/s tune measured at the bucket's top batch size: variant baseline (no drafter) or "
                            "schedule (what the bucket runs)", ("model", "bucket", "variant"))
SCHEDULE_TOLERANCE = Metric("eaglenest_serve_schedule_tolerance", "gauge",
                            "the bucket's measurement noise (fraction): slower than the baseline by more is a loss",
                            _BUCKET)
LIVE_BATCH_SIZE = Metric("eaglenest_serve_live_batch_size", "gauge",
                         "requests decoding together now (hf: the running batch; sglang: requests in flight)", _MODEL)
LIVE_NUM_STEPS = Metric("eaglenest_serve_live_num_steps", "gauge",
                        "num_steps of the latest decoding step (0 = speculation off)", _MODEL)
BUCKET_ACTIVE = Metric("eaglenest_serve_bucket_active", "gauge", "1 for the bucket of the live batch size, else 0",
                       _BUCKET)
BUCKET_SPEEDUP = Metric("eaglenest_serve_bucket_speedup_vs_tuned_baseline", "gauge",
                        "decode tok/s per request in the bucket over the tuned baseline's per-request tok/s at the "
                        "same concurrency (moving average)", _BUCKET)
SERVE_SCHEDULE = (SCHEDULE_NUM_STEPS, SCHEDULE_TUNED_TPS, SCHEDULE_TOLERANCE, LIVE_BATCH_SIZE, LIVE_NUM_STEPS,
                  BUCKET_ACTIVE, BUCKET_SPEEDUP)

# --------------------------------------------------------------------------------------------------------- regen
REGEN_SAMPLES_DONE = Metric("eaglenest_regen_samples_done", "counter", "regen samples written to shards", ("source",))
REGEN_SAMPLES_QUARANTINED = Metric("eaglenest_regen_samples_quarantined", "counter", "regen samples quarantined",
                                   ("source", "reason"))
REGEN_GENERATED_TOKENS = Metric("eaglenest_regen_generated_tokens", "counter",
                                "tokens generated by the target during regen")
REGEN_TOKENS_PER_SECOND = Metric("eaglenest_regen_tokens_per_second", "gauge",
                                 "regen generated tokens per second (last minute)")
REGEN_ETA = Metric("eaglenest_regen_eta_seconds", "gauge", "estimated seconds until the regen job finishes")
REGEN = (REGEN_SAMPLES_DONE, REGEN_SAMPLES_QUARANTINED, REGEN_GENERATED_TOKENS, REGEN_TOKENS_PER_SECOND, REGEN_ETA)

# ------------------------------------------------------------------------------------------------------ training
_RUN = ("run",)
TRAIN_LOSS = Metric("eaglenest_train_loss", "gauge", "drafter TTT training loss (weighted over steps)", _RUN)
TRAIN_ACC0 = Metric("eaglenest_train_acc0", "gauge", "drafter step-0 top-1 agreement with the target", _RUN)
TRAIN_SIM_ACCEPT_LENGTH = Metric("eaglenest_train_sim_accept_length", "gauge",
                                 "simulated accept length 1 + sum_k prod_{j<=k} acc_j", _RUN)
TRAIN_LOSS_NONFINITE = Metric("eaglenest_train_loss_nonfinite_total", "counter",
                              "training steps skipped for a non-finite loss", _RUN)
TRAIN = (TRAIN_LOSS, TRAIN_ACC0, TRAIN_SIM_ACCEPT_LENGTH, TRAIN_LOSS_NONFINITE)

# ------------------------------------------------------------------------------------------------------ flywheel
_APP = ("app",)
FLYWHEEL_ACCEPT_LENGTH = Metric("eaglenest_flywheel_accept_length", "gauge",
                                "the promotion gate's accept length per drafter role (candidate, live) and prompt set "
                                "(heldout: recent traffic, regression: the original held-out prompts)",
                                ("app", "role", "set"))
FLYWHEEL_LIVE_ACCEPT_LENGTH = Metric("eaglenest_flywheel_live_accept_length", "gauge",
                                     "served accept length after a swap over the watched requests, per phase "
                                     "(before: the previous drafter's recent requests, after: the new drafter's)",
                                     ("app", "phase"))
FLYWHEEL_PROMOTIONS = Metric("eaglenest_flywheel_promotions", "counter", "drafters swapped in after passing the gate",
                             _APP)
FLYWHEEL_REFUSALS = Metric("eaglenest_flywheel_refusals", "counter", "candidates the gate refused", _APP)
FLYWHEEL_ROLLBACKS = Metric("eaglenest_flywheel_rollbacks", "counter",
                            "swapped-in drafters rolled back by the post-swap watch", _APP)
FLYWHEEL = (FLYWHEEL_ACCEPT_LENGTH, FLYWHEEL_LIVE_ACCEPT_LENGTH, FLYWHEEL_PROMOTIONS, FLYWHEEL_REFUSALS,
            FLYWHEEL_ROLLBACKS)

ALL: tuple[Metric, ...] = SERVE + SERVE_SCHEDULE + SERVE_ROUTE + TRAFFIC + REGEN + TRAIN + FLYWHEEL
"""every metric eaglenest emits"""

RAY_SERIES_USED = ("ray_serve_num_http_requests_total", "ray_serve_num_http_error_requests_total",
                   "ray_serve_deployment_replica_healthy", "up")
"""series the alerts and dashboard read that Ray Serve / Prometheus emit themselves"""


def exported_series() -> frozenset[str]:
    """Every series name monitoring may query: ours as Ray exports them, and :data:`RAY_SERIES_USED`."""
    return frozenset(s for m in ALL for s in m.exported()) | frozenset(RAY_SERIES_USED)


__all__ = ["ALL", "FLYWHEEL", "REGEN", "SERVE", "SERVE_ROUTE", "SERVE_SCHEDULE", "TRAFFIC", "TRAIN",
           "RAY_SERIES_USED", "Metric", "accept_length", "exported_series", "ray_metric"]
