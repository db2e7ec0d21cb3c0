"""An SGLang engine start that fails by raising, not by ending the calling process.

When a scheduler process fails while ``sglang.Engine`` starts (a kernel that rejects the drafter's shapes during
CUDA-graph capture, say), it sends SIGQUIT to its parent, and SGLang's launch-phase handler ends the parent's whole
process tree: a benchmark of several drafters loses every measurement with the one engine that cannot start. SGLang
takes a ``custom_sigquit_handler`` for that phase instead; with one that only reports, ``Engine()`` raises its own
error (the scheduler it waited for is gone), and the children it had started (the detokenizer, non-daemonic) are
ended here, or the interpreter would wait for them at exit. Only the launch phase changes: once the engine serves
from the main thread, SGLang installs its running-phase handler as before. Nothing here imports sglang.
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
from collections.abc import Callable
from typing import Any

LAUNCH_FAILURE_LINE = ("[eaglenest engine] an SGLang child process failed while the engine started (SIGQUIT); the "
                       "start raises instead of ending this process")


def launch_failure_logged(signum: int, frame: Any) -> None:
    """SIGQUIT from a child while the engine starts: say so and return, so the start raises."""
    print(LAUNCH_FAILURE_LINE, file=sys.stderr, flush=True)


def end_children(children: set[Any], timeout_s: float = 5.0) -> None:
    """Terminate, then kill, these multiprocessing children, and reap them."""
    for proc in children:
        proc.terminate()
    for proc in children:
        proc.join(timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout_s)


def start_raising_on_failure(start: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """``start(**kwargs)`` with the launch-phase SIGQUIT reported rather than fatal (from the main thread only:
    elsewhere SGLang installs no handler); a start that raises leaves none of the children it started behind."""
    if threading.current_thread() is not threading.main_thread():
        return start(**kwargs)
    before = set(multiprocessing.active_children())
    try:
        return start(**kwargs, custom_sigquit_handler=launch_failure_logged)
    except BaseException:
        end_children(set(multiprocessing.active_children()) - before)
        raise
