"""What gpu_e2e reads out of real logs: SGLang's scheduler lines (the two engines' paces side by side) and Ray Data's
own progress lines, from lines in the exact shape the seventh GPU run printed them (actor prefix included)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_e2e", ROOT / "benchmarks" / "gpu_e2e.py")
gpu_e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_e2e)

ACTOR = "\x1b[36m(MapWorker(MapBatches(EngineActor)) pid=3288)\x1b[0m "
LOG = "\n".join([
    ACTOR + "[2026-12-01 23:01:40] Prefill batch, #new-seq: 79, #new-token: 8192, #cached-token: 0, token usage: "
            "0.01, #running-req: 0, #queue-req: 3115, #pending-token: 0, cuda graph: False, input throughput "
            "(token/s): 1203.77",
    ACTOR + "[2026-12-01 23:01:44] Decode batch, #running-req: 3194, #token: 161695, token usage: 0.22, cuda graph: "
            "False, gen throughput (token/s): 5032.11, #queue-req: 0",
    ACTOR + "[2026-12-01 23:01:45] Decode batch, #running-req: 3191, #token: 193528, token usage: 0.26, cuda graph: "
            "False, gen throughput (token/s): 33937.20, #queue-req: 0",
    ACTOR + "[2026-12-01 23:01:49] Decode batch, #running-req: 2891, #token: 0, token usage: 0.00, cuda graph: "
            "False, gen throughput (token/s): 36120.02, #queue-req: 0",
    ACTOR + "[2026-12-01 23:01:52] Decode batch, #running-req: 1200, #token: 0, token usage: 0.00, cuda graph: "
            "False, gen throughput (token/s): 17000.00, #queue-req: 0",
    "2026-12-01 23:00:18,539\tINFO logging_progress.py:233 --   Tasks: 1 [backpressured:tasks(ResourceBudget)]; "
    "Actors: 0; Queued blocks: 0 (0.0B); Resources: 0.2 CPU, 0.0B object store",
    "2026-12-01 23:00:18,440\tINFO streaming_executor.py:215 -- Starting execution of Dataset dataset_0",
    "regen progress: 3200/3200 samples (3200 written, 0 quarantined), 486221 generated tokens, 8348.9 tok/s, ETA 0s",
    ACTOR + "[eaglenest capture] 256 requests waited 0.41 s for their last rows; reader: no chunk since the last batch",
])


def test_scheduler_lines_give_the_decode_pace_with_the_running_batch_full() -> None:
    pace = gpu_e2e.scheduler_pace(LOG)
    assert pace["prefill_forwards"] == 1 and pace["prefill_tokens"] == 8192 and pace["decode_lines"] == 4
    assert pace["decode_rates"][0] == [3194, 5032, 0]
    # after the first line (its interval holds the prefill), within 10% of the largest running batch: 3191 and 2891
    # requests, not the tail's 1200
    assert pace["full_batch_running_reqs"] == 3191
    assert pace["full_batch_decode_tokens_per_s"] == round((33937.20 + 36120.02) / 2, 1)
    assert gpu_e2e.scheduler_pace("no scheduler lines here") is None


def test_ray_data_progress_counts_ray_datas_lines_not_every_line_of_the_pool() -> None:
    lines = gpu_e2e.ray_data_progress(LOG)
    assert len(lines) == 3  # two of Ray Data's, one of regen's; none of the actor's SGLang or capture lines
    assert all("Decode batch" not in ln and "[eaglenest capture]" not in ln for ln in lines)


def test_serve_series_are_read_under_rays_prefix() -> None:
    # Ray's metrics agent prefixes application metrics with ray_ (the eighth GPU run's filter missed them all)
    body = "\n".join([
        "# HELP ray_eaglenest_serve_requests_total Requests by route and status.",
        "# TYPE ray_eaglenest_serve_requests_total counter",
        'ray_eaglenest_serve_requests_total{Component="core_worker",route="/v1/chat/completions",status="200"} 3.0',
        'ray_eaglenest_serve_accept_length_bucket{le="2.0",model="eaglenest"} 1.0',
        'ray_eaglenest_serve_replica_healthy{model="eaglenest"} 1.0',
        'ray_serve_num_http_requests_total{route="/"} 5.0',
    ])
    assert gpu_e2e.eaglenest_series(body) == ["ray_eaglenest_serve_accept_length_bucket",
                                              "ray_eaglenest_serve_replica_healthy",
                                              "ray_eaglenest_serve_requests_total"]


def _regen_record(steady_s: float) -> dict:
    # the shape of the eighth GPU run's regen step record (results/steps/regen.json), trimmed
    return {"samples": 3200, "tokens": 586384, "offline_engine_generate_tokens_per_s": 29020.4,
            "whole_run_tokens_per_s": 27022.4, "whole_run_vs_offline": 0.931, "steady_tokens_per_s": 17358.1,
            "steady_vs_offline": 0.598, "generate_only_vs_offline": None, "ray_data_progress_lines_in_job_logs": 60,
            "whole_run_split": {"generation_s": 16.1, "after_generation_s": 0.8},
            "last_run": {"steady": {"seconds": steady_s, "tokens": 9436, "tokens_per_second": 17358.1},
                         "whole_run": {"seconds": 16.901, "tokens": 456697, "tokens_per_second": 27022.4},
                         "capture_placement": {"on_arrival": 3200}}}


def test_a_one_wave_run_names_the_whole_run_not_a_fraction_of_a_second_of_tail() -> None:
    line = gpu_e2e.regen_summary(_regen_record(0.544))
    assert "whole run (first batch start to last batch end, engine start excluded) 27022.4 tok/s = 0.931x" in line
    assert "no steady window" in line and "0.598" not in line and "one batch in flight" not in line


def test_a_long_run_reports_its_steady_window() -> None:
    line = gpu_e2e.regen_summary(_regen_record(12.0))
    assert "steady 17358.1 tok/s = 0.598x over 12.0 s" in line and "no steady window" not in line


def test_a_regen_without_a_timeline_claims_no_wave() -> None:
    rec = _regen_record(0.544)
    rec["last_run"] = {}
    line = gpu_e2e.regen_summary(rec)
    assert "no batch timeline in the manifest" in line and "one wave" not in line


def test_a_step_killed_before_its_record_gets_one_from_the_runner(tmp_path: Path, monkeypatch) -> None:
    """The small-preset run's offline reference ran out of GPU memory, SGLang ended the step's whole process tree,
    and the summary said "not run": the runner now writes a record naming the exit status; one the step wrote stays."""
    monkeypatch.setattr(gpu_e2e, "RESULTS", tmp_path)
    assert gpu_e2e.record_death("offline_ref", 137)
    import json

    rec = json.loads((tmp_path / "steps" / "offline_ref.json").read_text())
    assert rec["status"] == "error" and "exit status 137 (signal SIGKILL)" in rec["error"]
    (tmp_path / "steps" / "bench.json").write_text('{"status": "error", "error": "its own"}')
    assert not gpu_e2e.record_death("bench", 1)
    assert json.loads((tmp_path / "steps" / "bench.json").read_text())["error"] == "its own"
