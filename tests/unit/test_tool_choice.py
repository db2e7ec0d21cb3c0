"""``tool_choice`` required / named: which functions a choice forces, the 400s, and the grammar of calls in the
target's own syntax. Both syntaxes are walked: a seeded random walk over the grammar's own masks (every token drawn
among those allowed, on a byte-level BPE tokenizer with the markers as special tokens) must end in text the server's
chat parser reads back as calls of the forced functions, with arguments valid under their schemas; a control shows
the parser finds no call in a walk without the grammar."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from eaglenest.engines.base import OutputConstraint
from eaglenest.serve.chat_parsing import KIMI_TOOL_CALL, ChatFormat
from eaglenest.serve.openai_protocol import APIError
from eaglenest.serve.tool_choice import forced_functions, tool_call_grammar
from eaglenest.speculative.guide import GuideCompiler

WEATHER = {"type": "object", "properties": {"city": {"enum": ["paris", "rome"]}}, "required": ["city"],
           "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
HERMES = ("<tool_call>", "</tool_call>")
SPECIAL = ["<|end|>", "<tool_call>", "</tool_call>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
           "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"]


def test_which_functions_a_choice_forces():
    assert forced_functions(TOOLS, None) is None and forced_functions(TOOLS, "auto") is None
    assert forced_functions(TOOLS, "none") is None and forced_functions(None, "auto") is None
    assert forced_functions(TOOLS, "required") == ["get_weather", "add"]
    assert forced_functions(TOOLS, {"type": "function", "function": {"name": "add"}}) == ["add"]


@pytest.mark.parametrize(("tools", "choice", "param"), [
    (None, "required", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "mul"}}, "tool_choice.function.name"),
    (TOOLS, {"type": "function"}, "tool_choice.function.name"),
    (TOOLS, "any", "tool_choice"),
    (TOOLS, {"type": "allowed_tools"}, "tool_choice"),
])
def test_a_choice_that_cannot_be_honoured_is_a_400_naming_it(tools, choice, param):
    with pytest.raises(APIError) as e:
        forced_functions(tools, choice)
    assert e.value.status == 400 and e.value.param == param


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(['{"name": "get_weather", "arguments": {"city": "paris"}} functions.add:0 {"a": 12}'],
                            trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", additional_special_tokens=SPECIAL[1:])


def _walk(tokenizer, constraint: OutputConstraint | None, seed: int, limit: int = 200) -> list[int] | None:
    """Draw each next token uniformly among those the grammar allows (all of them without one); None when a
    constrained walk has not ended within ``limit`` tokens (a random walk may keep adding calls)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = len(tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|end|>")
    guide = GuideCompiler(tokenizer, vocab, [eos]).guide(constraint) if constraint is not None else None
    out: list[int] = []
    while len(out) < limit:
        allowed = guide.mask() if guide is not None else torch.ones(vocab, dtype=torch.bool)
        tok = int(allowed.nonzero().flatten()[torch.randint(int(allowed.sum()), (1,), generator=gen)])
        if tok == eos:
            break
        out.append(tok)
        if guide is not None:
            guide.advance(tok)
            if guide.done:
                break
    else:
        if guide is not None:
            return None
    return out


def _ended_walks(tokenizer, grammar: str, want: int = 4) -> list[list[int]]:
    walks = [w for w in (_walk(tokenizer, OutputConstraint(lark=grammar), seed) for seed in range(24)) if w]
    assert len(walks) >= want, "too few walks ended within their limit"
    return walks


@pytest.mark.parametrize("markers", [HERMES, KIMI_TOOL_CALL], ids=["hermes", "kimi"])
@pytest.mark.parametrize(("names", "parallel"), [(["get_weather", "add"], True), (["add"], False)])
def test_a_walk_in_the_grammar_parses_as_calls_of_the_forced_functions(tokenizer, markers, names, parallel):
    grammar = tool_call_grammar(TOOLS, names, markers=markers, vocab=tokenizer.get_vocab(), parallel=parallel)
    fmt = ChatFormat(tokenizer, tool_call=markers, reasoning=None)
    schemas = {"get_weather": WEATHER, "add": ADD}
    for ids in _ended_walks(tokenizer, grammar):
        parser = fmt.parser(tools=True, reasoning=False)
        parser.feed(fmt.decode(ids, tools=True))
        parser.finish()
        calls = parser.out.tool_calls
        assert calls and not parser.out.content.strip(), fmt.decode(ids, tools=True)
        for call in calls:
            assert call.name in names
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        if not parallel:
            assert len(calls) == 1
    control = _walk(tokenizer, None, 0, limit=40)
    parser = fmt.parser(tools=True, reasoning=False)
    parser.feed(fmt.decode(control, tools=True))
    parser.finish()
    assert not parser.out.tool_calls


@pytest.mark.parametrize("markers", [HERMES, KIMI_TOOL_CALL], ids=["hermes", "kimi"])
def test_beside_a_response_format_the_answer_is_calls_or_json_under_it(tokenizer, markers):
    """tool_choice auto with tools and a response_format: every walk is either calls or an answer in the format."""
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    grammar = tool_call_grammar(TOOLS, ["get_weather", "add"], markers=markers, vocab=tokenizer.get_vocab(),
                                parallel=True, answer=answer)
    fmt = ChatFormat(tokenizer, tool_call=markers, reasoning=None)
    kinds = set()
    for ids in _ended_walks(tokenizer, grammar):
        parser = fmt.parser(tools=True, reasoning=False)
        parser.feed(fmt.decode(ids, tools=True))
        parser.finish()
        if parser.out.tool_calls:
            assert not parser.out.content.strip()
            kinds.add("calls")
        else:
            jsonschema.validate(json.loads(parser.out.content), answer)
            kinds.add("answer")
    assert kinds == {"calls", "answer"}, kinds  # both branches are reachable


def test_parameters_that_cannot_constrain_a_call_are_a_400_naming_tools(tokenizer):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "strnig"}}}}}]
    with pytest.raises(APIError) as e:
        tool_call_grammar(bad, ["f"], markers=HERMES, vocab=tokenizer.get_vocab(), parallel=False)
    assert e.value.param == "tools" and "strnig" in e.value.message


def test_a_marker_that_is_not_one_token_is_a_400(tokenizer):
    with pytest.raises(APIError) as e:
        tool_call_grammar(TOOLS, ["add"], markers=("[CALL]", "[/CALL]"), vocab=tokenizer.get_vocab(), parallel=False)
    assert e.value.param == "tool_choice" and "'[CALL]'" in e.value.message


def test_the_kimi_grammar_is_valid_for_llguidance(tokenizer):
    grammar = tool_call_grammar(TOOLS, ["get_weather", "add"], markers=KIMI_TOOL_CALL, vocab=tokenizer.get_vocab(),
                                parallel=True)
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar)) == ""
    assert "calls: <[" in grammar and '"functions.add:" INDEX' in grammar
