"""Structured output on a live Ray Serve, through the official ``openai`` client's own helpers: ``chat.completions.
parse`` and ``responses.parse`` with a pydantic model (the client sends the model's strict JSON Schema and parses the
answer back into it), the chat stream helper, ``json_object``, a reasoning block before the answer, forced tool calls
(``tool_choice`` required or a named function, on both routes), and the 400s that name what the server cannot use.

One application: the tiny target with an exported EAGLE-3 drafter (the speculative path serves every answer). The
decoder's exactness under a constraint is tested in ``tests/component/test_spec_structured.py``; here: the answers
parse into the model, the same questions asked free do not, and the speculative path was used.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field
from serve_helpers import make_drafter

from eaglenest.config import EaglenestConfig

QUESTIONS = ["What is the weather in paris?", "Write a short poem about the sea.", "Sort a list in python."]
THINK_Q = "What is 8 plus 24?"


class Forecast(BaseModel):
    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=7)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def client(ray_session, tiny_target_path, tmp_path_factory):
    from eaglenest.serve.cli import AppSpec, start_apps, stop_serve

    drafter = make_drafter(tmp_path_factory.mktemp("structured") / "drafter", tiny_target_path)
    cfg = EaglenestConfig.model_validate({
        "target": {"model": str(tiny_target_path), "device": "cpu", "dtype": "float32"},
        "serve": {"num_cpus_per_replica": 0.25, "max_tokens_limit": 64}})
    (url,) = start_apps([AppSpec(cfg, str(drafter), "structured", "/")], port=_free_port())
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    stop_serve()


def _ask(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


@pytest.mark.parametrize("question", QUESTIONS)
def test_chat_parse_returns_the_model_and_free_answers_would_not_parse(client, question):
    r = client.chat.completions.parse(model="eaglenest", messages=_ask(question), response_format=Forecast,
                                      temperature=0, max_tokens=48)
    msg = r.choices[0].message
    assert isinstance(msg.parsed, Forecast) and r.choices[0].finish_reason == "stop"
    assert Forecast.model_validate_json(msg.content) == msg.parsed
    spec = r.usage.model_extra["spec"]
    assert spec["draft_tokens"] > 0, "the speculative path served it"
    free = client.chat.completions.create(model="eaglenest", messages=_ask(question), temperature=0, max_tokens=48)
    with pytest.raises(ValueError):  # the control: unconstrained, the tiny target does not write a Forecast
        Forecast.model_validate_json(free.choices[0].message.content or "")


def test_the_chat_stream_helper_parses_the_streamed_answer(client):
    whole = client.chat.completions.parse(model="eaglenest", messages=_ask(QUESTIONS[1]), response_format=Forecast,
                                          temperature=0, max_tokens=48)
    with client.chat.completions.stream(model="eaglenest", messages=_ask(QUESTIONS[1]), response_format=Forecast,
                                        temperature=0, max_tokens=48) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == whole.choices[0].message.parsed


def test_json_object_answers_an_object(client):
    r = client.chat.completions.create(model="eaglenest", messages=_ask(QUESTIONS[2]), temperature=0, max_tokens=64,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # an object without a size limit may outlast max_tokens: what came is still an object's beginning
        assert r.choices[0].message.content.startswith("{")


def test_responses_parse_returns_the_model(client):
    r = client.responses.parse(model="eaglenest", input=QUESTIONS[0], text_format=Forecast, temperature=0,
                               max_output_tokens=48)
    chat = client.chat.completions.parse(model="eaglenest", messages=_ask(QUESTIONS[0]), response_format=Forecast,
                                         temperature=0, max_tokens=48,
                                         extra_body={"separate_reasoning": True})  # as /v1/responses does
    assert isinstance(r.output_parsed, Forecast) and r.output_parsed == chat.choices[0].message.parsed
    assert r.text.format.type == "json_schema" and r.text.format.name == "Forecast"


def test_a_reasoning_block_may_open_the_answer(client):
    """Reasoning separated: the tiny target thinks on this question, freely, and the answer after it is the model."""
    r = client.chat.completions.parse(model="eaglenest", messages=_ask(THINK_Q), response_format=Forecast,
                                      temperature=0, max_tokens=64, extra_body={"separate_reasoning": True})
    msg = r.choices[0].message
    assert msg.model_extra.get("reasoning_content"), "the tiny target no longer reasons on this question"
    assert isinstance(msg.parsed, Forecast)


@pytest.mark.parametrize(("fmt", "param"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "minLength": 5,
                                                                     "maxLength": 2}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "xml"}, "response_format.type"),
])
def test_a_schema_the_server_cannot_use_is_a_400_naming_it(client, fmt, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="eaglenest", messages=_ask("hi"), max_tokens=4, response_format=fmt)
    assert e.value.body["param"] == param, e.value.body


def test_responses_name_their_own_field_in_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="eaglenest", input="hi", max_output_tokens=4,
                                text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "strnig"}}})
    assert e.value.body["param"] == "text.format.schema" and "strnig" in e.value.body["message"]


# ---------------------------------------------------------------------------------------------- forced tool calls
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "current weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "description": "add two integers", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"], "additionalProperties": False}}}]


def _calls(r) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls or []]


def test_tool_choice_required_makes_a_call_where_auto_answers_text(client):
    auto = client.chat.completions.create(model="eaglenest", messages=_ask("hello"), tools=TOOLS, temperature=0,
                                          max_tokens=48)
    assert not auto.choices[0].message.tool_calls, "the control: the tiny target answers hello with text"
    r = client.chat.completions.create(model="eaglenest", messages=_ask("hello"), tools=TOOLS, temperature=0,
                                       max_tokens=64, tool_choice="required")
    calls = _calls(r)
    assert calls and r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    assert all(name in {"get_weather", "add"} for name, _ in calls)
    assert r.usage.model_extra["spec"]["draft_tokens"] > 0, "the speculative path served it"
    with client.chat.completions.stream(model="eaglenest", messages=_ask("hello"), tools=TOOLS, temperature=0,
                                        max_tokens=64, tool_choice="required") as stream:
        final = stream.get_final_completion()
    assert _calls(final) == calls


def test_a_named_function_is_the_one_call(client):
    r = client.chat.completions.create(model="eaglenest", messages=_ask("What is the weather in paris?"),
                                       tools=TOOLS, temperature=0, max_tokens=64,
                                       tool_choice={"type": "function", "function": {"name": "add"}})
    calls = _calls(r)
    assert len(calls) == 1 and calls[0][0] == "add" and set(calls[0][1]) == {"a", "b"}
    assert all(isinstance(v, int) for v in calls[0][1].values())
    one = client.chat.completions.create(model="eaglenest", messages=_ask("hello"), tools=TOOLS, temperature=0,
                                         max_tokens=64, tool_choice="required", parallel_tool_calls=False)
    assert len(_calls(one)) == 1


def test_responses_take_required_and_their_named_form(client):
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
             for t in TOOLS]
    r = client.responses.create(model="eaglenest", input="hello", tools=tools, tool_choice="required",
                                temperature=0, max_output_tokens=64)
    assert [i.type for i in r.output if i.type != "reasoning"] and \
        all(i.type == "function_call" for i in r.output if i.type != "reasoning")
    one = client.responses.create(model="eaglenest", input="hello", tools=tools, tool_choice="required",
                                  parallel_tool_calls=False, temperature=0, max_output_tokens=64)
    assert len([i for i in one.output if i.type == "function_call"]) == 1
    named = client.responses.create(model="eaglenest", input="hello", tools=tools, temperature=0,
                                    max_output_tokens=64, tool_choice={"type": "function", "name": "add"})
    assert [i.name for i in named.output if i.type == "function_call"] == ["add"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="eaglenest", input="hello", tools=tools, max_output_tokens=8,
                                tool_choice={"type": "function", "name": "mul"})
    assert e.value.body["param"] == "tool_choice.name"


@pytest.mark.parametrize(("kw", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}}, "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_a_tool_choice_that_cannot_be_honoured_is_a_400(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="eaglenest", messages=_ask("hello"), max_tokens=4, **kw)
    assert e.value.body["param"] == param, e.value.body


def test_beside_a_response_format_tools_may_still_be_called(client):
    """tool_choice auto with tools and a response_format: the answer is calls or JSON in the format, never free
    text (the tiny target, with tools in its prompt, picks the call even for hello; both branches are walked in
    tests/unit/test_tool_choice.py); a forced call is calls only (no text is left for the format)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "Forecast", "schema": Forecast.model_json_schema()}}
    kw = {"model": "eaglenest", "tools": TOOLS, "temperature": 0, "max_tokens": 64, "response_format": fmt}
    weather = client.chat.completions.create(messages=_ask("What is the weather in paris?"), **kw)
    assert [name for name, _ in _calls(weather)] == ["get_weather"] and not weather.choices[0].message.content
    for question in QUESTIONS:
        msg = client.chat.completions.create(messages=_ask(question), **kw).choices[0].message
        assert msg.tool_calls or Forecast.model_validate_json(msg.content)
    forced = client.chat.completions.create(messages=_ask("hello"), tool_choice="required", **kw)
    assert _calls(forced) and forced.choices[0].finish_reason == "tool_calls"


