"""OpenAI-compatibility pieces without a server: tool-call / reasoning parsing on the tiny target's real template,
the parameter checks, the hf decoder's logprobs and repetition penalty against transformers, the drain's deadline."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from eaglenest.config import SpecConfig
from eaglenest.engines.base import SamplingParams, render_chat_ids
from eaglenest.serve.chat_parsing import ChatFormat, ChatParser, chat_message, finish_reason, parse_all

TOOL_TURN = [
    {"role": "user", "content": "What is the weather in rome?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should look it up.",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "rome"}}},
                    {"type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}}]},
]


def _generated_part(tok, messages):
    """The ids the template gives the assistant's turn: what a model that made these calls generated."""
    prompt = render_chat_ids(tok, messages[:-1], add_generation_prompt=True)
    full = render_chat_ids(tok, messages, add_generation_prompt=False)
    assert full[:len(prompt)] == prompt
    return prompt, full[len(prompt):]


@pytest.mark.parametrize("piece", [1, 2, 7, 10_000])
def test_template_rendered_tool_calls_and_reasoning_parse_back(tiny_engine, piece):
    tok = tiny_engine.tokenizer
    fmt = ChatFormat.from_tokenizer(tok)
    assert fmt.tool_call == ("<tool_call>", "</tool_call>") and fmt.reasoning == ("<think>", "</think>")
    prompt, gen = _generated_part(tok, TOOL_TURN)
    text = fmt.decode(gen)
    parser = fmt.parser(tools=True, prompt_text=fmt.decode(prompt[-16:]))
    deltas = []
    for i in range(0, len(text), piece):  # any split of the stream gives the same result
        deltas += parser.feed(text[i:i + piece])
    deltas += parser.finish()
    out = parser.out
    assert out.reasoning == "I should look it up." and out.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", {"city": "rome"}),
                                                                            ("get_time", {"tz": "CET"})]
    assert [k for k, _ in deltas if k == "tool_call"] == ["tool_call", "tool_call"]
    msg = chat_message(out)
    assert msg["content"] is None and msg["reasoning_content"] == out.reasoning and len(msg["tool_calls"]) == 2
    assert finish_reason(out, "stop") == "tool_calls" and finish_reason(out, "length") == "length"


def test_plain_text_passes_unchanged_and_bad_calls_stay_visible(tiny_engine):
    fmt = ChatFormat.from_tokenizer(tiny_engine.tokenizer)
    text = "  Hello <b>world</b>, 1 < 2 and <tool_ <think  \n"
    assert parse_all(fmt.parser(tools=True), text).content == text
    bad = 'Sure. <tool_call>{"name": get_weather}</tool_call>'
    out = parse_all(fmt.parser(tools=True), bad)
    assert out.content == 'Sure. {"name": get_weather}' and out.tool_calls == []  # the text stays, its markers not
    # tools not offered: the markers are not even decoded, the text is plain decoding's
    _, gen = _generated_part(tiny_engine.tokenizer, TOOL_TURN)
    assert "<tool_call>" not in fmt.decode(gen, tools=False)
    assert fmt.decode(gen, tools=False).replace("<think>", "").replace("</think>", "") == \
        tiny_engine.tokenizer.decode(gen, skip_special_tokens=True)


CALL = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
LEAKS = [  # (model output, content with tools offered, calls parsed then, content without tools)
    ("Done.</tool_call> Bye", "Done. Bye", 0, "Done. Bye"),  # a stray end marker
    ("Hi <tool_call>{bad<tool_call>" + CALL[11:], 'Hi {bad{"name": "f", "arguments": {"x": 1}}', 0,
     'Hi {bad{"name": "f", "arguments": {"x": 1}}'),  # a body holding another start marker
    ('Let me check. <tool_call>{"name": "f"', 'Let me check. {"name": "f"', 0, 'Let me check. {"name": "f"'),
    ("A " + CALL + " B</tool_call>", "AB", 1, 'A {"name": "f", "arguments": {"x": 1}} B'),
]


