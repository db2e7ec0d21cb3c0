"""Online training end to end (`eaglenest train --online`): regen streams into Ray Train, nothing hidden is written;
SIGKILL of the driver mid-epoch, rerun, and the resumed epoch streams only what the checkpoint had not seen. Every
sample's answer is generated once over the whole run (kill included): later rows of it are captured only.

The killed run is an `eaglenest train --online` subprocess attached to the test session's Ray, in its own process
group (the kill takes the driver and nothing else; Ray reaps its job's actors and workers)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import yaml
from process_helpers import process_running

from eaglenest.drafter.data import is_eval_sample
from eaglenest.engines.tiny import corpus_chats
from eaglenest.regen import answer_files

RUN = "online-test"
EAGLENEST = Path(sys.executable).with_name("eaglenest")
MALFORMED_REASON = "wrong_type"
EVAL_FRACTION = 0.15


def filed_answers(ledger: Path) -> list[str]:
    """The ids of every answers file, duplicates kept (one filing = one generation)."""
    return [i for f in answer_files(ledger) for i in pq.read_table(f, columns=["id"]).column("id").to_pylist()]


def write_inputs(tmp: Path, n: int) -> Path:
    src = tmp / "chats.jsonl"
    rows = [{"messages": c["messages"]} for c in corpus_chats()[:n]]
    rows.append({"messages": "not a list"})  # a malformed row: quarantined into the ledger while normalizing
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "target": {"model": "tiny", "device": "cpu", "dtype": "float32"},
        "regen": {"sources": [{"name": "chats", "domain": "chat", "adapter": "openai", "path": str(src)}],
                  "sampling": {"temperature": 0.0, "max_new_tokens": 12}, "batch_size": 4, "num_actors": 1,
                  "num_cpus_per_actor": 0.5, "min_tokens": 4, "max_tokens": 256},
        "train": {"drafter": {"draft_vocab_size": 200}, "ttt_steps": 3, "batch_size": 4, "epochs": 2,
                  "checkpoint_every": 2, "eval_every": 100, "log_every": 2, "eval_fraction": EVAL_FRACTION,
                  "eval_max_samples": 8, "learning_rate": 0.003, "warmup_ratio": 0.1, "run_name": RUN,
                  "cpus_per_worker": 0.5, "online_vocab_samples": 16},
    }
    path = tmp / "online.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def registered_state(run_dir: Path) -> dict | None:
    """train_state.json of the checkpoint Ray Train has registered for this run (what a rerun resumes from)."""
    try:
        latest = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())["latest_checkpoint_result"]
        return json.loads((run_dir / latest["checkpoint_dir_name"] / "train_state.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError):
        return None


def wait_until_reaped(driver_pid: int, timeout_s: float = 120.0) -> None:
    """Wait until Ray has reaped the killed driver's job: its actors dead and their processes gone.

    Ray notices a dead driver seconds after the kill; until then its engine actor goes on filing answers, so the
    answers on disk are the killed run's final set only once every one of its actor processes has exited. (Ray
    Data's detached helpers, such as its stats actor, outlive every job by design and file nothing.)"""
    from eaglenest.ray_private import driver_job_actors

    deadline = time.time() + timeout_s
    while True:
        job = driver_job_actors(driver_pid)
        left = [] if job is None else [(a["ActorClassName"], a["State"], a["Pid"]) for a in job[1]
                                       if a["State"] != "DEAD" or (a["Pid"] and process_running(a["Pid"]))]
        if job is not None and job[0] and not left:
            return
        if time.time() > deadline:
            raise AssertionError(f"Ray did not reap the killed driver's job (pid {driver_pid}) within "
                                 f"{timeout_s:.0f} s: dead {job and job[0]}, actors left {left}")
        time.sleep(0.2)


