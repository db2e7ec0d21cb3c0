"""When a request reached Ray Serve's HTTP proxy, so that TTFT and queue time count what the client waited for.

Why: a replica's handler runs only after Ray Serve's proxy has read the request, routed it (waiting there while every
replica is at ``max_ongoing_requests``) and the replica's event loop has picked it up. Timing from the handler missed
all of that (issue #30: 101 of 256 streams waited over 2.5 s by the client's clock while every histogram sample was
at most 2.5 s). Ray Serve 2.60 carries no arrival time in its request metadata; the closest point it exposes is an
ASGI middleware in front of the proxy's app, which every proxy (and a replica serving direct ingress) installs at
start from ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``. :class:`StampArrival` writes the proxy's wall-clock time
into a request header there, replacing any copy the client sent, and the replica turns it into a time on its own
clock (:func:`arrival`).

Trust: the header is read only when this process's environment names :data:`PROXY_CALLBACK` (the proxies of the
same Ray then stamp every request; a Ray that ``eaglenest serve`` starts sets it, see ``serve.cli``). Otherwise a
client could send the header itself, so it is ignored and timing starts at the handler, as before. The proxy and
the replica compare wall clocks: on one node that is one clock; across nodes their skew enters (NTP keeps it to
milliseconds), and a stamp from the future counts as arriving at the handler.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from eaglenest.ray_private import PROXY_CALLBACK_ENV

ARRIVAL_HEADER = "x-eaglenest-arrival"
"""the proxy's ``time.time()`` at arrival, seconds with microseconds"""
PROXY_CALLBACK = "eaglenest.serve.arrival:proxy_middlewares"
"""the value of ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` that installs :class:`StampArrival`"""

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


class StampArrival:
    """ASGI middleware for Ray Serve's HTTP proxy: stamp each HTTP request with its arrival time."""

    _name = ARRIVAL_HEADER.encode()

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope.get("type") == "http":
            stamp = f"{time.time():.6f}".encode()
            headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() != self._name]
            scope["headers"] = [*headers, (self._name, stamp)]
            # let every request read in the same event-loop turn take its stamp before Serve's routing of any of them
            # runs: under a burst the first segment of each request's handling takes milliseconds, and without this
            # the 128th request of a burst would be stamped after the other 127 were routed (~0.3 s late on 2 cores)
            await asyncio.sleep(0)
        await self.app(scope, receive, send)


def proxy_middlewares() -> list[Any]:
    """The proxy callback: Ray Serve calls it once per proxy and wraps its app in the middlewares returned."""
    from starlette.middleware import Middleware

    return [Middleware(StampArrival)]


def proxy_stamps(environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether this Ray's proxies stamp requests (so the header can be trusted)."""
    return (os.environ if environ is None else environ).get(PROXY_CALLBACK_ENV) == PROXY_CALLBACK


@dataclass(frozen=True)
class Arrival:
    """One request's arrival, on this process's ``time.perf_counter`` clock."""

    at: float
    """when it reached the proxy (the handler's start when it was not stamped)"""
    queue_s: float | None
    """proxy arrival -> handler start (Ray Serve's routing and queueing); None when not stamped"""


def arrival(stamp: str | None, *, trusted: bool, now: float | None = None,
            now_wall: float | None = None) -> Arrival:
    """The arrival of a request whose handler starts ``now`` (perf_counter) = ``now_wall`` (time.time)."""
    now = time.perf_counter() if now is None else now
    if not trusted or not stamp:
        return Arrival(now, None)
    try:
        at_wall = float(stamp)
    except ValueError:
        return Arrival(now, None)
    if not math.isfinite(at_wall):
        return Arrival(now, None)
    waited = max((time.time() if now_wall is None else now_wall) - at_wall, 0.0)
    return Arrival(now - waited, waited)
