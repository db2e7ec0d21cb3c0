"""Greedy speculative decoding reproduces the target's own greedy output, token for token, in every shape.

The reference is ``HFEngine.generate_ids`` (an independent decoding loop). Draft models: the target drafting for
itself (every draft accepted: stops land inside accepted drafts), a random proposer (nothing accepted) and an
untrained EAGLE-3 drafter.
"""

from __future__ import annotations

import json

import pytest
from conftest import FIXTURES
from spec_helpers import untrained_eagle3

from eaglenest.config import SpecConfig
from eaglenest.drafters.eagle3.model import Eagle3Drafter
from eaglenest.engines.base import SamplingParams
from eaglenest.speculative.decoder import BaselineDecoder, SpecDecoder
from eaglenest.speculative.draft import RandomDraft, TargetSelfDraft

CHAIN = SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)
TREE = SpecConfig(num_steps=4, topk=3, num_draft_tokens=8)


@pytest.fixture(scope="module")
def prompts(tiny_engine) -> list[list[int]]:
    recs = [json.loads(x) for x in (FIXTURES / "prompts" / "heldout.jsonl").read_text().splitlines() if x.strip()]
    return [tiny_engine.render_prompt(r["messages"], r.get("tools")) for r in recs[::2]]  # 25 prompts, 5 domains


@pytest.fixture(scope="module")
def reference(tiny_engine, prompts) -> dict[int, list[list[int]]]:
    """The target's own greedy answers, per max_new_tokens."""
    out = {}
    for n in (40, 7):
        out[n] = [g.token_ids for g in tiny_engine.generate_ids(prompts, SamplingParams(max_new_tokens=n))]
    return out


@pytest.fixture(scope="module")
def untrained_drafter(tiny_engine) -> Eagle3Drafter:
    return untrained_eagle3(tiny_engine)


def _draft(kind: str, engine, untrained):
    if kind == "self":
        return TargetSelfDraft(engine.model)
    if kind == "random":
        return RandomDraft(engine.info.vocab_size, seed=1)
    return untrained


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("kind", ["self", "random", "untrained"])
@pytest.mark.parametrize("batch", [1, 5])
def test_greedy_equals_target_greedy(tiny_engine, prompts, reference, untrained_drafter, spec, kind, batch):
    dec = SpecDecoder.from_engine(tiny_engine, _draft(kind, tiny_engine, untrained_drafter), spec)
    n = 40 if batch == 1 else 7  # both EOS and max-token stops occur
    subset = range(0, len(prompts), 3) if batch == 1 else range(len(prompts))
    got = {}
    for i in range(0, len(subset), batch):
        rows = list(subset)[i:i + batch]
        for r, res in zip(rows, dec.generate([prompts[j] for j in rows], SamplingParams(max_new_tokens=n)),
                          strict=True):
            got[r] = res
    for r, res in got.items():
        assert res.token_ids == reference[n][r], f"prompt {r}: speculative output differs from plain greedy"
        assert res.draft_steps == len(res.accepted_per_step) >= 0
        assert all(0 <= a <= spec.num_steps for a in res.accepted_per_step)
    mean_al = sum(r.accept_length for r in got.values()) / len(got)
    if kind == "self" and spec is CHAIN:
        assert mean_al == pytest.approx(spec.num_steps + 1), "the target drafting for itself must accept every token"
    if kind in ("random", "untrained"):
        assert mean_al < 1.1, f"a random / untrained drafter should accept ~nothing, got accept length {mean_al:.2f}"


def test_stops_inside_accepted_drafts(tiny_engine, prompts, reference):
    """EOS and max_new_tokens cut an accepted draft block; the stream shows the cut and matches the reference."""
    dec = SpecDecoder.from_engine(tiny_engine, TargetSelfDraft(tiny_engine.model), CHAIN)
    eos_cut = length_cut = 0
    for r, p in enumerate(prompts):
        for n in (40, 7):
            chunks = list(dec.stream(p, SamplingParams(max_new_tokens=n)))
            toks = [t for c in chunks for t in c.token_ids]
            assert toks == reference[n][r]
            last = chunks[-1]
            assert last.finished and last.result is not None and last.result.token_ids == toks
            assert [c.step for c in chunks] == list(range(len(chunks)))
            assert all(not c.finished for c in chunks[:-1])
            if last.accepted is not None and len(last.token_ids) < last.accepted + 1:
                if last.finish_reason == "stop":
                    eos_cut += 1
                    assert toks[-1] in tiny_engine.info.eos_token_ids
                else:
                    length_cut += 1
                    assert len(toks) == n and last.finish_reason == "length"
    assert eos_cut > 0 and length_cut > 0, (eos_cut, length_cut)


def test_baseline_decoder_matches_engine_and_reports_steps(tiny_engine, prompts, reference):
    base = BaselineDecoder.from_engine(tiny_engine)
    res = base.generate(prompts[:6], SamplingParams(max_new_tokens=40))
    for r, x in enumerate(res):
        assert x.token_ids == reference[40][r]
        assert x.accept_length == 1.0 and x.draft_steps == len(x.token_ids) - 1  # prefill emits the first token


def test_ignore_eos_matches_the_engine(tiny_engine, prompts, reference):
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    eos = set(tiny_engine.info.eos_token_ids)
    # prompts whose greedy answer ends early (which ones is up to the tiny target's weights)
    ending = [p for p, ref in zip(prompts, reference[40], strict=True) if len(ref) < 40 and ref[-1] in eos][:3]
    assert ending, "the tiny target should end some answers with <|end|> within 40 tokens"
    want = tiny_engine.generate_ids(ending, sp)
    assert all(eos & set(w.token_ids[:-1]) for w in want)  # the decoding really ran past an end-of-sequence token
    for dec in (SpecDecoder.from_engine(tiny_engine, TargetSelfDraft(tiny_engine.model), CHAIN),
                BaselineDecoder.from_engine(tiny_engine)):
        got = dec.generate(ending, sp)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        assert all(g.finish_reason == "length" and len(g.token_ids) == 40 for g in got)


def test_accept_length_definition(tiny_engine, prompts):
    """accept length = emitted tokens per verify forward (bonus included) when no stop cuts a block."""
    dec = SpecDecoder.from_engine(tiny_engine, TargetSelfDraft(tiny_engine.model), CHAIN)
    res = dec.generate([prompts[0]], SamplingParams(max_new_tokens=1 + 4 * 5))[0]
    assert res.finish_reason == "length" or res.token_ids[-1] in tiny_engine.info.eos_token_ids
    assert res.accept_length == pytest.approx(1 + sum(res.accepted_per_step) / res.draft_steps)
    if res.finish_reason == "length":
        assert res.draft_steps == 5 and res.accept_length == 4.0


def test_rejects_empty_prompt(tiny_engine):
    dec = SpecDecoder.from_engine(tiny_engine, RandomDraft(tiny_engine.info.vocab_size), CHAIN)
    with pytest.raises(ValueError, match="empty prompt"):
        dec.generate([[1, 2], []], SamplingParams(max_new_tokens=4))
