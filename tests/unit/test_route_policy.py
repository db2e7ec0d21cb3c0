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
    ingress_share,
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


def test_ingress_replicas_each_route_their_share_and_never_pass_the_range_together():
    """Two ingress replicas, each with half of an even load: each routes over half of the engines and half of the
    range, so together they never pass it (a router that counted the whole range as its own would send twice the
    safe range to the speculative side); they split a load as one router with all of it would, but in steps of two
    requests, which costs a little at small loads."""
    from eaglenest.serve.routed import deployments_policy

    s = _schedule({1: (100.0, 150.0), 2: (180.0, 240.0), 8: (400.0, 200.0)})
    plan = s.route_plan(1)
    route = {"by_load": True, "placement": "deployments", "speculative_replicas": 2}
    one, whole = deployments_policy(EaglenestConfig.model_validate({"serve": {"route": route}}), s, plan)
    two, predicted = deployments_policy(
        EaglenestConfig.model_validate({"serve": {"route": route, "num_replicas": 2}}), s, plan)
    assert (one.limit, two.limit) == (4, 2), "the range (2 a speculative replica, 2 replicas) shared by 2 routers"
    assert two.speculative_curve(1) == pytest.approx(one.speculative_curve(2) / 2)
    assert all(2 * two.split(n)[0] <= one.limit for n in range(64)), "together they never pass the range"
    assert 2 * one.split(6)[0] == 8 > one.limit, "a router that took the whole range as its own would pass it"
    assert tuple(2 * x for x in two.split(6)) == one.split(12) == (4, 8), "at 12 requests, as one router would"
    assert tuple(2 * x for x in two.split(2)) == (4, 0) and one.split(4) == (3, 1), \
        "the price: each router decides in steps of two of the app's requests"
    assert predicted[4] == pytest.approx(1.263, abs=1e-3) and whole[4] == pytest.approx(1.289, abs=1e-3)
    assert predicted[8] == pytest.approx(whole[8]) and predicted[64] == pytest.approx(whole[64])
    assert max(predicted) == 2 * 64, "predicted up to max_concurrent_requests per ingress replica"


def test_ingress_share_refuses_a_router_without_a_speculative_request():
    assert ingress_share(4, 1) == 4 and ingress_share(4, 3) == 1
    with pytest.raises(ValueError, match=r"serve.num_replicas <= 2.*speculative_replicas"):
        ingress_share(2, 3)


def test_deployments_refuse_what_the_ingress_replicas_cannot_share(tmp_path):
    """Refused before anything is deployed, naming the fix: more ingress replicas than speculative requests to
    share, or an autoscaled ingress (the share needs a fixed count)."""
    from eaglenest.serve.engine_deployment import bind_engines

    path = _schedule({1: (100.0, 150.0), 2: (180.0, 240.0), 8: (400.0, 200.0)}).save(tmp_path / "schedule.json")
    serve = {"schedule": str(path), "route": {"by_load": True, "placement": "deployments"}}
    for replicas in (1, 2):
        engines = bind_engines(EaglenestConfig.model_validate({"serve": {**serve, "num_replicas": replicas}}),
                               "drafter")
        assert engines is not None and set(engines) == {"speculative_engine", "plain_engine"}
    with pytest.raises(ValueError, match="serve.num_replicas <= 2"):
        bind_engines(EaglenestConfig.model_validate({"serve": {**serve, "num_replicas": 3}}), "drafter")
    with pytest.raises(ValueError, match="without serve.autoscaling"):
        bind_engines(EaglenestConfig.model_validate({"serve": {**serve, "autoscaling": {"min_replicas": 1}}}),
                     "drafter")
    assert bind_engines(EaglenestConfig.model_validate({"serve": {**serve, "route": {"by_load": True}}}),
                       "drafter") is None, "placement: replica runs both engines on the replica"