@pytest.mark.parametrize("output,with_tools,calls,without", LEAKS)
@pytest.mark.parametrize("piece", [1, 3, 10_000])
def test_tool_call_markers_never_reach_content(tiny_engine, output, with_tools, calls, without, piece):
    """Stray, unclosed or around a body that is no call, offered tools or not, streamed in any pieces: the markers
    are dropped and the model's other text stays."""
    fmt = ChatFormat.from_tokenizer(tiny_engine.tokenizer)
    for tools, want in ((True, with_tools), (False, without)):
        parser = fmt.parser(tools=tools, reasoning=False)
        for i in range(0, len(output), piece):
            parser.feed(output[i:i + piece])
        parser.finish()
        assert parser.out.content == want, (tools, parser.out)
        assert "tool_call>" not in parser.out.content
        assert len(parser.out.tool_calls) == (calls if tools else 0)
    # markers that are plain text (a configured pair) are kept out the same way
    custom = ChatFormat.from_tokenizer(tiny_engine.tokenizer, tool_call_markers=["[CALL]", "[/CALL]"])
    text = output.replace("<tool_call>", "[CALL]").replace("</tool_call>", "[/CALL]")
    assert parse_all(custom.parser(tools=False, reasoning=False), text).content == without


def test_markers_from_config_and_a_template_that_opens_reasoning(tiny_engine):
    tok = tiny_engine.tokenizer
    off = ChatFormat.from_tokenizer(tok, tool_call_markers=[], reasoning_markers=[])
    assert not off.active
    custom = ChatFormat.from_tokenizer(tok, tool_call_markers=["[CALL]", "[/CALL]"], reasoning_markers=[])
    out = parse_all(custom.parser(tools=True), 'ok [CALL]{"name": "f", "parameters": {"x": 1}}[/CALL]')
    assert out.content == "ok" and out.tool_calls[0].name == "f" and json.loads(out.tool_calls[0].arguments) == {"x": 1}
    with pytest.raises(ValueError, match="start, end"):
        ChatFormat.from_tokenizer(tok, tool_call_markers=["only-one"])
    # DeepSeek-R1 style: the generation prompt ends with <think>, the model writes only the closing marker
    parser = ChatParser(None, ("<think>", "</think>"), in_reasoning=True)
    out = parse_all(parser, "step 1, step 2</think>\n\nThe answer is 4.")
    assert (out.reasoning, out.content) == ("step 1, step 2", "The answer is 4.")
    assert ChatFormat.from_tokenizer(tok).starts_in_reasoning("<|assistant|><think>")


