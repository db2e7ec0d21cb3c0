"""What bench and tune start on SGLang for each variant (``sglang_variants.planned_launch``): a plan that serve runs as
SGLang's adaptive mode must start a speculative engine. On #29's H100 rehearsal the tune's "off" and "schedule"
variants started the plain engine instead (adaptive plans carry no static shape), so the schedule measured 1.006x
the baseline at batch 1 where serve, launching the same schedule, speculated; this pins the rule on a CPU."""

from __future__ import annotations

from eaglenest.config import SpecConfig
from eaglenest.speculative.schedule import OffPlan, SGLangPlan, build_schedule
from eaglenest.speculative.sglang_variants import planned_launch

EXPECTED = (1, 256)


def _report(base: float, **tps: float) -> dict:
    return {"baseline": {"tok_per_s": base, "tok_per_s_rounds": [base, base * 1.005]},
            "configs": [{"config": k.replace("_", "-"), "tok_per_s": v, "tok_per_s_rounds": [v, v]}
                        for k, v in tps.items()]}


def test_plain_and_static_variants() -> None:
    assert planned_launch(None, None, {}, EXPECTED) == SGLangPlan("plain")
    shape = SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)
    assert planned_launch(shape, None, {}, EXPECTED) == SGLangPlan("static", spec=shape)


def test_speculation_off_is_a_speculative_engine_pinned_to_zero_steps() -> None:
    launch = planned_launch(None, OffPlan(), {}, EXPECTED)
    assert launch.mode == "adaptive" and launch.spec is None
    assert launch.adaptive.buckets == ((1, (0,)),)


def test_off_is_the_plain_engine_where_sglang_refuses_adaptive_mode(capsys) -> None:
    launch = planned_launch(None, OffPlan(), {"enable_dp_attention": True}, EXPECTED)
    assert launch.mode == "plain" and launch.spec is None and launch.adaptive is None
    assert "speculation off is the plain engine here" in capsys.readouterr().err


def test_a_tuned_schedule_starts_sglangs_adaptive_mode_with_its_candidates() -> None:
    """the rehearsal's shape: speculation wins at batch 1, off from 2 on"""
    per = {1: [_report(160.6, off=161.0, **{"3_1_4": 377.5})],
           256: [_report(20019.0, off=22571.0, **{"3_1_4": 6689.5})]}
    schedule = build_schedule(per, {}, noise_floor=0.01)
    launch = planned_launch(None, schedule, {}, EXPECTED)
    assert launch.mode != "plain", "a schedule that speculates at batch 1 must not start the plain engine"
    assert launch.spec is None and launch.adaptive is not None
    assert launch.adaptive.steps_for(1) == (3,) and launch.adaptive.steps_for(256) == (0,)


def test_a_schedule_that_never_speculates_is_the_plain_engine(capsys) -> None:
    per = {1: [_report(100.0, off=99.9, **{"3_1_4": 60.0})], 8: [_report(700.0, off=699.0, **{"3_1_4": 400.0})]}
    launch = planned_launch(None, build_schedule(per, {}, noise_floor=0.01), {}, EXPECTED)
    assert launch.mode == "plain" and launch.spec is None and launch.adaptive is None
    assert "never speculates" in capsys.readouterr().err


def test_a_schedule_routed_by_load_is_measured_as_serve_routes_it(capsys) -> None:
    """serve.route.by_load: the bench's engine runs a batch of at most the limit on the speculative engine and a
    larger one on the plain engine, one engine up at a time (the other closed first)."""
    from eaglenest.config import RouteConfig
    from eaglenest.speculative.routed_engine import RoutedEngine

    per = {1: [_report(160.0, off=150.0, **{"3_1_4": 310.0})],
           256: [_report(23500.0, off=6600.0, **{"3_1_4": 10000.0})]}
    schedule = build_schedule(per, {}, noise_floor=0.01)
    assert planned_launch(None, schedule, {}, EXPECTED).mode == "plain", "without routing: no drafter"
    launch = planned_launch(None, schedule, {}, EXPECTED, route=RouteConfig(by_load=True))
    assert launch.mode == "routed" and launch.route_limit == 1 and launch.spec.num_steps == 3
    assert "routing by live load" in capsys.readouterr().err

    log: list[str] = []

    class Side:  # what the factory's engines do here: start on creation, answer, close
        def __init__(self, name: str) -> None:
            self.name = name
            log.append(f"start {name}")

        def generate_ids(self, prompts, sampling):
            log.append(f"{self.name} x{len(prompts)}")
            return []

        def close(self) -> None:
            log.append(f"close {self.name}")

    eng = RoutedEngine(lambda: Side("speculative"), lambda: Side("plain"), launch.route_limit)
    for bs in (1, 1, 8, 256):
        eng.ready_for(bs)
        eng.generate_ids([[1]] * bs, None)
    eng.close()
    assert log == ["start speculative", "speculative x1", "speculative x1", "close speculative", "start plain",
                   "plain x8", "plain x256", "close plain"]
