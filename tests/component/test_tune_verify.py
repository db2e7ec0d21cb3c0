"""``eaglenest tune --verify`` on the SGLang path's orchestration: the schedule is measured beside the measurements
that chose it, starting one engine more (the schedule's) and then the baseline's drift run, instead of a second bench
that starts the baseline and every static config again (issue 29's GPU run must fit a 30-minute lease). The tiny
transformers engine stands in for the started engines (SGLang needs a GPU), as in the bench's orchestration test:
this checks which engines start and what the reports hold, not speed."""

from __future__ import annotations

import pytest
from conftest import FIXTURES

from eaglenest.speculative.evaluate import load_prompts, prompt_ids
from eaglenest.speculative.tune import Measurements, TuneSettings, run_tune, schedule_from, verify_schedule

IDENTITY = {"target": {"path": "t", "fingerprint": "sha256:t"}, "drafter": {"path": "d", "fingerprint": "sha256:d"},
            "engine": {"engine": "sglang", "version": "x"}}


@pytest.fixture()
def started():
    return []


def _factory(engine, started):
    def factory(spec, drafter, plan=None):
        if plan is not None:
            started.append(type(plan).__name__)
        else:
            started.append("baseline" if spec is None else f"{spec.num_steps}-{spec.topk}-{spec.num_draft_tokens}")
        return engine
    return factory


def test_verify_starts_only_the_schedule_and_the_drift_run_after_the_tune(tmp_path, tiny_engine, started):
    prompts = [prompt_ids(tiny_engine.tokenizer, r) for r in load_prompts(FIXTURES / "prompts" / "heldout.jsonl", 3)]
    settings = TuneSettings(batch_sizes=[1, 2], candidates=["1-1-2", "2-1-3"], temperatures=[0.0], repeats=2,
                            max_new_tokens=4, num_prompts=2, noise_floor=0.01)
    log = Measurements(tmp_path / "measurements.jsonl", IDENTITY, settings)
    factory = _factory(tiny_engine, started)
    run_tune("sglang", None, "drafter-dir", prompts, settings, log, sglang_factory=factory, progress=False,
             drift_check=False)
    assert started == ["baseline", "1-1-2", "2-1-3", "OffPlan"], "the tune leaves the baseline's second run out"
    schedule = schedule_from(log, IDENTITY, settings)
    reps = verify_schedule("sglang", None, "drafter-dir", prompts, settings, log, schedule, sglang_factory=factory,
                           progress=False)
    assert started[4:] == ["Schedule", "baseline"], "verify starts the schedule, then the baseline again: no more"
    for bs, rep in zip(settings.batch_sizes, reps, strict=True):
        assert rep["batch_size"] == bs and rep["baseline"]["tok_per_s_end"] > 0
        configs = {c["config"] for c in rep["configs"]}
        assert {"1-1-2", "2-1-3", "off", "schedule"} <= configs
        recorded = next(r for (t, b), r in log.reports.items() if b == bs)
        assert rep["baseline"]["tok_per_s"] == pytest.approx(recorded["baseline"]["tok_per_s"]), \
            "the baseline compared is the tune's own run"
    assert set(log.drift[0.0]) == {1, 2}, "the drift check's result reaches the measurements (and the schedule)"
    assert schedule_from(log, IDENTITY, settings).drift is not None
    again = Measurements(tmp_path / "measurements.jsonl", IDENTITY, settings)
    before = len(started)
    verify_schedule("sglang", None, "drafter-dir", prompts, settings, again, schedule, sglang_factory=factory,
                    progress=False)
    assert len(started) == before, "a re-run verify continues from the measurements file: nothing starts again"
