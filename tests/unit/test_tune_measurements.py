"""tune's measurements file: kept as it goes, continued by a re-run, refused for another tune; whole batches of
prompts per batch size; the schedule built from it with its drift check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eaglenest.speculative.tune import (
    Measurements,
    TuneError,
    TuneSettings,
    candidate_labels,
    prompts_for,
    schedule_from,
)

IDENTITY = {"target": {"path": "t", "fingerprint": "sha256:t"}, "drafter": {"path": "d", "fingerprint": "sha256:d"},
            "engine": {"engine": "hf", "version": "x"}}


def _settings(**kw) -> TuneSettings:
    base = {"batch_sizes": [1, 2], "candidates": ["1-1-2", "3-1-4"], "temperatures": [0.0], "repeats": 2,
            "max_new_tokens": 16, "num_prompts": 4, "noise_floor": 0.01}
    return TuneSettings(**{**base, **kw})


def _report(base: float, spec: float) -> dict:
    return {"baseline": {"tok_per_s": base, "tok_per_s_rounds": [base, base]},
            "configs": [{"config": "off", "tok_per_s": base, "tok_per_s_rounds": [base, base]},
                        {"config": "3-1-4", "tok_per_s": spec, "tok_per_s_rounds": [spec, spec]}]}


def test_a_rerun_continues_and_another_tune_is_refused(tmp_path: Path):
    path = tmp_path / "measurements.jsonl"
    log = Measurements(path, IDENTITY, _settings())
    log.add_report(0.0, 1, _report(100, 150))
    again = Measurements(path, IDENTITY, _settings(batch_sizes=[1, 2, 4]))  # more batch sizes: continued
    assert again.done(0.0, 1) and not again.done(0.0, 2)
    with pytest.raises(TuneError, match=r"(?s)another tune.*drafter.*--output"):
        Measurements(path, {**IDENTITY, "drafter": {"path": "e", "fingerprint": "sha256:e"}}, _settings())
    with pytest.raises(TuneError, match="repeats: measured with 2, now 3"):
        Measurements(path, IDENTITY, _settings(repeats=3))
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["kind"] for x in lines] == ["header", "report"], "nothing is written by a refused or a reading open"


def test_schedule_from_measurements_with_drift(tmp_path: Path):
    log = Measurements(tmp_path / "m.jsonl", IDENTITY, _settings())
    log.add_report(0.0, 1, _report(100, 150))
    log.add_report(0.0, 2, _report(180, 150))
    log.add_drift(0.0, 1, 100.0, 90.0, 0.01)
    s = schedule_from(log, IDENTITY, _settings())
    assert [b.choice.label for b in s.buckets] == ["3-1-4", "off", "off"]
    assert s.drift["all_within_noise"] is False and s.drift["worst"]["relative"] == pytest.approx(-0.1)


def test_prompts_run_in_whole_batches():
    ps = [[1], [2], [3]]
    assert prompts_for(ps, 1, 4) == [[1], [2], [3], [1]]
    assert len(prompts_for(ps, 4, 2)) == 4 and len(prompts_for(ps, 3, 4)) == 6
    with pytest.raises(TuneError, match="--prompts"):
        prompts_for([], 1, 1)
    assert candidate_labels([1, 3], []) == ["1-1-2", "3-1-4"]


def test_a_variant_measured_in_two_runs_holds_every_batch_size(tmp_path: Path):
    """A tune grown by a batch size measures each variant there only; the file then holds each variant at every
    size (what a later ``--verify`` checks before starting an engine again), read back the same way."""
    path = tmp_path / "m.jsonl"
    log = Measurements(path, IDENTITY, _settings())
    log.add_variant(0.0, "3-1-4", {1: [{"seconds": 1.0}], 2: [{"seconds": 2.0}]})
    log.add_variant(0.0, "3-1-4", {4: [{"seconds": 4.0}]})
    assert sorted(log.variants[0.0]["3-1-4"]) == [1, 2, 4]
    again = Measurements(path, IDENTITY, _settings(batch_sizes=[1, 2, 4]))
    assert again.variants[0.0]["3-1-4"] == log.variants[0.0]["3-1-4"]
