"""The decoder process's program (``python -m eaglenest.serve.engine_process --fd N``), started by
:class:`eaglenest.serve.process_backend.ProcessBackend`, whose docstring describes the protocol: it runs the engine
and its scheduler (:func:`eaglenest.serve.backends.make_local_backend`) and serves the parent's jobs until the parent
closes or goes away."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from multiprocessing.connection import Connection

from eaglenest.config import EaglenestConfig
from eaglenest.serve.backends import make_local_backend
from eaglenest.serve.jobs import DecodeEvent, Job

log = logging.getLogger(__name__)


def child_main(fd: int) -> int:
    """Run the engine and its scheduler; serve the parent's requests until it closes or goes away."""
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
        from eaglenest.engines.location import resolve_target_path

        cfg = EaglenestConfig.model_validate(cfg_dict)
        backend = make_local_backend(cfg, drafter, after_step=flush)
        backend.warmed.wait()  # an engine that starts on the worker thread (SGLang) has started, or failed, by now:
        if backend.fatal:      # the parent may start the next engine only once this one holds its GPU memory
            raise RuntimeError(f"the engine did not start: {backend.fatal}")
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
