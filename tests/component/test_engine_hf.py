"""The transformers backend: capture matches transformers' own hidden states; batching changes nothing."""

from __future__ import annotations

import pytest
import torch

from eaglenest.contracts.layers import LayerIdError, default_aux_layer_ids
from eaglenest.engines import SamplingParams

PROMPTS = [
    "What is 12 plus 7?",
    "Tell me about alice in paris.",
    "Write a python function add_3 of a and x.",
    "What is the weather in oslo?",
    "Count from 4 in steps of 3, 6 numbers.",
]


def _convs():
    return [[{"role": "user", "content": p}] for p in PROMPTS]


@pytest.fixture(scope="module")
def sequences(tiny_engine):
    gens = tiny_engine.generate(_convs(), SamplingParams(max_new_tokens=24))
    return [tiny_engine.render_prompt(c) + g.token_ids for c, g in zip(_convs(), gens, strict=True)]


def test_capture_equals_transformers_hidden_states(tiny_engine, sequences):
    n = tiny_engine.info.num_layers
    layer_ids = default_aux_layer_ids(n)
    assert layer_ids == [2, 4, 5] and len(set(layer_ids)) == 3
    caps = tiny_engine.capture(sequences, layer_ids)
    for seq, cap in zip(sequences, caps, strict=True):
        ids = torch.tensor([seq])
        with torch.no_grad():
            out = tiny_engine.model(input_ids=ids, output_hidden_states=True)
        hs = out.hidden_states
        want_aux = torch.cat([hs[i][0] for i in layer_ids], dim=-1)
        h = tiny_engine.info.hidden_size
        assert cap.aux_hidden_states.shape == (len(seq), 3 * h)
        assert cap.last_hidden_state.shape == (len(seq), h)
        torch.testing.assert_close(cap.aux_hidden_states, want_aux, rtol=1e-5, atol=1e-5)
        # physical id k is the output of decoder layer k-1: check one tap against a forward hook too
        # the final normed state is what lm_head consumes: logits must be reproduced from it
        logits = tiny_engine.model.lm_head(cap.last_hidden_state)
        torch.testing.assert_close(logits, out.logits[0], rtol=1e-4, atol=1e-4)


def test_physical_id_is_output_of_previous_decoder_layer(tiny_engine, sequences):
    seen = {}
    layers = tiny_engine.model.model.layers
    hooks = [layers[k - 1].register_forward_hook(lambda m, a, o, k=k: seen.__setitem__(k, o[0] if isinstance(o, tuple)
                                                                                       else o))
             for k in (2, 4, 5)]
    try:
        with torch.no_grad():
            tiny_engine.model(input_ids=torch.tensor([sequences[0]]))
    finally:
        for h in hooks:
            h.remove()
    cap = tiny_engine.capture([sequences[0]], [2, 4, 5])[0]
    h = tiny_engine.info.hidden_size
    for j, k in enumerate((2, 4, 5)):
        torch.testing.assert_close(cap.aux_hidden_states[:, j * h:(j + 1) * h], seen[k][0], rtol=1e-5, atol=1e-5)


def test_capture_batched_equals_one_at_a_time(tiny_engine, sequences):
    batched = tiny_engine.capture(sequences)
    for seq, b in zip(sequences, batched, strict=True):
        single = tiny_engine.capture([seq])[0]
        torch.testing.assert_close(b.aux_hidden_states, single.aux_hidden_states, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.last_hidden_state, single.last_hidden_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [[0, 4, 5], [2, 4, 8], [2, 4, 99], [-1, 2, 3], [2, 2, 5], [2, 4]])
def test_out_of_range_layer_ids_are_refused(tiny_engine, sequences, bad):
    with pytest.raises(LayerIdError) as err:
        tiny_engine.capture(sequences[:1], bad)
    assert str(bad[0]) in str(err.value) or "distinct" in str(err.value) or "exactly 3" in str(err.value)


def test_batched_greedy_equals_one_at_a_time(tiny_engine):
    sampling = SamplingParams(max_new_tokens=32)
    batched = tiny_engine.generate(_convs(), sampling)
    assert any(g.finish_reason == "stop" for g in batched), "the tiny target should end some answers with <|end|>"
    for conv, b in zip(_convs(), batched, strict=True):
        alone = tiny_engine.generate([conv], sampling)[0]
        assert alone.token_ids == b.token_ids
        assert alone.text == b.text and alone.finish_reason == b.finish_reason


def _ending_conv(engine, max_new_tokens: int = 64) -> list[dict]:
    """The first test prompt whose greedy answer ends with EOS in time (which one is up to the weights)."""
    convs = _convs()
    gens = engine.generate(convs, SamplingParams(max_new_tokens=max_new_tokens))
    ending = [c for c, g in zip(convs, gens, strict=True) if g.finish_reason == "stop"]
    assert ending, [g.text for g in gens]
    return ending[0]


def test_generation_is_sensible_and_ends_with_eos(tiny_engine):
    g = tiny_engine.generate([_ending_conv(tiny_engine)], SamplingParams(max_new_tokens=64))[0]
    assert g.finish_reason == "stop" and g.token_ids[-1] in tiny_engine.info.eos_token_ids
    # not a degenerate loop: no single token dominates the answer
    top = max(g.token_ids.count(t) for t in set(g.token_ids))
    assert len(g.token_ids) >= 8 and top / len(g.token_ids) < 0.3, g.text


def test_ignore_eos_decodes_exactly_max_new_tokens(tiny_engine):
    conv = [_ending_conv(tiny_engine)]
    short = tiny_engine.generate(conv, SamplingParams(max_new_tokens=64))[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 64
    full = tiny_engine.generate(conv, SamplingParams(max_new_tokens=64, ignore_eos=True))[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 64
    assert full.token_ids[:len(short.token_ids)] == short.token_ids  # same greedy path, only the stop is gone


def test_sampling_is_seeded_per_request_and_respects_max_tokens(tiny_engine):
    s = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8, seed=7)
    a = tiny_engine.generate(_convs()[:2], s)
    b = tiny_engine.generate(_convs()[:2], s)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert all(len(x.token_ids) <= 8 for x in a)
    assert any(x.finish_reason == "length" for x in a) or all(x.finish_reason == "stop" for x in a)


def test_stop_strings_cut_the_text(tiny_engine):
    conv = [[{"role": "user", "content": "What is 12 plus 7?"}]]
    full = tiny_engine.generate(conv, SamplingParams(max_new_tokens=40))[0]
    word = full.text.split()[1]
    cut = tiny_engine.generate(conv, SamplingParams(max_new_tokens=40, stop=(word,)))[0]
    assert cut.finish_reason == "stop" and word not in cut.text
    assert full.text.startswith(cut.text)


def test_empty_prompt_is_refused(tiny_engine):
    with pytest.raises(ValueError, match="empty prompt"):
        tiny_engine.generate_ids([[]], SamplingParams())
