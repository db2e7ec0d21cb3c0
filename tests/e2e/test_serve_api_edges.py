"""The API as real clients, operators and outside benchmark tools meet it (issue #30), on a live Ray Serve.

One application, two replicas (tiny target + an exported drafter), small body and prompt limits. Where the official
``openai`` client can send the input it is used; raw ``httpx`` sends what it cannot (bad JSON, wrong types,
oversized and chunked bodies, other content types).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from serve_helpers import make_drafter

from eaglenest.config import EaglenestConfig

MAX_BYTES = 64 * 1024
API_KEY = "sk-edges"
HI = [{"role": "user", "content": "hi"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cfg(target, **serve) -> EaglenestConfig:
    return EaglenestConfig.model_validate({
        "target": {"model": str(target), "device": "cpu", "dtype": "float32"},
        "serve": {"num_cpus_per_replica": 0.25, "max_tokens_limit": 64, "max_prompt_tokens": 64, **serve}})


@pytest.fixture(scope="module")
def apps(ray_session, tiny_target_path, tmp_path_factory):
    """``edges``: two replicas with a drafter and the default reasoning setting (off); ``thinking``: one baseline
    replica with ``serve.reasoning_parser: true`` and an API key; ``open``: an API key with /health's details and
    the docs made public."""
    from eaglenest.serve.cli import AppSpec, start_apps, stop_serve

    drafter = make_drafter(tmp_path_factory.mktemp("edges") / "drafter", tiny_target_path)
    specs = [AppSpec(_cfg(tiny_target_path, num_replicas=2, max_request_bytes=MAX_BYTES), str(drafter), "edges", "/"),
             AppSpec(_cfg(tiny_target_path, model_name="thinking", reasoning_parser=True, api_key=API_KEY), None,
                     "thinking", "/thinking"),
             AppSpec(_cfg(tiny_target_path, model_name="open", api_key=API_KEY, health_details_public=True,
                          docs_public=True), None, "open", "/open")]
    urls = start_apps(specs, port=_free_port())
    yield dict(zip(("edges", "thinking", "open"), urls, strict=True))
    stop_serve()


@pytest.fixture(scope="module")
def url(apps):
    return apps["edges"]


def _client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def _error(resp: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    """An OpenAI error body with ``status`` (never a plain-text 500)."""
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


# ------------------------------------------------------------------------------------------------------- seeds
@pytest.mark.parametrize("seed", [0, 2**44, 2**63 - 1, -(2**63), 2**64 - 1, -1])
def test_any_64_bit_seed_samples_deterministically(url, seed):
    client = _client(url)

    def sample() -> tuple[str, int]:
        r = client.chat.completions.create(model="eaglenest", messages=[{"role": "user", "content": "List three "
                                           "colors."}], temperature=1.0, max_tokens=16, seed=seed)
        return r.choices[0].message.content, r.usage.completion_tokens

    first = sample()
    assert first[1] >= 1 and sample() == first


def test_a_seed_outside_64_bits_is_400(url):
    with pytest.raises(openai.BadRequestError) as e:
        _client(url).chat.completions.create(model="eaglenest", messages=HI, seed=2**64, max_tokens=4)
    assert e.value.body["param"] == "seed"


# ------------------------------------------------------------------------------------------------- raw bodies
def _post(url: str, content: bytes | None = None, **kw) -> httpx.Response:
    headers = kw.pop("headers", {"content-type": "application/json"})
    return httpx.post(f"{url}/v1/chat/completions", content=content, headers=headers, timeout=60, **kw)


@pytest.mark.parametrize("depth", [1_000, 5_000, 30_000])
def test_deeply_nested_json_is_a_400_error_body(url, depth):
    nested = b'{"model": "eaglenest", "messages": [{"role": "user", "content": "hi"}], "metadata": {"a": ' + \
        b"[" * depth + b"]" * depth + b"}}"
    _error(_post(url, nested), 400, code="invalid_json")
    _error(_post(url, b"[" * depth + b"]" * depth), 400, code="invalid_json")


def test_a_body_over_max_request_bytes_is_413_before_parsing(url):
    big = json.dumps({"model": "eaglenest", "messages": [{"role": "user", "content": "x " * MAX_BYTES}]}).encode()
    err = _error(_post(url, big), 413, code="request_too_large")
    assert "serve.max_request_bytes" in err["message"]

    def chunks():  # no Content-Length: counted while it arrives
        yield big[:1000]
        yield big[1000:]

    _error(_post(url, chunks()), 413, code="request_too_large")
    # not JSON at all, but too large: refused by size, so it was never parsed
    _error(_post(url, b"{" * (MAX_BYTES + 1)), 413, code="request_too_large")
    with pytest.raises(openai.APIStatusError) as e:
        _client(url).chat.completions.create(model="eaglenest",
                                             messages=[{"role": "user", "content": "x " * MAX_BYTES}])
    assert e.value.status_code == 413 and e.value.code == "request_too_large"


@pytest.mark.parametrize("body,param", [
    ({"model": "eaglenest", "messages": HI, "stream": "yes"}, "stream"),
    ({"model": "eaglenest", "messages": HI, "max_tokens": 4.5}, "max_tokens"),
    ({"model": "eaglenest", "messages": HI, "temperature": "0"}, "temperature"),
    ({"model": "eaglenest", "messages": [{"role": "user"}]}, "messages"),
    ({"model": "eaglenest", "messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"model": "eaglenest", "messages": HI, "tools": [{"type": "function"}]}, "tools"),
    ({"model": "eaglenest", "messages": HI,
      "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools"),
    ({"model": "eaglenest", "messages": HI + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"model": "eaglenest", "messages": HI + [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function"}]}]},
     "messages[1].tool_calls[0].function"),
    ({"model": 7, "messages": HI}, "model"),
])
def test_wrong_types_are_400_naming_the_parameter(url, body, param):
    _error(_post(url, json.dumps(body).encode()), 400, param)


def test_the_client_sees_400_for_what_it_can_send(url):
    client = _client(url)
    with pytest.raises(openai.BadRequestError, match="needs content"):
        client.chat.completions.create(model="eaglenest", messages=[{"role": "user"}])
    with pytest.raises(openai.BadRequestError, match="function"):
        client.chat.completions.create(model="eaglenest", messages=HI, tools=[{"type": "function"}])
    bad_call = {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                     "function": {"name": "f", "arguments": "city=paris"}}]}
    with pytest.raises(openai.BadRequestError, match="not valid JSON"):
        client.chat.completions.create(model="eaglenest", messages=HI + [bad_call])


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_bodies_that_are_not_json_are_415(url, ctype):
    body = json.dumps({"model": "eaglenest", "messages": HI, "max_tokens": 2}).encode()
    _error(_post(url, body, headers={"content-type": ctype}), 415, code="unsupported_media_type")
    assert _post(url, body, headers={"content-type": "application/json; charset=utf-8"}).status_code == 200


def test_completions_context_error_names_prompt(url):
    err = _error(httpx.post(f"{url}/v1/completions", timeout=60,
                            json={"model": "eaglenest", "prompt": "word " * 200, "max_tokens": 4}), 400, "prompt")
    assert err["code"] == "context_length_exceeded" and "messages" not in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        _client(url).completions.create(model="eaglenest", prompt="word " * 200, max_tokens=4)
    assert e.value.code == "context_length_exceeded" and e.value.body["param"] == "prompt"


# ------------------------------------------------------------------------------------------------------ routes
def test_405_carries_allow(url):
    resp = httpx.get(f"{url}/v1/chat/completions", timeout=30)
    _error(resp, 405, code="method_not_allowed")
    assert "POST" in resp.headers["allow"]
    resp = httpx.post(f"{url}/v1/models", timeout=30)
    _error(resp, 405)
    assert "GET" in resp.headers["allow"]


def test_retrieve_a_model(url):
    client = _client(url)
    m = client.models.retrieve("eaglenest")
    assert (m.id, m.object, m.owned_by) == ("eaglenest", "model", "eaglenest")
    assert m.created == client.models.list().data[0].created
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    _error(httpx.get(f"{url}/v1/models/org/other-model", timeout=30), 404, "model", "model_not_found")


# --------------------------------------------------------------------------------------------------- reasoning
THINK_Q = [{"role": "user", "content": "What is 8 plus 24?"}]


def _raw(engine, messages, max_tokens=48) -> str:
    """The engine's greedy output with special tokens kept (the markers the server parses)."""
    from eaglenest.engines.base import SamplingParams, render_chat_ids

    ids = render_chat_ids(engine.tokenizer, messages, add_generation_prompt=True)
    g = engine.generate_ids([ids], SamplingParams(temperature=0.0, max_new_tokens=max_tokens))[0]
    return engine.tokenizer.decode(g.token_ids, skip_special_tokens=False)


