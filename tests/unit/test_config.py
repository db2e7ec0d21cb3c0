"""Config files: every section loads; unknown keys and bad values are refused with the file, key and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from eaglenest.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path, text: str) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


def test_demo_config_loads():
    cfg = load_config(REPO / "configs" / "demo.yaml")
    assert cfg.target.model == "tiny"
    assert cfg.target.engine == "hf"


def test_defaults_without_file():
    cfg = load_config(None)
    assert cfg.serve.host == "127.0.0.1"
    assert cfg.train.ttt_steps == 7


def test_unknown_key_names_file_key_and_allowed(tmp_path):
    p = _write(tmp_path, "target:\n  modle: tiny\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    msg = str(err.value)
    assert str(p) in msg and "target.modle" in msg and "unknown key" in msg and "model" in msg


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match="trian: unknown key; allowed here: .*train"):
        load_config(_write(tmp_path, "trian:\n  epochs: 2\n"))


def test_invalid_enum_value_lists_allowed(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, "target:\n  engine: vllm\n"))
    msg = str(err.value)
    assert "target.engine" in msg and "'hf'" in msg and "'sglang'" in msg and "vllm" in msg


def test_invalid_number(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.ttt_steps.*greater than or equal to 1"):
        load_config(_write(tmp_path, "train:\n  ttt_steps: 0\n"))


def test_nested_unknown_key(tmp_path):
    with pytest.raises(ConfigError, match=r"target\.tiny\.layers: unknown key; allowed here: .*num_layers"):
        load_config(_write(tmp_path, "target:\n  tiny:\n    layers: 3\n"))


def test_spec_chain_budget_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="num_draft_tokens: 4"):
        load_config(_write(tmp_path, "serve:\n  spec:\n    num_steps: 3\n    topk: 1\n    num_draft_tokens: 16\n"))


def test_not_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(_write(tmp_path, "- a\n- b\n"))


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_gpu_example_configs_load_and_tap_the_default_layers():
    from eaglenest.contracts.layers import default_aux_layer_ids, validate_aux_layer_ids

    cfg = load_config(REPO / "configs" / "gpu-small.yaml")
    assert cfg.target.engine == "sglang" and cfg.regen.num_gpus_per_actor == cfg.target.sglang.tp_size
    assert validate_aux_layer_ids(cfg.target.aux_layer_ids, 28) == default_aux_layer_ids(28)
    assert len(cfg.regen.sources) == 10
