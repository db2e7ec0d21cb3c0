"""The decoder process: start failures are reported with the child's reason, a dead child fails its requests and
marks the backend not alive, and a child never outlives its replica."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from process_helpers import process_running

from eaglenest.config import EaglenestConfig
from eaglenest.engines.base import SamplingParams
from eaglenest.serve.jobs import DecodeEvent, Job
from eaglenest.serve.process_backend import DecoderProcessError, ProcessBackend


def _cfg(tiny_target_path) -> EaglenestConfig:
    return EaglenestConfig.model_validate({"target": {"model": str(tiny_target_path), "device": "cpu",
                                                      "dtype": "float32"}})


def test_a_start_failure_carries_the_childs_reason(tiny_target_path, tmp_path):
    with pytest.raises(DecoderProcessError, match="no-such-drafter"):
        ProcessBackend(_cfg(tiny_target_path), str(tmp_path / "no-such-drafter"))


def test_a_killed_decoder_fails_its_requests_and_the_backend_says_so(tiny_target_path):
    backend = ProcessBackend(_cfg(tiny_target_path), None)
    try:
        assert backend.alive and backend.info.num_layers >= 8
        ids, finish, _ = backend.generate(backend.render_chat([{"role": "user", "content": "hi"}]),
                                          SamplingParams(max_new_tokens=4), timeout=60)
        assert len(ids) <= 4 and finish in ("stop", "length")
        events: list[DecodeEvent] = []
        first, done = threading.Event(), threading.Event()

        def sink(ev: DecodeEvent) -> None:
            events.append(ev)
            first.set()
            if ev.final:
                done.set()

        prompt = backend.render_chat([{"role": "user", "content": "Count from 1 to 50."}])
        backend.submit(Job(prompt, SamplingParams(max_new_tokens=100_000, ignore_eos=True), sink))
        assert first.wait(60)
        os.kill(backend.pid, signal.SIGKILL)
        assert done.wait(30), "the running request never heard that its decoder died"
        assert events[-1].error and "decoder process exited unexpectedly" in events[-1].error
        deadline = time.monotonic() + 10
        while backend.alive and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not backend.alive and "exited unexpectedly" in (backend.fatal or "")
        with pytest.raises(RuntimeError, match="decoder process is not running"):
            backend.submit(Job(prompt, SamplingParams(max_new_tokens=4), lambda ev: None))
    finally:
        backend.close(timeout=5)


def test_the_decoder_does_not_outlive_its_replica(tiny_target_path, tmp_path):
    """A replica killed without any cleanup: its decoder notices the closed socket and exits."""
    script = tmp_path / "replica.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        from eaglenest.config import EaglenestConfig
        from eaglenest.serve.process_backend import ProcessBackend
        cfg = EaglenestConfig.model_validate({{"target": {{"model": {str(tiny_target_path)!r}, "device": "cpu"}}}})
        b = ProcessBackend(cfg, None)
        print(b.pid, flush=True)
        os._exit(0)  # no close(), no atexit: as if the replica were killed
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    child = int(out.stdout.strip().splitlines()[-1])
    deadline = time.monotonic() + 30
    while process_running(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not process_running(child), f"decoder process {child} outlived its parent"
