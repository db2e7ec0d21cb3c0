"""The GPU stand-in target: the function-preserving widening, the dump reader, and a tiny CPU build end to end."""

from __future__ import annotations

import json

import pytest
import torch

from eaglenest.engines.standin import StandinSpec, build_standin, chat_of, read_json_array
from eaglenest.engines.widen import (
    WidenError,
    WideShape,
    count_parameters,
    layer_positions,
    widen_config,
    widen_state_dict,
)

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=128, tie_word_embeddings=False, rms_norm_eps=1e-5)
WIDE = WideShape(hidden_size=256, num_layers=8, num_heads=16, num_kv_heads=4, intermediate_size=400)


def _small_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(**SMALL)).float().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # norms away from 1, so a wrong rescale shows
    return m


def test_widened_model_computes_the_same_function():
    from transformers import LlamaConfig, LlamaForCausalLM

    small = _small_model()
    cfg = widen_config(small.config.to_dict(), WIDE)
    wide = LlamaForCausalLM(LlamaConfig(**cfg)).float().eval()
    wide.load_state_dict(widen_state_dict(small.state_dict(), small.config.to_dict(), WIDE, dtype=torch.float32))
    assert sum(p.numel() for p in wide.parameters()) == count_parameters(cfg)
    x = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        a = small(x, output_hidden_states=True)
        b = wide(x, output_hidden_states=True)
    assert (a.logits - b.logits).abs().max() < 1e-4
    assert torch.equal(a.logits.argmax(-1), b.logits.argmax(-1))
    # small layer j sits at wide layer positions[j]: the residual stream after it matches, new channels stay 0
    # (the last entry of hidden_states is after the final norm, so the small model's last layer is left out)
    for j, pos in enumerate(layer_positions(3, 8)[:-1]):
        assert (a.hidden_states[j + 1] - b.hidden_states[pos + 1][..., :64]).abs().max() < 1e-4
        assert b.hidden_states[pos + 1][..., 64:].abs().max() == 0


