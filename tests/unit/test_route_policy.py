"""Routing by live load's two rules (serve.route_policy): one GPU group never splits the load; two deployments split
it by the schedule's measured curves, and say what that predicts against the same replicas all plain."""

from __future__ import annotations

import pytest

from eaglenest.config import EaglenestConfig
from eaglenest.serve.route_policy import (
    PLAIN,
    SPECULATIVE,
    Curve,
    MarginalPolicy,
    OverflowPolicy,
    SharedGpuPolicy,
    predicted_ratios,
    schedule_curves,
)
from eaglenest.speculative.schedule import build_schedule


def test_a_curve_is_linear_between_its_points_through_zero_and_flat_beyond():
    c = Curve(((1, 100.0), (4, 250.0)))
    assert (c(0), c(1), c(2), c(4), c(100)) == (0.0, 100.0, 150.0, 250.0, 250.0)
    assert c(0.5) == 50.0
    assert c.pooled(2)(2) == 200.0 and c.pooled(2)(8) == 500.0, "two replicas sharing the load evenly"
    with pytest.raises(ValueError, match="ascending"):
        Curve(((4, 1.0), (1, 2.0)))
    with pytest.raises(ValueError, match="at least one"):
        Curve(())


def test_one_gpu_group_never_splits_the_load():
    p = SharedGpuPolicy(limit=4)
    assert p.choose(0, 0) == SPECULATIVE and p.choose(3, 0) == SPECULATIVE
    assert p.choose(4, 0) == PLAIN, "at the limit"
    assert p.choose(0, 1) == PLAIN, "the plain engine is busy: joining the speculative one would time-slice the GPU"


def test_two_deployments_take_the_larger_measured_gain_up_to_the_limit():
    spec = Curve(((1, 300.0), (2, 560.0), (8, 1_600.0), (16, 2_000.0)))
    plain = Curve(((1, 150.0), (2, 295.0), (8, 1_100.0), (16, 2_000.0)))
    p = MarginalPolicy(spec, plain, limit=8)
    assert p.choose(0, 0) == SPECULATIVE, "300 vs 150: the drafter pays most at batch 1"
    assert p.choose(0, 5) == SPECULATIVE, "unlike one GPU group, a busy plain side does not block speculation"
    assert p.choose(8, 0) == PLAIN, "the limit: the drafter's safe range ends there"
    assert p.choose(3, 0) == SPECULATIVE, "from 3 to 4 the speculative curve gains 173 tok/s, the plain one's first 150"
    s, q = p.split(12)
    assert s + q == 12 and s == 8, (s, q)
    assert p.split(1) == (1, 0) and p.split(3)[0] == 3


def test_ties_go_to_the_speculative_side_and_overflow_needs_no_curves():
    flat = Curve(((1, 100.0), (2, 200.0)))
    assert MarginalPolicy(flat, flat, limit=2).split(3) == (2, 1)
    o = OverflowPolicy(limit=2)
    assert [o.choose(n, 5) for n in range(3)] == [SPECULATIVE, SPECULATIVE, PLAIN]


def test_prediction_against_the_same_replicas_all_plain():
    spec = Curve(((1, 150.0), (2, 240.0), (8, 200.0)))
    plain = Curve(((1, 100.0), (2, 180.0), (8, 400.0)))
    p = MarginalPolicy(spec, plain, limit=2)
    r = predicted_ratios(p, plain, copies=2, loads=[1, 2, 4, 16])
    assert r[1] == pytest.approx(150 / 100), "one request: on one copy either way, the other idles"
    assert r[2] == pytest.approx((150 + 100) / 200)
    assert r[4] == pytest.approx((240 + 180) / 360)
    assert r[16] == pytest.approx((240 + 400) / 800), "beyond twice the range: said, not hidden"


def _schedule(rates: dict[int, tuple[float, float]]):
    def rep(base: float, spec: float) -> list[dict]:
        return [{"baseline": {"tok_per_s": base, "tok_per_s_rounds": [base, base]},
                 "configs": [{"config": "off", "tok_per_s": base, "tok_per_s_rounds": [base, base]},
                             {"config": "3-1-4", "tok_per_s": spec, "tok_per_s_rounds": [spec, spec]}]}]

    return build_schedule({b: rep(*r) for b, r in rates.items()}, {"target": "t"}, noise_floor=0.01)


def test_curves_come_from_the_schedules_measured_buckets():
    s = _schedule({1: (100.0, 150.0), 2: (180.0, 240.0), 8: (400.0, 200.0)})
    spec, plain = schedule_curves(s.buckets, "3-1-4")
    assert spec.points == ((1, 150.0), (2, 240.0), (8, 200.0))
    assert plain.points == ((1, 100.0), (2, 180.0), (8, 400.0))
    assert schedule_curves(s.buckets, "5-1-6") is None, "a shape the tune never measured"


def test_the_deployments_policy_pools_replicas_and_predicts_up_to_the_admission_limit():
    from eaglenest.serve.routed import deployments_policy

    s = _schedule({1: (100.0, 150.0), 2: (180.0, 240.0), 8: (400.0, 200.0)})
    plan = s.route_plan(1)
    assert plan is not None and plan.route_limit == 2
    cfg = EaglenestConfig.model_validate({"serve": {"max_concurrent_requests": 16, "route": {
        "by_load": True, "placement": "deployments", "speculative_replicas": 2}}})
    policy, predicted = deployments_policy(cfg, s, plan)
    assert isinstance(policy, MarginalPolicy) and policy.limit == 4, "the limit is per speculative replica"
    assert policy.speculative_curve(2) == 300.0, "two speculative replicas at one request each"
    assert sorted(predicted) == [1, 2, 4, 8, 16]


def test_deployments_refuse_more_than_one_ingress(tmp_path):
    """Each ingress replica counts only what it routed itself: two would each send the limit to the speculative
    side. Refused before anything is deployed, naming the fix."""
    from eaglenest.serve.engine_deployment import bind_engines

    path = _schedule({1: (100.0, 150.0), 2: (180.0, 240.0), 8: (400.0, 200.0)}).save(tmp_path / "schedule.json")
    serve = {"schedule": str(path), "route": {"by_load": True, "placement": "deployments"}}
    one = EaglenestConfig.model_validate({"serve": serve})
    engines = bind_engines(one, "drafter")
    assert engines is not None and set(engines) == {"speculative_engine", "plain_engine"}
    two = EaglenestConfig.model_validate({"serve": {**serve, "num_replicas": 2}})
    with pytest.raises(ValueError, match="serve.num_replicas: 1.*speculative_replicas"):
        bind_engines(two, "drafter")
    assert bind_engines(EaglenestConfig.model_validate({"serve": {**serve, "route": {"by_load": True}}}),
                       "drafter") is None, "placement: replica runs both engines on the replica"
