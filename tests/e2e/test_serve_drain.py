"""Graceful drain: SIGTERM to ``eaglenest serve`` (its PID, or its whole process group) lets a running stream finish;
past the deadline a request ends with an error event (ServerCore in process, real backend)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from eaglenest.config import EaglenestConfig

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cfg(target: Path, **serve) -> dict:
    return {"target": {"model": str(target), "device": "cpu", "dtype": "float32"},
            "serve": {"num_cpus_per_replica": 0.25, "max_tokens_limit": 1800, **serve}}


def test_sigterm_lets_a_running_stream_finish(tiny_target_path, tmp_path):
    port = _free_port()
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(yaml.safe_dump(_cfg(tiny_target_path, port=port, drain_timeout_s=120)))
    env = {**os.environ, "RAY_ADDRESS": "local", "PYTHONPATH": str(REPO)}  # its own Ray, never someone else's
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "eaglenest.cli", "serve", "--config", str(cfg)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not come up"
            if "press Ctrl-C to stop" in (tmp_path / "serve.log").read_text():  # started, SIGTERM handler set
                break
            time.sleep(1)
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        started, result = threading.Event(), {}

        def stream() -> None:
            n, finish, usage = 0, None, None
            for chunk in client.chat.completions.create(
                    model="eaglenest", messages=[{"role": "user", "content": "Write a short poem about the sea."}],
                    max_tokens=1800, temperature=0, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True}):
                if chunk.choices and chunk.choices[0].delta.content:
                    n += 1
                    started.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                usage = chunk.usage or usage
            result.update(finish=finish, tokens=usage.completion_tokens if usage else None, at=time.monotonic())

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(120)
        proc.send_signal(signal.SIGTERM)
        refused = None
        while refused is None and time.monotonic() < deadline:  # new requests are refused while it drains
            r = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                           json={"model": "eaglenest", "messages": [{"role": "user", "content": "hi"}]})
            if r.status_code == 503:
                refused = (r, time.monotonic())
            time.sleep(0.1)
        t.join(300)
        assert result.get("finish") == "length" and result.get("tokens") == 1800, result
        r, at = refused
        assert r.json()["error"]["code"] == "shutting_down" and int(r.headers["retry-after"]) >= 1
        assert at < result["at"], "the stream ended before the drain began: this test needs a longer stream"
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        log.close()


def test_group_sigterm_drains_and_exits_within_the_deadline(tiny_target_path, tmp_path):
    """``os.killpg`` of the command's group (what a terminal, an init system or a container runtime may send): new
    requests get 503 at once, the running stream ends with its finish_reason or the final error event, and the
    command exits within serve.drain_timeout_s + 5 s, its Ray with it."""
    drain_s = 6.0
    port = _free_port()
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(yaml.safe_dump(_cfg(tiny_target_path, port=port, drain_timeout_s=drain_s)))
    env = {**os.environ, "RAY_ADDRESS": "local", "PYTHONPATH": str(REPO)}
    log_path = tmp_path / "serve.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "eaglenest.cli", "serve", "--config", str(cfg)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while "press Ctrl-C to stop" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(1)
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        started, result = threading.Event(), {}

        def stream() -> None:
            try:
                for chunk in client.chat.completions.create(
                        model="eaglenest", messages=[{"role": "user", "content": "Write a short poem about the sea."}],
                        max_tokens=1800, temperature=0, stream=True, extra_body={"ignore_eos": True}):
                    if chunk.choices and chunk.choices[0].delta.content:
                        started.set()
                    if chunk.choices and chunk.choices[0].finish_reason:
                        result["finish"] = chunk.choices[0].finish_reason
            except openai.APIError as e:  # the final error event of a request cut at the deadline
                result["error"] = str(e)
            result["at"] = time.monotonic()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(120)
        signalled = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        health = chat = None
        while (health is None or chat is None) and time.monotonic() < signalled + 10:
            if health is None:
                h = httpx.get(f"{url}/health", timeout=10)
                health = (h, time.monotonic()) if h.status_code == 503 else None
            if chat is None:
                r = httpx.post(f"{url}/v1/chat/completions", timeout=10,
                               json={"model": "eaglenest", "messages": [{"role": "user", "content": "hi"}]})
                chat = (r, time.monotonic()) if r.status_code == 503 else None
            time.sleep(0.05)
        assert health and chat, "no 503 within 10 s of the group SIGTERM"
        assert chat[1] - signalled < 2.0 and health[1] - signalled < 2.0, (chat[1] - signalled, health[1] - signalled)
        assert chat[0].json()["error"]["code"] == "shutting_down" and int(chat[0].headers["retry-after"]) >= 1
        assert int(health[0].headers["retry-after"]) >= 1
        t.join(60)
        assert result.get("finish") == "length" or "did not finish within serve.drain_timeout_s" in \
            result.get("error", ""), result
        rc = proc.wait(drain_s + 30)
        took = time.monotonic() - signalled
        assert rc == 0, log_path.read_text()[-3000:]
        assert took <= drain_s + 5.0, f"exited {took:.1f} s after SIGTERM (deadline {drain_s:g} s + 5 s)"
        with pytest.raises(httpx.TransportError):  # nothing of it still answers
            httpx.get(f"{url}/health", timeout=5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        log.close()


def test_past_the_deadline_a_running_request_ends_with_an_error(tiny_target_path):
    from eaglenest.serve.core import Outcome, ServerCore
    from eaglenest.serve.openai_protocol import APIError, SamplingRequest

    cfg = EaglenestConfig.model_validate(_cfg(tiny_target_path, decoder_process=False, drain_timeout_s=0.3))
    core = ServerCore(cfg, None, use_ray_metrics=False)
    try:
        prompt = core.backend.render_chat([{"role": "user", "content": "Write a short poem about the sea."}])
        sampling = SamplingRequest(max_tokens=1800, temperature=0.0, top_p=1.0, ignore_eos=True)
        out = Outcome()

        async def run() -> None:
            async for _ in core.generate(prompt, sampling, out):
                core.begin_drain()  # from the first piece on: 0.3 s left

        with pytest.raises(APIError) as e:
            asyncio.run(run())
        assert e.value.status == 503 and e.value.code == "shutting_down" and e.value.retry_after
        assert 0 < out.completion_tokens < 1800
        with pytest.raises(APIError) as e:
            core.check_ready()
        assert e.value.status == 503 and e.value.headers == {"Retry-After": str(e.value.retry_after)}
    finally:
        core.shutdown(timeout=0)
