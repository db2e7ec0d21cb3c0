"""TTFT and queue time from the request's arrival at Ray Serve's HTTP proxy, against what clients measure (#30).

One Serve instance on 127.0.0.1 whose proxies stamp each request's arrival (serve.arrival; the tests' Ray
environment names the proxy callback, as ``eaglenest serve``'s does), two applications:

- ``/``: 128 concurrent streams through the official ``openai`` client, twice over the same kept-alive connections
  (the first round opens them, the second is measured). Each client times its request from the moment its headers
  left it (httpcore's ``send_request_headers.started`` trace event, which runs the socket write with no await in
  between; the proxy stamps a request when its headers are in, before its body) to its first chunk (the role chunk
  rides with the first token, as vLLM sends it). Stamped at ``send_request_body.complete`` instead, a client learns
  its body went out only after anyio's write yields to the event loop, behind its other 127 streams: the first
  batch's stamps came up to ~0.4 s late, and 16 requests served by 0.75 s read as done by 0.5 s (a CI failure). What
  the client did before that, building 128 requests in one Python event loop on the two cores the server runs on, is
  the client's own time; the report prints it beside the rest. The histogram's delta over exactly those 128 requests
  must agree with the clients: the mean within 10 % of the clients' (binned as Ray bins it, or raw: see the test;
  timed from the handler instead, the mean came out 11-27 % low in three runs here), and at every bucket bound the
  count at or below it must be what a 10 % error on at least 95 % of the requests allows (the clients' count at or
  below ``le / 1.1`` .. ``le / 0.9 + READ_LAG_S``, widened by 5 % of the requests). ``READ_LAG_S`` is the client's,
  not the server's: the first batch's chunks reach a client whose one event loop is still sending the other 112
  requests (its own time, ~0.1 s mean), so it reads them up to that much late, and a whole batch of 16 crosses a
  bound at once (a CI run saw 16 served by 0.3 s that the clients read at 0.346 s and later). Kept short for CI: a
  baseline replica, 32 tokens per request (``ignore_eos``), so a round is eight batches of 16 and lasts seconds.
- ``/narrow``: a replica that takes 5 requests at once (``max_concurrent_requests`` 1 plus Serve's headroom of 4).
  Five requests whose bodies are still arriving hold those places, so the next request waits in Ray Serve's
  router, at the proxy, before its handler runs: the control that the test can fail. Its TTFT and queue samples
  must include the wait; timed from the handler (what the histogram measured before) they would not.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import urllib.request

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from eaglenest.config import EaglenestConfig
from eaglenest.serve.arrival import PROXY_CALLBACK, proxy_stamps

STREAMS = 128
MODEL, NARROW = "ttft-load", "narrow"
MAX_TOKENS = 32
HOLD_S = 3.0
READ_LAG_S = 0.1  # how late a client busy sending other requests may read a chunk the server already sent
TAG = "x-test-stream"
HISTOGRAMS = ("ray_eaglenest_serve_ttft_seconds", "ray_eaglenest_serve_queue_seconds")
PROMPTS = ["Hello! Who are you?", "Write a short poem about the sea.", "What is 12 times 7? Explain briefly.",
           "List three colors."]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def urls(ray_session, tiny_target_path):
    from eaglenest.serve.cli import AppSpec, start_apps, stop_serve

    def cfg(**serve) -> EaglenestConfig:
        return EaglenestConfig.model_validate({
            "target": {"model": str(tiny_target_path), "device": "cpu", "dtype": "float32"},
            "serve": {"num_cpus_per_replica": 0.25, "max_tokens_limit": MAX_TOKENS, "max_prompt_tokens": 64,
                      **serve}})

    apps = [AppSpec(cfg(model_name=MODEL, max_concurrent_requests=STREAMS), None, "ttft", "/"),
            AppSpec(cfg(model_name=NARROW, max_concurrent_requests=1), None, "narrow", "/narrow")]
    yield dict(zip(("load", "narrow"), start_apps(apps, port=_free_port()), strict=True))
    stop_serve()


@pytest.fixture(scope="module")
def metrics_port(ray_session) -> int:
    from eaglenest.ray_private import metrics_export_port

    return metrics_export_port()


def _histograms(port: int, model: str) -> dict[str, dict[str, float]]:
    """``{metric: {le | "sum" | "count": value}}`` of ``model``, summed over series."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, dict[str, float]] = {m: {} for m in HISTOGRAMS}
    for fam in text_string_to_metric_families(text):
        if fam.name not in HISTOGRAMS:
            continue
        for s in fam.samples:
            if s.labels.get("model") != model:
                continue
            key = s.labels["le"] if s.name.endswith("_bucket") else s.name.rsplit("_", 1)[1]
            out[fam.name][key] = out[fam.name].get(key, 0.0) + s.value
    return out


