"""An engine deployment seen from the routing ingress (``serve.route.placement: deployments``): the
:class:`~eaglenest.serve.jobs.BackendBase` interface over a Ray Serve handle to
:class:`~eaglenest.serve.engine_deployment.EngineDeployment`.

Jobs are submitted from the replica's event loop and from plain threads (the self-test), so the handle's streams run
on one event loop of this object's own thread; a job's events are delivered from there, as a local backend delivers
them from its decoder thread. The tokenizer is loaded here from the folder the engine names (the ingress renders
chat templates and counts prompt tokens itself).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from eaglenest.serve.jobs import DecodeEvent, Job, RemoteEngineBackend

log = logging.getLogger(__name__)

FACTS_TIMEOUT_S = 900.0
"""the engine deployment answers once its engine has started (a large checkpoint loads first)"""


class HandleBackend(RemoteEngineBackend):
    """Requests to one engine deployment through ``handle``; facts from its ``facts()`` at construction."""

    def __init__(self, handle: Any, *, trust_remote_code: bool = False,
                 facts_timeout_s: float = FACTS_TIMEOUT_S) -> None:
        self._stream = handle.options(stream=True)
        self.fatal: str | None = None
        self._closing = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="eaglenest-engine-handle", daemon=True)
        self._thread.start()
        try:  # awaited on our loop: a replica's constructor may run inside Serve's event loop, where a blocking
            # `.result()` is refused
            facts = asyncio.run_coroutine_threadsafe(self._facts(handle), self._loop).result(facts_timeout_s)
        except BaseException:
            self.close()
            raise
        self.name = f"{facts['name']}-deployment"
        self.side: str = facts["side"]
        self._take_facts(facts["info"], facts["speculative"], facts["algorithm"], facts["model_path"],
                         trust_remote_code)

    @staticmethod
    async def _facts(handle: Any) -> dict[str, Any]:
        return await handle.facts.remote()

    # ---- facts (info, tokenizer, speculative, algorithm: RemoteEngineBackend)
    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- requests
    def submit(self, job: Job) -> None:
        if self._closing:
            raise RuntimeError("the backend is shutting down")
        task = asyncio.run_coroutine_threadsafe(self._run(job), self._loop)
        job.on_cancel = lambda: self._loop.call_soon_threadsafe(task.cancel)

    async def _run(self, job: Job) -> None:
        gen = self._stream.generate.remote(list(job.prompt_ids), job.sampling)
        try:
            async for batch in gen:
                for ev in batch:
                    job.emit(ev)
        except asyncio.CancelledError:  # the client went away: end the engine's stream too
            gen.cancel()
            job.emit(DecodeEvent([], error="cancelled"))
        except Exception as e:  # the engine replica died or refused: this request fails, the next may not
            log.warning("an engine deployment call failed", exc_info=True)
            job.emit(DecodeEvent([], error=f"the engine deployment failed: {type(e).__name__}: {e}"))
        else:
            if not job.finished:
                job.emit(DecodeEvent([], error="the engine deployment ended the stream without a final event"))

    def close(self, timeout: float = 10.0) -> None:
        """Stops this side's event loop; the engine deployment itself is Serve's to stop."""
        if self._closing:
            return
        self._closing = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
