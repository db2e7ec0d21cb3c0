"""Structured output on the reference decoder: every answer is JSON valid under the schema, and speculation changes
nothing: greedy speculative answers equal plain constrained decoding's, which equals an independent loop written here
(the target's forward, llguidance's mask, argmax), for chains and trees, with drafters that are always right, never
right, and untrained, drafting under the grammar or free. A control shows the same prompts answered free are not
JSON. Drafting under the grammar (a tree step with a constrained row drafts as a chain), the target drafting for itself
is accepted in full; drafting free, the grammar rejects most of its drafts.
"""

from __future__ import annotations

import json

import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch
from spec_helpers import untrained_eagle3

from eaglenest.config import SpecConfig
from eaglenest.engines.base import OutputConstraint, SamplingParams
from eaglenest.serve.continuous import ContinuousBatch
from eaglenest.speculative.decoder import BaselineDecoder, SpecDecoder
from eaglenest.speculative.draft import RandomDraft, TargetSelfDraft
from eaglenest.speculative.guide import canonical_schema

FORECAST = {"type": "object", "additionalProperties": False, "required": ["city", "unit", "days"],
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
QUESTIONS = ["What is the weather in paris?", "Write a short poem about the sea.", "What is 8 plus 24?",
             "Sort a list in python.", "hello"]
CHAIN = SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)
TREE = SpecConfig(num_steps=4, topk=3, num_draft_tokens=8)
MAX_NEW = 48


@pytest.fixture(scope="module")
def prompts(tiny_engine) -> list[list[int]]:
    return [tiny_engine.render_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def sampling() -> SamplingParams:
    return SamplingParams(max_new_tokens=MAX_NEW, constraint=OutputConstraint(canonical_schema(FORECAST)))


def _independent_answers(engine, prompts: list[list[int]]) -> list[list[int]]:
    """Constrained greedy decoding without eaglenest's decoder: full forwards, llguidance's mask, argmax."""
    model, tok = engine.model, engine.tokenizer
    width = model.get_output_embeddings().weight.shape[0]
    eos = sorted(engine.info.eos_token_ids)
    assert len(eos) == 1, "the tiny target has one end token"
    ll_tok = llguidance.hf.from_tokenizer(tok, n_vocab=width, eos_token=eos[0])
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(FORECAST),
                                                            defaults={"whitespace_flexible": False})
    answers = []
    for prompt in prompts:
        matcher = llguidance.LLMatcher(ll_tok, grammar)
        out: list[int] = []
        while len(out) < MAX_NEW:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
            allowed = torch.tensor(list(matcher.compute_logit_bias()), dtype=torch.uint8)[:width] > 0
            nxt = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            out.append(nxt)
            if nxt in eos:
                break
            assert matcher.consume_token(nxt)
            if matcher.is_stopped():
                break
        answers.append(out)
    return answers


@pytest.fixture(scope="module")
def baseline(tiny_engine, prompts, sampling):
    return BaselineDecoder.from_engine(tiny_engine).generate(prompts, sampling)


def test_plain_constrained_decoding_equals_an_independent_loop(tiny_engine, prompts, baseline):
    assert [r.token_ids for r in baseline] == _independent_answers(tiny_engine, prompts)


def test_every_answer_is_valid_json_under_the_schema_and_free_answers_are_not(tiny_engine, prompts, baseline):
    for r in baseline:
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), FORECAST)
    free = BaselineDecoder.from_engine(tiny_engine).generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    valid = 0
    for r in free:
        try:
            jsonschema.validate(json.loads(r.text), FORECAST)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    assert valid == 0, [r.text for r in free]  # the control: the tiny target does not answer this by itself


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("kind", ["self", "random", "untrained"])
def test_greedy_speculative_answers_equal_plain_constrained_decoding(tiny_engine, prompts, sampling, baseline, kind,
                                                                      shape):
    draft = {"self": lambda: TargetSelfDraft(tiny_engine.model),
             "random": lambda: RandomDraft(tiny_engine.info.vocab_size, seed=1),
             "untrained": lambda: untrained_eagle3(tiny_engine)}[kind]()
    out = SpecDecoder.from_engine(tiny_engine, draft, shape).generate(prompts, sampling)
    assert [r.token_ids for r in out] == [r.token_ids for r in baseline]
    assert all(r.finish_reason == "stop" for r in out)
    free = SpecDecoder.from_engine(tiny_engine, draft, shape, guided_drafting=False).generate(prompts, sampling)
    assert [r.token_ids for r in free] == [r.token_ids for r in baseline]
    if kind == "self":  # drafting under the grammar (a tree step drafts as a chain), the target drafting for itself
        assert all(a == shape.num_steps for r in out for a in r.accepted_per_step[:-1])  # is always right;
        assert any(a < shape.num_steps for r in free for a in r.accepted_per_step)  # drafting free, it is not


