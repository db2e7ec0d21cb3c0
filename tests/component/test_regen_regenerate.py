"""Regeneration on the real tiny target: exact ids, loss masks = the target's tokens incl. its end-of-turn token,
append-only checks, truncation and cut decisions, engine-error isolation, native samples."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml

from eaglenest.contracts.shards import bytes_to_tensor
from eaglenest.engines import SamplingParams, TargetEngine, render_chat_text
from eaglenest.engines.hf import HFEngine
from eaglenest.regen.formats import OK, conversation_tokens, normalize_record, template_messages
from eaglenest.regen.regenerate import Quarantined, Regenerated, Regenerator, Sample

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "sources"
SOURCES = {s["name"]: s for s in yaml.safe_load((FIX / "sources.yaml").read_text())["sources"]}
GREEDY = SamplingParams(max_new_tokens=40)


def fixture_samples(*names: str) -> list[Sample]:
    out = []
    for name in names:
        src = SOURCES[name]
        path = FIX / src["path"]
        recs = (pq.read_table(path).to_pylist() if path.suffix == ".parquet"
                else [x for x in path.read_text().splitlines() if x.strip()])
        for r in recs:
            row = normalize_record(r, src["adapter"], source=name, domain=src["domain"])
            if row["status"] == OK:
                out.append(Sample(row["id"], name, src["domain"], row["messages"], row["tools"], row["native"],
                                  row["native_input_ids"], row["native_loss_mask"], row["raw"]))
    return out


def spans(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of every run of 1s."""
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def final_conversation(sample: Sample, turns: list[dict]) -> list[dict]:
    """The dataset's conversation with every assistant turn replaced by the target's answer (as plain text)."""
    msgs = template_messages(sample.messages)
    out, k = [], 0
    for m in msgs:
        if m["role"] == "assistant":
            if k == len(turns):
                break
            out.append({"role": "assistant", "content": turns[k]["text"]})
            k += 1
        else:
            out.append(m)
    if k < len(turns):
        out.append({"role": "assistant", "content": turns[k]["text"]})
    return out


@pytest.fixture(scope="module")
def regenerated(tiny_engine):
    samples = [s for s in fixture_samples("sharegpt_vicuna", "swe_smith", "xlam", "openthoughts", "ultrachat")
               if "very_long" not in s.raw]  # the over-long row is the length filter's (tested below)
    regen = Regenerator(tiny_engine, min_tokens=4, max_tokens=1024, storage_dtype="bfloat16")
    return samples, regen.run(samples, lambda s: GREEDY)


def test_ids_and_masks_follow_the_template(tiny_engine, regenerated):
    tok = tiny_engine.tokenizer
    end = tok.convert_tokens_to_ids("<|end|>")
    samples, results = regenerated
    assert all(isinstance(r, Regenerated) for r in results), [getattr(r, "detail", "") for r in results]
    for s, r in zip(samples, results, strict=True):
        # every assistant turn is regenerated, and a trailing user turn (a split chat's last part) gets an answer
        n_assistant = sum(m["role"] == "assistant" for m in s.messages) + (s.messages[-1]["role"] != "assistant")
        assert len(r.assistant_turns) == n_assistant >= 1
        # the whole sequence is exactly the template's rendering of the conversation with the target's answers
        want = render_chat_text(tok, final_conversation(s, r.assistant_turns), tools=json.loads(s.tools)
                                if s.tools else None, add_generation_prompt=False)
        assert tok.decode(r.input_ids, skip_special_tokens=False) == want
        # loss mask = exactly the generated tokens of every turn, including the target's own <|end|>; a turn
        # stopped by max_new_tokens is closed by an <|end|> outside the loss
        runs = spans(r.loss_mask)
        assert len(runs) == n_assistant
        for (a, b), turn in zip(runs, r.assistant_turns, strict=True):
            text = tok.decode(r.input_ids[a:b], skip_special_tokens=False)
            if turn["ended"]:
                assert r.input_ids[b - 1] == end and text == turn["text"] + "<|end|>"
            else:
                assert b - a == GREEDY.max_new_tokens and text == turn["text"]
                assert r.input_ids[b] == end and r.loss_mask[b] == 0
        assert sum(r.loss_mask) == r.generated_tokens
        assert r.truncated_turns == sum(not t["ended"] for t in r.assistant_turns)
        # dataset tool results stay in the context (not in the loss)
        for m in s.messages:
            if m["role"] == "tool":
                assert m["content"] in want