def _without_special(engine, text: str, keep: tuple[str, ...] = ()) -> str:
    for marker in engine.tokenizer.all_special_tokens:
        if marker not in keep:
            text = text.replace(marker, "")
    return text


def _chat(client, model, stream=False, **kw) -> tuple[str | None, str | None]:
    """(content, reasoning_content) of one greedy answer, streamed deltas joined."""
    if not stream:
        m = client.chat.completions.create(model=model, messages=THINK_Q, temperature=0, **kw).choices[0].message
        return m.content, (m.model_extra or {}).get("reasoning_content")
    content, reasoning = None, None
    for chunk in client.chat.completions.create(model=model, messages=THINK_Q, temperature=0, stream=True, **kw):
        if chunk.choices:
            d = chunk.choices[0].delta
            if d.content:
                content = (content or "") + d.content
            r = (d.model_extra or {}).get("reasoning_content")
            if r:
                reasoning = (reasoning or "") + r
    return content, reasoning


def _split(engine) -> tuple[str | None, str]:
    """(content, reasoning) a reasoning parser makes of the greedy answer: the first block is reasoning (vLLM's and
    SGLang's parsers); later markers are special tokens, which content does not show."""
    raw = _raw(engine, THINK_Q)
    assert raw.startswith("<think>") and "</think>" in raw, f"the tiny target no longer reasons here: {raw!r}"
    reasoning, _, content = raw[len("<think>"):].partition("</think>")
    return _without_special(engine, content).lstrip() or None, reasoning


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_is_not_parsed_by_default(apps, tiny_engine, stream):
    """Off by default (as vLLM and SGLang without --reasoning-parser): content is the whole text, markers kept;
    SGLang's ``separate_reasoning: true`` turns it on for one request."""
    whole = _without_special(tiny_engine, _raw(tiny_engine, THINK_Q), keep=("<think>", "</think>"))
    assert whole.startswith("<think>")
    client = _client(apps["edges"])
    assert _chat(client, "eaglenest", stream, max_tokens=48) == (whole, None)
    assert _chat(client, "eaglenest", stream, max_tokens=48, extra_body={"separate_reasoning": True}) == \
        _split(tiny_engine)


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_parser_on(apps, tiny_engine, stream):
    """``serve.reasoning_parser: true``: the first block is reasoning_content, the rest content; a request's
    ``separate_reasoning: false`` turns it off again."""
    client = _client(apps["thinking"], API_KEY)
    assert _chat(client, "thinking", stream, max_tokens=48) == _split(tiny_engine)
    whole = _without_special(tiny_engine, _raw(tiny_engine, THINK_Q), keep=("<think>", "</think>"))
    assert _chat(client, "thinking", stream, max_tokens=48, extra_body={"separate_reasoning": False}) == (whole, None)


