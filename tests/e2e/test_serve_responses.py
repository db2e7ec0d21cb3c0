"""OpenAI's Responses API (``POST /v1/responses``) on a live Ray Serve, through the official ``openai`` client: its
typed response objects, its streaming helper (which checks the events' order and rebuilds the response from them),
function calls with their outputs sent back, reasoning items, and the 400s that name what this server cannot do.

One application: the tiny target with an exported EAGLE-3 drafter (speculative path). Every answer is checked
against the same request on ``/v1/chat/completions``, which its own tests check against the engine.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket

import httpx
import openai
import pytest
from serve_helpers import make_drafter

from eaglenest.config import EaglenestConfig

WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "current weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
WEATHER_Q = "What is the weather in paris?"
THINK_Q = "What is 8 plus 24?"
POEM_Q = "Write a short poem about the sea."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


GENERATION_PROMPT = "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
INSTANT = ("{% if add_generation_prompt %}{{ '<|assistant|>' }}{% if thinking is defined and not thinking %}"
           "{{ '<think></think>' }}{% endif %}{% endif %}")
"""Kimi-K2.5's switch to instant mode (``chat_template_kwargs: {"thinking": false}``: the generation prompt closes an
empty reasoning block), added to a copy of the tiny target's template"""


@pytest.fixture(scope="module")
def served(ray_session, tiny_target_path, tmp_path_factory):
    from eaglenest.serve.cli import AppSpec, start_apps, stop_serve

    root = tmp_path_factory.mktemp("responses")
    target = root / "target"
    shutil.copytree(tiny_target_path, target)
    template = (target / "chat_template.jinja").read_text()
    assert template.count(GENERATION_PROMPT) == 1, "the tiny target's generation prompt changed"
    (target / "chat_template.jinja").write_text(template.replace(GENERATION_PROMPT, INSTANT))
    drafter = make_drafter(root / "drafter", target)
    cfg = EaglenestConfig.model_validate({
        "target": {"model": str(target), "device": "cpu", "dtype": "float32"},
        "serve": {"num_cpus_per_replica": 0.25, "max_tokens_limit": 64}})
    (url,) = start_apps([AppSpec(cfg, str(drafter), "responses", "/")], port=_free_port())
    yield {"url": url, "target": target}
    stop_serve()


@pytest.fixture(scope="module")
def url(served) -> str:
    return served["url"]


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _chat(client, messages, extra: dict | None = None, **kw):
    return client.chat.completions.create(model="eaglenest", messages=messages, temperature=0,
                                          extra_body={"separate_reasoning": True, **(extra or {})}, **kw)


