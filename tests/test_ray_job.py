"""`ray job submit` runs `eaglenest regen` unchanged on a Ray head bound to 127.0.0.1; its logs are readable."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray(*args: str, env: dict, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ray"), *args], capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.slow
def test_ray_job_submit_regen_and_read_logs(tmp_path):
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled",
               RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1",
               PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")  # the job's shell finds `eaglenest` (venv)
    env.pop("RAY_ADDRESS", None)
    # A head of its own, in its own process group: stopping it cannot touch the suite's shared Ray session
    # (`ray stop` would kill every Ray process on the machine). Short temp path: Ray's socket paths are limited.
    temp_dir = Path(tempfile.mkdtemp(prefix="rj", dir="/tmp"))
    gcs, dash = _free_port(), _free_port()
    # every port of its own: the suite's Ray session already holds the default agent/metrics ports, and a job
    # head whose dashboard agent cannot bind answers "No available agent to submit job"
    agent, agent_grpc, metrics, env_agent, client = (_free_port() for _ in range(5))
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs}", "--node-ip-address=127.0.0.1",
         "--num-cpus=2", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--temp-dir={temp_dir}",
         f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
         f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={env_agent}",
         f"--ray-client-server-port={client}", "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    address = f"http://127.0.0.1:{dash}"
    out = tmp_path / "regen-out"
    try:
        for _ in range(90):  # the dashboard's job API comes up a little after `ray start` returns
            if _ray("job", "list", "--address", address, env=env, timeout=60).returncode == 0:
                break
            time.sleep(1)
        runtime_env = {"excludes": [".venv", ".git", ".work", "demo-work", ".gpu", ".whl"]}
        cmd = ["job", "submit", "--address", address, "--submission-id", "eaglenest-regen-test",
               "--working-dir", str(REPO), "--runtime-env-json", json.dumps(runtime_env),
               "--entrypoint-num-cpus", "0.25", "--",
               "eaglenest", "regen", "--config", "configs/demo.yaml", "--output", str(out), "--limit", "6"]
        for _ in range(80):  # the job agent registers (and the dashboard settles) seconds to minutes after start
            submit = _ray(*cmd, env=env, timeout=600)
            if submit.returncode == 0 or "submitted successfully" in submit.stdout + submit.stderr:
                break  # submitted: the job's own outcome is asserted below, never retried
            time.sleep(3)
        assert submit.returncode == 0, submit.stdout[-4000:] + submit.stderr[-4000:]
        assert "succeeded" in submit.stdout
        logs = _ray("job", "logs", "--address", address, "eaglenest-regen-test", env=env, timeout=60)
        assert logs.returncode == 0
        assert "manifest" in logs.stdout.lower() or "samples" in logs.stdout.lower(), logs.stdout[-3000:]
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["num_samples"] > 0
        assert any((out / "shards").glob("*.parquet"))
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(head.pid, sig)
            except ProcessLookupError:
                break
            try:
                head.wait(timeout=20)
                time.sleep(2)  # children of the group (gcs, raylet, dashboard) exit with it
            except subprocess.TimeoutExpired:
                continue
        shutil.rmtree(temp_dir, ignore_errors=True)
