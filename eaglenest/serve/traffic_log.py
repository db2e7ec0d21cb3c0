"""``serve.traffic_log``: sampled requests and their answers written as a regen source, never on the request path.

Why: a drafter trained once goes stale as traffic drifts; the flywheel (``eaglenest flywheel``) retrains it on what
the server really answered. Speculative decoding is lossless, so those answers are the target's own and need only a
capture pass (the native format, :mod:`eaglenest.contracts.traffic`), no regeneration.

The request path only decides the sample (one random draw) and puts the ids on a bounded queue without waiting; a
full queue drops the record and counts it (``eaglenest_serve_traffic_dropped{reason="queue_full"}``), and so does a
write that fails (``write_error``): the log never delays or fails a request. One writer thread per replica builds the
JSON line (redaction included), appends it to the replica's own ``traffic-<host>-<pid>-<ms>-<n>.jsonl`` (one ``write``
per line, so a reader sees whole lines or an unfinished last one), starts a new file every ``max_bytes / 8``, and
deletes the folder's oldest files past ``max_bytes`` and those older than ``retention_days``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import random
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from eaglenest.config import TrafficLogConfig
from eaglenest.contracts import metrics as contract
from eaglenest.contracts.traffic import FILE_GLOB, FILE_PREFIX, FILE_SUFFIX, traffic_record
from eaglenest.serve.redact import redact

log = logging.getLogger("eaglenest.serve")

ROTATE_MAX_BYTES = 64 << 20
SWEEP_EVERY_S = 60.0
_STOP = object()


class _Counters:
    """The log's two counters, as Ray metrics when asked (replicas) and always as plain numbers (health, tests)."""

    def __init__(self, model: str, use_ray_metrics: bool) -> None:
        self.tags = {"model": model}
        self.logged = 0
        self.dropped: dict[str, int] = {"queue_full": 0, "write_error": 0}
        self._lock = threading.Lock()
        self.ray_metrics: tuple[Any, Any] | None = None
        if use_ray_metrics:
            self.ray_metrics = (contract.ray_metric(contract.SERVE_TRAFFIC_LOGGED),
                         contract.ray_metric(contract.SERVE_TRAFFIC_DROPPED))

    def wrote(self) -> None:
        with self._lock:
            self.logged += 1
        if self.ray_metrics is not None:
            self.ray_metrics[0].inc(1, tags=self.tags)

    def drop(self, reason: str) -> None:
        with self._lock:
            self.dropped[reason] = self.dropped.get(reason, 0) + 1
        if self.ray_metrics is not None:
            self.ray_metrics[1].inc(1, tags={**self.tags, "reason": reason})