def test_generated_ids_are_the_engines_own_tokens(tiny_engine, regenerated):
    """Re-running the target on each turn's exact prefix reproduces the stored tokens (greedy)."""
    samples, results = regenerated
    prefixes, wants = [], []
    for r in results:
        for a, b in spans(r.loss_mask):
            prefixes.append(r.input_ids[:a])
            wants.append(r.input_ids[a:b])
    gens = tiny_engine.generate_ids(prefixes, GREEDY)
    assert [g.token_ids for g in gens] == wants


def test_capture_is_the_teacher_forced_prefill(tiny_engine, regenerated):
    _, results = regenerated
    h = tiny_engine.info.hidden_size
    for r in results[:3]:
        cap = tiny_engine.capture([r.input_ids])[0]
        aux = bytes_to_tensor(r.aux_hidden_states, "bfloat16", 3 * h)
        last = bytes_to_tensor(r.last_hidden_state, "bfloat16", h)
        assert len(r.aux_hidden_states) + len(r.last_hidden_state) == 8 * h * len(r.input_ids)
        torch.testing.assert_close(aux.float(), cap.aux_hidden_states.float(), rtol=2 ** -7, atol=1e-4)
        torch.testing.assert_close(last.float(), cap.last_hidden_state.float(), rtol=2 ** -7, atol=1e-4)


def test_turn_at_max_new_tokens_is_kept_and_closed_outside_the_loss(tiny_engine):
    samples = fixture_samples("ultrachat")[:1]  # two assistant turns
    r = Regenerator(tiny_engine, min_tokens=4, max_tokens=1024, storage_dtype="bfloat16").run(
        samples, lambda s: SamplingParams(max_new_tokens=2))[0]
    assert isinstance(r, Regenerated) and r.truncated_turns == 2  # no real answer fits in 2 tokens
    end = tiny_engine.tokenizer.convert_tokens_to_ids("<|end|>")
    runs = spans(r.loss_mask)
    assert [b - a for a, b in runs] == [2, 2] and r.generated_tokens == 4
    for _, b in runs:  # the forced end-of-turn token follows, with loss 0
        assert r.input_ids[b] == end and r.loss_mask[b] == 0
    assert r.input_ids[-1] == end


