"""The Responses API's stream events and response objects, validated by the official ``openai`` package's own types
(the discriminated union a client parses each event with): every event of a stream that changes item kind several
times, and of one that fails, has the fields its type requires."""

from __future__ import annotations

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from eaglenest.serve.chat_parsing import Parsed, ToolCall
from eaglenest.serve.openai_protocol import SpecUsage, Usage
from eaglenest.serve.responses_api import (
    ResponseEvents,
    ResponseShell,
    ResponsesRequest,
    input_messages,
    output_items,
    usage_of,
)

EVENT = TypeAdapter(ResponseStreamEvent)
CALL = ToolCall(id="call_1", name="get_weather", arguments='{"city": "paris"}')
USAGE = usage_of(Usage(prompt_tokens=5, completion_tokens=7, total_tokens=12,
                       spec=SpecUsage(accept_length=2.5, draft_tokens=9, accepted_tokens=6)), reasoning_tokens=3)


def _shell() -> ResponseShell:
    return ResponseShell(ResponsesRequest(model="m", input="hi"), "m", 1_700_000_000)


def test_every_event_of_a_mixed_stream_parses_as_its_type():
    events = ResponseEvents(_shell())
    stream = events.start() + events.feed([("reasoning", "think "), ("reasoning", "more")]) + \
        events.feed([("content", "Let me look."), ("tool_call", CALL), ("content", "done")]) + \
        events.finish("tool_calls", USAGE)
    parsed = [EVENT.validate_python(ev) for ev in stream]
    assert [p.sequence_number for p in parsed] == list(range(len(stream)))
    assert [type(p).__name__ for p in parsed][:2] == ["ResponseCreatedEvent", "ResponseInProgressEvent"]
    final = parsed[-1]
    assert final.type == "response.completed" and final.response.status == "completed"
    assert [i.type for i in final.response.output] == ["reasoning", "message", "function_call", "message"]
    assert final.response.output[0].content[0].text == "think more"
    assert final.response.output[2].arguments == CALL.arguments
    assert final.response.usage.output_tokens_details.reasoning_tokens == 3
    added = [p.output_index for p in parsed if p.type == "response.output_item.added"]
    assert added == [0, 1, 2, 3], "each item opens at the next index"


def test_a_cut_stream_is_incomplete_and_a_failed_one_says_why():
    events = ResponseEvents(_shell())
    stream = events.start() + events.feed([("content", "abc")]) + events.finish("length", USAGE)
    last = EVENT.validate_python(stream[-1])
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"

    events = ResponseEvents(_shell())
    stream = events.start() + events.feed([("content", "abc")]) + events.failed(503, "draining", "shutting_down")
    error, failed = (EVENT.validate_python(ev) for ev in stream[-2:])
    assert error.type == "error" and error.code == "shutting_down" and error.message == "draining"
    assert failed.type == "response.failed" and failed.response.error.message == "draining"
    assert [(i.type, i.status, i.content[0].text) for i in failed.response.output] == [("message", "incomplete", "abc")]


def test_an_empty_answer_is_one_empty_message():
    events = ResponseEvents(_shell())
    body = EVENT.validate_python((events.start() + events.finish("stop", USAGE))[-1]).response
    assert [(i.type, i.content[0].text) for i in body.output] == [("message", "")]
    whole = Response.model_validate(_shell().body("completed", output_items(Parsed()), USAGE))
    assert whole.output_text == ""


def test_a_whole_answer_is_a_response():
    body = _shell().body("incomplete", output_items(Parsed(content="a", reasoning="r", tool_calls=[CALL])), USAGE)
    r = Response.model_validate(body)
    assert [i.type for i in r.output] == ["reasoning", "message", "function_call"] and r.output_text == "a"
    assert r.incomplete_details.reason == "max_output_tokens" and r.usage.model_extra["spec"]["draft_tokens"] == 9
    assert r.output[2].call_id == "call_1" and r.output[2].id.startswith("fc")


def test_input_items_become_the_chat_turns():
    msgs = input_messages([
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "input_text", "text": "weather "}, {"type": "input_text", "text": "?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
    ])
    assert msgs[:2] == [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "weather ?"}]
    assert msgs[2]["role"] == "assistant" and msgs[2]["reasoning_content"] == "r"
    assert [c["id"] for c in msgs[2]["tool_calls"]] == ["c1", "c2"], "calls in a row are one assistant turn"
    assert msgs[3] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert msgs[4] == {"role": "assistant", "content": "It is sunny."}


@pytest.mark.parametrize("item", [{"type": "function_call", "call_id": "c1", "name": "f"},
                                  {"type": "function_call_output", "output": "x"},
                                  {"role": "tool", "content": "x"}])
def test_an_incomplete_item_names_its_field(item):
    from eaglenest.serve.openai_protocol import APIError

    with pytest.raises(APIError) as e:
        input_messages([item])
    assert e.value.status == 400 and e.value.param.startswith("input[0].")