def test_sampled_speculative_answers_are_valid_and_follow_the_seed(tiny_engine, prompts):
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=7,
                              constraint=OutputConstraint(canonical_schema(FORECAST)))
    dec = SpecDecoder.from_engine(tiny_engine, TargetSelfDraft(tiny_engine.model), CHAIN)
    first = dec.generate(prompts, sampling)
    for r in first:
        if r.finish_reason == "stop":
            jsonschema.validate(json.loads(r.text), FORECAST)
        else:  # cut at max tokens: still a prefix the grammar allows
            assert r.text.startswith("{")
    assert [r.token_ids for r in dec.generate(prompts, sampling)] == [r.token_ids for r in first]


def test_constrained_and_free_rows_share_one_running_batch(tiny_engine, prompts, sampling, baseline):
    """The server's continuous batch: each row carries its own constraint (or none)."""
    dec = SpecDecoder.from_engine(tiny_engine, TargetSelfDraft(tiny_engine.model), CHAIN)
    free_sampling = SamplingParams(max_new_tokens=MAX_NEW)
    free = BaselineDecoder.from_engine(tiny_engine).generate(prompts[:2], free_sampling)
    got: dict[int, list[int]] = {}

    def emit(rid, chunk):
        got.setdefault(rid, []).extend(chunk.token_ids)

    batch = ContinuousBatch(dec, free_sampling, emit)
    ids = [batch.add(prompts[0], sampling.constraint), batch.add(prompts[0]),
           batch.add(prompts[1]), batch.add(prompts[1], sampling.constraint)]
    while batch.alive:
        batch.step()
    assert [got[i] for i in ids] == [baseline[0].token_ids, free[0].token_ids, free[1].token_ids,
                                     baseline[1].token_ids]


def test_tree_masks_follow_each_path_and_leave_the_state_as_it_was(tiny_engine):
    dec = SpecDecoder.from_engine(tiny_engine, None)
    guide = dec.guides.guide(OutputConstraint(canonical_schema(FORECAST)))
    tok = tiny_engine.tokenizer
    for t in tok.encode('{"city":"', add_special_tokens=False):
        guide.advance(t)
    before = guide.mask()
    a, b = tok.encode("ab", add_special_tokens=False)[:1], tok.encode("x", add_special_tokens=False)[:1]
    quote = tok.encode('"', add_special_tokens=False)
    # root -> a -> quote ; root -> b ; root -> 7 (a digit: allowed in a string too) ; quote's child: "}" is not allowed
    tokens = [0, a[0], b[0], quote[0], tok.encode("}", add_special_tokens=False)[0]]
    parents = [-1, 0, 0, 1, 3]
    masks = guide.tree_masks(tokens, parents)
    assert torch.equal(guide.mask(), before) and torch.equal(masks[0], before)
    for node, path in ((1, [a[0]]), (2, [b[0]]), (3, [a[0], quote[0]])):
        fresh = dec.guides.guide(OutputConstraint(canonical_schema(FORECAST)))
        for t in tok.encode('{"city":"', add_special_tokens=False) + path:
            fresh.advance(t)
        assert torch.equal(masks[node], fresh.mask()), node
    assert not bool(masks[3, tokens[4]])  # '"city":"a"' must go on with ',', not close the object
    assert bool(masks[4].all())  # unreachable: left unmasked (its parent's mask already rejects it)


def test_a_reasoning_block_opens_the_answer_unconstrained(tiny_engine):
    vocab = tiny_engine.tokenizer.get_vocab()
    think = (vocab["<think>"], vocab["</think>"])
    dec = SpecDecoder.from_engine(tiny_engine, None)
    guide = dec.guides.guide(OutputConstraint(canonical_schema(FORECAST), reasoning=think))
    brace = tiny_engine.tokenizer.encode('{"city', add_special_tokens=False)[0]  # the answer's first token
    word = tiny_engine.tokenizer.encode("hello", add_special_tokens=False)[0]
    opening = guide.mask()
    assert bool(opening[think[0]]) and bool(opening[brace]) and not bool(opening[word])
    guide.advance(think[0])
    eos = sorted(tiny_engine.info.eos_token_ids)
    thinking = guide.mask()
    assert not bool(thinking[eos].any()) and int(thinking.sum()) == thinking.numel() - len(eos)  # free, no end
    guide.advance(word)
    guide.advance(think[1])
    after = guide.mask()
    assert bool(after[brace]) and not bool(after[word]) and not bool(after[think[0]])
    guide.retreat(3)
    assert torch.equal(guide.mask(), opening)
    closed = dec.guides.guide(OutputConstraint(canonical_schema(FORECAST), reasoning=think, in_reasoning=True))
    assert torch.equal(closed.mask(), thinking)
