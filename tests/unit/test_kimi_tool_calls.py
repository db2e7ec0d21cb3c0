"""Kimi-K2 / K2.5 tool calls in the target's output: ``<|tool_calls_section_begin|>``, then per call
``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>``, then
``<|tool_calls_section_end|>`` (Moonshot's tool-call guidance). A byte-level BPE tokenizer with Kimi's special tokens
stands in for Kimi's (its markers are special tokens there too): the markers are detected from the vocabulary, decoding
keeps the call's markers and drops the section's, and the parser returns the calls with the model's own ids."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from eaglenest.serve.chat_parsing import KIMI_TOOL_CALL, ChatFormat, ChatParser, parse_all, parse_kimi_body

SPECIAL = ["<|im_end|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
           "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>"]
CALLS = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
         '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|> functions.get_time:1 <|tool_call_argument_begin|>'
         ' {"tz": "CET"} <|tool_call_end|><|tool_calls_section_end|>')
WANT = [("functions.get_weather:0", "get_weather", {"city": "Paris"}), ("functions.get_time:1", "get_time",
                                                                       {"tz": "CET"})]


@pytest.fixture(scope="module")
def kimi_like_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["Let me check the weather in Paris.", 'functions.get_weather:0 {"city": "Paris"}'],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   additional_special_tokens=SPECIAL[1:])


def _calls(parsed) -> list[tuple[str, str, dict]]:
    return [(c.id, c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def test_the_body_reads_the_id_name_and_arguments():
    call = parse_kimi_body('functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}')
    assert (call.id, call.name, json.loads(call.arguments)) == WANT[0]
    assert parse_kimi_body('get_weather:3<|tool_call_argument_begin|>{}').name == "get_weather"  # no prefix
    for bad in ('functions.get_weather<|tool_call_argument_begin|>{}', 'functions.f:0<|tool_call_argument_begin|>[1]',
                'functions.f:0<|tool_call_argument_begin|>{"a": ', 'functions.f:0 {"a": 1}'):
        assert parse_kimi_body(bad) is None, bad


@pytest.mark.parametrize("stream", [False, True])
def test_calls_are_parsed_whole_or_fed_piece_by_piece(stream):
    text = "Let me check." + CALLS.replace("<|tool_calls_section_begin|>", "").replace("<|tool_calls_section_end|>",
                                                                                        "")
    parser = ChatParser(KIMI_TOOL_CALL, None)
    if stream:
        deltas = [d for ch in text for d in parser.feed(ch)] + parser.finish()
        kinds = [k for i, (k, _) in enumerate(deltas) if k == "tool_call" or i == 0 or deltas[i - 1][0] != k]
        assert kinds == ["content", "tool_call", "tool_call"]
        parsed = parser.out
    else:
        parsed = parse_all(parser, text)
    assert parsed.content == "Let me check." and _calls(parsed) == WANT


def test_a_body_that_does_not_parse_stays_content_without_markers():
    parsed = parse_all(ChatParser(KIMI_TOOL_CALL, None), "<|tool_call_begin|>get_weather<|tool_call_argument_begin|>"
                                                         "{city: Paris}<|tool_call_end|>")
    assert parsed.tool_calls == [] and parsed.content == "get_weather{city: Paris}"


def test_the_markers_are_detected_and_decoding_keeps_only_the_calls(kimi_like_tokenizer):
    fmt = ChatFormat.from_tokenizer(kimi_like_tokenizer)
    assert fmt.tool_call == KIMI_TOOL_CALL and fmt.reasoning == ("<think>", "</think>")
    ids = kimi_like_tokenizer.encode("Let me check the weather." + CALLS + "<|im_end|>", add_special_tokens=False)
    with_tools = fmt.decode(ids, tools=True)
    assert "<|tool_call_argument_begin|>" in with_tools and "section" not in with_tools and "<|im_end|>" not in \
        with_tools
    parsed = parse_all(fmt.parser(tools=True), with_tools)
    assert parsed.content == "Let me check the weather." and _calls(parsed) == WANT
    # without tools offered, no call is parsed and no marker is shown
    plain = parse_all(fmt.parser(tools=False), fmt.decode(ids, tools=False))
    assert plain.tool_calls == [] and "<|" not in plain.content
