"""Several threads' generations in one ``sglang.Engine`` at once: its event loop kept running on a thread of its own.

``Engine.generate`` is synchronous: it runs the engine's asyncio loop (``Engine.loop``) until its own batch is done,
so two callers must take turns, and between two batches the scheduler drains: every batch ends with a tail of a few
long answers decoding at a small batch size, and the next batch starts cold. Regen runs several batches per engine
actor (``regen.batches_in_flight``); this driver keeps ``Engine.loop`` running on one thread and submits each
caller's batch with ``Engine.async_generate`` onto it, so the requests of every batch in flight reach SGLang's
scheduler together and one batch's tail decodes alongside the next batch's requests (continuous batching across
batches). Callers block on their own batch's result only.

While a driver runs, nothing may call the engine's synchronous methods (they would run the same loop from a second
thread); :meth:`close` stops the loop first. Used on the engine: ``loop``, ``async_generate(input_ids=,
sampling_params=, rid=)`` (a batch without ``stream`` returns the list of output dicts).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class EngineLoopDriver:
    """Runs ``engine.loop`` forever on a daemon thread; :meth:`generate` may be called from any number of threads."""

    def __init__(self, engine: Any, *, name: str = "eaglenest-sglang-loop") -> None:
        self.engine = engine
        self.loop: asyncio.AbstractEventLoop = engine.loop
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def generate(self, **kwargs: Any) -> Any:
        """``Engine.async_generate(**kwargs)`` on the engine's loop; blocks the calling thread until it returns."""
        if not self.running:
            raise RuntimeError("the engine's loop driver is stopped")
        return asyncio.run_coroutine_threadsafe(self.engine.async_generate(**kwargs), self.loop).result()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the loop (requests still in flight are abandoned) and join its thread; the engine's synchronous
        methods work again afterwards."""
        if self.running:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=timeout_s)
