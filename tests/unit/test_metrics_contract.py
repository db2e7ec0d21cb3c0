"""The metric contract (eaglenest.contracts.metrics) against the metric objects the code really creates.

Behavioural: serve's ServeMetrics, regen's progress metrics and drafter training's metrics are constructed (Ray's
metric objects need no running cluster) and their names, types, tag keys and buckets are read back from the objects;
a name that only appears in a comment or a string cannot satisfy this. The alerts/dashboard side is checked against
the same contract by tests/e2e/test_monitoring.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from ray.util import metrics as ray_metrics

from eaglenest.contracts import metrics as contract
from eaglenest.contracts.metrics import Metric, accept_length

KINDS = {ray_metrics.Counter: "counter", ray_metrics.Gauge: "gauge", ray_metrics.Histogram: "histogram"}


def _created(objs: Any) -> dict[str, tuple[str, tuple[str, ...], tuple[float, ...]]]:
    """name -> (kind, tag keys, buckets) of every Ray metric object in ``objs`` (objects, tuples, or attributes)."""
    found: dict[str, tuple[str, tuple[str, ...], tuple[float, ...]]] = {}
    stack = list(objs)
    while stack:
        o = stack.pop()
        if isinstance(o, ray_metrics.Metric):
            info = o.info
            found[info["name"]] = (KINDS[type(o)], tuple(info["tag_keys"]), tuple(info.get("boundaries") or ()))
        elif isinstance(o, tuple | list):
            stack.extend(o)
        elif hasattr(o, "__dict__"):
            stack.extend(v for v in vars(o).values() if isinstance(v, ray_metrics.Metric))
    return found


def _expected(defs: tuple[Metric, ...]) -> dict[str, tuple[str, tuple[str, ...], tuple[float, ...]]]:
    return {m.name: (m.kind, m.tag_keys, m.boundaries) for m in defs}


def test_serve_creates_exactly_the_contract_serve_metrics() -> None:
    from eaglenest.serve.metrics import ServeMetrics

    assert _created([ServeMetrics("m", baseline_tokens_per_s=10.0)]) == _expected(contract.SERVE)


def test_a_routing_replica_creates_exactly_the_contract_route_metrics() -> None:
    from eaglenest.serve.metrics import ServeMetrics

    m = ServeMetrics("m")
    assert m._routed is None, "a replica that does not route exports no routed counter"
    m.routed("plain")
    assert _created([m._routed]) == _expected(contract.SERVE_ROUTE)


def test_regen_creates_exactly_the_contract_regen_metrics() -> None:
    from eaglenest.regen.progress import regen_metrics

    assert _created([regen_metrics()]) == _expected(contract.REGEN)


def test_training_creates_exactly_the_contract_training_metrics() -> None:
    from eaglenest.drafter.metrics import TrainMetrics

    m = TrainMetrics.create("run-1")
    assert _created([m]) == _expected(contract.TRAIN)
    assert all(x.info["default_tags"] == {"run": "run-1"} for x in vars(m).values())


def test_the_traffic_log_creates_exactly_the_contract_traffic_metrics(tmp_path) -> None:
    from eaglenest.config import TrafficLogConfig
    from eaglenest.serve.traffic_log import TrafficLog

    log = TrafficLog(TrafficLogConfig(path=str(tmp_path)), model="m", drafter=None, decode=str, encode=list)
    log.close()
    assert _created([log.counters.ray_metrics]) == _expected(contract.TRAFFIC)


def test_the_flywheel_creates_exactly_the_contract_flywheel_metrics() -> None:
    from eaglenest.flywheel.metrics import FlywheelMetrics

    assert _created([FlywheelMetrics.create("app")]) == _expected(contract.FLYWHEEL)


def test_every_contract_metric_is_created_by_some_code(tmp_path) -> None:
    from eaglenest.config import TrafficLogConfig
    from eaglenest.drafter.metrics import TrainMetrics
    from eaglenest.flywheel.metrics import FlywheelMetrics
    from eaglenest.regen.progress import regen_metrics
    from eaglenest.serve.metrics import ServeMetrics
    from eaglenest.serve.traffic_log import TrafficLog

    log = TrafficLog(TrafficLogConfig(path=str(tmp_path)), model="m", drafter=None, decode=str, encode=list)
    log.close()
    mon = _schedule_monitor()
    mon.stop()
    from eaglenest.serve.metrics import route_counter

    created = _created([ServeMetrics("m"), regen_metrics(), TrainMetrics.create("r"), log.counters.ray_metrics,
                        FlywheelMetrics.create("a"), list(mon._gauges.values()), route_counter()])
    assert created == _expected(contract.ALL)
    names = [m.name for m in contract.ALL]
    assert len(names) == len(set(names)), "a metric is defined twice"


def test_the_check_sees_a_wrong_type_or_name() -> None:
    """A metric created under another name or type does not match the contract."""
    wrong = [ray_metrics.Gauge("eaglenest_serve_requests", "x", tag_keys=("route", "status"))]
    assert _created(wrong) != _expected((contract.SERVE_REQUESTS,))
    renamed = [ray_metrics.Counter("eaglenest_serve_request", "x", tag_keys=("route", "status"))]
    assert _created(renamed) != _expected((contract.SERVE_REQUESTS,))


def test_exported_series_names() -> None:
    assert contract.SERVE_REQUESTS.exported() == ("ray_eaglenest_serve_requests_total",)
    assert contract.TRAIN_LOSS_NONFINITE.exported() == ("ray_eaglenest_train_loss_nonfinite_total",)
    assert contract.SERVE_TTFT.exported() == tuple(f"ray_eaglenest_serve_ttft_seconds_{s}"
                                                   for s in ("bucket", "sum", "count"))
    assert contract.SERVE_HEALTHY.exported() == ("ray_eaglenest_serve_replica_healthy",)
    assert "up" in contract.exported_series()


@pytest.mark.parametrize(("steps", "accepted", "want"), [(0, 0, 1.0), (4, 0, 1.0), (4, 6, 2.5), (3, 9, 4.0)])
def test_accept_length_counts_the_bonus_token(steps: int, accepted: int, want: float) -> None:
    assert accept_length(steps, accepted) == want



def _schedule_monitor() -> Any:
    """A replica's schedule metrics (eaglenest.serve.schedule_metrics) over a one-bucket schedule."""
    from eaglenest.serve.schedule_metrics import ScheduleMonitor
    from eaglenest.speculative.schedule import build_schedule

    rep = {"baseline": {"tok_per_s": 100.0, "tok_per_s_rounds": [100.0, 101.0]},
           "configs": [{"config": "3-1-4", "tok_per_s": 150.0, "tok_per_s_rounds": [150.0, 149.0]}]}
    schedule = build_schedule({1: [rep]}, {}, noise_floor=0.01)
    return ScheduleMonitor("m", schedule, applied=lambda b: b.choice, inflight=lambda: 0, from_events=True)


def test_a_schedule_replica_creates_exactly_the_contract_schedule_metrics() -> None:
    mon = _schedule_monitor()
    mon.stop()
    assert _created(list(mon._gauges.values())) == _expected(contract.SERVE_SCHEDULE)
