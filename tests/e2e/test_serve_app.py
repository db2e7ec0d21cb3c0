"""The serve app on a live Ray Serve (127.0.0.1, free port), exercised with the official openai client.

One Serve instance, three applications (started once for the module):
- ``/``        the tiny target + an exported EAGLE-3 drafter (speculative path), default limits;
- ``/strict``  plain target, API key, max 1 concurrent request, short prompt and max_tokens limits;
- ``/sick``    the drafter with an unreachable self-test minimum: the replica must report unhealthy and say why.
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
from serve_helpers import make_drafter

from eaglenest.config import EaglenestConfig
from eaglenest.engines.base import SamplingParams

API_KEY = "sk-eaglenest-test"
PROMPTS = [
    "Hello! Who are you?",
    "Write a short poem about the sea.",
    "What is 12 times 7? Explain briefly.",
    "List three colors.",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cfg(target, **serve) -> EaglenestConfig:
    return EaglenestConfig.model_validate({"target": {"model": str(target), "device": "cpu", "dtype": "float32"},
                                           "serve": {"num_cpus_per_replica": 0.25, **serve}})


@pytest.fixture(scope="module")
def served(ray_session, tiny_target_path, tmp_path_factory):
    from eaglenest.serve.cli import AppSpec, start_apps, stop_serve

    drafter = make_drafter(tmp_path_factory.mktemp("serve") / "drafter", tiny_target_path)
    t = tiny_target_path
    apps = [
        AppSpec(_cfg(t, max_tokens_limit=64, baseline_tokens_per_s=50.0), str(drafter), "main", "/"),
        AppSpec(_cfg(t, model_name="strict", api_key=API_KEY, max_concurrent_requests=1, max_prompt_tokens=32,
                     max_tokens_limit=24), None, "strict", "/strict"),
        AppSpec(_cfg(t, model_name="sick", self_test_min_accept_length=4.5), str(drafter), "sick", "/sick"),
    ]
    urls = start_apps(apps, port=_free_port())  # the three replicas start in parallel
    yield {**dict(zip(("main", "strict", "sick"), urls, strict=True)), "drafter_path": drafter}
    stop_serve()


def _client(url: str, key: str = "none", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120, **kw)


def _greedy(engine, messages=None, prompt_ids=None, max_tokens=48, stop=()):
    sp = SamplingParams(temperature=0.0, max_new_tokens=max_tokens, stop=tuple(stop))
    if prompt_ids is None:
        prompt_ids = engine.render_prompt(messages)
    return engine.generate_ids([prompt_ids], sp)[0]


def test_models_and_health(served):
    assert [m.id for m in _client(served["main"]).models.list().data] == ["eaglenest"]
    health = httpx.get(f"{served['main']}/health", timeout=30).json()
    assert health["status"] == "ok" and health["speculative"] is True and health["algorithm"] == "EAGLE3"
    assert health["self_test"]["ok"] is True and health["self_test"]["accept_length"] >= 1.0


@pytest.mark.parametrize("stream", [False, True])
def test_chat_greedy_matches_the_engine(served, tiny_engine, stream):
    client = _client(served["main"])
    for prompt in PROMPTS[:2]:
        messages = [{"role": "user", "content": prompt}]
        want = _greedy(tiny_engine, messages)
        if stream:
            chunks = list(client.chat.completions.create(model="eaglenest", messages=messages, temperature=0,
                                                         max_tokens=48, stream=True,
                                                         stream_options={"include_usage": True}))
            assert chunks[0].choices[0].delta.role == "assistant"
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            usage = chunks[-1].usage
            assert chunks[-1].choices == [] and finish == [want.finish_reason]
        else:
            r = client.chat.completions.create(model="eaglenest", messages=messages, temperature=0, max_tokens=48)
            text, usage = r.choices[0].message.content, r.usage
            assert r.choices[0].finish_reason == want.finish_reason
        assert text == want.text
        assert usage.completion_tokens == len(want.token_ids)
        assert usage.prompt_tokens == len(tiny_engine.render_prompt(messages))
        spec = usage.model_extra["spec"]
        assert set(spec) == {"accept_length", "draft_tokens", "accepted_tokens"}
        assert spec["accept_length"] >= 1.0 and spec["draft_tokens"] > 0  # the drafter proposed tokens
        assert 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_greedy_matches_the_engine(served, tiny_engine, stream):
    client = _client(served["main"])
    prompt = "The answer is"
    want = _greedy(tiny_engine, prompt_ids=tiny_engine.tokenizer.encode(prompt), max_tokens=32)
    if stream:
        chunks = list(client.completions.create(model="eaglenest", prompt=prompt, temperature=0, max_tokens=32,
                                                stream=True))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == want.finish_reason
    else:
        r = client.completions.create(model="eaglenest", prompt=prompt, temperature=0, max_tokens=32)
        text = r.choices[0].text
        assert r.usage.completion_tokens == len(want.token_ids) and r.usage.model_extra["spec"]["draft_tokens"] > 0
    assert text == want.text


def _stop_string(text: str) -> str:
    """A word of ``text`` whose first occurrence is past the start: stopping on it must cut a non-empty answer short."""
    for word in text.split()[1:]:
        if text.index(word) > 0:
            return word
    raise AssertionError(f"no word to stop on in {text!r}")


def test_ignore_eos_extension(served, tiny_engine):
    """``ignore_eos`` (as in vLLM and SGLang): exactly max_tokens tokens, the engine's greedy path past its EOS."""
    convs = [[{"role": "user", "content": p}] for p in PROMPTS]
    stopping = [m for m in convs if _greedy(tiny_engine, m, max_tokens=64).finish_reason == "stop"]
    assert stopping, "the tiny target should end some answers with <|end|> within 64 tokens"
    messages = stopping[0]
    sp = SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True)
    want = tiny_engine.generate_ids([tiny_engine.render_prompt(messages)], sp)[0]
    r = _client(served["main"]).chat.completions.create(model="eaglenest", messages=messages, temperature=0,
                                                        max_tokens=64, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 64 and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content == want.text


def test_stop_sequences(served, tiny_engine):
    """The stop string comes from the unstopped answer itself, so it cuts whatever the tiny target's weights say."""
    messages = [{"role": "user", "content": PROMPTS[2]}]
    full = _greedy(tiny_engine, messages)
    stop = _stop_string(full.text)
    want = _greedy(tiny_engine, messages, stop=(stop,))
    assert want.finish_reason == "stop" and full.text.startswith(want.text) and len(want.text) < len(full.text)
    for stream in (False, True):
        r = _client(served["main"]).chat.completions.create(model="eaglenest", messages=messages, temperature=0,
                                                            max_tokens=48, stop=[stop], stream=stream)
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert chunks[-1].choices[0].finish_reason == "stop"
        else:
            text = r.choices[0].message.content
            assert r.choices[0].finish_reason == "stop"
        assert text == want.text and stop not in text


ERROR_CASES = [
    # (body or raw, status, param)
    ({"model": "eaglenest"}, 400, "messages"),
    ({"model": "eaglenest", "messages": "hi"}, 400, "messages"),
    ({"model": "eaglenest", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": "eaglenest", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ({"model": "eaglenest", "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
    ({"model": "eaglenest", "messages": [{"role": "user", "content": "hi"}], "n": 3}, 400, "n"),
    ({"model": "eaglenest", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, 400, "max_tokens"),
    ({"model": "eaglenest", "messages": [{"role": "user", "content": "hi"}], "bogus": True}, 400, "bogus"),
    ({"model": "eaglenest", "messages": []}, 400, "messages"),
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    (b"{not json", 400, None),
]


def _assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("body,status,param", ERROR_CASES)
def test_bad_requests_get_openai_errors(served, body, status, param):
    url = f"{served['main']}/v1/chat/completions"
    if isinstance(body, bytes):
        resp = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        resp = httpx.post(url, json=body, timeout=30)
    _assert_error(resp, status, param)


def test_unknown_routes_and_the_client_view_of_errors(served):
    _assert_error(httpx.get(f"{served['main']}/v1/nope", timeout=30), 404)
    _assert_error(httpx.get(f"{served['main']}/v1/chat/completions", timeout=30), 405)
    client = _client(served["main"])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="eaglenest", prompt="hi", temperature=5)
    with pytest.raises(openai.BadRequestError, match="prompt"):
        client.completions.create(model="eaglenest", prompt={"not": "a prompt"})


def test_api_key(served):
    url = served["strict"]
    with pytest.raises(openai.AuthenticationError, match="Incorrect API key"):
        _client(url, "wrong-key").chat.completions.create(model="strict", messages=[{"role": "user", "content": "hi"}],
                                                          max_tokens=4)
    body = {"model": "strict", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    _assert_error(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30), 401)
    _assert_error(httpx.get(f"{url}/v1/models", timeout=30), 401)
    _assert_error(httpx.get(f"{url}/v1/models", headers={"Authorization": "Basic abc"}, timeout=30), 401)
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # probes need no key
    r = _client(url, API_KEY).chat.completions.create(model="strict", messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=4, temperature=0)
    assert r.usage.completion_tokens >= 1
    assert r.usage.model_extra["spec"] == {"accept_length": 1.0, "draft_tokens": 0, "accepted_tokens": 0}


def test_prompt_over_the_context_is_400_context_length_exceeded(served):
    """What OpenAI, vLLM and SGLang answer, and what clients' truncation fallbacks key on."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "strict", "messages": [{"role": "user", "content": "word " * 200}], "max_tokens": 4}
    err = _assert_error(httpx.post(f"{served['strict']}/v1/chat/completions", json=body, headers=headers,
                                   timeout=30), 400, "messages")
    assert err["code"] == "context_length_exceeded" and "serve.max_prompt_tokens" in err["message"]
    with pytest.raises(openai.BadRequestError) as info:
        _client(served["strict"], API_KEY).chat.completions.create(
            model="strict", messages=[{"role": "user", "content": "word " * 200}], max_tokens=4)
    assert info.value.code == "context_length_exceeded" and "maximum context length" in info.value.message
    body = {"model": "strict", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 25}
    _assert_error(httpx.post(f"{served['strict']}/v1/chat/completions", json=body, headers=headers, timeout=30), 400,
                  "max_tokens")


def test_over_the_concurrency_limit_is_429(served):
    """max_concurrent_requests 1: of 8 simultaneous streams some are refused with 429, the rest complete."""
    client = _client(served["strict"], API_KEY)
    results: list[object] = []
    barrier = threading.Barrier(8)

    def one():
        barrier.wait()
        try:
            chunks = list(client.chat.completions.create(
                model="strict", messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=24, temperature=0,
                stream=True))
            results.append(chunks[-1].choices[0].finish_reason)
        except openai.RateLimitError as e:
            results.append(e)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    done = [r for r in results if r in ("stop", "length")]
    assert len(results) == 8 and len(refused) + len(done) == 8, results
    assert refused and done
    assert "max_concurrent_requests" in str(refused[0])
    assert int(refused[0].response.headers["retry-after"]) >= 1


def test_64_concurrent_streams_complete(served, tiny_engine):
    want = {p: _greedy(tiny_engine, [{"role": "user", "content": p}], max_tokens=24).text for p in PROMPTS}

    async def run() -> list[tuple[str, str, str | None]]:
        client = openai.AsyncOpenAI(base_url=f"{served['main']}/v1", api_key="none", max_retries=0, timeout=300)

        async def one(i: int) -> tuple[str, str, str | None]:
            prompt = PROMPTS[i % len(PROMPTS)]
            stream = await client.chat.completions.create(
                model="eaglenest", messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=0,
                stream=True)
            parts, finish = [], None
            async for c in stream:
                if c.choices:
                    parts.append(c.choices[0].delta.content or "")
                    finish = c.choices[0].finish_reason or finish
            return prompt, "".join(parts), finish

        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await client.close()

    t0 = time.perf_counter()
    results = asyncio.run(run())
    assert len(results) == 64
    for prompt, text, finish in results:
        assert finish in ("stop", "length")
        assert text == want[prompt]  # batched speculative decoding keeps every greedy answer exact
    assert time.perf_counter() - t0 < 180


def test_failed_self_test_reports_unhealthy(served):
    resp = httpx.get(f"{served['sick']}/health", timeout=30)
    err = _assert_error(resp, 503)
    assert "self_test_min_accept_length 4.5" in err["message"] and "preflight" in err["message"]
    assert resp.json()["self_test"]["ok"] is False
    with pytest.raises(openai.InternalServerError, match="unhealthy"):
        _client(served["sick"]).chat.completions.create(model="sick", messages=[{"role": "user", "content": "hi"}])


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def test_metrics_endpoint_has_accept_length_and_ttft(served, ray_session):
    # some traffic (ok and failing), then scrape Ray's metrics agent on this node
    _client(served["main"]).chat.completions.create(model="eaglenest", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=8, temperature=0)
    # the baseline app (no drafter) generates too, but must not report an accept length (1.0 = "bypassed" alert)
    _client(served["strict"], API_KEY).chat.completions.create(
        model="strict", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)
    for body in ({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, {"model": "eaglenest"},
                 {"model": "eaglenest", "messages": [{"role": "user", "content": "hi"}], "n": 2}):
        assert httpx.post(f"{served['main']}/v1/chat/completions", json=body, timeout=30).status_code >= 400
    port = ray_session.nodes()[0]["MetricsExportPort"]
    from eaglenest.serve.metrics import METRIC_NAMES

    suffix = {"eaglenest_serve_accept_length": "_bucket", "eaglenest_serve_ttft_seconds": "_bucket",
              "eaglenest_serve_queue_seconds": "_bucket",
              "eaglenest_serve_inter_token_latency_seconds": "_bucket", "eaglenest_serve_generated_tokens": "_total",
              "eaglenest_serve_draft_tokens_proposed": "_total", "eaglenest_serve_draft_tokens_accepted": "_total"}
    # every model-tagged series of the main app (accepted drafts may legitimately be 0 with a random drafter)
    wanted = [f"ray_{n}{suffix.get(n, '')}{{" for n in METRIC_NAMES
              if n not in ("eaglenest_serve_requests", "eaglenest_serve_draft_tokens_accepted")]
    deadline, text = time.monotonic() + 90, ""
    while time.monotonic() < deadline:
        text = _scrape(port)
        lines = text.splitlines()
        have = all(any(line.startswith(w) and 'model="eaglenest"' in line for line in lines) for w in wanted)
        sick = [ln for ln in lines if ln.startswith("ray_eaglenest_serve_replica_healthy{") and 'model="sick"' in ln]
        main = [ln for ln in lines if ln.startswith("ray_eaglenest_serve_replica_healthy{")
                and 'model="eaglenest"' in ln]
        requests = [ln for ln in lines if ln.startswith("ray_eaglenest_serve_requests_total{")]
        statuses = {s for ln in requests for s in ("200", "400", "401", "404", "413", "422", "429", "503")
                    if f'status="{s}"' in ln}
        baseline = [ln for ln in lines if ln.startswith("ray_eaglenest_serve_generated_tokens_total{")
                    and 'model="strict"' in ln]
        # each status series is exported on its own schedule: wait for all of them, not only the first
        if have and sick and main and baseline and {"200", "400", "404"} <= statuses:
            break
        time.sleep(2)
    else:
        families = sorted({ln.split("{")[0] for ln in text.splitlines() if ln.startswith("ray_eaglenest_serve")})
        missing = [w for w in wanted if not any(ln.startswith(w) and 'model="eaglenest"' in ln for ln in lines)]
        pytest.fail(f"metrics missing after 90 s: {missing}, healthy gauges sick={sick} main={main}, "
                    f"request statuses {sorted(statuses)}; eaglenest families seen: {families}")
    assert float(sick[-1].rsplit(" ", 1)[1]) == 0.0 and float(main[-1].rsplit(" ", 1)[1]) == 1.0
    assert not [ln for ln in lines if ln.startswith("ray_eaglenest_serve_accept_length") and 'model="strict"' in ln]
    assert any('route="/v1/chat/completions"' in ln for ln in requests)


# ------------------------------------------------------------------------- OpenAI compatibility (issue #13)
WEATHER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
WEATHER_Q = [{"role": "user", "content": "What is the weather in paris?"}]


def _raw_output(engine, messages, tools=None, max_tokens=48):
    """The engine's greedy output with special tokens kept (the markers the server parses)."""
    from eaglenest.engines.base import render_chat_ids

    ids = render_chat_ids(engine.tokenizer, messages, tools=tools, add_generation_prompt=True)
    g = _greedy(engine, prompt_ids=ids, max_tokens=max_tokens)
    return g, engine.tokenizer.decode(g.token_ids, skip_special_tokens=False), len(ids)


def test_tool_call_round_trip(served, tiny_engine):
    """The tiny target learned (from its corpus) to answer a weather question with a get_weather call; the server
    must return that call as tool_calls (streamed and not) and render the client's tool turn back exactly."""
    import json
    import re

    from eaglenest.engines.base import render_chat_ids

    g, raw, _ = _raw_output(tiny_engine, WEATHER_Q, WEATHER_TOOLS)
    bodies = re.findall(r"<tool_call>(.*?)</tool_call>", raw, flags=re.S)
    assert bodies, f"the tiny target no longer calls get_weather on its corpus' weather question: {raw!r}"
    want = [(json.loads(b)["name"], json.loads(b)["arguments"]) for b in bodies]
    client = _client(served["main"])
    r = client.chat.completions.create(model="eaglenest", messages=WEATHER_Q, tools=WEATHER_TOOLS, temperature=0,
                                       max_tokens=48)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and not msg.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == want
    assert all(c.type == "function" and c.id.startswith("call_") for c in msg.tool_calls)
    assert r.usage.completion_tokens == len(g.token_ids)

    calls: dict[int, dict] = {}
    finish = []
    for chunk in client.chat.completions.create(model="eaglenest", messages=WEATHER_Q, tools=WEATHER_TOOLS,
                                                temperature=0, max_tokens=48, stream=True):
        if not chunk.choices:
            continue
        for d in chunk.choices[0].delta.tool_calls or []:
            c = calls.setdefault(d.index, {"name": "", "arguments": ""})
            c["name"] += d.function.name or ""
            c["arguments"] += d.function.arguments or ""
        finish += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    assert finish == ["tool_calls"]
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == want

    # the client sends the call and its result back: the template must see the arguments as an object
    result = json.dumps({"city": want[0][1].get("city"), "celsius": 21})
    turn = WEATHER_Q + [msg.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": result}]
    r2 = client.chat.completions.create(model="eaglenest", messages=turn, tools=WEATHER_TOOLS, temperature=0,
                                        max_tokens=32)
    expected_turn = WEATHER_Q + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": n, "arguments": a}} for n, a in want]},
        {"role": "tool", "content": result}]
    ids = render_chat_ids(tiny_engine.tokenizer, expected_turn, tools=WEATHER_TOOLS, add_generation_prompt=True)
    assert r2.usage.prompt_tokens == len(ids)
    assert r2.usage.completion_tokens == len(_greedy(tiny_engine, prompt_ids=ids, max_tokens=32).token_ids)

    # without tools offered, the same output is not parsed into calls
    r3 = client.chat.completions.create(model="eaglenest", messages=WEATHER_Q, tools=WEATHER_TOOLS,
                                        tool_choice="none", temperature=0, max_tokens=48)
    assert r3.choices[0].message.tool_calls is None and r3.choices[0].finish_reason == g.finish_reason


def test_ignored_params_and_sampling_extensions(served, tiny_engine):
    """store / metadata / service_tier / reasoning_effort / user do not change decoding; top_k=1 and min_p=1 keep
    only the most likely token, so even at temperature 2 the answer is the greedy one."""
    messages = [{"role": "user", "content": PROMPTS[1]}]
    want = _greedy(tiny_engine, messages, max_tokens=32)
    client = _client(served["main"])
    r = client.chat.completions.create(model="eaglenest", messages=messages, temperature=0, max_tokens=32,
                                       store=True, metadata={"team": "eaglenest"}, service_tier="auto",
                                       reasoning_effort="low", user="u-1", parallel_tool_calls=False)
    assert r.usage.completion_tokens == len(want.token_ids)
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        r = client.chat.completions.create(model="eaglenest", messages=messages, temperature=2.0, max_tokens=32,
                                           seed=1, extra_body=extra)
        assert r.usage.completion_tokens == len(want.token_ids), extra
    r = client.chat.completions.create(model="eaglenest", messages=messages, temperature=2.0, max_tokens=32, seed=1)
    hot = client.chat.completions.create(model="eaglenest", messages=messages, temperature=2.0, max_tokens=32,
                                         seed=2)
    assert (r.usage.completion_tokens, r.choices[0].message.content) != (len(want.token_ids), want.text) or \
        (hot.usage.completion_tokens, hot.choices[0].message.content) != (len(want.token_ids), want.text)
    with pytest.raises(openai.BadRequestError, match="top_k"):
        client.chat.completions.create(model="eaglenest", messages=messages, extra_body={"top_k": -5})


def test_logprobs(served, tiny_engine):
    """One entry per generated token; greedy picks the most likely token, so it is its own top alternative."""
    messages = [{"role": "user", "content": PROMPTS[0]}]
    client = _client(served["main"])
    r = client.chat.completions.create(model="eaglenest", messages=messages, temperature=0, max_tokens=24,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0.0
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert e.top_logprobs[0].token == e.token and abs(e.top_logprobs[0].logprob - e.logprob) < 1e-5
    streamed = []
    for chunk in client.chat.completions.create(model="eaglenest", messages=messages, temperature=0, max_tokens=24,
                                                logprobs=True, top_logprobs=3, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    c = client.completions.create(model="eaglenest", prompt="The answer is", temperature=0, max_tokens=8, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == c.usage.completion_tokens
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_show_special_tokens_and_offsets_point_into_the_text(served, tiny_engine, stream):
    """Past its end of turn (``ignore_eos``) the tiny target writes ``<|end|><|bos|><|user|>``: the text skips them
    (special tokens), logprobs show them as vLLM does, and every ``text_offset`` still points into the text (vLLM's
    running sum of token lengths would shift everything after them by 22 characters)."""
    ids = tiny_engine.render_prompt([{"role": "user", "content": "List three colors."}])
    special = set(tiny_engine.tokenizer.all_special_tokens)
    kw = dict(model="eaglenest", prompt=ids, temperature=0, max_tokens=40, logprobs=1,
              extra_body={"ignore_eos": True})
    client = _client(served["main"])
    if stream:
        text, tokens, offsets = "", [], []
        for chunk in client.completions.create(stream=True, **kw):
            if chunk.choices:
                text += chunk.choices[0].text
                if chunk.choices[0].logprobs:
                    tokens += chunk.choices[0].logprobs.tokens
                    offsets += chunk.choices[0].logprobs.text_offset
    else:
        c = client.completions.create(**kw)
        text, tokens, offsets = c.choices[0].text, c.choices[0].logprobs.tokens, c.choices[0].logprobs.text_offset
    assert {"<|end|>", "<|user|>"} <= set(tokens) and "<|end|>" not in text  # the premise
    assert len(tokens) == len(offsets) == 40 and offsets == sorted(offsets)
    for tok, at in zip(tokens, offsets, strict=True):
        assert text[at:at + len(tok)] == tok or (tok in special and 0 <= at <= len(text)), (tok, at)
    assert "".join(t for t in tokens if t not in special) == text


def test_the_suite_table_through_the_served_api(served, tiny_engine):
    """The field's suites (the installed packages' real files) asked through the served API with the openai client:
    MT-Bench's second turns carry the served first answers, BFCL's tools go through (a prompt past the served limit
    is a counted 400, not a lost table), and the table pools each reply's ``usage.spec``; the reference decoder on
    the same prompts (``eaglenest eval --suite``) gives the same figures."""
    from eaglenest.config import SpecConfig
    from eaglenest.drafters.eagle3.model import load_drafter
    from eaglenest.engines.base import SamplingParams
    from eaglenest.speculative import evaluate_suites, evaluate_suites_served, load_suite, openai_ask
    from eaglenest.speculative.evaluate import prompt_ids
    from eaglenest.speculative.suite_report import suites_markdown

    suites = {n: load_suite(n, 3) for n in ("mt-bench", "humaneval", "bfcl")}
    too_long = {r["id"] for records, _ in suites.values() for r in records
                if len(prompt_ids(tiny_engine.tokenizer, {"messages": r["messages"], "tools": r.get("tools")})) > 1536}
    asked: list[tuple[list, dict, object]] = []
    base = openai_ask(_client(served["main"]), max_tokens=24)

    def ask(messages, record):
        reply = base(messages, record)
        asked.append((messages, record, reply))
        return reply

    doc = evaluate_suites_served(ask, suites, concurrency=2, endpoint=served["main"])
    first = {r["id"]: a.text for m, r, a in asked if len(m) == 1}
    followed = [(m, r) for m, r, _ in asked if len(m) > 1]
    assert followed and all(m[1] == {"role": "assistant", "content": first[r["id"]]} for m, r in followed)
    fitting = {n: ([r for r in records if r["id"] not in too_long], src) for n, (records, src) in suites.items()}
    for name, (records, _) in fitting.items():
        rep = doc["suites"][name]
        failed = sum(rep["failed_requests"].values())
        assert failed == len(suites[name][0]) - len(records)
        assert all("maximum context length" in k for k in rep["failed_requests"])
        assert rep["requests"] == len(records) + sum(len(r["followups"]) for r in records)
        assert rep["completion_tokens"] == sum(a.completion_tokens for _, r, a in asked if r["suite"] == name)
        assert rep["accept_length"] >= 1.0 and rep["per_position"] is None
    assert doc["suites"]["mt-bench"]["per_turn"]["turn 2"]["requests"] == len(followed)
    assert "| mt-bench | all | 6 |" in suites_markdown(doc)
    drafter = load_drafter(str(served["drafter_path"]), device="cpu", dtype=tiny_engine.dtype)
    ref = evaluate_suites(tiny_engine, drafter, fitting, SpecConfig(),
                          sampling=SamplingParams(temperature=0.0, max_new_tokens=24))
    for name in suites:
        assert doc["suites"][name]["completion_tokens"] == ref["suites"][name]["completion_tokens"]
        assert abs(doc["suites"][name]["accept_length"] - ref["suites"][name]["accept_length"]) < 0.02


def test_eval_cli_asks_a_running_serve(served, tmp_path, capsys):
    """``eaglenest eval --endpoint URL --suite ...``: the table of a deployment, written as suites.json/.md/.png; the
    mistakes a user makes with it are refused with the fix."""
    import json

    from eaglenest.cli import main as cli_main

    out = tmp_path / "served"
    assert cli_main(["eval", "--endpoint", served["main"], "--suite", "mt-bench,humaneval", "--num-prompts", "2",
                     "--max-new-tokens", "8", "--concurrency", "2", "--output", str(out)]) == 0
    doc = json.loads((out / "suites.json").read_text())
    assert doc["endpoint"] == served["main"] and doc["suites"]["mt-bench"]["requests"] == 4
    assert (out / "suites.png").stat().st_size > 10_000
    assert "| mt-bench | turn 2 | 2 | " in capsys.readouterr().out
    assert cli_main(["eval", "--endpoint", served["main"], "--prompts", "x.jsonl"]) == 2
    assert "--endpoint takes --suite" in capsys.readouterr().err
    assert cli_main(["eval", "--suite", "humaneval"]) == 2
    assert "give --target and --drafter (or --endpoint" in capsys.readouterr().err
    assert cli_main(["eval", "--endpoint", "http://127.0.0.1:9", "--suite", "humaneval", "--num-prompts", "1"]) == 2
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err