def _exported(port: int, model: str, count: float) -> dict[str, dict[str, float]]:
    """Scrape until both histograms of ``model`` count ``count`` samples (Ray exports every few seconds)."""
    deadline = time.monotonic() + 60
    while True:
        h = _histograms(port, model)
        if all(h[m].get("count", 0) >= count for m in HISTOGRAMS) or time.monotonic() > deadline:
            return h
        time.sleep(1)


def _midpoint(value: float, bounds: list[float]) -> float:
    """What Ray's exporter adds to a histogram's ``_sum`` for ``value``: its bucket's midpoint (Ray 2.60 rebuilds
    the sum from bucket counts, ray:_private/telemetry/open_telemetry_metric_recorder.py)."""
    for i, b in enumerate(bounds):
        if value <= b:
            return (b + (bounds[i - 1] if i else 0.0)) / 2
    return bounds[-1] * 2


def _bounds(hist: dict[str, float]) -> list[float]:
    return sorted(float(k) for k in hist if k not in ("sum", "count", "+Inf"))


def _bucket(hist: dict[str, float]) -> tuple[float, float]:
    """The (lower, upper] bucket of a histogram delta that holds one sample."""
    lower = 0.0
    for bound, key in sorted((float(k), k) for k in hist if k not in ("sum", "count", "+Inf")):
        if hist[key] >= 1:
            return lower, bound
        lower = bound
    return lower, float("inf")


def _deltas(after: dict, before: dict) -> tuple[dict[str, float], dict[str, float]]:
    """(TTFT, queue) histogram deltas."""
    ttft, queue = ({k: v - before[m].get(k, 0.0) for k, v in after[m].items()} for m in HISTOGRAMS)
    return ttft, queue


class Streams:
    """``n`` concurrent streams through one official client, a connection per stream kept alive between rounds (the
    first round opens them, so a measured round times requests, not TCP handshakes)."""

    def __init__(self, base: str, n: int) -> None:
        self.n = n
        self.sent: dict[str, float] = {}
        http = httpx.AsyncClient(limits=httpx.Limits(max_connections=n, max_keepalive_connections=n), timeout=300,
                                 event_hooks={"request": [self._trace]})
        self.client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, http_client=http)

    async def _trace(self, request: httpx.Request) -> None:
        """Note when the request's headers go to the socket (httpcore's trace extension)."""
        tag = request.headers[TAG]

        async def trace(event: str, info: dict) -> None:
            if event == "http11.send_request_headers.started":
                self.sent[tag] = time.perf_counter()

        request.extensions["trace"] = trace

    async def round(self) -> tuple[list[float], list[float]]:
        """Per stream: (first chunk - headers sent, headers sent - ``create()`` called)."""
        start = asyncio.Event()

        async def one(i: int) -> tuple[float, float]:
            await start.wait()
            tag = f"{id(start)}-{i}"
            called = time.perf_counter()
            stream = await self.client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                max_tokens=MAX_TOKENS, temperature=0, stream=True, extra_body={"ignore_eos": True},
                extra_headers={TAG: tag})
            first = None
            async for chunk in stream:
                if first is None and chunk.choices:
                    first = time.perf_counter()
            assert first is not None
            return first - self.sent[tag], self.sent[tag] - called

        tasks = [asyncio.create_task(one(i)) for i in range(self.n)]
        await asyncio.sleep(0)
        start.set()
        done = await asyncio.gather(*tasks)
        return [a for a, _ in done], [b for _, b in done]


def test_the_tests_ray_stamps_arrivals_at_the_proxy():
    """The environment the tests start Ray with names the proxy callback, as `eaglenest serve`'s does."""
    from eaglenest.serve.cli import RAY_ENV_DEFAULTS

    assert proxy_stamps() and PROXY_CALLBACK in RAY_ENV_DEFAULTS.values()


