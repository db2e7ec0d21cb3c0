"""The hf decoder in a child process of the replica: decoding and HTTP work no longer share one interpreter lock.

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

import argparse
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from eaglenest.config import EaglenestConfig
from eaglenest.engines.base import TargetInfo
from eaglenest.serve.backends import BackendBase, DecodeEvent, Job

log = logging.getLogger(__name__)

START_TIMEOUT_S = 900.0
"""building the tiny target on first use, or loading a large checkpoint, happens before the child says ready"""


class DecoderProcessError(RuntimeError):
    """The decoder process could not start or went away."""


class ProcessBackend(BackendBase):
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
        _, self._info, self._speculative, self._algorithm, model_path = ready
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.target.trust_remote_code)
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

    # ---- facts
    @property
    def info(self) -> TargetInfo:
        return self._info

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def speculative(self) -> bool:
        return self._speculative

    @property
    def algorithm(self) -> str | None:
        return self._algorithm

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


# ------------------------------------------------------------------------------------------------------- child
def child_main(fd: int) -> int:
    """Run the engine and its scheduler; serve the parent's requests until it closes or goes away."""
    from eaglenest.serve.backends import make_local_backend

    conn = Connection(fd)
    send_lock = threading.Lock()

    def send(msg: tuple) -> None:
        """Send to the parent; a parent that went away is noticed by the receiving loop, not here."""
        try:
            with send_lock:
                conn.send(msg)
        except OSError:
            pass

    kind, cfg_dict, drafter = conn.recv()
    assert kind == "start", kind
    outbox: list[tuple[int, DecodeEvent]] = []
    out_lock = threading.Lock()

    def flush() -> None:  # decoder thread, after each scheduler round: one message for the round
        with out_lock:
            if not outbox:
                return
            batch = outbox[:]
            outbox.clear()
        send(("events", batch))

    try:
        from eaglenest.contracts.target import resolve_target_path

        cfg = EaglenestConfig.model_validate(cfg_dict)
        backend = make_local_backend(cfg, drafter, after_step=flush)
        send(("ready", backend.info, backend.speculative, backend.algorithm, resolve_target_path(cfg.target)))
    except Exception as e:  # the parent raises this message
        log.exception("decoder process failed to start")
        send(("failed", f"{type(e).__name__}: {e}"))
        return 1

    def watch() -> None:  # the scheduler thread died: the parent must know (the replica reports unhealthy)
        backend._thread.join()  # noqa: SLF001 - the worker thread is ours
        if backend.fatal:
            send(("fatal", backend.fatal))

    threading.Thread(target=watch, name="eaglenest-decoder-watch", daemon=True).start()
    jobs: dict[int, Job] = {}

    def sink(jid: int):
        def put(ev: DecodeEvent) -> None:
            with out_lock:
                outbox.append((jid, ev))
            if ev.final:
                jobs.pop(jid, None)
        return put

    try:
        while True:
            msg = conn.recv()
            if msg[0] == "submit":
                _, jid, prompt_ids, sampling = msg
                job = Job(prompt_ids, sampling, sink(jid))  # the parent sends SamplingParams itself
                jobs[jid] = job
                try:
                    backend.submit(job)
                except RuntimeError as e:
                    job.emit(DecodeEvent([], error=str(e)))
                    flush()
            elif msg[0] == "cancel":
                job = jobs.get(msg[1])
                if job is not None:
                    job.cancelled.set()
            elif msg[0] == "close":
                break
    except (EOFError, OSError):  # the parent went away
        pass
    backend.close()
    flush()
    send(("closed",))
    conn.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="eaglenest decoder process (started by the serve replica)")
    ap.add_argument("--fd", type=int, required=True, help="the socket inherited from the replica")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s decoder %(levelname)s %(message)s")
    return child_main(args.fd)


if __name__ == "__main__":
    sys.exit(main())
