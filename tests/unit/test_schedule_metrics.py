"""A replica's schedule series (eaglenest.serve.schedule_metrics) from what the decoder reports and requests do."""

from __future__ import annotations

import time

import pytest

from eaglenest.contracts import metrics as contract
from eaglenest.serve.schedule_metrics import ScheduleMonitor
from eaglenest.speculative.schedule import build_schedule


def _rep(base: float, spec: float) -> list[dict]:
    return [{"baseline": {"tok_per_s": base, "tok_per_s_rounds": [base, base * 1.01]},
             "configs": [{"config": "off", "tok_per_s": base, "tok_per_s_rounds": [base, base]},
                         {"config": "3-1-4", "tok_per_s": spec, "tok_per_s_rounds": [spec, spec]}]}]


@pytest.fixture
def monitor():
    s = build_schedule({1: _rep(100.0, 160.0), 4: _rep(320.0, 200.0)}, {}, noise_floor=0.01)
    inflight = [0]
    m = ScheduleMonitor("m", s, applied=lambda b: b.choice, inflight=lambda: inflight[0], from_events=True,
                        use_ray=False, interval_s=3600)
    m.inflight_box = inflight
    yield m
    m.stop()


def test_published_per_bucket(monitor):
    assert monitor.value(contract.SCHEDULE_NUM_STEPS, bucket="1") == 3
    assert monitor.value(contract.SCHEDULE_NUM_STEPS, bucket="2-4") == 0
    assert monitor.value(contract.SCHEDULE_NUM_STEPS, bucket="5+") == 0
    assert monitor.value(contract.SCHEDULE_TUNED_TPS, bucket="1", variant="schedule") == 160.0
    assert monitor.value(contract.SCHEDULE_TUNED_TPS, bucket="2-4", variant="baseline") == 320.0
    assert monitor.value(contract.SCHEDULE_TOLERANCE, bucket="1") == pytest.approx(0.01)


def test_live_mode_and_active_bucket(monitor):
    monitor.inflight_box[0] = 3
    monitor.observe((3, 0))
    monitor._tick()
    assert monitor.live() == {"batch_size": 3, "num_steps": 0, "bucket": "2-4"}
    assert monitor.value(contract.LIVE_NUM_STEPS) == 0 and monitor.value(contract.LIVE_BATCH_SIZE) == 3
    assert monitor.value(contract.BUCKET_ACTIVE, bucket="2-4") == 1.0
    assert monitor.value(contract.BUCKET_ACTIVE, bucket="1") == 0.0
    monitor.inflight_box[0] = 0  # idle: no bucket is live
    monitor._tick()
    assert monitor.live()["bucket"] is None and monitor.value(contract.BUCKET_ACTIVE, bucket="2-4") == 0.0


def test_speedup_against_the_tuned_baseline_at_the_same_concurrency(monitor):
    assert monitor.baseline_tok_per_s(1) == 100.0 and monitor.baseline_tok_per_s(4) == 320.0
    assert monitor.baseline_tok_per_s(2) == pytest.approx(210.0), "log-linear between 1 and 4"
    t0 = time.perf_counter()
    monitor.observe((1, 3))
    time.sleep(0.25)  # long enough that a whole number of tokens is within 3% of the rate asked for
    t1 = time.perf_counter()
    # a lone request at 150 tok/s against the baseline's 100 per request at batch 1
    monitor.finished(t0, t1, 1 + round(150 * (t1 - t0)))
    assert monitor.value(contract.BUCKET_SPEEDUP, bucket="1") == pytest.approx(1.5, rel=0.05)
    t2 = time.perf_counter()
    monitor.observe((4, 0))
    time.sleep(0.25)
    t3 = time.perf_counter()
    assert monitor.mean_batch(t2, t3) == pytest.approx(4.0, rel=0.05)
    monitor.finished(t2, t3, 1 + round(72 * (t3 - t2)))  # 72 tok/s per request at batch 4: 0.9x of 320/4
    assert monitor.value(contract.BUCKET_SPEEDUP, bucket="2-4") == pytest.approx(0.9, rel=0.05)
