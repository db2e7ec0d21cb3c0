"""serve.arrival: the proxy's arrival stamp and the replica's reading of it (no Ray started; the e2e check is
tests/e2e/test_serve_ttft.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from eaglenest.ray_private import PROXY_CALLBACK_ENV
from eaglenest.serve.arrival import ARRIVAL_HEADER, PROXY_CALLBACK, StampArrival, arrival, proxy_stamps

NAME = ARRIVAL_HEADER.encode()


def _call(scope: dict) -> dict:
    """Run the middleware over ``scope``; the scope the wrapped app received."""
    seen: dict = {}

    async def app(scope, receive, send):
        seen.update(scope)

    asyncio.run(StampArrival(app)(scope, None, None))
    return seen


def test_the_stamp_is_the_proxys_clock_and_replaces_the_clients():
    before = time.time()
    forged = [(NAME, b"1.0"), (ARRIVAL_HEADER.upper().encode(), b"2")]
    seen = _call({"type": "http", "headers": [(b"host", b"x"), *forged]})
    stamps = [v for k, v in seen["headers"] if k.lower() == NAME]
    assert len(stamps) == 1 and before <= float(stamps[0]) <= time.time()
    assert (b"host", b"x") in seen["headers"]


def test_other_scopes_pass_untouched():
    for scope in ({"type": "websocket", "headers": [(NAME, b"1.0")]}, {"type": "lifespan"}):
        assert _call(dict(scope)) == scope


def test_a_burst_is_stamped_before_any_of_it_is_routed():
    """Serve's handling of a request starts with milliseconds of work; every request of a burst read in one loop
    turn must be stamped before that work runs for any of them, not one after another behind it."""
    stamps: list[float] = []

    async def busy_app(scope, receive, send):  # Serve's first synchronous segment of one request
        stamps.append(float(dict(scope["headers"])[NAME]))
        time.sleep(0.01)

    async def burst() -> None:
        mw = StampArrival(busy_app)
        await asyncio.gather(*(mw({"type": "http", "headers": []}, None, None) for _ in range(20)))

    asyncio.run(burst())
    assert len(stamps) == 20 and max(stamps) - min(stamps) < 0.05  # not 19 x 10 ms


def test_the_replica_counts_from_the_stamp():
    a = arrival("1000.5", trusted=True, now=50.0, now_wall=1002.0)
    assert a.queue_s == pytest.approx(1.5) and a.at == pytest.approx(48.5)


@pytest.mark.parametrize("stamp,trusted", [
    ("1000.5", False),  # a client could have written it: the proxies of this Ray do not stamp
    (None, True), ("", True), ("soon", True), ("nan", True), ("inf", True), ("-inf", True),
])
def test_without_a_usable_stamp_timing_starts_at_the_handler(stamp, trusted):
    a = arrival(stamp, trusted=trusted, now=50.0, now_wall=1002.0)
    assert (a.at, a.queue_s) == (50.0, None)


def test_a_stamp_from_the_future_counts_as_arriving_now():
    """Clock skew between a proxy's node and the replica's must not give a negative wait."""
    assert arrival("1002.3", trusted=True, now=50.0, now_wall=1002.0) == arrival("1002.0", trusted=True, now=50.0,
                                                                                 now_wall=1002.0)
    assert arrival("1002.3", trusted=True, now=50.0, now_wall=1002.0).queue_s == 0.0


def test_the_stamp_is_trusted_only_where_the_proxies_set_it():
    assert proxy_stamps({PROXY_CALLBACK_ENV: PROXY_CALLBACK})
    assert not proxy_stamps({})
    assert not proxy_stamps({PROXY_CALLBACK_ENV: "someone.else:middlewares"})
