"""``eaglenest serve`` as a small supervisor, so that a SIGTERM to its whole process group drains like one to its PID.

Why: a Ray that ``eaglenest serve`` starts itself (no cluster to attach to) runs its GCS, raylet, Serve controller,
proxy and replicas as children in the CLI's process group. ``kill -TERM -<pgid>``, a terminal's Ctrl-C, or an init
system / container runtime that signals the group, then reached them all at once: Ray died under the running
requests and nothing drained. So the command re-runs itself as a child in a session of its own (which then starts
Ray, in that session) and stays in the caller's group as the only process there: every SIGTERM / SIGINT / SIGHUP it
receives is forwarded once to the child as SIGTERM, which drains (serve.drain) and shuts Ray down itself. Should the
child outlive ``serve.drain_timeout_s`` + :data:`KILL_AFTER_S`, its whole session (Ray included) is killed; should
the supervisor die, the child notices (its parent changes) and drains on its own.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping

from eaglenest.ray_private import JOB_DRIVER_ENV, JOB_STOP_WAIT_DEFAULT_S, JOB_STOP_WAIT_ENV

CHILD_ENV = "EAGLENEST_SERVE_SUPERVISOR"
"""set in the child: the supervisor's pid (the child watches for its parent to change)"""
KILL_AFTER_S = 10.0
"""after the forwarded SIGTERM, the child gets the drain deadline plus this long before its session is killed"""
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def is_child() -> bool:
    return CHILD_ENV in os.environ


def parent_gone() -> bool:
    """In the child: the supervisor exited (the child was re-parented)."""
    return is_child() and os.getppid() != int(os.environ[CHILD_ENV])


def exit_now(code: int) -> None:
    """End the child at once once Ray is stopped: the interpreter's own teardown (Ray's and torch's exit hooks, the
    threads they wait for) took ~2 s more, past the drain deadline's budget, with nothing left to clean up."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def supervise(argv: list[str], drain_timeout_s: float) -> int:
    """Run ``python -m eaglenest.cli <argv>`` in its own session, forward termination signals, return its status."""
    env = {**os.environ, CHILD_ENV: str(os.getpid())}
    child = subprocess.Popen([sys.executable, "-m", "eaglenest.cli", *argv], env=env, start_new_session=True)
    kill_at: list[float] = []

    def forward(signum: int, _frame: object) -> None:
        if kill_at:  # forwarded once: a second Ctrl-C does not cut the drain short
            return
        kill_at.append(time.monotonic() + drain_timeout_s + KILL_AFTER_S)
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGTERM)

    for s in FORWARDED:
        signal.signal(s, forward)
    while True:
        try:
            return child.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            if kill_at and time.monotonic() > kill_at[0]:
                print(f"eaglenest serve: still running {drain_timeout_s + KILL_AFTER_S:g} s after SIGTERM; killing it "
                      f"and its Ray", file=sys.stderr, flush=True)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                return 1


def job_stop_warning(drain_timeout_s: float, environ: Mapping[str, str] | None = None) -> str | None:
    """Run as a Ray job, `ray job stop` SIGTERMs this driver and SIGKILLs it ``RAY_JOB_STOP_WAIT_TIME_S`` later (3 s
    by default): a longer drain is cut there, and Serve, left deployed, keeps answering 503. The warning names the
    runtime env that gives the drain its time; None when it has it, or when this is no job."""
    env = os.environ if environ is None else environ
    if JOB_DRIVER_ENV not in env:
        return None
    try:
        wait = int(env.get(JOB_STOP_WAIT_ENV, JOB_STOP_WAIT_DEFAULT_S))
    except ValueError:
        wait = JOB_STOP_WAIT_DEFAULT_S
    need = math.ceil(drain_timeout_s + KILL_AFTER_S)
    if wait >= need:
        return None
    return (f"warning: `ray job stop` kills this job {wait} s after its SIGTERM ({JOB_STOP_WAIT_ENV}), before the "
            f"drain (serve.drain_timeout_s {drain_timeout_s:g} s) can end; submit it with "
            f"--runtime-env-json '{{\"env_vars\": {{\"{JOB_STOP_WAIT_ENV}\": \"{need}\"}}}}'")