def test_ttft_histogram_matches_the_clients_under_128_streams(urls, metrics_port):
    async def run() -> tuple[dict, tuple[list[float], list[float]], dict, float]:
        streams = Streams(urls["load"], STREAMS)
        try:
            await streams.round()  # opens the connections, warms the decoder
            before = await asyncio.to_thread(_exported, metrics_port, MODEL, STREAMS)
            t0 = time.perf_counter()
            measured = await streams.round()
            wall = time.perf_counter() - t0
        finally:
            await streams.client.close()
        after = await asyncio.to_thread(_exported, metrics_port, MODEL, 2 * STREAMS)
        return before, measured, after, wall

    before, (client_ttft, client_own), after, wall = asyncio.run(run())
    ttft, queue = _deltas(after, before)
    assert ttft["count"] == STREAMS and queue["count"] == STREAMS, (ttft, queue)
    client_mean = sum(client_ttft) / STREAMS
    bounds = _bounds(ttft)
    client_binned = sum(_midpoint(c, bounds) for c in client_ttft) / STREAMS
    server_mean = ttft["sum"] / STREAMS  # Ray's sum: bucket midpoints, so the clients' mean is binned alike
    handler_mean = (ttft["sum"] - queue["sum"]) / STREAMS
    report = (f"client TTFT from the wire: mean {client_mean:.3f} s, binned as Ray sums {client_binned:.3f} s (min "
              f"{min(client_ttft):.3f}, max {max(client_ttft):.3f}); histogram mean {server_mean:.3f} s "
              f"({server_mean / client_binned - 1:+.1%}); queue before the handler {queue['sum'] / STREAMS:.3f} s, "
              f"so from the handler {handler_mean:.3f} s ({handler_mean / client_binned - 1:+.1%}); the client's own "
              f"time before sending: mean {sum(client_own) / STREAMS:.3f} s; round {wall:.1f} s")
    print(report)
    print("le: histogram, clients", {le: (int(n), sum(c <= float(le) for c in client_ttft)) for le, n in ttft.items()
                                     if le not in ("sum", "count")})
    # Two estimates of the clients' mean, each off from the histogram's by binning in its own way: binned alike, a
    # batch of 16 the server finished just under a bound and the clients read just over it moves the clients' mean
    # by a whole bucket (a CI run: -12.0 % binned, -1.9 % against the raw mean); raw, the histogram's midpoints
    # stand for values anywhere in their buckets. Agreement with either within 10 % passes; timed from the handler,
    # the histogram misses both (-24 % / -15 % in that run), and /narrow's test below is the control of that.
    assert (server_mean == pytest.approx(client_binned, rel=0.10)
            or server_mean == pytest.approx(client_mean, rel=0.10)), report
    slack = STREAMS // 20
    for le, count in ttft.items():
        if le in ("sum", "count", "+Inf"):
            continue
        lo = sum(c <= float(le) / 1.1 for c in client_ttft) - slack
        hi = sum(c <= float(le) / 0.9 + READ_LAG_S for c in client_ttft) + slack
        assert lo <= count <= hi, f"le={le}: histogram {count:.0f}, clients allow {lo}..{hi}; {report}"
    assert 0 < queue["sum"] < ttft["sum"], report


def test_time_waiting_in_serves_router_counts(urls, metrics_port):
    """Five requests with unfinished bodies fill the narrow replica's places; a stream sent then waits at the proxy
    for HOLD_S before its handler runs, and both its TTFT and its queue sample include that wait."""
    before = _histograms(metrics_port, NARROW)
    port = int(urls["narrow"].rsplit(":", 1)[1].split("/")[0])
    holders = []
    for _ in range(5):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"POST /narrow/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 64\r\n\r\n{")
        holders.append(s)
    time.sleep(2.0)  # they reach the replica, which waits for their bodies
    client = openai.OpenAI(base_url=f"{urls['narrow']}/v1", api_key="none", max_retries=0, timeout=120)
    seen: dict[str, float] = {}

    def stream() -> None:
        t0 = time.perf_counter()
        for chunk in client.chat.completions.create(model=NARROW, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=4, temperature=0, stream=True):
            if chunk.choices and "first" not in seen:
                seen["first"] = time.perf_counter() - t0

    waiting = threading.Thread(target=stream)
    waiting.start()
    time.sleep(HOLD_S)
    for s in holders:  # the bodies end as invalid JSON: five quick 400s free the places
        s.sendall(b"x" * 63)
        assert b" 400 " in s.recv(4096).split(b"\r\n", 1)[0]
        s.close()
    waiting.join(timeout=60)
    ttft, queue = _deltas(_exported(metrics_port, NARROW, before[HISTOGRAMS[0]].get("count", 0) + 1), before)
    assert ttft["count"] == queue["count"] == 1, (ttft, queue)
    (t_lo, t_hi), (q_lo, q_hi) = _bucket(ttft), _bucket(queue)
    report = f"client TTFT {seen['first']:.3f} s; histogram TTFT in ({t_lo}, {t_hi}], queue in ({q_lo}, {q_hi}]"
    print(report)
    assert seen["first"] >= HOLD_S - 0.5, report
    assert q_lo >= HOLD_S - 1.0, report  # the wait at the proxy, where the handler could not see it
    assert t_lo < 1.1 * seen["first"] and t_hi >= 0.9 * seen["first"], report  # within 10 % of the client's