def test_online_training_writes_no_hidden_states_and_resumes_after_sigkill(ray_session, tmp_path) -> None:
    cfg = write_inputs(tmp_path, 40)
    out = tmp_path / "out"
    cmd = [str(EAGLENEST), "train", "--config", str(cfg), "--online", "--output", str(out)]
    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)
    run_dir = out / "ray" / RUN

    with open(tmp_path / "run1.log", "wb") as log:
        first = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                                 start_new_session=True)
        deadline = time.time() + 300
        killed_at = None
        while time.time() < deadline and first.poll() is None:
            state = registered_state(run_dir)
            if state and state.get("online_consumed"):
                killed_at = state["step"]
                break
            time.sleep(0.1)
        assert first.poll() is None, "training ended before a checkpoint could be interrupted:\n" + \
            (tmp_path / "run1.log").read_text()[-3000:]
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    wait_until_reaped(first.pid)
    assert killed_at is not None and not (out / "export").exists()
    cached_before = filed_answers(out / "online")
    assert len(cached_before) == len(set(cached_before))  # the first run generated no sample twice

    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=500, cwd=tmp_path)
    log = second.stdout + second.stderr
    assert second.returncode == 0, log[-4000:]

    summary = json.loads((out / "summary.json").read_text())
    online = summary["online"]
    n = online["planned_train"]
    engine_rejects = sum(k for r, k in online["quarantined_per_reason"].items() if r != MALFORMED_REASON)
    assert engine_rejects == 0, online["quarantined_per_reason"]  # the chats fit regen.max_tokens
    # resumed from a checkpoint that had trained on part of the run
    assert online["resumed_from_step"] >= killed_at  # (a newer one may have registered before the kill landed)
    trained_before = online["already_trained_before_resume"]
    assert 0 < trained_before < 2 * n
    assert "are not regenerated" in log
    # every epoch trained on each of its samples exactly once, across the kill
    assert online["epochs"] == [{"epoch": 0, "samples": n, "distinct_samples": n},
                                {"epoch": 1, "samples": n, "distinct_samples": n}]
    # ... and the rerun's engines streamed only the rest (its held-out split aside, streamed before the training)
    timeline = json.loads((out / "online" / "engine_timeline.json").read_text())
    stream = [b for b in timeline if b[1] >= online["stream_started"]]
    streamed = sum(b[4] for b in stream)
    assert streamed == 2 * n - trained_before
    # answers: generated once per sample over the whole run (one engine actor files each batch before its next);
    # the rerun generated exactly the training samples the killed run had not filed, and captured every other row
    filed = filed_answers(out / "online")
    assert len(filed) == len(set(filed)), "a sample with a cached answer was generated again"
    train_ids = {i for i in filed if not is_eval_sample(i, EVAL_FRACTION, 0)}
    assert len(train_ids) == n  # every training sample has its answer filed
    before = set(cached_before) & train_ids
    assert len(before) >= 16  # at least the draft-vocab pass's samples (train.online_vocab_samples)
    per_epoch = online["rows_per_epoch"]
    assert [r["epoch"] for r in per_epoch] == [0, 1] and all(r["skipped_quarantined"] == 0 for r in per_epoch)
    generated = sum(r["generated"] for r in per_epoch)
    assert generated == n - len(before) == sum(b[5] for b in stream)
    assert sum(r["capture_only"] for r in per_epoch) == streamed - generated > 0
    assert sum(online["held_out_rows"].values()) == summary["eval_samples"]
    assert online["vocab_rows"]["generated"] == 0  # the vocab exists: no draft-vocab pass on a resume
    assert online["answers_cached_at_start"] == len(set(cached_before)) and online["answers_cached"] == len(filed)
    # (the killed run's engines may have run far enough ahead to file every answer: the rerun then generates nothing)
    rerun_generated = generated + online["held_out_rows"]["generated"]
    seconds = online["engine_seconds"]
    assert (seconds["generate"] > 0) == (rerun_generated > 0) and seconds["capture"] > 0
    resumes = [json.loads(x) for x in (out / "resume_log.jsonl").read_text().splitlines()]
    assert len(resumes) == 1 and resumes[0]["resumed_from_step"] == online["resumed_from_step"]

    # nothing hidden on disk: no shards, no parquet with hidden-state columns anywhere under OUT (the scan reads the
    # answers files: parquet with ids and masks, a few bytes per token)
    assert online["hidden_state_bytes_written"] == 0 and online["hidden_state_files"] == []
    assert not (out / "shards").exists()
    scanned = list(out.rglob("*.parquet"))
    assert {p.parent.name for p in scanned} >= {"answers", "quarantine"}
    for p in scanned:
        names = pq.read_schema(p).names
        assert "aux_hidden_states" not in names and "last_hidden_state" not in names, p
    # the ledger: the malformed row is quarantined with its reason; the finished run's plan is gone
    assert online["quarantined_per_reason"] == {MALFORMED_REASON: 1}
    assert not (out / "online" / "plan").exists()

    # the export is a drafter for the target's layers, and held-out metrics were recorded
    exported = json.loads((out / "export" / "config.json").read_text())
    assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert summary["final_eval"] is not None and summary["eval_samples"] > 0