def test_a_text_answer_is_the_chat_answer(client):
    want = _chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": POEM_Q}],
                 max_tokens=24)
    r = client.responses.create(model="eaglenest", instructions="Be brief.", input=POEM_Q, temperature=0,
                                max_output_tokens=24)
    assert r.object == "response" and r.id.startswith("resp") and r.model == "eaglenest"
    assert r.output_text == want.choices[0].message.content
    assert [item.type for item in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.usage.input_tokens == want.usage.prompt_tokens and r.usage.output_tokens == want.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    spec = r.usage.model_extra["spec"]
    assert spec["draft_tokens"] > 0 and spec["accept_length"] >= 1.0, "the speculative path served it"
    assert want.choices[0].finish_reason == "stop" and r.status == "completed" and r.incomplete_details is None
    assert r.store is False, "nothing is stored"
    cut = client.responses.create(model="eaglenest", instructions="Be brief.", input=POEM_Q, temperature=0,
                                  max_output_tokens=4)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 4 and r.output_text.startswith(cut.output_text)


def test_the_streaming_helper_rebuilds_the_same_response(client):
    """The SDK's ``responses.stream`` checks each event against the response it accumulates (an item or content
    index out of order raises) and returns the final response. Cut at max_output_tokens, the stream ends with
    ``response.incomplete``, as OpenAI's does (the SDK's ``get_final_response`` wants ``response.completed``, so a
    client reads the last event's response)."""
    whole = client.responses.create(model="eaglenest", input=POEM_Q, temperature=0, max_output_tokens=12)
    kinds, deltas = [], []
    with client.responses.stream(model="eaglenest", input=POEM_Q, temperature=0, max_output_tokens=12) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = event.response
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.status == "incomplete" and final.usage.output_tokens == whole.usage.output_tokens


def test_a_function_call_and_its_output_round_trip(client):
    """The tiny target answers the weather question with a get_weather call (its corpus taught it): a function_call
    item, streamed or not; sending it back with a function_call_output renders the same prompt chat renders for the
    call and the tool message."""
    chat_tool = {"type": "function", "function": {k: WEATHER_TOOL[k] for k in ("name", "description", "parameters")}}
    want = _chat(client, [{"role": "user", "content": WEATHER_Q}], tools=[chat_tool], max_tokens=48)
    calls = want.choices[0].message.tool_calls
    assert calls, "the tiny target no longer calls get_weather on its corpus' weather question"
    r = client.responses.create(model="eaglenest", input=WEATHER_Q, tools=[WEATHER_TOOL], temperature=0,
                                max_output_tokens=48)
    got = [item for item in r.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in got] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in calls]
    assert r.status == "completed" and all(c.call_id.startswith("call_") for c in got)

    with client.responses.stream(model="eaglenest", input=WEATHER_Q, tools=[WEATHER_TOOL], temperature=0,
                                 max_output_tokens=48) as stream:
        done = [e.arguments for e in stream if e.type == "response.function_call_arguments.done"]
        final = stream.get_final_response()
    assert [json.loads(a) for a in done] == [json.loads(c.arguments) for c in got]
    assert [i.type for i in final.output] == [i.type for i in r.output]

    result = json.dumps({"city": "paris", "celsius": 21})
    back = client.responses.create(model="eaglenest", tools=[WEATHER_TOOL], temperature=0, max_output_tokens=16, input=[
        {"role": "user", "content": WEATHER_Q},
        *[{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments} for c in got],
        {"type": "function_call_output", "call_id": got[0].call_id, "output": result}])
    turn = [{"role": "user", "content": WEATHER_Q}, want.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": calls[0].id, "content": result}]
    again = _chat(client, turn, tools=[chat_tool], max_tokens=16)
    assert back.usage.input_tokens == again.usage.prompt_tokens
    assert back.output_text == (again.choices[0].message.content or "")


def test_reasoning_comes_back_as_a_reasoning_item(client):
    want = _chat(client, [{"role": "user", "content": THINK_Q}], max_tokens=48).choices[0].message
    reasoning = want.model_extra.get("reasoning_content")
    assert reasoning, "the tiny target no longer reasons on this question"
    r = client.responses.create(model="eaglenest", input=THINK_Q, temperature=0, max_output_tokens=48)
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text == reasoning
    assert r.output_text == (want.content or "")
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.stream(model="eaglenest", input=THINK_Q, temperature=0, max_output_tokens=48) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.reasoning_text.delta")
        final = stream.get_final_response()
    assert text == reasoning and [i.type for i in final.output] == [i.type for i in r.output]


def test_chat_template_kwargs_reach_the_template(served, client):
    """vLLM's and SGLang's ``chat_template_kwargs`` on both routes: ``thinking: false`` renders the prompt the
    template renders with that variable (the reasoning block closed in the generation prompt), and the answer is
    the one to that prompt; a variable the renderer sets itself is a 400 naming it."""
    from transformers import AutoTokenizer

    from eaglenest.engines.base import render_chat_ids

    tok = AutoTokenizer.from_pretrained(served["target"])
    question = [{"role": "user", "content": THINK_Q}]
    instant = render_chat_ids(tok, question, add_generation_prompt=True, template_kwargs={"thinking": False})
    assert len(instant) > len(render_chat_ids(tok, question, add_generation_prompt=True))
    on = _chat(client, question, max_tokens=48)
    off = _chat(client, question, max_tokens=48, extra={"chat_template_kwargs": {"thinking": False}})
    assert off.usage.prompt_tokens == len(instant) > on.usage.prompt_tokens
    assert off.choices[0].message != on.choices[0].message, "another prompt, another greedy answer"
    r = client.responses.create(model="eaglenest", input=THINK_Q, temperature=0, max_output_tokens=48,
                                extra_body={"chat_template_kwargs": {"thinking": False}})
    assert r.usage.input_tokens == len(instant) and r.output_text == (off.choices[0].message.content or "")
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, [{"role": "user", "content": THINK_Q}], max_tokens=4,
              extra={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert e.value.body["param"] == "chat_template_kwargs.add_generation_prompt"


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "hi", "max_output_tokens": 1000}, "max_output_tokens"),
    ({"input": "hi", "frobnicate": 1}, "frobnicate"),
    ({"input": "hi", "messages": [{"role": "user", "content": "other"}]}, "messages"),  # chat's, not this API's
    ({"input": "hi", "max_tokens": 4}, "max_tokens"),
    ({"input": 3}, "input"),
])
def test_what_the_server_cannot_do_is_a_400_naming_it(url, body, param):
    resp = httpx.post(f"{url}/v1/responses", json={"model": "eaglenest", **body}, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_an_agent_of_openais_agents_sdk_calls_its_tool_and_answers(url):
    """A real agent framework over this server: OpenAI's Agents SDK (its Responses model, streamed and not) runs the
    loop, the model calls the Python tool, the SDK sends the result back as a function_call_output, and the model's
    next answer ends the run. Greedy, so both runs take the same path."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """current weather of a city"""
        cities.append(city)
        return json.dumps({"city": city, "celsius": 21})

    model = OpenAIResponsesModel(model="eaglenest", openai_client=openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120))
    agent = Agent(name="weather", tools=[get_weather], model=model,
                  model_settings=ModelSettings(temperature=0, max_tokens=48))

    async def both() -> tuple[object, object]:
        plain = await Runner.run(agent, WEATHER_Q, max_turns=3)
        streamed = Runner.run_streamed(agent, WEATHER_Q, max_turns=3)
        async for _ in streamed.stream_events():
            pass
        return plain, streamed

    plain, streamed = asyncio.run(both())
    assert [type(i).__name__ for i in plain.new_items] == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert len(cities) == 2 and cities[0] == cities[1] and cities[0], cities
    assert isinstance(plain.final_output, str) and plain.final_output
    assert streamed.final_output == plain.final_output


def test_the_client_raises_on_an_unknown_model(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="other", input="hi")
