"""The hf decoder in a child process of the replica (the parent side): decoding and HTTP work no longer share one
interpreter lock; the child runs `eaglenest.serve.engine_process`.

On the thread backend, every SSE chunk the replica sends (FastAPI, Ray Serve's streaming, the metrics) runs Python
under the same GIL as the decoder's Python between its torch calls, so serving work and decoding serialize: at 16
streams on 2 cores the replica sat at ~80 % of one core while each decoding step took twice its in-process time.
Production servers split the same way (SGLang's tokenizer manager vs scheduler processes, vLLM's engine core).

Protocol over one socket pair (``multiprocessing.connection`` framing, pickled tuples):

- parent -> child: ``("start", config dict, drafter)``, then ``("submit", jid, prompt_ids, sampling)``,
  ``("cancel", jid)``, ``("close",)``
- child -> parent: ``("ready", info, speculative, algorithm, model path)`` or ``("failed", message)``, then
  ``("events", [(jid, DecodeEvent), ...])`` once per scheduler round, ``("fatal", message)``, ``("closed",)``

The child exits when the parent goes away (end of file on the socket, noticed even during a long step). Event
timestamps are ``time.perf_counter`` (CLOCK_MONOTONIC on Linux: one clock for both processes), so time to first
token is measured from the decoder's commit, as on the thread backend.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

from eaglenest.config import EaglenestConfig
from eaglenest.serve.jobs import DecodeEvent, Job, RemoteEngineBackend

log = logging.getLogger(__name__)

START_TIMEOUT_S = 900.0
"""building the tiny target on first use, or loading a large checkpoint, happens before the child says ready"""


class DecoderProcessError(RuntimeError):
    """The decoder process could not start or went away."""


class ProcessBackend(RemoteEngineBackend):
    """Same interface as :class:`eaglenest.serve.backends.Backend`; the engine and scheduler live in ``python -m
    eaglenest.serve.engine_process`` and this side keeps the tokenizer, the job table and one receiving thread."""

    def __init__(self, cfg: EaglenestConfig, drafter: str | None, *, start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.name = cfg.target.engine
        self.fatal: str | None = None
        self._jobs: dict[int, Job] = {}
        self._next_id = 0
        self._lock = threading.Lock()  # guards sends and the job table (the event loop, self-test and reader)
        self._closing = False
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the child imports what this process does
        cmd = [sys.executable, "-m", "eaglenest.serve.engine_process", "--fd", str(child_sock.fileno())]
        self._proc = subprocess.Popen(cmd, pass_fds=[child_sock.fileno()], env=env)
        child_sock.close()
        self._conn = Connection(parent_sock.detach())
        self._conn.send(("start", cfg.model_dump(mode="json"), drafter))
        ready = self._await_ready(start_timeout_s)
        _, info, speculative, algorithm, model_path = ready
        self._take_facts(info, speculative, algorithm, model_path, cfg.target.trust_remote_code)
        self._reader = threading.Thread(target=self._receive, name="eaglenest-decoder-events", daemon=True)
        self._reader.start()

    def _await_ready(self, timeout: float) -> tuple:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(1.0):
            if self._proc.poll() is not None:
                raise DecoderProcessError(f"the decoder process exited with code {self._proc.returncode} before it "
                                          f"was ready (its log above says why)")
            if time.monotonic() > deadline:
                self._proc.kill()
                raise DecoderProcessError(f"the decoder process was not ready within {timeout:.0f} s")
        msg = self._conn.recv()
        if msg[0] == "failed":
            self._proc.wait(30)
            raise DecoderProcessError(msg[1])
        return msg

    # ---- facts (info, tokenizer, speculative, algorithm: RemoteEngineBackend)
    @property
    def alive(self) -> bool:
        return self.fatal is None and self._proc.poll() is None and self._reader.is_alive()

    @property
    def pid(self) -> int:
        return self._proc.pid

    # ---- requests
    def submit(self, job: Job) -> None:
        if self._closing:
            raise RuntimeError("the backend is shutting down")
        if not self.alive:
            raise RuntimeError(f"the decoder process is not running ({self.fatal or 'exited'})")
        with self._lock:
            jid = self._next_id
            self._next_id += 1
            self._jobs[jid] = job
            job.on_cancel = lambda: self._send(("cancel", jid))
            self._conn.send(("submit", jid, list(job.prompt_ids), job.sampling))

    def _send(self, msg: tuple) -> None:
        try:
            with self._lock:
                self._conn.send(msg)
        except OSError:  # the child is gone; the reader reports it
            pass

    def _receive(self) -> None:
        try:
            while True:
                msg = self._conn.recv()
                if msg[0] == "events":
                    self._deliver(msg[1])
                elif msg[0] == "fatal":
                    self.fatal = msg[1]
                elif msg[0] == "closed":
                    break
        except (EOFError, OSError):
            if not self._closing:
                code = self._proc.wait(5) if self._proc.poll() is None else self._proc.returncode
                self.fatal = self.fatal or f"the decoder process exited unexpectedly (code {code})"
        self._fail_all(self.fatal or "the server is shutting down")

    def _deliver(self, events: list[tuple[int, DecodeEvent]]) -> None:
        for jid, ev in events:
            with self._lock:
                job = self._jobs.get(jid)
                if job is not None and ev.final:
                    del self._jobs[jid]
            if job is not None:
                job.emit(ev)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            jobs, self._jobs = list(self._jobs.values()), {}
        for job in jobs:
            job.emit(DecodeEvent([], error=message))

    def close(self, timeout: float = 10.0) -> None:
        """Let the running batch stop, then end the child (killed if it does not exit in time)."""
        if self._closing:
            return
        self._closing = True
        self._send(("close",))
        self._reader.join(timeout)
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)
        self._conn.close()
        self._fail_all("the server is shutting down")