def test_a_wrong_rescale_would_be_seen():
    """Control: without the norm rescale the widened model's logits differ (the test above can fail)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    small = _small_model()
    cfg = widen_config(small.config.to_dict(), WIDE)
    sd = widen_state_dict(small.state_dict(), small.config.to_dict(), WIDE, dtype=torch.float32)
    sd["model.norm.weight"] = sd["model.norm.weight"] * 2  # undo the sqrt(64/256) rescale of the final norm
    wide = LlamaForCausalLM(LlamaConfig(**cfg)).float().eval()
    wide.load_state_dict(sd)
    x = torch.randint(0, 300, (1, 20))
    with torch.no_grad():
        assert (small(x).logits - wide(x).logits).abs().max() > 1e-2


def test_widen_refuses_shapes_it_cannot_preserve():
    with pytest.raises(WidenError, match="head_dim"):
        widen_config(SMALL, WideShape(hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4,
                                      intermediate_size=400))
    with pytest.raises(WidenError, match="multi-head"):
        widen_config({**SMALL, "num_key_value_heads": 2}, WIDE)
    with pytest.raises(WidenError, match="fewer layers"):
        widen_config(SMALL, WideShape(hidden_size=256, num_layers=2, num_heads=16, num_kv_heads=4,
                                      intermediate_size=400))


def test_eight_b_shape_has_eight_b_class_size():
    cfg = widen_config({**SMALL, "vocab_size": 32000, "hidden_size": 1024, "num_attention_heads": 8,
                        "num_key_value_heads": 8, "intermediate_size": 2816, "num_hidden_layers": 12}, WideShape())
    assert 6.5e9 < count_parameters(cfg) < 7.5e9  # Llama-3-8B's shape with a 32k vocabulary
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5 / 4)


def _dump_text(records: list[dict]) -> str:
    return json.dumps(records, indent=2)


def test_read_json_array_keeps_what_precedes_the_damage(tmp_path):
    recs = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(5)]
    full = _dump_text(recs)
    cut = tmp_path / "cut.json"
    cut.write_text(full[: full.index('"r4"') + 2])  # inside the last element, as a capped download ends
    got = read_json_array(cut)
    assert [r["id"] for r in got.records] == ["r0", "r1", "r2", "r3"]
    assert got.damage and "cut.json" in got.damage and "after element 4" in got.damage
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + full.encode())
    assert len(read_json_array(bom).records) == 5 and read_json_array(bom).damage is None
    obj = tmp_path / "obj.json"
    obj.write_text(json.dumps(recs[0]))
    got = read_json_array(obj)
    assert got.records == [] and "not a JSON array" in got.damage


def test_chat_of_keeps_the_usable_part():
    rec = {"conversations": [{"from": "gpt", "value": "continued"}, {"from": "human", "value": "hi"},
                             {"from": "gpt", "value": "hello"}, {"from": "human", "value": " "},
                             {"from": "gpt", "value": "lost"}]}
    assert chat_of(rec) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert chat_of({"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]}) == [
        {"role": "user", "content": "a"}]


def test_tiny_build_on_cpu_end_to_end(tmp_path):
    """A ShareGPT-shaped dump (cut short) -> tokenizer, pre-training, widening, prompt files, all on the CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eaglenest.engines.base import render_chat_ids

    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards",
             "quietly", "judge", "boxing", "matches"]
    recs = []
    for i in range(120):
        q = " ".join(words[(i + k) % len(words)] for k in range(6 + i % 5))
        a = " ".join(words[(2 * i + k) % len(words)] for k in range(12))
        turns = [{"from": "human", "value": f"Question {i}: {q}?"}, {"from": "gpt", "value": f"Answer: {a}."}]
        if i % 7 == 0:
            turns.insert(0, {"from": "gpt", "value": "(continued)"})
        if i % 10 == 9:  # public dumps repeat prompts: the prompt files must not (regen drops repeats)
            turns = [dict(t) for t in recs[-1]["conversations"]]
        recs.append({"id": f"rec{i}", "conversations": turns})
    text = _dump_text(recs)
    dump = tmp_path / "dump.json"
    dump.write_text(text[: len(text) - 40])  # truncated inside the last record
    spec = StandinSpec(vocab_size=400, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seq_len=32,
                       batch_size=4, train_steps=20, warmup_steps=2, tokenizer_chats=100, heldout_records=30,
                       wide=WideShape(hidden_size=128, num_layers=6, num_heads=8, num_kv_heads=2,
                                      intermediate_size=160))
    rep = build_standin(dump, tmp_path / "out", spec, device="cpu", num_train_prompts=20, num_heldout_prompts=5,
                        log=lambda m: None)
    assert rep["dump_read"]["records"] == 119 and "after element 119" in rep["dump_read"]["damage"]
    assert rep["pretrain"]["loss_curve"][-1] < rep["pretrain"]["loss_curve"][0]
    assert rep["preservation"]["top1_agreement"] == 1.0
    train = [json.loads(x) for x in (tmp_path / "out/prompts/train.jsonl").read_text().splitlines()]
    held = [json.loads(x) for x in (tmp_path / "out/prompts/heldout.jsonl").read_text().splitlines()]
    assert len(train) == 20 and len(held) == 5
    assert not {r["id"] for r in train} & {r["id"] for r in held}  # disjoint records
    assert all(int(r["id"][3:]) >= 119 - 30 for r in held)  # held-out part: kept out of pre-training too
    assert train[0]["conversations"][0]["from"] == "human"  # a gpt-first record starts at its user turn
    prompts = [r["conversations"][0]["value"] for r in train] + [r["messages"][0]["content"] for r in held]
    assert len(set(prompts)) == len(prompts)

    tok = AutoTokenizer.from_pretrained(tmp_path / "out/model")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "out/base").eval()
    wide = AutoModelForCausalLM.from_pretrained(tmp_path / "out/model").eval()
    assert wide.config.hidden_size == 128 and wide.config.num_hidden_layers == 6
    ids = torch.tensor([render_chat_ids(tok, held[0]["messages"], add_generation_prompt=True)])
    with torch.no_grad():
        a = base.generate(ids, max_new_tokens=12, do_sample=False)
        b = wide.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(a, b)  # the same model, 4x wider and 3x deeper


def test_train_prompts_after_the_cut_follow_the_heldout_ones_and_never_overlap(tiny_target_path, tmp_path):
    from transformers import AutoTokenizer

    from eaglenest.engines.standin import write_prompt_files

    tok = AutoTokenizer.from_pretrained(tiny_target_path)
    recs = [{"id": f"rec{i}", "conversations": [{"from": "human", "value": f"question number {i} about rivers"},
                                                {"from": "gpt", "value": "an answer"}]} for i in range(60)]
    rep = write_prompt_files(recs, 40, tok, tmp_path, n_train=12, n_heldout=5, max_prompt_tokens=64,
                             train_after_cut=4)
    train = [json.loads(x)["id"] for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    held = [json.loads(x)["id"] for x in (tmp_path / "heldout.jsonl").read_text().splitlines()]
    assert held == [f"rec{i}" for i in range(40, 45)]  # the bench's prompts: the first after the cut, as before
    assert train == [f"rec{i}" for i in range(8)] + [f"rec{i}" for i in range(45, 49)]
    assert rep["train"] == 12 and rep["train_after_cut"] == 4
    plain = write_prompt_files(recs, 40, tok, tmp_path / "plain", n_train=12, n_heldout=5, max_prompt_tokens=64)
    assert plain["train_after_cut"] == 0  # default: every train prompt from before the cut
