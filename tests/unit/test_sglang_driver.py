"""EngineLoopDriver: several threads' batches are in the engine's scheduler at the same time.

The engine here has the part of ``sglang.Engine`` the driver uses (``loop``, ``async_generate`` returning a batch's
outputs) over a scheduler that steps all admitted requests together, one token per step, like SGLang's decode loop;
the contract venv checks the real ``Engine`` has that surface (tests/unit/test_sglang_contract.py).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from eaglenest.engines.sglang.driver import EngineLoopDriver


class SteppingEngine:
    """Continuous batching in miniature: every request admitted so far decodes one token per step."""

    def __init__(self, step_s: float = 0.002) -> None:
        self.loop = asyncio.new_event_loop()
        self.step_s = step_s
        self.running: dict[str, list[int]] = {}
        self.max_running = 0
        self.steps = 0
        self._stepper: asyncio.Task | None = None

    async def _step_forever(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            if self.running:
                self.steps += 1
                self.max_running = max(self.max_running, len(self.running))
                for out in self.running.values():
                    out.append(len(out))

    def shutdown(self) -> None:
        """After the driver stopped: end the stepping task on the (now free) loop."""
        if self._stepper is not None:
            self._stepper.cancel()
            self.loop.run_until_complete(asyncio.gather(self._stepper, return_exceptions=True))
        self.loop.close()

    async def async_generate(self, *, input_ids, sampling_params, rid=None):
        if self._stepper is None:
            self._stepper = asyncio.get_running_loop().create_task(self._step_forever())
        rids = rid or [f"r{id(p)}" for p in input_ids]
        for r in rids:
            self.running[r] = []
        while any(len(self.running[r]) < sp["max_new_tokens"] for r, sp in zip(rids, sampling_params, strict=True)):
            await asyncio.sleep(self.step_s / 2)
        outs = [{"output_ids": self.running.pop(r), "meta_info": {"rid": r}} for r in rids]
        return outs


def _batch(tag: str, n: int, max_new: int) -> dict:
    return {"input_ids": [[1, 2]] * n, "sampling_params": [{"max_new_tokens": max_new}] * n,
            "rid": [f"{tag}-{i}" for i in range(n)]}


def test_two_threads_batches_decode_together_and_each_gets_its_own_outputs() -> None:
    engine = SteppingEngine()
    driver = EngineLoopDriver(engine)
    results: dict[str, list] = {}

    def run(tag: str, max_new: int) -> None:
        results[tag] = driver.generate(**_batch(tag, 4, max_new))

    try:
        threads = [threading.Thread(target=run, args=(t, m)) for t, m in (("a", 30), ("b", 10))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    finally:
        driver.close()
        engine.shutdown()
    assert engine.max_running == 8  # both batches' requests were in the scheduler at once
    assert [o["meta_info"]["rid"] for o in results["a"]] == [f"a-{i}" for i in range(4)]
    assert [o["meta_info"]["rid"] for o in results["b"]] == [f"b-{i}" for i in range(4)]
    assert all(len(o["output_ids"]) >= 30 for o in results["a"])
    assert all(len(o["output_ids"]) >= 10 for o in results["b"])


def test_one_thread_at_a_time_never_overlaps_and_a_stopped_driver_refuses() -> None:
    engine = SteppingEngine()
    driver = EngineLoopDriver(engine)
    try:
        driver.generate(**_batch("a", 3, 5))
        driver.generate(**_batch("b", 3, 5))
    finally:
        driver.close()
    assert engine.max_running == 3
    assert not driver.running
    with pytest.raises(RuntimeError, match="stopped"):
        driver.generate(**_batch("c", 1, 1))
    # the loop is free again: synchronous use (what Engine.generate does) works after close
    assert engine.loop.run_until_complete(asyncio.sleep(0, result=7)) == 7
    engine.shutdown()


def test_a_failing_batch_raises_in_its_caller_only() -> None:
    class Failing(SteppingEngine):
        async def async_generate(self, *, input_ids, sampling_params, rid=None):
            if rid and rid[0].startswith("bad"):
                raise ValueError("prompt too long")
            return await super().async_generate(input_ids=input_ids, sampling_params=sampling_params, rid=rid)

    engine = Failing()
    driver = EngineLoopDriver(engine)
    try:
        with pytest.raises(ValueError, match="too long"):
            driver.generate(**_batch("bad", 2, 3))
        t0 = time.monotonic()
        assert len(driver.generate(**_batch("good", 2, 3))) == 2
        assert time.monotonic() - t0 < 10
    finally:
        driver.close()
        engine.shutdown()
