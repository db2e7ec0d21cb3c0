"""Structured output on a live Ray Serve, through the official ``openai`` client's own helpers: ``chat.completions.
parse`` and ``responses.parse`` with a pydantic model (the client sends the model's strict JSON Schema and parses the
answer back into it), the chat stream helper, ``json_object``, a reasoning block before the answer, and the 400s that
name a schema the server cannot use.

One application: the tiny target with an exported EAGLE-3 drafter (the speculative path serves every answer). The
decoder's exactness under a constraint is tested in ``tests/component/test_spec_structured.py``; here: the answers
parse into the model, the same questions asked free do not, and the speculative path was used.
"""

from __future__ import annotations

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
