"""The tuned schedule: the choice rule per bucket, the buckets, lookups, the file, the identity check, and SGLang's
adaptive configuration built from it (its parsing by SGLang itself: tests/unit/test_sglang_contract_adaptive.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eaglenest.engines.sglang.adaptive import SKIP_ZERO_STEP_ENV, AdaptiveSpec, adaptive_kwargs, adaptive_refusal
from eaglenest.speculative.identity import folder_fingerprint, identity_differences
from eaglenest.speculative.schedule import Schedule, ScheduleError, build_schedule
from eaglenest.speculative.schedule_select import choose, noise_of, options_of, single_choice


def report(base: list[float], **variants: list[float]) -> dict:
    """A bench report as run_bench_batches writes it: medians and per-repeat tok/s."""
    import statistics

    return {"baseline": {"tok_per_s": statistics.median(base), "tok_per_s_rounds": base},
            "configs": [{"config": k.replace("_", "-"), "tok_per_s": statistics.median(v), "tok_per_s_rounds": v,
                         "accept_length": 2.0} for k, v in variants.items()]}


def test_noise_is_the_baselines_spread_with_a_floor():
    assert noise_of([report([100, 104, 102])], 0.01) == pytest.approx(0.04 / 1.02, rel=1e-6)
    assert noise_of([report([100, 100.2])], 0.01) == 0.01


def test_choice_takes_the_fastest_qualifying_shape():
    opts = options_of([report([100, 100, 101], off=[100, 99.9], **{"3_1_4": [150, 149], "5_4_8": [160, 120]})])
    choice, safe = choose(opts, noise=0.01)
    assert (choice.label, safe) == ("3-1-4", True), "5-4-8 has the higher median but one repeat at 0.8x"


def test_a_shape_slower_than_the_baseline_beyond_noise_is_never_chosen():
    opts = options_of([report([100, 101, 100], off=[100, 100], **{"3_1_4": [97, 98]})])
    choice, safe = choose(opts, noise=0.01)
    assert (choice.label, safe) == ("off", True)


def test_within_noise_but_not_faster_stays_off():
    opts = options_of([report([100, 103, 101], off=[101, 100], **{"3_1_4": [100.5, 99.5]})])
    assert choose(opts, noise=noise_of([report([100, 103, 101])], 0.01))[0].label == "off"


def test_the_worst_temperature_decides():
    greedy = report([100, 100], off=[100, 100], **{"3_1_4": [150, 150]})
    sampled = report([100, 100], off=[100, 100], **{"3_1_4": [95, 96]})
    assert choose(options_of([greedy]), 0.01)[0].label == "3-1-4"
    assert choose(options_of([greedy, sampled]), 0.01)[0].label == "off"


def test_an_engine_whose_off_mode_costs_marks_the_bucket_unsafe():
    opts = options_of([report([100, 100], off=[95, 95], **{"3_1_4": [90, 91]})])
    choice, safe = choose(opts, noise=0.01)
    assert choice.label == "off" and safe is False


def _schedule() -> Schedule:
    per = {
        1: [report([100, 101], off=[100, 100], **{"3_1_4": [190, 188], "2_1_3": [170, 171], "5_4_8": [200, 199]})],
        2: [report([180, 181], off=[180, 180], **{"3_1_4": [240, 239], "2_1_3": [250, 251], "5_4_8": [200, 199]})],
        4: [report([300, 301], off=[300, 300], **{"3_1_4": [280, 281], "2_1_3": [290, 292], "5_4_8": [250, 249]})],
    }
    return build_schedule(per, {"target": {}, "drafter": {}, "engine": {"engine": "hf"}}, noise_floor=0.01)


def test_buckets_cover_every_batch_size_and_apply_the_choice_at_their_top():
    s = _schedule()
    assert [b.label for b in s.buckets] == ["1", "2", "3-4", "5+"]
    assert [b.choice.label for b in s.buckets] == ["5-4-8", "2-1-3", "off", "off"]
    assert s.bucket_for(3).label == "3-4" and s.bucket_for(1000).label == "5+"
    policy = s.policy()
    assert [None if policy(n) is None else policy(n).num_steps for n in (1, 2, 3, 4, 5, 64)] == [5, 2, None, None,
                                                                                               None, None]
    assert s.largest_spec().num_draft_tokens == 8 and s.speculates()


def test_sglang_gets_chains_only():
    s = _schedule()
    assert [b.chain_choice.label for b in s.buckets] == ["3-1-4", "2-1-3", "off", "off"]
    spec = s.adaptive_spec(provenance="x")
    assert spec.buckets == ((1, (3,)), (2, (2,)), (3, (0,)), (5, (0,)))
    assert spec.initial_steps == 3 and spec.env == {SKIP_ZERO_STEP_ENV: "1"}
    assert s.adaptive_safe() == []


def test_one_config_for_an_expected_load():
    s = _schedule()
    assert s.single_for_load(1, 2).label == "3-1-4", "the only shape that wins in both buckets"
    assert s.single_for_load(1, 4) is None, "nothing wins at 3-4: speculation off"
    assert single_choice([]) is None


def test_file_round_trip_and_clear_errors(tmp_path: Path):
    s = _schedule()
    path = s.save(tmp_path / "schedule.json")
    again = Schedule.load(path)
    assert again.to_dict() == s.to_dict()
    with pytest.raises(ScheduleError, match="eaglenest tune"):
        Schedule.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ScheduleError, match="not an eaglenest schedule"):
        Schedule.load(tmp_path / "bad.json")


def _weights(folder: Path, seed: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"hidden_size": 8}))
    g = torch.Generator().manual_seed(seed)
    save_file({"a": torch.randn(64, 64, generator=g), "b": torch.randn(512, 300, generator=g)},
              str(folder / "model.safetensors"))
    return folder


def test_fingerprints_follow_the_weights_not_the_path(tmp_path: Path):
    import shutil

    a = _weights(tmp_path / "a", 0)
    shutil.copytree(a, tmp_path / "copy")
    b = _weights(tmp_path / "b", 1)  # same shapes and config, other weights: a retrained drafter
    assert folder_fingerprint(a) == folder_fingerprint(tmp_path / "copy")
    assert folder_fingerprint(a) != folder_fingerprint(b)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        folder_fingerprint(tmp_path)


def test_a_stale_schedule_is_refused_naming_the_fix(tmp_path: Path):
    a, b = _weights(tmp_path / "a", 0), _weights(tmp_path / "b", 1)
    recorded = {"target": {"path": "t", "fingerprint": "sha256:1"},
                "drafter": {"path": str(a), "fingerprint": folder_fingerprint(a)}, "engine": {"engine": "hf"}}
    s = _schedule()
    s.identity = recorded
    s.check(json.loads(json.dumps(recorded)), path="s.json", fix="eaglenest tune --config c.yaml")
    other = {**recorded, "drafter": {"path": str(b), "fingerprint": folder_fingerprint(b)}}
    with pytest.raises(ScheduleError, match=r"(?s)stale.*drafter: tuned on .*re-run.*eaglenest tune --config c.yaml"):
        s.check(other, path="s.json", fix="eaglenest tune --config c.yaml")
    engine = {**recorded, "engine": {"engine": "sglang"}}
    assert identity_differences(recorded, engine) == ["engine engine: tuned with 'hf', serving with 'sglang'"]
    # a serve driver on a CPU head node compares the files only; the replica compares the engine too
    s.check({k: v for k, v in engine.items() if k != "engine"}, path="s.json", fix="x", parts=("target", "drafter"))
    with pytest.raises(ScheduleError, match="engine engine"):
        s.check(engine, path="s.json", fix="x")


def test_adaptive_spec_routing_and_validation(tmp_path: Path):
    spec = AdaptiveSpec(((1, (3, 2)), (5, (1,)), (9, (0,))))
    assert [spec.steps_for(n) for n in (1, 4, 5, 8, 9, 500)] == [(3, 2), (3, 2), (1,), (1,), (0,), (0,)]
    cfg = spec.config()
    assert cfg["1"] == {"candidate_steps": [3, 2]} and "eaglenest" in cfg
    assert spec.write(tmp_path) == spec.write(tmp_path), "a schedule always writes the same file"
    kw = adaptive_kwargs(spec, "/x.json")
    assert kw["speculative_num_steps"] == 3 and kw["speculative_num_draft_tokens"] == 4 and kw["speculative_adaptive"]
    assert AdaptiveSpec(((1, (3,)),)).env == {}, "no steps-0 candidate: nothing to skip"
    with pytest.raises(ValueError, match="ascending"):
        AdaptiveSpec(((4, (1,)), (2, (0,))))
    assert adaptive_refusal({"enable_dp_attention": True}).startswith("enable_dp_attention")
    assert "topk" in adaptive_refusal({}, topk=4)


def test_sglang_plan_adaptive_static_or_plain():
    s = _schedule()
    plan = s.sglang_plan({}, expected=(1, 2))
    assert plan.mode == "adaptive" and plan.adaptive.buckets[0] == (1, (3,))
    assert any("chains only" in n for n in plan.notes), "bucket 1 measured best with a tree: said at start"
    refused = s.sglang_plan({"enable_dp_attention": True}, expected=(1, 2))
    assert refused.mode == "static" and refused.spec.num_steps == 3
    assert any("enable_dp_attention" in n and "1-2" in n for n in refused.notes)
    wide = s.sglang_plan({"enable_dp_attention": True}, expected=(1, 64))
    assert wide.mode == "plain" and wide.spec is None, "no shape is safe up to 64: the plain engine"


def test_sglang_plan_falls_back_when_even_steps_0_loses():
    per = {1: [report([100, 100], off=[100, 100], **{"3_1_4": [150, 150]})],
           2: [report([180, 180], off=[170, 171], **{"3_1_4": [160, 161]})]}
    s = build_schedule(per, {}, noise_floor=0.01)
    assert s.adaptive_safe() == ["2"]
    plan = s.sglang_plan({}, expected=(1, 1))
    assert plan.mode == "static" and any("steps 0" in n for n in plan.notes)


def test_a_plain_fallback_says_up_to_which_load_a_drafter_is_safe():
    """The H100 rehearsal's shape: 3-1-4 1.96x at batch 1; at 256 it and SGLang's "off" (0.28x) both lose."""
    per = {1: [report([156.8, 161.4], off=[147.5, 148.3], **{"3_1_4": [310.4, 314.2]})],
           4: [report([600, 602], off=[590, 592], **{"3_1_4": [900, 905]})],
           256: [report([23558.6, 23590.3], off=[6675.6, 6494.1], **{"3_1_4": [10019.1, 10074.3]})]}
    s = build_schedule(per, {}, noise_floor=0.01)
    plan = s.sglang_plan({}, expected=(1, 256))
    assert plan.mode == "plain"
    hint = [n for n in plan.notes if "safe up to" in n]
    assert len(hint) == 1 and "up to 4 concurrent" in hint[0] and "3-1-4" in hint[0], plan.notes
    assert "serve.expected_batch_size: [1, 4]" in hint[0] and "serve.route.by_load: true" in hint[0], hint
    assert s.widest_speculative_load(1)[0] == 4
    assert s.widest_speculative_load(5) is None, "from 5 on only the losing bucket remains"
    assert s.sglang_plan({}, expected=(1, 4)).mode == "static", "the narrower range the hint names does speculate"


def test_routing_by_load_keeps_the_batch_1_gain_where_one_config_cannot():
    """The same schedule with serve.route.by_load: 3-1-4 for up to 4 requests, the plain engine above; a limit caps it,
    and routing is only chosen where one configuration would have been none."""
    from eaglenest.serve.schedule import ServeSchedule

    per = {1: [report([156.8, 161.4], off=[147.5, 148.3], **{"3_1_4": [310.4, 314.2]})],
           4: [report([600, 602], off=[590, 592], **{"3_1_4": [900, 905]})],
           256: [report([23558.6, 23590.3], off=[6675.6, 6494.1], **{"3_1_4": [10019.1, 10074.3]})]}
    s = build_schedule(per, {}, noise_floor=0.01)
    plan = s.sglang_plan({}, expected=(1, 256), route=True)
    assert plan.mode == "routed" and plan.route_limit == 4 and plan.spec.num_steps == 3
    assert any("routing by live load: up to 4" in n for n in plan.notes), plan.notes
    assert s.sglang_plan({}, expected=(1, 256), route=True, route_limit=2).route_limit == 2
    assert s.sglang_plan({}, expected=(1, 4), route=True).mode == "static", "one engine suffices there"
    assert s.sglang_plan({}, expected=(5, 256), route=True).mode == "plain", "no safe load from 5 on"
    applied = ServeSchedule(s, "x", "sglang", plan)
    assert [applied.applied(b).label for b in s.buckets] == ["3-1-4", "3-1-4", "off", "off"]


def test_what_a_replica_applies_per_bucket():
    from eaglenest.serve.schedule import ServeSchedule

    s = _schedule()
    hf = ServeSchedule(s, "s.json", "hf")
    assert [hf.applied(b).label for b in s.buckets] == ["5-4-8", "2-1-3", "off", "off"]
    ad = ServeSchedule(s, "s.json", "sglang", s.sglang_plan({}, expected=(1, 2)))
    assert [ad.applied(b).label for b in s.buckets] == ["3-1-4", "2-1-3", "off", "off"]
    st = ServeSchedule(s, "s.json", "sglang", s.sglang_plan({"enable_dp_attention": True}, expected=(1, 2)))
    assert [st.applied(b).label for b in s.buckets] == ["3-1-4"] * 4
    assert st.health()["mode"] == "static"