class TrafficLog:
    """One replica's traffic log: :meth:`offer` on the request path, a writer thread behind it."""

    def __init__(self, cfg: TrafficLogConfig, *, model: str, drafter: str | None,
                 decode: Callable[[list[int]], str], encode: Callable[[str], list[int]],
                 use_ray_metrics: bool = True, tag: str | None = None, seed: int | None = None) -> None:
        if not cfg.path:
            raise ValueError("serve.traffic_log.path is not set: the traffic log is off")
        self.cfg = cfg
        self.folder = Path(cfg.path).expanduser()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(f"serve.traffic_log.path {self.folder} cannot be created ({e}); point it at a writable "
                          "folder or unset it (the log is off then)") from e
        if not os.access(self.folder, os.W_OK):
            raise OSError(f"serve.traffic_log.path {self.folder} is not writable; point it at a writable folder or "
                          "unset it (the log is off then)")
        self.model, self.drafter = model, drafter
        self.decode, self.encode = decode, encode
        self.tag = tag or f"{socket.gethostname()}-{os.getpid()}".replace("/", "_")
        self.rotate_bytes = min(ROTATE_MAX_BYTES, max(4096, cfg.max_bytes // 8))
        self.counters = _Counters(model, use_ray_metrics)
        self._rng = random.Random(seed)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=cfg.queue_size)
        self._file: Any = None
        self._file_bytes = 0
        self._files = 0
        self._swept = 0.0
        self.writer_cpu_s = 0.0  # the writer thread's CPU time: what the log costs the replica, measured in place
        self._thread = threading.Thread(target=self._run, name="eaglenest-traffic-log", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------ the request path
    def offer(self, *, prompt_ids: Sequence[int], answer_ids: Sequence[int], route: str, sampling: dict[str, Any],
              spec: dict[str, Any], finish_reason: str, arrived_at: float, ttft_s: float | None,
              request_id: str | None = None) -> bool:
        """Queue one finished request if it is sampled; True when queued. Never blocks, never raises."""
        try:
            if not answer_ids or self._rng.random() >= self.cfg.sample_rate:
                return False
            item = {"prompt_ids": list(prompt_ids), "answer_ids": list(answer_ids), "route": route,
                    "sampling": sampling, "spec": spec, "finish_reason": finish_reason, "arrived_at": arrived_at,
                    "finished_at": time.time(), "ttft_s": ttft_s, "request_id": request_id}
            self._queue.put_nowait(item)
            return True
        except queue.Full:
            self.counters.drop("queue_full")
        except Exception:  # the log must never fail a request
            self.counters.drop("write_error")
            log.warning("traffic log: could not queue a record", exc_info=True)
        return False

    # --------------------------------------------------------------------------------------------- the writer
    def _run(self) -> None:
        self._sweep()
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            started = time.thread_time()
            try:
                self._write(self._record(item))
                self.counters.wrote()
            except Exception:
                self.counters.drop("write_error")
                log.warning("traffic log: a record could not be written to %s", self.folder, exc_info=True)
            self.writer_cpu_s += time.thread_time() - started
        if self._file is not None:
            self._file.close()

    def _record(self, item: dict[str, Any]) -> dict[str, Any]:
        prompt, answer, n = item.pop("prompt_ids"), item.pop("answer_ids"), 0
        if self.cfg.redact:
            prompt, answer, n = self._redacted(prompt, answer)
        return traffic_record(prompt_ids=prompt, answer_ids=answer, model=self.model, drafter=self.drafter,
                              redacted=n, **item)

    def _redacted(self, prompt: list[int], answer: list[int]) -> tuple[list[int], list[int], int]:
        """The ids unchanged when nothing matches; else both parts re-tokenized from their redacted text."""
        p_text, p_n = redact(self.decode(prompt))
        a_text, a_n = redact(self.decode(answer))
        if p_n + a_n == 0:
            return prompt, answer, 0
        return (self.encode(p_text) if p_n else prompt), (self.encode(a_text) if a_n else answer), p_n + a_n

    def _write(self, rec: dict[str, Any]) -> None:
        import json

        line = (json.dumps(rec, separators=(",", ":"), ensure_ascii=False) + "\n").encode()
        if self._file is None or self._file_bytes >= self.rotate_bytes:
            self._rotate()
        self._file.write(line)
        self._file.flush()
        self._file_bytes += len(line)
        if time.monotonic() - self._swept > SWEEP_EVERY_S:
            self._sweep()

    def _rotate(self) -> None:
        if self._file is not None:
            self._file.close()
        self._files += 1  # a file per rotation, even within one millisecond
        name = f"{FILE_PREFIX}{self.tag}-{int(time.time() * 1000)}-{self._files:06d}{FILE_SUFFIX}"
        self._file = open(self.folder / name, "ab")  # noqa: SIM115 - held open across writes, closed on rotation
        self._file_bytes = 0
        self._sweep()

    def _sweep(self) -> None:
        """Delete files past ``retention_days``, then the oldest ones while the folder exceeds ``max_bytes``; the
        file being written is never deleted. Other replicas sweep the same folder: a file gone already is fine."""
        self._swept = time.monotonic()
        current = Path(self._file.name).resolve() if self._file is not None else None
        files = []
        for f in self.folder.glob(FILE_GLOB):
            try:
                st = f.stat()
            except FileNotFoundError:
                continue
            files.append((st.st_mtime, st.st_size, f))
        files.sort()
        limit = time.time() - self.cfg.retention_days * 86400
        total = sum(size for _, size, _ in files)
        for mtime, size, f in files:
            if f.resolve() == current:
                continue
            if mtime < limit or total > self.cfg.max_bytes:
                with contextlib.suppress(FileNotFoundError):
                    f.unlink()
                total -= size

    # ------------------------------------------------------------------------------------------------ lifecycle
    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (up to ``timeout``), then stop the writer."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self._queue.put(_STOP, timeout=0.1)
                break
            except queue.Full:
                continue
        self._thread.join(max(0.0, deadline - time.monotonic()))

    def stats(self) -> dict[str, Any]:
        """What ``/health`` shows: where the log goes, its counts, and the CPU seconds its writer has used."""
        return {"path": str(self.folder), "sample_rate": self.cfg.sample_rate, "logged": self.counters.logged,
                "dropped": dict(self.counters.dropped), "queued": self._queue.qsize(),
                "writer_cpu_s": round(self.writer_cpu_s, 4)}


__all__ = ["TrafficLog"]