def test_growing_past_max_tokens_cuts_at_a_turn_boundary(tiny_engine):
    chat = {"messages": [{"role": "user", "content": "Tell me about alice in paris."},
                         {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": "How many books does alice keep?"},
                         {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": "What is 3 plus 4?"},
                         {"role": "assistant", "content": "ok"}]}
    row = normalize_record(chat, "openai", source="s", domain="chat")
    sample = Sample(row["id"], "s", "chat", row["messages"], raw=row["raw"])
    full = Regenerator(tiny_engine, min_tokens=4, max_tokens=4096, storage_dtype="bfloat16").run(
        [sample], lambda s: GREEDY)[0]
    (_, first_end), (_, second_end), _ = spans(full.loss_mask)
    original = conversation_tokens(tiny_engine.tokenizer, row["messages"], None)
    assert original < second_end  # the input passes the length filter; the regenerated answers are longer
    cut = Regenerator(tiny_engine, min_tokens=4, max_tokens=second_end - 1, storage_dtype="bfloat16").run(
        [sample], lambda s: GREEDY)[0]
    assert isinstance(cut, Regenerated) and cut.dropped_turns == 2 and len(cut.assistant_turns) == 1
    assert cut.input_ids == full.input_ids[:first_end] and cut.loss_mask == full.loss_mask[:first_end]
    too_long = Regenerator(tiny_engine, min_tokens=4, max_tokens=first_end - 1, storage_dtype="bfloat16").run(
        [sample], lambda s: GREEDY)[0]
    assert isinstance(too_long, Quarantined) and too_long.reason == "too_long"


def test_template_that_rewrites_history_is_quarantined(tiny_engine):
    tok = copy.deepcopy(tiny_engine.tokenizer)
    # like templates that drop earlier reasoning: earlier assistant turns render differently from the last one
    tok.chat_template = tok.chat_template.replace(
        "{{ m['content'] or '' }}{% for tc", "{{ (m['content'] or '') if loop.last else '...' }}{% for tc")
    engine = HFEngine(tiny_engine.model, tok, model_name="tiny-rewriting-template")
    single, multi = fixture_samples("numina_math")[0], fixture_samples("ultrachat")[0]
    out = Regenerator(engine, min_tokens=4, max_tokens=1024, storage_dtype="bfloat16").run(
        [single, multi], lambda s: GREEDY)
    assert isinstance(out[0], Regenerated)  # one answer: nothing earlier to rewrite
    assert isinstance(out[1], Quarantined) and out[1].reason == "template_not_append_only"
    assert "changes earlier text" in out[1].detail


class FailingEngine(TargetEngine):
    """The tiny engine, except that any batch containing the poisoned prompt raises (like a CUDA error would)."""

    def __init__(self, inner: HFEngine, poison: str):
        self.inner, self.tokenizer, self.info = inner, inner.tokenizer, inner.info
        self.aux_layer_ids = inner.aux_layer_ids
        self.poison = inner.tokenizer.encode(poison, add_special_tokens=False)
        self.calls = 0

    def _poisoned(self, seqs) -> bool:
        n = len(self.poison)
        return any(list(s[i:i + n]) == self.poison for s in seqs for i in range(len(s) - n + 1))

    def generate_ids(self, prompts, sampling):
        self.calls += 1
        if self._poisoned(prompts):
            raise RuntimeError("device-side assert triggered")
        return self.inner.generate_ids(prompts, sampling)

    def capture(self, sequences, layer_ids=None, *, hints=None):
        return self.inner.capture(sequences, layer_ids)


def test_engine_error_on_one_sample_is_isolated(tiny_engine):
    samples = fixture_samples("numina_math", "magicoder")
    engine = FailingEngine(tiny_engine, "What is 9 times 6?")
    out = Regenerator(engine, min_tokens=4, max_tokens=1024, storage_dtype="bfloat16").run(samples, lambda s: GREEDY)
    bad = [r for r in out if isinstance(r, Quarantined)]
    assert len(bad) == 1 and bad[0].reason == "engine_error" and "device-side assert" in bad[0].detail
    assert "9 times 6" in bad[0].sample.messages[0]["content"]
    good = [r for r in out if isinstance(r, Regenerated)]
    assert len(good) == len(samples) - 1
    clean = Regenerator(tiny_engine, min_tokens=4, max_tokens=1024, storage_dtype="bfloat16").run(
        [r.sample for r in good], lambda s: GREEDY)
    assert [r.input_ids for r in good] == [r.input_ids for r in clean]


def test_over_long_input_is_quarantined_before_generation(tiny_engine):
    long = [s for s in fixture_samples("sharegpt_vicuna") if "very_long" in s.raw]
    engine = FailingEngine(tiny_engine, "no poison here")
    out = Regenerator(engine, min_tokens=4, max_tokens=1024, storage_dtype="bfloat16").run(long, lambda s: GREEDY)
    assert out[0].reason == "too_long" and engine.calls == 0


def test_native_samples_are_captured_not_regenerated(tiny_engine):
    samples = fixture_samples("target_native")
    out = Regenerator(tiny_engine, min_tokens=4, max_tokens=512, storage_dtype="bfloat16").run(
        samples, lambda s: GREEDY)
    by_reason = {getattr(r, "reason", "ok") for r in out}
    assert by_reason == {"ok", "token_out_of_range", "too_long"}
    for s, r in zip(samples, out, strict=True):
        if isinstance(r, Regenerated):
            assert r.input_ids == s.native_input_ids and r.loss_mask == s.native_loss_mask
            assert r.generated_tokens == 0


def test_a_batch_of_prompts_is_tokenized_as_one_by_one(tiny_engine):
    """A batch's first prompt segments are tokenized in one call; each must be what encoding it alone gives."""
    samples = fixture_samples("sharegpt_vicuna", "swe_smith", "xlam", "openthoughts", "ultrachat", "numina_math")
    regen = Regenerator(tiny_engine, min_tokens=1, max_tokens=4096, storage_dtype="float32")
    states = [regen._start(s, GREEDY) for s in samples]
    regen._open_turns(states)
    tok = tiny_engine.tokenizer
    assert len(states) >= 6 and all(st.failure is None for st in states)
    for st in states:
        assert st.ids == tok.encode(st.text, add_special_tokens=False) and st.mask == [0] * len(st.ids)
        assert st.text.startswith(render_chat_text(tok, st.msgs[:st.pos], tools=st.tools, add_generation_prompt=True))
