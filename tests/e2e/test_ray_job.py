"""`ray job submit` runs `eaglenest regen`, `train` and `serve` unchanged on a `ray start` head bound to 127.0.0.1.

Every command attaches to the running cluster (no driver-only ``ray.init`` options), and the job logs are readable.
"""

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
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RUNTIME_ENV = {"excludes": [".venv", ".git", ".work", "demo-work", ".gpu", ".whl", "out"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray(*args: str, env: dict, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ray"), *args], capture_output=True, text=True, env=env, timeout=timeout)


@dataclass
class Head:
    address: str
    env: dict

    def submit(self, job_id: str, *entrypoint: str, wait: bool = True,
               env_vars: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        runtime_env = {**RUNTIME_ENV, **({"env_vars": env_vars} if env_vars else {})}
        cmd = ["job", "submit", "--address", self.address, "--submission-id", job_id, "--working-dir", str(REPO),
               "--runtime-env-json", json.dumps(runtime_env), "--entrypoint-num-cpus", "0.25",
               *([] if wait else ["--no-wait"]), "--", *entrypoint]
        for _ in range(80):  # the job agent registers (and the dashboard settles) seconds to minutes after start
            res = _ray(*cmd, env=self.env, timeout=900)
            if res.returncode == 0 or "submitted successfully" in res.stdout + res.stderr:
                return res  # submitted: the job's own outcome is asserted by the caller, never retried
            time.sleep(3)
        return res

    def logs(self, job_id: str) -> str:
        res = _ray("job", "logs", "--address", self.address, job_id, env=self.env, timeout=60)
        assert res.returncode == 0, res.stderr[-2000:]
        return res.stdout

    def status(self, job_id: str) -> str:
        return _ray("job", "status", "--address", self.address, job_id, env=self.env, timeout=60).stdout


def _start_head(env: dict, temp_dir: Path, log: Path) -> tuple[subprocess.Popen, Head]:
    """``ray start --head`` with ports of its own (fresh each call), its output in ``log``."""
    gcs, dash = _free_port(), _free_port()
    # every port of its own: the suite's Ray session already holds the default agent/metrics ports, and a job
    # head whose dashboard agent cannot bind answers "No available agent to submit job"
    agent, agent_grpc, metrics, env_agent, client = (_free_port() for _ in range(5))
    with open(log, "w") as out:
        head = subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs}", "--node-ip-address=127.0.0.1",
             "--num-cpus=4", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--temp-dir={temp_dir}",
             f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
             f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={env_agent}",
             f"--ray-client-server-port={client}", "--disable-usage-stats"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    return head, Head(f"http://127.0.0.1:{dash}", env)


def _stop_head(head: subprocess.Popen) -> None:
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


@pytest.fixture(scope="module")
def ray_head() -> Iterator[Head]:
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled",
               RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1",
               PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")  # the job's shell finds `eaglenest` (venv)
    env.pop("RAY_ADDRESS", None)
    # A head of its own, in its own process group: stopping it cannot touch the suite's shared Ray session
    # (`ray stop` would kill every Ray process on the machine). Short temp path: Ray's socket paths are limited.
    temp_dir = Path(tempfile.mkdtemp(prefix="rj", dir="/tmp"))
    log = temp_dir / "head.log"
    head = None
    try:
        # a second start with fresh ports if the first never answers (a port taken between probing and binding,
        # or a head that died starting): the test is about jobs on a head, not about one start of Ray
        for _attempt in range(2):
            head, h = _start_head(env, temp_dir, log)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 120 and head.poll() is None:
                if _ray("job", "list", "--address", h.address, env=env, timeout=60).returncode == 0:
                    break
                time.sleep(1)
            else:
                _stop_head(head)
                continue
            break
        else:
            pytest.fail(f"`ray start --head` never served the job API (twice); its output:\n{log.read_text()[-3000:]}")
        yield h
    finally:
        if head is not None:
            _stop_head(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_job_submit_regen_then_train(ray_head, tmp_path):
    out = tmp_path / "regen-out"
    submit = ray_head.submit("eaglenest-regen-test", "eaglenest", "regen", "--config", "configs/demo.yaml",
                             "--output", str(out), "--limit", "6")
    assert submit.returncode == 0, submit.stdout[-4000:] + submit.stderr[-4000:]
    assert "succeeded" in submit.stdout
    logs = ray_head.logs("eaglenest-regen-test")
    assert "manifest" in logs.lower() or "samples" in logs.lower(), logs[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_samples"] > 0
    assert any((out / "shards").glob("*.parquet"))

    # the trainer attaches to the same cluster (Ray Train under a job driver)
    train_out = tmp_path / "train-out"
    submit = ray_head.submit("eaglenest-train-test", "eaglenest", "train", "--config", "configs/demo.yaml",
                             "--data", str(out), "--output", str(train_out), "--max-steps", "4")
    assert submit.returncode == 0, submit.stdout[-4000:] + submit.stderr[-4000:]
    assert (train_out / "export" / "config.json").is_file(), ray_head.logs("eaglenest-train-test")[-3000:]


def test_ray_job_submit_serve_attaches_to_the_cluster(ray_head):
    """`eaglenest serve` as a job: attaches (no driver-only options), serves the official client, and `ray job stop`
    drains it: a running stream ends with its finish_reason, then Serve is gone. Ray's job supervisor SIGKILLs the
    driver RAY_JOB_STOP_WAIT_TIME_S after its SIGTERM (3 s by default, which the drain's 30 s would not fit: the
    command warns), so the job is submitted with the runtime env the warning names."""
    from openai import OpenAI

    from eaglenest.serve.supervise import job_stop_warning

    port = _free_port()
    submit = ray_head.submit("eaglenest-serve-test", "eaglenest", "serve", "--config", "configs/demo.yaml",
                             "--port", str(port), wait=False, env_vars={"RAY_JOB_STOP_WAIT_TIME_S": "40"})
    assert submit.returncode == 0, submit.stdout[-4000:] + submit.stderr[-4000:]
    stopped = False
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            status = ray_head.status("eaglenest-serve-test")
            assert "FAILED" not in status and "STOPPED" not in status, ray_head.logs("eaglenest-serve-test")[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(2)
        else:
            pytest.fail("serve job never became healthy:\n" + ray_head.logs("eaglenest-serve-test")[-4000:])
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
        reply = client.chat.completions.create(model="eaglenest", max_tokens=8,
                                               messages=[{"role": "user", "content": "Say hello."}])
        assert reply.choices[0].finish_reason in {"stop", "length"}
        assert reply.usage.completion_tokens > 0
        logs = ray_head.logs("eaglenest-serve-test")
        assert "eaglenest serving" in logs and "RAY_JOB_STOP_WAIT_TIME_S" not in logs  # no warning: it has 40 s
        assert "RAY_JOB_STOP_WAIT_TIME_S" in job_stop_warning(30.0, {"RAY_JOB_CONFIG_JSON_ENV_VAR": "{}"})

        stream = client.chat.completions.create(
            model="eaglenest", messages=[{"role": "user", "content": "Write a short poem about the sea."}],
            max_tokens=512, temperature=0, stream=True, extra_body={"ignore_eos": True})
        finish, tokens = None, 0
        for chunk in stream:  # stop the job once the stream runs; it must still end with its finish_reason
            if chunk.choices and chunk.choices[0].delta.content and not stopped:
                res = _ray("job", "stop", "--no-wait", "--address", ray_head.address, "eaglenest-serve-test",
                           env=ray_head.env, timeout=120)
                assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
                stopped = True
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        assert stopped and finish == "length", (finish, tokens)
        deadline = time.monotonic() + 60
        while "stopped" not in ray_head.status("eaglenest-serve-test").lower() and time.monotonic() < deadline:
            time.sleep(1)
        assert "stopped" in ray_head.status("eaglenest-serve-test").lower()
        logs = ray_head.logs("eaglenest-serve-test")
        assert any(line.strip() == "stopped" for line in logs.splitlines()), logs[-2000:]  # drained, not killed
        with pytest.raises(OSError):  # Serve went with it
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        if not stopped:
            _ray("job", "stop", "--address", ray_head.address, "eaglenest-serve-test", env=ray_head.env, timeout=120)
