"""The flywheel's decisions without Ray or a model: the gate's rule, the watch's verdict, the traffic split, the
settings' errors, the audit log and the alert webhook. The loop itself runs in tests/e2e/test_flywheel.py."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from eaglenest.config import ConfigError, EaglenestConfig
from eaglenest.contracts.traffic import traffic_record
from eaglenest.flywheel.audit import AuditLog, send_alert
from eaglenest.flywheel.gate import decide
from eaglenest.flywheel.settings import flywheel_settings
from eaglenest.flywheel.traffic import collect_traffic, load_jsonl
from eaglenest.flywheel.watch import Baseline, judge


def m(al: float, **per_domain: float) -> dict:
    return {"accept_length": al, "per_domain": per_domain, "requests": 8, "verify_steps": 100}


def sets(held: tuple, reg: tuple | None = None) -> dict:
    out = {"heldout": {"live": m(held[0]), "candidate": m(held[1]), "prompts": 8}}
    if reg is not None:
        out["regression"] = {"live": m(reg[0], math=reg[0], code=reg[0]),
                             "candidate": m(reg[1], math=reg[2] if len(reg) > 2 else reg[1], code=reg[1]),
                             "prompts": 8}
    return out


def test_the_gate_promotes_a_clear_win_that_loses_nowhere() -> None:
    ok, reasons = decide(sets((1.5, 2.2), (3.0, 3.0)), margin=0.03, tolerance=0.02)
    assert ok and "wins on held-out traffic" in reasons[0]


@pytest.mark.parametrize("case, needle", [
    (sets((2.0, 2.02)), "does not win on held-out traffic: accept length 2.020 vs live 2.000 (needs 2.060"),
    (sets((1.5, 2.2), (3.0, 2.8)), "loses on regression: 2.800 vs live 3.000"),
    (sets((1.5, 2.2), (3.0, 3.0, 2.5)), "loses on regression/math: 2.500 vs live 3.000"),
    (sets((2.0, 1.0)), "does not win"),  # an untrained drafter
    ({}, "no held-out traffic"),
])
def test_the_gate_refuses_with_the_numbers(case, needle) -> None:
    ok, reasons = decide(case, margin=0.03, tolerance=0.02)
    assert not ok and any(needle in r for r in reasons), reasons


def test_the_watch_rolls_back_below_the_previous_level_and_keeps_otherwise() -> None:
    base = Baseline(previous_level=2.5, previous_requests=64, new_requests=0, new_verify_steps=0, new_accepted=0)
    verdict, reason = judge(1.0, 64, base, 3.0, tolerance=0.05, min_requests=8)
    assert verdict == "rollback" and "below the previous drafter's recent level 2.500" in reason
    assert judge(2.45, 64, base, 3.0, tolerance=0.05, min_requests=8)[0] == "keep"  # within the tolerance
    assert judge(1.0, 3, base, 3.0, tolerance=0.05, min_requests=8)[0] == "inconclusive"
    assert judge(None, 0, base, 3.0, tolerance=0.05, min_requests=8)[0] == "inconclusive"
    first = Baseline(None, 0, 0, 0, 0)  # no previous drafter's traffic: the gate's prediction is the reference
    verdict, reason = judge(1.02, 64, first, 3.0, tolerance=0.05, min_requests=8)
    assert verdict == "rollback" and "the gate's prediction 3.000" in reason


def _rec(i: int, t: float) -> dict:
    return traffic_record(prompt_ids=[1, 2, i], answer_ids=[i, i + 1], route="/v1/chat/completions", model="m",
                          drafter="/d", sampling={}, spec={}, finish_reason="stop", arrived_at=t - 1,
                          finished_at=t, ttft_s=0.1)


def test_traffic_is_split_by_time_deduplicated_and_bad_lines_counted(tmp_path) -> None:
    log = tmp_path / "log"
    log.mkdir()
    recs = [_rec(i, 1000.0 + i) for i in range(20)]
    lines = [json.dumps(r) for r in recs[:10]] + [json.dumps(recs[3]), "{not json", json.dumps({"schema": "x"})]
    (log / "traffic-a-1.jsonl").write_text("\n".join(lines) + "\n")
    (log / "traffic-b-1.jsonl").write_text("\n".join(json.dumps(r) for r in recs[10:]) + "\n" + '{"half')
    split = collect_traffic(log, tmp_path / "turn", since=1001.5, heldout_fraction=0.25, max_heldout=64)
    train, held = load_jsonl(split.train), load_jsonl(split.heldout)
    assert [r["finished_at"] for r in train + held] == [1000.0 + i for i in range(2, 20)]  # since, sorted, once each
    assert len(held) == 5 and min(r["finished_at"] for r in held) > max(r["finished_at"] for r in train)
    assert split.watermark == train[-1]["finished_at"]
    assert split.skipped == {"invalid_json": 1, "bad_record": 1, "unfinished": 1} and split.files == 2
    with pytest.raises(FileNotFoundError, match="serve.traffic_log.path"):
        collect_traffic(tmp_path / "missing", tmp_path / "t2", since=0, heldout_fraction=0.2, max_heldout=8)


def test_settings_refuse_bad_values_with_the_dotted_key() -> None:
    cfg = EaglenestConfig.model_validate({"flywheel": {"margin": -1, "watch": {"requets": 5}}})
    with pytest.raises(ConfigError) as e:
        flywheel_settings(cfg, "fw.yaml")
    text = str(e.value)
    assert "invalid config fw.yaml:" in text and "flywheel.margin: Input should be greater than or equal to 0" in text
    assert "flywheel.watch.requets: unknown key; allowed here: min_requests, poll_s, requests" in text
    assert flywheel_settings(EaglenestConfig()).traffic_share == 0.5


class _Sink(BaseHTTPRequestHandler):
    got: list = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Sink.got.append(json.loads(body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_the_alert_is_posted_and_a_dead_webhook_does_not_raise(tmp_path) -> None:
    server = HTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert send_alert(f"http://127.0.0.1:{server.server_port}/hook", {"alert": "X", "app": "a"}) is None
        assert _Sink.got[-1] == {"alert": "X", "app": "a"}
    finally:
        server.shutdown()
        server.server_close()
    assert "URLError" in send_alert(f"http://127.0.0.1:{server.server_port}/hook", {"alert": "X"}, timeout=2)
    assert send_alert(None, {}) == "no flywheel.alert_webhook set"
    audit = AuditLog(tmp_path / "a" / "audit.jsonl")
    audit.write("gate", decision="refuse", numbers={"x": 1.5})
    audit.write("swap", drafter="/d")
    assert [r["event"] for r in audit.read()] == ["gate", "swap"]
    assert audit.read("gate")[0]["numbers"] == {"x": 1.5} and audit.read("gate")[0]["time"] <= time.time()


def test_vocab_coverage_counts_generated_tokens_inside_the_draft_vocabulary(tmp_path) -> None:
    import torch
    from safetensors.torch import save_file

    from eaglenest.flywheel.traffic import vocab_coverage

    t2d = torch.zeros(16, dtype=torch.bool)
    t2d[[1, 2, 3]] = True
    save_file({"t2d": t2d}, str(tmp_path / "model.safetensors"))
    recs = [_rec(1, 1.0), _rec(7, 2.0)]  # answers [1, 2] (inside) and [7, 8] (outside); prompts do not count
    assert vocab_coverage(recs, tmp_path) == 0.5
    assert vocab_coverage([], tmp_path) is None


def _tuned(path, rates: dict[int, tuple[float, float]], **settings) -> str:
    """A schedule file from {batch: (baseline tok/s, 3-1-4 tok/s)}, two equal rounds each."""
    from eaglenest.speculative.schedule import build_schedule

    def rep(base: float, spec: float) -> list[dict]:
        return [{"baseline": {"tok_per_s": base, "tok_per_s_rounds": [base, base]},
                 "configs": [{"config": "off", "tok_per_s": base, "tok_per_s_rounds": [base, base]},
                             {"config": "3-1-4", "tok_per_s": spec, "tok_per_s_rounds": [spec, spec]}]}]

    return str(build_schedule({b: rep(*r) for b, r in rates.items()}, {}, noise_floor=0.01,
                              settings=settings).save(path))


TUNED = {"batch_sizes": [1, 8], "candidates": ["3-1-4"], "temperatures": [0.0], "repeats": 2, "max_new_tokens": 8,
         "num_prompts": 2, "noise_floor": 0.01}


@pytest.mark.parametrize(("retune", "schedule_settings", "needle"), [
    (False, TUNED, "set flywheel.retune: true"),
    (True, {}, "does not record how it was tuned"),
    (True, {**TUNED, "prompts": "/nowhere/prompts.jsonl"}, "no prompt file to re-tune with"),
])
@pytest.mark.parametrize("command", [["flywheel", "--once"],
                                     ["promote", "--candidate", "cand", "--heldout", "h.jsonl"]])
def test_a_loop_whose_swap_could_not_happen_is_refused_before_it_trains(tmp_path, capsys, command, retune,
                                                                        schedule_settings, needle) -> None:
    """serve.schedule is tied to the live drafter: a candidate is swapped in only with a schedule of its own, tuned
    as the live one was; without the re-tune, or where it could not run, the loop is refused before hours of
    training, naming the fix."""
    from eaglenest.cli import main

    (tmp_path / "h.jsonl").write_text(json.dumps(_rec(0, 1.0)) + "\n")
    _tuned(tmp_path / "schedule.json", {1: (100.0, 150.0), 8: (400.0, 300.0)}, **schedule_settings)
    cfg = tmp_path / "fw.yaml"
    cfg.write_text(json.dumps({"serve": {"schedule": "schedule.json", "port": 9},
                               "flywheel": {"workdir": str(tmp_path / "fw"), "retune": retune}}))
    args = [a if a != "h.jsonl" else str(tmp_path / "h.jsonl") for a in command]
    assert main([args[0], "--config", str(cfg), *args[1:]]) == 2
    err = capsys.readouterr().err
    assert needle in err, err


def test_the_re_tune_keeps_a_candidate_whose_schedule_gains_as_much_and_refuses_one_that_gains_less(tmp_path):
    """Each schedule's choice against its own run's baseline, bucket by bucket: a machine that got 10% slower
    between the runs does not count against the candidate; a bucket where its schedule gains less does."""
    from eaglenest.flywheel.retune import compare_schedules
    from eaglenest.speculative.schedule import Schedule

    live = Schedule.load(_tuned(tmp_path / "live.json", {1: (100.0, 150.0), 8: (400.0, 300.0)}, **TUNED))
    slower_machine = Schedule.load(_tuned(tmp_path / "a.json", {1: (90.0, 140.0), 8: (360.0, 300.0)}, **TUNED))
    keeps = compare_schedules(live, slower_machine, tolerance=0.02)
    assert keeps.keeps and keeps.reasons == []
    assert [(r["batch_size"], r["live"], r["candidate"]) for r in keeps.rows] == [(1, "3-1-4", "3-1-4"),
                                                                               (8, "off", "off")]
    gains_less = Schedule.load(_tuned(tmp_path / "b.json", {1: (100.0, 120.0), 8: (400.0, 300.0)}, **TUNED))
    refused = compare_schedules(live, gains_less, tolerance=0.02)
    assert not refused.keeps and [r["lost"] for r in refused.rows] == [True, False]
    assert "batch 1: the candidate's schedule runs 3-1-4 at 1.200x its baseline, the live one 3-1-4 at 1.500x" in \
        refused.reasons[0]
    within = Schedule.load(_tuned(tmp_path / "c.json", {1: (100.0, 148.0), 8: (400.0, 300.0)}, **TUNED))
    assert compare_schedules(live, within, tolerance=0.02).keeps, "1.48x vs 1.50x is within 2%"
    other_sizes = Schedule.load(_tuned(tmp_path / "d.json", {2: (100.0, 150.0)}, **TUNED))
    assert compare_schedules(live, other_sizes, tolerance=0.02).reasons == [
        "the two schedules share no measured batch size"]


def test_a_re_tune_measures_as_the_live_schedule_was_measured(tmp_path) -> None:
    from eaglenest.speculative.schedule import Schedule
    from eaglenest.speculative.tune_run import settings_of

    live = Schedule.load(_tuned(tmp_path / "live.json", {1: (100.0, 150.0)}, **TUNED, prompts="p.jsonl"))
    s = settings_of(live)
    assert (s.batch_sizes, s.candidates, s.repeats, s.max_new_tokens, s.prompts) == ([1, 8], ["3-1-4"], 2, 8,
                                                                                     "p.jsonl")
    with pytest.raises(ValueError, match="eaglenest tune"):
        settings_of(Schedule.load(_tuned(tmp_path / "bare.json", {1: (100.0, 150.0)})))