def test_openai_params_accepted_ignored_or_checked():
    from eaglenest.serve.openai_protocol import (
        IGNORED_PARAMS,
        APIError,
        ChatCompletionRequest,
        CompletionRequest,
        check_sampling,
    )

    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    ignored = {"store": True, "metadata": {"a": "b"}, "service_tier": "auto", "reasoning_effort": "low", "user": "u",
               "prompt_cache_key": "k", "safety_identifier": "s", "parallel_tool_calls": False}
    assert set(ignored) == set(IGNORED_PARAMS)
    s = check_sampling(ChatCompletionRequest.model_validate({**base, **ignored}), max_tokens=8, max_tokens_limit=8)
    assert (s.top_k, s.min_p, s.repetition_penalty, s.logprobs) == (0, 0.0, 1.0, None)
    s = check_sampling(ChatCompletionRequest.model_validate(
        {**base, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "logprobs": True, "top_logprobs": 3}),
        max_tokens=8, max_tokens_limit=8)
    assert (s.top_k, s.min_p, s.repetition_penalty, s.logprobs) == (5, 0.1, 1.2, 3)
    comp = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "logprobs": 2, "top_k": -1})
    assert check_sampling(comp, max_tokens=8, max_tokens_limit=8).logprobs == 2
    bad_cases = (({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                 ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
                 ({"frobnicate": 1}, "frobnicate"))
    for bad, param in bad_cases:
        with pytest.raises(APIError) as e:
            check_sampling(ChatCompletionRequest.model_validate({**base, **bad}), max_tokens=8, max_tokens_limit=8)
        assert e.value.status == 400 and e.value.param == param


def test_sampling_filters_keep_the_most_likely_token():
    from eaglenest.speculative.sampling import target_probs

    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    p = target_probs(logits, 1.0, 1.0, top_k=2)
    assert (p[0, 2:] == 0).all() and torch.allclose(p.sum(), torch.tensor(1.0))
    p = target_probs(logits, 1.0, 1.0, min_p=0.5)  # exp(1-2)=0.37 < 0.5: only the first survives
    assert p[0].tolist() == [1.0, 0.0, 0.0, 0.0]


def _decoders(engine):
    from eaglenest.speculative.decoder import BaselineDecoder, SpecDecoder
    from eaglenest.speculative.draft import TargetSelfDraft

    chain = SpecDecoder.from_engine(engine, TargetSelfDraft(engine.model), SpecConfig(num_steps=3, topk=1,
                                                                                      num_draft_tokens=4))
    tree = SpecDecoder.from_engine(engine, TargetSelfDraft(engine.model), SpecConfig(num_steps=3, topk=2,
                                                                                     num_draft_tokens=6))
    return {"baseline": BaselineDecoder.from_engine(engine), "chain": chain, "tree": tree}


@pytest.mark.parametrize("kind", ["baseline", "chain", "tree"])
def test_decoder_logprobs_are_the_targets_own(tiny_engine, kind):
    """Each committed token's logprob (and top alternatives) equals log-softmax of one plain forward over the
    whole sequence: the verify step's columns were read at the right positions."""
    dec = _decoders(tiny_engine)[kind]
    prompt = tiny_engine.render_prompt([{"role": "user", "content": "Write a short poem about the sea."}])
    chunks = list(dec.stream(prompt, SamplingParams(max_new_tokens=24, logprobs=3)))
    tokens = [t for c in chunks for t in c.token_ids]
    entries = [e for c in chunks for e in c.logprobs]
    assert [e[0] for e in entries] == tokens and len(tokens) > 4
    with torch.no_grad():
        logits = tiny_engine.model(torch.tensor([prompt + tokens])).logits[0].float()
    ref = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    for i, (tid, lp, alts) in enumerate(entries):
        assert abs(lp - float(ref[i, tid])) < 1e-4
        top = ref[i].topk(3)
        assert [a for a, _ in alts] == top.indices.tolist()
    assert all(c.logprobs is None for c in dec.stream(prompt, SamplingParams(max_new_tokens=4)))


@pytest.mark.parametrize("kind", ["baseline", "chain", "tree"])
def test_repetition_penalty_matches_transformers(tiny_engine, kind):
    """Greedy with a repetition penalty = transformers' generate with the same penalty (prompt + output counted),
    also when the draft tree's nodes must each see their own path."""
    prompt = tiny_engine.render_prompt([{"role": "user", "content": "List three colors."}])
    with torch.no_grad():
        want = tiny_engine.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32,
                                          repetition_penalty=1.8, attention_mask=torch.ones(1, len(prompt),
                                                                                            dtype=torch.long))
    want = want[0, len(prompt):].tolist()
    plain = _decoders(tiny_engine)[kind].generate([prompt], SamplingParams(max_new_tokens=32))[0].token_ids
    assert plain != want  # the penalty changes this answer, so the comparison below can fail
    got = _decoders(tiny_engine)[kind].generate([prompt], SamplingParams(max_new_tokens=32,
                                                                         repetition_penalty=1.8))[0].token_ids
    assert got == want


def test_accept_length_is_recorded_only_for_requests_that_drafted():
    from eaglenest.serve.metrics import RequestStats, records_accept_length

    def stats(verify_steps: int, speculative: bool = True) -> RequestStats:
        return RequestStats(completion_tokens=1 + verify_steps, ttft_s=0.1, decode_s=0.1, accept_length=1.0,
                            draft_tokens=3 * verify_steps, accepted_tokens=0, speculative=speculative,
                            verify_steps=verify_steps)

    assert records_accept_length(stats(2)) and not records_accept_length(stats(0))
    assert not records_accept_length(stats(2, speculative=False))


def test_drain_deadline_wakes_running_requests():
    from eaglenest.serve.drain import Drain

    d = Drain()
    woke = threading.Event()
    d.register(woke.set)
    assert not d.draining and d.begin(0.2) and not d.begin(5.0)
    assert d.draining and not d.expired and not woke.is_set()
    assert woke.wait(5) and d.expired
    late = threading.Event()
    d.register(late.set)  # a request still registering after the deadline is told at once
    assert late.is_set()
