"""A schedule switching drafting on and off between steps (SpecDecoder's ``policy``) keeps every guarantee.

Off steps skip the drafter and defer its catch-up (eaglenest.speculative.backlog); the catch-up must leave the
drafter exactly where step-by-step catch-ups would have. The exact oracle: an EAGLE-3 drafter's next-draft logits
after a deferred catch-up equal those of a decoder that never stopped (a lost or misplaced column changes them).
Around it, rows join and leave a continuous batch while a catch-up is pending, answers stay the target's greedy
answers, and the target drafting for itself keeps accepting every draft token.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import FIXTURES
from spec_helpers import untrained_eagle3

from eaglenest.config import SpecConfig
from eaglenest.drafters.eagle3.model import Eagle3Drafter
from eaglenest.engines.base import SamplingParams
from eaglenest.serve.continuous import ContinuousBatch
from eaglenest.speculative import DecodeRow, SpecDecoder
from eaglenest.speculative.draft import TargetSelfDraft

CHAIN = SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)


@pytest.fixture(scope="module")
def prompts(tiny_engine) -> list[list[int]]:
    recs = [json.loads(x) for x in (FIXTURES / "prompts" / "heldout.jsonl").read_text().splitlines() if x.strip()]
    return [tiny_engine.render_prompt(r["messages"], r.get("tools")) for r in recs[:4]]


def test_load_policy_in_a_continuous_batch_keeps_every_draft_accepted(tiny_engine, prompts):
    """Drafting only when one row runs: rows join while the batch runs without drafting (one joins a batch whose
    catch-up is pending) and leave before drafting resumes; every answer is the target's greedy answer and every
    drafting step of the self-drafting target accepts all its draft tokens."""
    sampling = SamplingParams(max_new_tokens=24, ignore_eos=True)
    reference = [g.token_ids for g in tiny_engine.generate_ids(prompts[:3], sampling)]
    dec = SpecDecoder.from_engine(tiny_engine, TargetSelfDraft(tiny_engine.model), CHAIN,
                                  policy=lambda n: CHAIN if n == 1 else None)
    results, modes = {}, []

    def emit(rid, chunk):
        if chunk.result is not None:
            results[rid] = chunk.result

    cb = ContinuousBatch(dec, sampling, emit)
    order = [cb.add(prompts[0])]
    for _ in range(3):  # alone: drafting
        cb.step()
        modes.append(dec.last_mode)
    order.append(cb.add(prompts[1]))
    for _ in range(2):  # two rows: no drafting, the catch-up piles up
        cb.step()
        modes.append(dec.last_mode)
    order.append(cb.add(prompts[2]))  # joins a batch that owes the drafter a catch-up
    while cb.alive:
        cb.step()
        modes.append(dec.last_mode)
    assert (1, 3) in modes and (2, 0) in modes and (3, 0) in modes
    assert modes[-1] == (1, 3), "the last row alone drafts again"
    for i, rid in enumerate(order):
        r = results[rid]
        assert r.token_ids == reference[i], f"row {i}: the answer is not the target's greedy answer"
        assert all(a == CHAIN.num_steps for a in r.accepted_per_step), \
            f"row {i}: a drafting step after a deferred catch-up rejected a self-drafted token: {r.accepted_per_step}"
        assert r.draft_tokens == len(r.accepted_per_step) * (CHAIN.num_draft_tokens - 1)
    first, middle, last = (results[rid] for rid in order)
    assert first.draft_steps == 3 and middle.draft_steps == 0, "drafting only while a row runs alone"
    assert last.draft_steps >= 1, "the last row, alone at the end, drafts after its deferred catch-up"


@pytest.fixture(scope="module")
def untrained(tiny_engine) -> Eagle3Drafter:
    return untrained_eagle3(tiny_engine)


def _roots_by_position(dec: SpecDecoder, prompt: list[int], steps: int) -> dict[int, torch.Tensor]:
    """The drafter's next-draft logits after every drafting step, keyed by the position they draft for."""
    rows = {0: DecodeRow(prompt=list(prompt))}
    sampling = SamplingParams(max_new_tokens=64, ignore_eos=True)
    batch, _ = dec.prefill(rows, sampling)
    out = {}
    for k in range(steps):
        dec.step(batch, rows, sampling, k + 1)
        if dec.last_mode[1] > 0:
            out[int(batch.next_pos[0])] = batch.root_logits[0].clone()
    return out


def test_deferred_catch_up_equals_step_by_step_catch_up(tiny_engine, untrained, prompts):
    """An EAGLE-3 drafter reading target features: after two steps without drafting, its logits for the next draft
    equal those of a decoder that drafted (and caught up) at every step."""
    always = SpecDecoder.from_engine(tiny_engine, untrained, CHAIN)
    calls = iter(range(10_000))
    toggling = SpecDecoder.from_engine(tiny_engine, untrained, CHAIN,
                                       policy=lambda n: CHAIN if next(calls) % 3 == 0 else None)
    ref = _roots_by_position(always, prompts[3], 18)
    got = _roots_by_position(toggling, prompts[3], 18)
    common = sorted(set(ref) & set(got))
    assert len(common) >= 3, (sorted(ref), sorted(got))
    for p in common:
        torch.testing.assert_close(got[p], ref[p], atol=2e-4, rtol=1e-4, msg=f"position {p}")