def _agent_model(client):
    from agents import OpenAIResponsesModel, set_tracing_disabled

    set_tracing_disabled(True)
    return OpenAIResponsesModel(model="eaglenest", openai_client=openai.AsyncOpenAI(
        base_url=str(client.base_url), api_key="none", max_retries=0, timeout=120))


def test_an_agents_sdk_agent_answers_in_its_output_type(client):
    """OpenAI's Agents SDK with a pydantic ``output_type`` (sent as a strict ``text.format``): the SDK parses the
    final answer into the type."""
    from agents import Agent, ModelSettings, Runner

    agent = Agent(name="forecaster", model=_agent_model(client), output_type=Forecast,
                  model_settings=ModelSettings(temperature=0, max_tokens=64))
    result = asyncio.run(Runner.run(agent, QUESTIONS[0], max_turns=2))
    assert isinstance(result.final_output, Forecast)


def test_an_agents_sdk_agent_forced_to_its_tool_calls_it_then_answers(client):
    """``ModelSettings(tool_choice="required")`` on a question the tiny target answers without tools: the call is
    forced, the SDK runs the tool, resets the choice to auto (its default) and the model's next answer ends the run."""
    from agents import Agent, ModelSettings, Runner, function_tool

    added: list[tuple[int, int]] = []

    @function_tool
    def add(a: int, b: int) -> int:
        """add two integers"""
        added.append((a, b))
        return a + b

    agent = Agent(name="adder", tools=[add], model=_agent_model(client),
                  model_settings=ModelSettings(temperature=0, max_tokens=48, tool_choice="required"))
    result = asyncio.run(Runner.run(agent, "hello", max_turns=3))
    assert [type(i).__name__ for i in result.new_items] == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert len(added) == 1 and isinstance(result.final_output, str)