@pytest.mark.parametrize("stream", [False, True])
def test_an_unclosed_reasoning_block_is_all_reasoning(apps, tiny_engine, stream):
    """Cut before ``</think>``: everything after ``<think>`` is reasoning and content is null, as vLLM's deepseek_r1
    parser returns it."""
    raw = _raw(tiny_engine, THINK_Q, max_tokens=4)
    assert raw.startswith("<think>") and "</think>" not in raw, raw
    client = _client(apps["thinking"], API_KEY)
    assert _chat(client, "thinking", stream, max_tokens=4) == (None, raw[len("<think>"):])


# ------------------------------------------------------------------------------------- vLLM's counters on /metrics
SPEC = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def _scrape_vllm(url: str) -> dict:
    """The counters as a Prometheus client parses them from the serving port: {(name, position): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    resp = httpx.get(f"{url}/metrics", timeout=30)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(resp.text):
        if fam.name in SPEC + (PER_POS,):
            assert fam.type == "counter", fam
            for s in fam.samples:
                if s.name.endswith("_total"):
                    assert s.labels["model_name"] == "eaglenest", s
                    out[(s.name, s.labels.get("position"))] = s.value
    return out


def test_vllm_spec_decode_counters_match_usage_spec(url):
    """Scraped like ``vllm bench serve`` does (before and after a run): the deltas, summed over both replicas, give
    the drafted and accepted tokens and the accept length the responses' ``usage.spec`` report."""
    before = _scrape_vllm(url)
    assert {(f"{n}_total", None) for n in SPEC} <= set(before)
    positions = sorted(int(p) for n, p in before if n == f"{PER_POS}_total")
    assert positions == [0, 1, 2]  # serve.spec.num_steps

    async def run() -> list[dict]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)

        async def one(i: int) -> dict:
            messages = [{"role": "user", "content": ["Write a short poem about the sea.", "List three colors.",
                                                     "What is 12 times 7? Explain briefly."][i % 3]}]
            if i % 2:
                r = await client.chat.completions.create(model="eaglenest", messages=messages, max_tokens=48,
                                                         temperature=0)
                return r.usage.model_extra["spec"]
            usage = None
            async for c in await client.chat.completions.create(
                    model="eaglenest", messages=messages, max_tokens=48, temperature=0, stream=True,
                    stream_options={"include_usage": True}):
                usage = c.usage or usage
            return usage.model_extra["spec"]

        try:
            return await asyncio.gather(*(one(i) for i in range(16)))
        finally:
            await client.close()

    specs = asyncio.run(run())
    drafted, accepted = sum(s["draft_tokens"] for s in specs), sum(s["accepted_tokens"] for s in specs)
    assert drafted > 0
    deadline = time.monotonic() + 30
    while True:  # counts arrive a moment after the response (the store is updated without blocking it)
        after = _scrape_vllm(url)
        delta = {k: after[k] - before.get(k, 0.0) for k in after}
        if delta[(f"{SPEC[1]}_total", None)] >= drafted or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    drafts, d_tokens, d_accepted = (delta[(f"{n}_total", None)] for n in SPEC)
    assert (d_tokens, d_accepted) == (drafted, accepted)
    per_step = d_tokens / drafts  # num_draft_tokens - 1 on a chain
    assert per_step == 3
    steps = [s["draft_tokens"] / per_step for s in specs]
    for s, n in zip(specs, steps, strict=True):  # each response's accept length, from its own counts
        assert s["accept_length"] == pytest.approx(1 + s["accepted_tokens"] / n, abs=1e-4)
    assert drafts == sum(steps)
    assert 1 + d_accepted / drafts == pytest.approx(1 + accepted / sum(steps))
    per_pos = [delta[(f"{PER_POS}_total", str(k))] for k in positions]
    assert sum(per_pos) == d_accepted and per_pos == sorted(per_pos, reverse=True)
    # every replica answers /metrics with the same sums
    assert all(_scrape_vllm(url) == after for _ in range(6))


