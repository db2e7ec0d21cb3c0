"""Export: SGLang loader contract (reference/sglang.md §D), round trip, refusals, layer-id conventions."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglenest.config import EaglenestConfig
from eaglenest.contracts.target import TargetSpec
from eaglenest.drafter.checkpoint import load_training_checkpoint, save_training_checkpoint
from eaglenest.drafter.export import (
    ExportError,
    export_checkpoint,
    export_drafter,
    export_tensors,
)
from eaglenest.drafter.shape import resolve_model_config
from eaglenest.drafters.eagle3.model import Eagle3Drafter, load_drafter
from eaglenest.drafters.vocab import build_vocab_mapping

# the weight names SGLang's LlamaForCausalLMEagle3.load_weights maps (reference/sglang.md §D.2)
SGLANG_NAMES = {
    "fc.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
    "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight",
}


@pytest.fixture(scope="module")
def tiny_drafter(tiny_target_path):
    """A drafter for the tiny target (aux taps [2, 4, 5]) with a 300-token draft vocab and non-trivial weights."""
    facts = TargetSpec.read(tiny_target_path)
    counts = torch.arange(facts.vocab_size).flip(0) % 37
    mapping = build_vocab_mapping(counts, 300)
    cfg = EaglenestConfig()
    mcfg = resolve_model_config(cfg, facts, [2, 4, 5], mapping.draft_vocab_size)
    torch.manual_seed(0)
    m = Eagle3Drafter(mcfg)
    embed, head = TargetSpec.read(tiny_target_path).load_embed_and_head()
    m.init_from_target(embed, head, mapping.d2t, mapping.t2d)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return m.eval(), mapping


def sample_inputs(m: Eagle3Drafter):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, m.config.vocab_size, (2, 6), generator=g)
    aux = torch.randn(2, 6, 3 * m.config.target_hidden_size, generator=g)
    return ids, aux, torch.arange(6).expand(2, 6)


def test_sglang_export_matches_loader_contract(tiny_drafter, tmp_path, tiny_target_path) -> None:
    m, _ = tiny_drafter
    out = export_drafter(m, tmp_path / "exp", fmt="sglang", dtype="bfloat16")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "eaglenest_drafter.json",
                                                     "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    facts = TargetSpec.read(tiny_target_path)
    assert "eagle_aux_hidden_state_layer_ids" not in cfg  # vLLM's key: an SGLang-only folder does not carry it
    readme = (out / "README.md").read_text()
    assert "Not for vLLM" in readme and "--speculative-algorithm EAGLE3" in readme
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 1
    assert cfg["hidden_size"] == facts.hidden_size and cfg["vocab_size"] == facts.vocab_size
    assert cfg["draft_vocab_size"] == 300 and cfg["tie_word_embeddings"] is False
    assert cfg["max_position_embeddings"] >= facts.max_position_embeddings
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    assert "num_nextn_predict_layers" not in cfg and "target_hidden_size" not in cfg
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == SGLANG_NAMES
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["fc.weight"].shape == (facts.hidden_size, 3 * facts.hidden_size)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * facts.hidden_size
    assert tensors["lm_head.weight"].dtype == torch.bfloat16
    side = json.loads((out / "eaglenest_drafter.json").read_text())
    assert side["aux_layer_ids_physical"] == [2, 4, 5] and side["format"] == "sglang"
    assert side["target_num_layers"] == facts.num_layers and side["target"] == str(tiny_target_path)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_gives_identical_logits(tiny_drafter, tmp_path, dtype) -> None:
    m, _ = tiny_drafter
    ids, aux, pos = sample_inputs(m)
    ref = m if dtype == "float32" else Eagle3Drafter(m.config).to(torch.bfloat16)
    if dtype != "float32":
        ref.load_state_dict(m.state_dict())
    with torch.no_grad():
        want = ref.step(ids, aux.to(ref.fc.weight.dtype), pos, ref.new_cache())
        back = Eagle3Drafter.from_pretrained(export_drafter(m, tmp_path / dtype, dtype=dtype))
        got = back.step(ids, aux.to(back.fc.weight.dtype), pos, back.new_cache())
    assert back.config.aux_layer_ids == [2, 4, 5]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_vllm_format_writes_physical_ids_and_loads_back(tiny_drafter, tmp_path) -> None:
    m, _ = tiny_drafter
    out = export_drafter(m, tmp_path / "v", fmt="vllm", dtype="float32", include_embedding=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # the key both of vLLM's model runners read
    assert "Not for SGLang" in (out / "README.md").read_text()
    assert "embed_tokens.weight" not in load_file(str(out / "model.safetensors"))
    back = load_drafter(out)  # embedding comes from the target recorded in the sidecar
    assert back.config.aux_layer_ids == [2, 4, 5]
    assert torch.equal(back.embed_tokens.weight, m.embed_tokens.weight)


def test_default_export_serves_both_engines_from_one_folder(tiny_drafter, tmp_path) -> None:
    """The default format: SGLang's ids (physical - 1) in eagle_config, vLLM's physical ids at the top level; each
    engine reads its own key (drafters.eagle3.engine_ids), preflight passes for both, and the README next to the
    weights gives each engine's exact launch settings (vLLM's speculative_config with method eagle3)."""
    from eaglenest.drafters.eagle3.engine_ids import sglang_reads, vllm_reads
    from eaglenest.drafters.preflight import run_preflight

    m, _ = tiny_drafter
    out = export_drafter(m, tmp_path / "both", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert sglang_reads(cfg)[0] == [1, 3, 4]
    assert {r: ids for r, (ids, _) in vllm_reads(cfg).items()} == {"v1": [2, 4, 5], "v2": [2, 4, 5]}
    side = json.loads((out / "eaglenest_drafter.json").read_text())
    assert side["format"] == "both" and side["engine_aux_layer_ids"] == {"sglang": [1, 3, 4], "vllm": [2, 4, 5]}
    assert load_drafter(out).config.aux_layer_ids == [2, 4, 5]
    target = side["target"]
    for engine in ("sglang", "vllm", "hf"):
        report = run_preflight(target, out, engine=engine)
        assert report.ok, report.format()
    readme = (out / "README.md").read_text()
    spec = json.dumps({"method": "eagle3", "model": str(out.resolve()), "num_speculative_tokens": 3})
    assert f"speculative_config={spec}" in readme
    assert "--speculative-algorithm EAGLE3" in readme and "Not for" not in readme
    # the top-level key edited to SGLang's ids: the folder no longer reads back (one record disagrees)
    cfg["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="eagle_aux_hidden_state_layer_ids \\[1, 3, 4\\] in vllm's convention"):
        load_drafter(out)


def test_exporter_refuses_missing_tensor_and_bad_shapes(tiny_drafter, tmp_path) -> None:
    m, _ = tiny_drafter
    tensors = dict(m.state_dict())
    missing = {k: v for k, v in tensors.items() if k != "midlayer.hidden_norm.weight"}
    with pytest.raises(ExportError, match=r"missing tensors \['midlayer.hidden_norm.weight'\]"):
        export_tensors(missing, m.config, tmp_path / "a")
    bad = dict(tensors)
    bad["fc.weight"] = torch.zeros(m.config.hidden_size, m.config.hidden_size)  # a 1H input: the EAGLE-1 shape
    with pytest.raises(ExportError, match="fc.weight has shape"):
        export_tensors(bad, m.config, tmp_path / "b")
    stray = dict(tensors)
    stray["layers.0.mlp.up_proj.weight"] = tensors["midlayer.mlp.up_proj.weight"]
    with pytest.raises(ExportError, match="unexpected tensors"):
        export_tensors(stray, m.config, tmp_path / "c")
    broken_map = dict(tensors)
    t2d = tensors["t2d"].clone()
    t2d[t2d.nonzero()[0]] = False
    broken_map["t2d"] = t2d
    with pytest.raises(ExportError, match="d2t and t2d disagree"):
        export_tensors(broken_map, m.config, tmp_path / "d")
    assert not any(p.name in {"a", "b", "c", "d"} for p in tmp_path.iterdir())  # nothing half-written


def test_export_checkpoint_and_its_refusals(tiny_drafter, tmp_path) -> None:
    m, mapping = tiny_drafter
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
    ck = save_training_checkpoint(tmp_path / "ck", drafter=m, optimizer=opt, scheduler=None, mapping=mapping,
                                  state={"step": 5, "epoch": 0, "epoch_batches": 5})
    out = export_checkpoint(tmp_path / "ck", tmp_path / "exp", fmt="sglang", dtype="float32")
    back = load_drafter(out)
    ids, aux, pos = sample_inputs(m)
    with torch.no_grad():
        assert torch.equal(back.step(ids, aux, pos)[0], m.step(ids, aux, pos)[0])
    assert json.loads((out / "eaglenest_drafter.json").read_text())["trained_steps"] == 5
    # a checkpoint with a tensor removed
    w = load_file(str(ck / "drafter.safetensors"))
    del w["lm_head.weight"]
    save_file(w, str(ck / "drafter.safetensors"))
    with pytest.raises(ExportError, match="lm_head.weight"):
        export_checkpoint(ck, tmp_path / "exp2")
    # a checkpoint whose tensor does not fit its config
    w["lm_head.weight"] = torch.zeros(17, m.config.hidden_size)
    save_file(w, str(ck / "drafter.safetensors"))
    with pytest.raises(ExportError, match=r"lm_head.weight has shape \(17"):
        export_checkpoint(ck, tmp_path / "exp2")
    with pytest.raises(FileNotFoundError, match="no drafter training checkpoint"):
        export_checkpoint(tmp_path / "nothing-here", tmp_path / "exp3")
    assert load_training_checkpoint(ck).step == 5


def test_loader_refuses_inconsistent_layer_ids(tiny_drafter, tmp_path) -> None:
    m, _ = tiny_drafter
    out = export_drafter(m, tmp_path / "e", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]  # physical ids written into an SGLang export
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="does not give the physical ids"):
        load_drafter(out)


def test_cli_export(tiny_drafter, tmp_path, capsys) -> None:
    from eaglenest.cli import main

    m, mapping = tiny_drafter
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
    save_training_checkpoint(tmp_path / "run" / "ray" / "x" / "checkpoint_1", drafter=m, optimizer=opt,
                             scheduler=None, mapping=mapping, state={"step": 1})
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--output", str(tmp_path / "o"),
                 "--format", "vllm"]) == 0
    assert json.loads((tmp_path / "o" / "eaglenest_drafter.json").read_text())["format"] == "vllm"
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--output", str(tmp_path / "b")]) == 0
    printed = capsys.readouterr().out
    assert json.loads((tmp_path / "b" / "eaglenest_drafter.json").read_text())["format"] == "both"
    spec = {"method": "eagle3", "model": str((tmp_path / "b").resolve()), "num_speculative_tokens": 3}
    assert f"speculative_config={json.dumps(spec)}" in printed and "--speculative-algorithm EAGLE3" in printed
    assert main(["export", "--checkpoint", str(tmp_path / "none"), "--output", str(tmp_path / "o2")]) == 2
