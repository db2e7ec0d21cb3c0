"""TargetSpec reads a target folder: config facts (text_config of multimodal wrappers), eos ids, and tensor shapes from
safetensors headers without loading weights; here on tiny hand-written files (no model, no Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eaglenest.contracts.target import TargetSpec, TargetSpecError


def _write_sharded_target(folder: Path) -> Path:
    """A Kimi-like wrapper: the LM under text_config, weights in two shards with vision and MTP tensors around."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "tie_word_embeddings": False,
        "text_config": {"num_hidden_layers": 6, "hidden_size": 8, "vocab_size": 32, "num_attention_heads": 2,
                        "max_position_embeddings": 64, "eos_token_id": 3, "torch_dtype": "bfloat16"}}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 7]}))
    shard1 = {"language_model.model.embed_tokens.weight": torch.arange(32 * 8, dtype=torch.float32).view(32, 8),
              "vision_tower.embed_tokens.weight": torch.zeros(5, 8)}
    shard2 = {"language_model.lm_head.weight": torch.ones(32, 8), "mtp.0.lm_head.weight": torch.zeros(3, 8)}
    save_file(shard1, str(folder / "model-00001-of-00002.safetensors"))
    save_file(shard2, str(folder / "model-00002-of-00002.safetensors"))
    wmap = {**{k: "model-00001-of-00002.safetensors" for k in shard1},
            **{k: "model-00002-of-00002.safetensors" for k in shard2}}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    return folder


def test_config_facts_from_text_config(tmp_path: Path) -> None:
    spec = TargetSpec.read(_write_sharded_target(tmp_path / "t"), context_length=48)
    assert (spec.num_layers, spec.hidden_size, spec.vocab_size) == (6, 8, 32)
    assert (spec.architecture, spec.first_id_rule, spec.dtype) == ("KimiK25ForConditionalGeneration", True, "bfloat16")
    assert (spec.max_position_embeddings, spec.context_length, spec.head_dim) == (64, 48, 4)
    assert spec.eos_token_ids() == (3, 7)  # config.json's and generation_config.json's


def test_embed_and_head_shapes_without_loading(tmp_path: Path) -> None:
    spec = TargetSpec.read(_write_sharded_target(tmp_path / "t"))
    assert spec.embed_name() == "language_model.model.embed_tokens.weight"  # not the vision tower's
    assert spec.lm_head_name() == "language_model.lm_head.weight"  # not the MTP head's
    assert spec.embed_shape() == [32, 8] and spec.lm_head_shape() == [32, 8]
    embed, head = spec.load_embed_and_head()
    assert torch.equal(head, torch.ones(32, 8)) and embed.shape == (32, 8)
    assert torch.equal(spec.embed_rows([0, 31]), embed[[0, 31]])
    with pytest.raises(KeyError, match="nope"):
        spec.tensor_shape("nope")


def test_single_file_and_tied_embeddings(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4, "hidden_size": 4, "vocab_size": 10,
        "tie_word_embeddings": True}))
    save_file({"model.embed_tokens.weight": torch.randn(10, 4)}, str(tmp_path / "model.safetensors"))
    spec = TargetSpec.read(tmp_path)
    assert spec.lm_head_name() == spec.embed_name() == "model.embed_tokens.weight"
    embed, head = spec.load_embed_and_head()
    assert head is embed and spec.lm_head_shape() == [10, 4]
    assert not spec.first_id_rule


def test_unreadable_targets_say_why(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="download it first"):
        TargetSpec.read(tmp_path / "missing")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4}))
    with pytest.raises(TargetSpecError, match="num_hidden_layers"):
        TargetSpec.read(tmp_path)
    with pytest.raises(FileNotFoundError, match="no safetensors"):
        TargetSpec(num_layers=4, hidden_size=4, vocab_size=10, path=str(tmp_path)).embed_shape()