def test_metrics_route_is_empty_without_speculation(apps):
    """A baseline server exports no spec-decode series, as vLLM without a speculative config."""
    resp = httpx.get(f"{apps['thinking']}/metrics", timeout=30)  # no key needed, as vLLM's
    assert resp.status_code == 200 and "vllm:spec_decode" not in resp.text


# ------------------------------------------------------------------------------------------ what outsiders see
def test_with_an_api_key_health_and_docs_reveal_only_the_status(apps):
    url, auth = apps["thinking"], {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(f"{url}/health", timeout=30).json() == {"status": "ok"}  # a probe needs no key
    full = httpx.get(f"{url}/health", headers=auth, timeout=30).json()
    assert full["status"] == "ok" and full["model"] == "thinking" and "target" in full
    for path in ("/docs", "/openapi.json"):
        _error(httpx.get(f"{url}{path}", timeout=30), 401, code="invalid_api_key")
        _error(httpx.get(f"{url}{path}", headers={"Authorization": "Bearer wrong"}, timeout=30), 401)
    schema = httpx.get(f"{url}/openapi.json", headers=auth, timeout=30).json()
    assert "/v1/chat/completions" in schema["paths"]
    assert "swagger" in httpx.get(f"{url}/docs", headers=auth, timeout=30).text.lower()
    # without a key configured they stay open
    assert "/v1/chat/completions" in httpx.get(f"{apps['edges']}/openapi.json", timeout=30).json()["paths"]
    assert httpx.get(f"{apps['edges']}/health", timeout=30).json()["model"] == "eaglenest"


def test_health_details_and_docs_can_be_made_public(apps):
    """serve.health_details_public / serve.docs_public: the operator's choice, the generation routes keep the key."""
    url = apps["open"]
    health = httpx.get(f"{url}/health", timeout=30).json()
    assert health["status"] == "ok" and health["model"] == "open" and "self_test" in health
    assert "/v1/chat/completions" in httpx.get(f"{url}/openapi.json", timeout=30).json()["paths"]
    assert "swagger" in httpx.get(f"{url}/docs", timeout=30).text.lower()
    _error(httpx.get(f"{url}/v1/models", timeout=30), 401, code="invalid_api_key")


# ---------------------------------------------------------------------------------- schema-driven fuzzing (bounded)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
"""no 5xx, and every response one the schema documents: its status, its content type and its body's schema"""


def test_schema_driven_requests_never_get_a_5xx(url):
    """Schemathesis generates bodies, paths and headers from the served /openapi.json, valid and invalid (25 per
    operation, derandomized so a failure reproduces); none may get a 5xx. Half the bodies name the served model, so
    validation runs too, not only the 404 of an unknown model. (Its Python API, not its pytest plugin: the plugin's
    fixture mode does not run under pytest 9.)"""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    labels, statuses, ops = [], set(), {}
    for result in schema.get_all_operations():
        op = result.ok()
        labels.append(op.label)
        ops[op.label] = op

        @given(case=op.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)
        def fuzz(case) -> None:
            if isinstance(case.body, dict) and isinstance(case.body.get("model"), str) and \
                    len(case.body["model"]) % 2 == 0:
                case.body["model"] = "eaglenest"
            resp = case.call_and_validate(checks=CHECKS, timeout=120)
            statuses.add((case.operation.label, resp.status_code))

        fuzz()
    assert {"POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses",
            "GET /v1/models/{model_id}"} <= set(labels)
    # the fuzzing got past the model check into parameter validation on every generation route
    assert {("POST /v1/chat/completions", 400), ("POST /v1/completions", 400), ("POST /v1/responses", 400)} <= \
        statuses, statuses
    # and what valid requests get, which random bodies rarely are (no chat 200 among them): JSON and SSE answers
    # are checked against the document too
    chat = {"model": "eaglenest", "messages": HI, "max_tokens": 4}
    for label, case in (("POST /v1/chat/completions", {"body": chat}),
                        ("POST /v1/chat/completions", {"body": {**chat, "stream": True, "logprobs": True}}),
                        ("POST /v1/completions", {"body": {"model": "eaglenest", "prompt": "hi", "stream": True}}),
                        ("POST /v1/responses", {"body": {"model": "eaglenest", "input": "hi", "max_output_tokens": 4}}),
                        ("POST /v1/responses", {"body": {"model": "eaglenest", "input": "hi", "max_output_tokens": 4,
                                                         "stream": True}}),
                        ("GET /v1/models/{model_id}", {"path_parameters": {"model_id": "eaglenest"}})):
        resp = ops[label].Case(**case).call_and_validate(checks=CHECKS, timeout=120)
        assert resp.status_code == 200, (label, resp.status_code, resp.text[:300])
