"""A failing engine start raises instead of ending the process (eaglenest.engines.sglang.launch_failure), shown with
real processes the way SGLang's start behaves: a scheduler child that fails sends SIGQUIT to its parent and exits,
another child (the detokenizer) runs on, the parent registers the custom SIGQUIT handler it was given and raises when
the scheduler it waits for is gone. SGLang itself cannot start without a GPU; its registration of the handler is
checked in the contract venv (tests/unit/test_sglang_contract.py)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from typing import Any

import pytest

from eaglenest.engines.sglang.launch_failure import LAUNCH_FAILURE_LINE, start_raising_on_failure

CTX = multiprocessing.get_context("spawn")


def _forever() -> None:
    while True:
        time.sleep(1)


def _fail_and_tell_parent(parent: int) -> None:
    os.kill(parent, signal.SIGQUIT)
    raise SystemExit(1)


def fake_engine_start(custom_sigquit_handler: Any = None, **kw: Any) -> Any:
    """What sglang.Engine does when its scheduler fails to start (engine.py: handler, children, wait for ready)."""
    if custom_sigquit_handler is not None:
        signal.signal(signal.SIGQUIT, custom_sigquit_handler)
    detokenizer = CTX.Process(target=_forever)
    detokenizer.start()
    scheduler = CTX.Process(target=_fail_and_tell_parent, args=(os.getpid(),))
    scheduler.start()
    scheduler.join(30)
    raise RuntimeError(f"Rank 0 scheduler died with exit code {scheduler.exitcode}")


def test_a_failed_start_raises_and_leaves_no_child_behind(capfd: pytest.CaptureFixture[str]) -> None:
    saved = signal.getsignal(signal.SIGQUIT)
    bystander = CTX.Process(target=_forever)  # started before: not the failed start's to end
    bystander.start()
    try:
        with pytest.raises(RuntimeError, match="scheduler died with exit code 1"):
            start_raising_on_failure(fake_engine_start, {"model_path": "m"})
        time.sleep(0.2)  # the handler runs between bytecodes: give the signal a moment if it was late
        assert LAUNCH_FAILURE_LINE in capfd.readouterr().err  # this process got the SIGQUIT and lived
        assert set(multiprocessing.active_children()) == {bystander}  # the detokenizer was ended
        assert bystander.is_alive()
    finally:
        signal.signal(signal.SIGQUIT, saved)
        bystander.terminate()
        bystander.join(5)


def test_a_start_that_succeeds_passes_the_handler_and_returns_the_engine() -> None:
    seen: dict[str, Any] = {}

    def start(**kw: Any) -> str:
        seen.update(kw)
        return "engine"

    assert start_raising_on_failure(start, {"model_path": "m"}) == "engine"
    assert seen["model_path"] == "m" and callable(seen["custom_sigquit_handler"])
