"""Ray Train end to end on tiny-target shards: kill the training command mid-run, rerun it, check the resume."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from eaglenest.engines.tiny import corpus_chats

RUN = "resume-test"


@pytest.fixture(scope="module")
def tiny_shards(tmp_path_factory, tiny_engine) -> Path:
    from eaglenest.drafter.quick_shards import chat_samples, write_quick_shards

    out = tmp_path_factory.mktemp("shards")
    samples = chat_samples(tiny_engine, corpus_chats()[:96], regenerate=False)
    write_quick_shards(tiny_engine, samples, out, dtype="bfloat16", rows_per_shard=24)
    return out


def write_config(path: Path, **train) -> Path:
    cfg = {
        "target": {"model": "tiny", "device": "cpu", "dtype": "float32"},
        "train": {
            "drafter": {"draft_vocab_size": 200}, "ttt_steps": 3, "batch_size": 4, "max_steps": 16,
            "checkpoint_every": 4, "eval_every": 8, "log_every": 4, "eval_fraction": 0.2, "eval_max_samples": 16,
            "learning_rate": 0.003, "warmup_ratio": 0.1, "run_name": RUN, **train,
        },
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def registered_checkpoint(run_dir: Path) -> bool:
    """Ray Train has recorded a checkpoint of this run (what a rerun resumes from)."""
    snap = run_dir / "checkpoint_manager_snapshot.json"
    try:
        return json.loads(snap.read_text()).get("latest_checkpoint_result") is not None
    except (FileNotFoundError, json.JSONDecodeError):
        return False


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_train_refuses_shards_from_another_target(tiny_shards, tmp_path) -> None:
    from eaglenest.config import load_config
    from eaglenest.drafter.data import DataMismatchError
    from eaglenest.drafter.driver import train_drafter

    bad = tmp_path / "bad"
    (bad / "shards").mkdir(parents=True)
    manifest = json.loads((tiny_shards / "manifest.json").read_text())
    manifest["hidden_size"] = 7168
    (bad / "manifest.json").write_text(json.dumps(manifest))
    cfg = load_config(write_config(tmp_path / "c.yaml"))
    with pytest.raises(DataMismatchError, match="hidden_size: shards 7168, target 128"):
        train_drafter(cfg, bad, tmp_path / "out")


def test_kill_mid_training_then_rerun_resumes(ray_session, tiny_shards, tmp_path) -> None:
    cfg = write_config(tmp_path / "train.yaml")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "eaglenest.drafter.cli", "train", "--config", str(cfg), "--data", str(tiny_shards),
           "--output", str(out)]
    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)
    ckpts = out / "ray" / RUN

    with open(tmp_path / "run1.log", "wb") as log:
        first = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
        deadline = time.time() + 240
        while time.time() < deadline and first.poll() is None:
            if registered_checkpoint(ckpts):
                break
            time.sleep(0.1)
        assert first.poll() is None, "training ended before a checkpoint could be interrupted:\n" + \
            (tmp_path / "run1.log").read_text()[-3000:]
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    assert not (out / "export").exists(), "the killed run must not have finished"
    vocab_hash = sha(out / "vocab.safetensors")

    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]

    # resumed at a saved step, with the optimizer state and vocab mapping it had saved
    resumes = [json.loads(x) for x in (out / "resume_log.jsonl").read_text().splitlines()]
    assert len(resumes) == 1
    r = resumes[0]
    assert r["resumed_from_step"] % 4 == 0 and 4 <= r["resumed_from_step"] < 16
    assert r["optimizer_fingerprint_loaded"] == r["optimizer_fingerprint_checkpoint"]
    assert r["vocab_fingerprint_checkpoint"] == r["vocab_fingerprint_run"]
    assert sha(out / "vocab.safetensors") == vocab_hash
    n_train = json.loads((out / "summary.json").read_text())["train_samples"]
    steps_per_epoch = -(-n_train // 4)
    assert r["epoch"] * steps_per_epoch + r["epoch_batches"] == r["resumed_from_step"]  # data position

    # metrics continue without gaps or duplicates, and training helped on held-out data
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train_steps = [x["step"] for x in records if x["kind"] == "train"]
    assert train_steps == list(range(4, 17, 4))
    evals = [x for x in records if x["kind"] == "eval"]
    assert [e["step"] for e in evals] == [0, 8, 16]
    assert evals[-1]["acc_0"] > evals[0]["acc_0"] + 0.1
    assert evals[-1]["sim_accept_length"] > evals[0]["sim_accept_length"]

    # the export is there and loads as an SGLang drafter for the target's layers
    from eaglenest.drafters.eagle3.model import load_drafter

    exported = json.loads((out / "export" / "config.json").read_text())
    assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert load_drafter(out / "export").config.draft_vocab_size == 200
    assert (out / "training_curves.png").stat().st_size > 10_000
    assert "resumed from step" in second.stdout + second.stderr


def test_a_run_resumed_with_another_worker_count_continues(ray_session, tiny_shards, tmp_path) -> None:
    """Two workers are killed after a checkpoint; the same run resumes with one (a cluster that shrank) and finishes:
    the epoch's position is kept in samples (the two workers' batches become twice as many for one), the run is
    re-planned for one worker, and the resume log says so."""
    out = tmp_path / "out"
    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)

    def cmd(cfg: Path) -> list[str]:
        return [sys.executable, "-m", "eaglenest.drafter.cli", "train", "--config", str(cfg), "--data",
                str(tiny_shards), "--output", str(out)]

    two = write_config(tmp_path / "two.yaml", num_workers=2, cpus_per_worker=0.25, max_steps=None, epochs=2)
    one = write_config(tmp_path / "one.yaml", num_workers=1, cpus_per_worker=0.25, max_steps=None, epochs=2)
    with open(tmp_path / "run1.log", "wb") as log:
        first = subprocess.Popen(cmd(two), env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
        deadline = time.time() + 300
        while time.time() < deadline and first.poll() is None and not registered_checkpoint(out / "ray" / RUN):
            time.sleep(0.1)
        assert first.poll() is None, (tmp_path / "run1.log").read_text()[-3000:]
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    second = subprocess.run(cmd(one), env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    r = [json.loads(x) for x in (out / "resume_log.jsonl").read_text().splitlines()][-1]
    assert (r["world_size_checkpoint"], r["world_size_run"]) == (2, 1)
    assert r["epoch"] == 0 and r["epoch_batches"] == 2 * r["epoch_batches_checkpoint"] > 0
    assert "resumed with 1 worker(s) from a checkpoint of 2" in second.stdout + second.stderr
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [x["step"] for x in records if x["kind"] == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == summary["steps"]  # no step logged twice, the plan finished
    assert (out / "export" / "config.json").is_file()
